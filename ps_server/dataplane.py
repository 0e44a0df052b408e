"""The PS data-plane connection loop: read a frame, check it, read its payload, reply.

Malformed frames (bad magic, unparsable header, inconsistent lengths, over the limits) get a
``BAD_FRAME``/``TOO_LARGE`` error reply and the connection is closed: the stream can no longer be
trusted to be on a frame boundary. Well-formed requests that fail (unknown job, not owner, wrong
shape, NaN gradient...) get an error reply; their payload is skipped and the connection stays up.
"""

from __future__ import annotations

import logging
import time

from shardline.ps_server.node import NotOwner, PSNode
from shardline.ps_server.store import StoreError
from shardline.services import auth, frame
from shardline.services.errors import FrameError, FrameTooLargeError
from shardline.services.pb import dataplane_pb2 as dp

log = logging.getLogger("shardline.ps.dataplane")

# Idle connections may wait forever between frames; inside a frame the bytes must keep coming.
PAYLOAD_TIMEOUT_SECONDS = 60.0
# Before authentication a peer gets little: a small header, no payload, a few seconds.
AUTH_TIMEOUT_SECONDS = 10.0
AUTH_LIMITS = frame.FrameLimits(max_header_bytes=1024, max_payload_bytes=0, max_blocks=0)


def serve_connection(sock, peer: str, node: PSNode, limits: frame.FrameLimits, metrics=None,
                     cluster_token: bytes | None = None) -> None:
    """Serve one connection until the peer closes it or sends a malformed frame.

    With ``cluster_token`` the peer must first authenticate (services/auth.py); before that, frames
    are held to a small header and no payload, and anything but the handshake closes the connection.
    """
    if cluster_token is not None and not _authenticate(sock, peer, cluster_token, metrics):
        return
    buffer = bytearray(0)
    while True:
        try:
            header = frame.recv_header(sock, limits)
        except ConnectionError:
            return  # peer went away between frames
        except FrameError as exc:
            code = dp.TOO_LARGE if isinstance(exc, FrameTooLargeError) else dp.BAD_FRAME
            log.warning("closing data-plane connection from %s: %s", peer, exc)
            if metrics:
                metrics.request(None, dp.ErrorCode.Name(code))
            _send_quietly(sock, frame.error_header(0, code, str(exc)))
            return
        started = time.perf_counter()
        op = dp.Op.Name(header.op)
        if header.op == dp.OP_HELLO:  # no token here: nothing to prove (empty nonce)
            frame.skip_bytes(sock, header.payload_bytes, buffer)
            frame.send_frame(sock, frame.FrameHeader(op=dp.OP_HELLO, request_id=header.request_id))
            continue
        try:
            node.precheck(header)
        except StoreError as exc:
            frame.skip_bytes(sock, header.payload_bytes, buffer)
            _reply_error(sock, header, exc, node, metrics, op)
            continue
        if header.payload_bytes > len(buffer):
            # Grows to the largest frame seen on this connection (bounded by limits), then reused.
            buffer = bytearray(header.payload_bytes)
        try:
            if header.op == dp.OP_PUSH:
                reply, payloads = _receive_push(sock, header, node, buffer), []
            else:
                view = memoryview(buffer)[: header.payload_bytes]
                _recv_payload(sock, view)
                reply, payloads = node.handle(header, view)
        except (ConnectionError, TimeoutError):
            return  # the peer vanished or stalled mid-frame: nothing of the frame was kept
        except StoreError as exc:
            _reply_error(sock, header, exc, node, metrics, op)
            continue
        except Exception as exc:  # a bug must not kill the node; report it and keep serving
            log.exception("internal error handling %s from %s", op, peer)
            _reply_error(sock, header, StoreError("INTERNAL", f"internal error: {type(exc).__name__}: {exc}"), node, metrics, op)
            continue
        frame.send_frame(sock, reply, payloads)
        if metrics:
            metrics.request(op, "OK", seconds=time.perf_counter() - started,
                            bytes_in=header.payload_bytes, bytes_out=reply.payload_bytes)


def _authenticate(sock, peer: str, token: bytes, metrics) -> bool:
    """Run the HELLO challenge; False (after an UNAUTHENTICATED reply) if the peer fails it."""
    sock.settimeout(AUTH_TIMEOUT_SECONDS)
    try:
        hello = frame.recv_header(sock, AUTH_LIMITS)
        if hello.op == dp.OP_HELLO:
            nonce = auth.new_nonce()
            frame.send_frame(sock, frame.FrameHeader(op=dp.OP_HELLO, request_id=hello.request_id, auth=nonce))
            answer = frame.recv_header(sock, AUTH_LIMITS)
            if answer.op == dp.OP_HELLO and auth.verify(token, nonce, answer.auth):
                frame.send_frame(sock, frame.FrameHeader(op=dp.OP_REPLY, request_id=answer.request_id))
                return True
            message = "wrong cluster token"
        else:
            message = "this node requires authentication: send HELLO with the cluster token first"
    except (FrameError, ConnectionError, TimeoutError) as exc:
        message = f"authentication failed: {exc}"
    finally:
        sock.settimeout(None)
    log.warning("refused data-plane connection from %s: %s", peer, message)
    if metrics:
        metrics.request("OP_HELLO", "UNAUTHENTICATED")
    _send_quietly(sock, frame.error_header(0, dp.UNAUTHENTICATED, message))
    return False


def _recv_payload(sock, view: memoryview) -> None:
    """Receive a payload; a peer that stalls mid-frame for PAYLOAD_TIMEOUT_SECONDS is dropped."""
    if not len(view):
        return
    sock.settimeout(PAYLOAD_TIMEOUT_SECONDS)
    try:
        frame.recv_exactly_into(sock, view)
    finally:
        sock.settimeout(None)


def _receive_push(sock, header, node: PSNode, scratch: bytearray):
    """Receive a PUSH block by block into the destinations the store picked, checking each block
    as it lands (the check overlaps the arrival of the next), then make it visible."""
    try:
        job, ticket = node.begin_push(header, scratch)
    except StoreError:
        frame.skip_bytes(sock, header.payload_bytes, scratch)  # keep the stream on a frame boundary
        raise
    try:
        for i, dest in enumerate(ticket.dests):
            if dest is not None:
                _recv_payload(sock, frame.tensor_bytes(dest))
                job.check_received(ticket, i)
        return node.finish_push(header, job, ticket)
    finally:
        if not ticket.done:
            job.abort_push(ticket)


def _reply_error(sock, header, exc: StoreError, node: PSNode, metrics, op: str) -> None:
    epoch = exc.epoch if isinstance(exc, NotOwner) else node.routing.epoch
    step = 0
    job = node.store.get(header.job)
    if job is not None:
        step = job.step
    if metrics:
        metrics.request(op, exc.code)
    log.debug("%s from rank %d failed: %s %s", op, header.rank, exc.code, exc)
    frame.send_frame(sock, frame.error_header(header.request_id, dp.ErrorCode.Value(exc.code), str(exc), epoch=epoch, step=step))


def _send_quietly(sock, header) -> None:
    try:
        frame.send_frame(sock, header)
    except OSError:
        pass
