"""The data-plane connection loop of a PS node and of a rack cache: read a frame, check it, read its
payload, hand it to the server's :class:`RequestHandler`, reply.

Every frame gets an answer. Malformed frames (bad magic, unparsable header, inconsistent lengths,
over the limits) get a ``BAD_FRAME``/``TOO_LARGE`` error reply and the connection is closed: the
stream can no longer be trusted to be on a frame boundary. Well-formed requests that fail (unknown
job, not owner, wrong shape, duplicate block, NaN gradient...) get an error reply; their payload is
skipped and the connection stays up.

Bounds (``ConnectionPolicy``): a frame's header and payload must arrive within ``payload_timeout``
of its first byte, or the connection is dropped and what it reserved is freed; a payload is
received only into memory reserved from the node's ``PayloadBudget`` (a connection keeps its
buffer between frames, and gives it back after ``IDLE_BUFFER_SECONDS`` without a frame); a pull
waiting server-side ends as soon as its client hangs up (``DisconnectWatcher``).

Logs: conditions a peer can cause at will (malformed frames, failed authentication) are WARNINGs
limited to one line per peer host per interval; a peer vanishing mid-frame is DEBUG; only a bug
logs a traceback.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardline.services import auth, frame
from shardline.services.disconnects import DisconnectWatcher
from shardline.services.errors import ErrorCode, FrameError, FrameTooLargeError, NotOwnerError, RequestError
from shardline.services.log_limits import RateLimitedLog
from shardline.services.payload_budget import PayloadBudget
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.transport.base import capabilities_of

log = logging.getLogger("shardline.ps.dataplane")

DEFAULT_PAYLOAD_TIMEOUT_SECONDS = 60.0
# Before authentication a peer gets little: a small header, no payload, a few seconds.
AUTH_TIMEOUT_SECONDS = 10.0
AUTH_LIMITS = frame.FrameLimits(max_header_bytes=1024, max_payload_bytes=0, max_blocks=0)
# Connections that may be authenticating at once: peers without the token cannot take every
# connection slot for AUTH_TIMEOUT_SECONDS at a time.
MAX_HANDSHAKES = 64
# A connection silent this long between frames gives its payload buffer back to the node's budget.
# Long enough that a worker's connection keeps it from one training step to the next (allocating
# a buffer again costs ~0.4 s per GiB: bytearray zero-fills it).
IDLE_BUFFER_SECONDS = 30.0


# A kept payload buffer larger than this and more than OVERSIZE_FACTOR times each of the last
# OVERSIZE_FRAMES frames with a payload is made the frame's size (reallocated: zero-filled, ~0.4 s
# per GiB; a connection whose frames alternate large and small keeps the large one).
OVERSIZE_MIN_BYTES = 16 * 1024 * 1024
OVERSIZE_FACTOR = 2
OVERSIZE_FRAMES = 4
# One far larger still (a job's INIT: the whole model's values) is given back at the first frame
# it dwarfs: kept for OVERSIZE_FRAMES steps it was the PS node's largest transient.
FAR_OVERSIZE_MIN_BYTES = 128 * 1024 * 1024
FAR_OVERSIZE_FACTOR = 16


def oversized(held: int, needed: int) -> bool:
    """Whether a connection holding a ``held``-byte buffer gives it back for a ``needed``-byte frame."""
    return held > OVERSIZE_MIN_BYTES and held > OVERSIZE_FACTOR * max(needed, 1)


def far_oversized(held: int, needed: int) -> bool:
    """Whether it gives it back for that frame at once (not after OVERSIZE_FRAMES such frames)."""
    return held > FAR_OVERSIZE_MIN_BYTES and held > FAR_OVERSIZE_FACTOR * max(needed, 1)


class RequestHandler(Protocol):
    """What the loop calls for each frame: a PS node (ps_server/node.py PSNode) or a rack cache
    (rack_cache/server.py CacheFrontend). Each raises RequestError to refuse a request.

    ``precheck(header)`` before the payload is read; ``handle(header, view, cancelled=, regions=)``
    after it, returning ``(reply, payloads)``; ``after_reply(header, reply)`` once the reply went
    out. Pushes (a PS node only): ``begin_push``, ``take_push``, ``finish_push``, ``after_push``.
    ``store.get(job)`` finds a job (to wake a pull's waiters, to name its step in an error reply),
    ``routing.epoch`` is the epoch an error reply names.
    """

    node_id: str
    store: Any
    routing: Any

    def precheck(self, header) -> None: ...

    def handle(self, header, view, cancelled=None, regions=None) -> tuple: ...

    def after_reply(self, header, reply) -> None: ...


@dataclass
class ConnectionPolicy:
    """What every data-plane connection of a node is held to (see the module docstring)."""

    limits: frame.FrameLimits = frame.DEFAULT_LIMITS
    cluster_token: bytes | None = None
    payload_timeout: float = DEFAULT_PAYLOAD_TIMEOUT_SECONDS
    budget: PayloadBudget | None = None
    hangups: DisconnectWatcher | None = None
    complaints: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log))
    handshakes: threading.BoundedSemaphore = field(default_factory=lambda: threading.BoundedSemaphore(MAX_HANDSHAKES))


def serve_connection(sock, peer: str, node: RequestHandler, policy: ConnectionPolicy, metrics=None) -> None:
    """Serve one connection until the peer closes it, stalls mid-frame or sends a malformed frame.

    With ``policy.cluster_token`` the peer must first authenticate (services/auth.py); before that,
    frames are held to a small header and no payload, and anything but the handshake closes the
    connection.
    """
    if policy.cluster_token is not None:
        if not policy.handshakes.acquire(blocking=False):
            policy.complaints.log(logging.WARNING, f"handshakes:{_peer_host(peer)}", "turned away a data-plane "
                                  "connection from %s: %d others are authenticating", peer, MAX_HANDSHAKES)
            _send_quietly(sock, frame.error_header(0, dp.RESOURCE_EXHAUSTED, "too many connections are authenticating; "
                                                   "retry shortly"))
            return
        try:
            if not _authenticate(sock, peer, policy, metrics):
                return
        finally:
            policy.handshakes.release()
    conn = _Connection(sock, peer, node, policy, metrics)
    try:
        conn.serve()
    except (ConnectionError, TimeoutError, OSError) as exc:
        log.debug("data-plane connection from %s ended: %s", peer, exc)
    finally:
        conn.drop_buffer()


def _peer_host(peer: str) -> str:
    return peer.rpartition(":")[0] or peer


class _Connection:
    def __init__(self, sock, peer: str, node: RequestHandler, policy: ConnectionPolicy, metrics):
        self.sock, self.peer, self.node, self.policy, self.metrics = sock, peer, node, policy, metrics
        self.capabilities = capabilities_of(sock)
        self.regions = sock if self.capabilities.shares_memory else None  # a shm connection: its peer's regions
        self.buffer = bytearray(0)   # payload buffer, reused between frames (reserved from the budget)
        self.smaller_frames = 0      # frames in a row with a payload the buffer is oversized for

    # --- the payload buffer -----------------------------------------------------------------
    def drop_buffer(self) -> None:
        if self.buffer and self.policy.budget is not None:
            self.policy.budget.release(len(self.buffer))
        self.buffer = bytearray(0)

    def ensure_buffer(self, nbytes: int, push: bool = False) -> bool:
        """A buffer of at least ``nbytes``; False if the node's budget could not grant it in time.
        One kept from a frame much larger than the last OVERSIZE_FRAMES frames with a payload (a
        job's INIT, a replica's initial sync: once) is given back and made this frame's size: a
        connection holds what its frames need from step to step, not its largest frame ever. One
        far larger (``far_oversized``) is given back at the first such frame. ``push``: the frame is
        a push, whose ``nbytes`` are what it needs besides the blocks received straight into their
        gradient buffers (0 for most: a frame that needs no buffer at all)."""
        if nbytes <= len(self.buffer):
            if not nbytes and not push:
                return True     # a frame without a payload (a pull) says nothing of the buffer's size
            self.smaller_frames = self.smaller_frames + 1 if oversized(len(self.buffer), nbytes) else 0
            if self.smaller_frames < OVERSIZE_FRAMES and not far_oversized(len(self.buffer), nbytes):
                return True
        self.smaller_frames = 0
        self.drop_buffer()  # never hold two
        budget = self.policy.budget
        if budget is not None and not budget.reserve(nbytes, timeout=self.policy.payload_timeout):
            return False
        self.buffer = bytearray(nbytes)
        return True

    def wait_for_frame(self) -> None:
        """Block until the next frame starts; give the buffer back if that takes a while."""
        if self.buffer and not _readable(self.sock, IDLE_BUFFER_SECONDS):
            self.drop_buffer()
        self.sock.settimeout(None)
        _readable(self.sock, None)

    # --- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        sock, node, policy, metrics = self.sock, self.node, self.policy, self.metrics
        while True:
            self.wait_for_frame()
            try:
                header = frame.recv_header(sock, policy.limits, deadline=time.monotonic() + policy.payload_timeout)
            except FrameError as exc:
                code = dp.TOO_LARGE if isinstance(exc, FrameTooLargeError) else dp.BAD_FRAME
                policy.complaints.log(logging.WARNING, _peer_host(self.peer),
                                      "closing data-plane connection from %s: %s", self.peer, exc)
                if metrics:
                    metrics.request(None, dp.ErrorCode.Name(code))
                _send_quietly(sock, frame.error_header(0, code, str(exc)))
                return
            deadline = time.monotonic() + policy.payload_timeout
            started = time.perf_counter()
            op = dp.Op.Name(header.op)
            if header.op == dp.OP_HELLO:  # no token here: nothing to prove (empty nonce)
                frame.skip_bytes(sock, header.payload_bytes, self.buffer, deadline)
                sock.settimeout(policy.payload_timeout)
                frame.send_frame(sock, frame.FrameHeader(op=dp.OP_HELLO, request_id=header.request_id))
                continue
            try:
                node.precheck(header)
                # a push's blocks taken from the client's regions are received too
                received = header.payload_bytes + (frame.sourced_bytes(header) if header.op == dp.OP_PUSH else 0)
                if header.op != dp.OP_PUSH and not self.ensure_buffer(received):
                    raise self.budget_exhausted()
            except RequestError as exc:
                self.refuse(header, exc, op, deadline)
                continue
            try:
                if header.op == dp.OP_PUSH:
                    # A push's blocks go straight into their gradient buffers where they can: the
                    # buffer holds only the others (a host's one push of a step needs none).
                    try:
                        job, ticket = node.begin_push(header, None, self.regions)
                        if not self.ensure_buffer(ticket.scratch_bytes, push=True):
                            job.abort_push(ticket)
                            raise self.budget_exhausted()
                    except RequestError as exc:
                        self.refuse(header, exc, op, deadline)
                        continue
                    ticket.bind_scratch(self.buffer)
                    reply, payloads, pushed = self.receive_push(header, job, ticket, deadline), [], (header, job, ticket)
                else:
                    pushed = None
                    view = memoryview(self.buffer)[: header.payload_bytes]
                    frame.recv_exactly_into(sock, view, deadline)
                    reply, payloads = self.run(header, view)
            except RequestError as exc:
                self.reply_error(header, exc, op)
                continue
            except (ConnectionError, TimeoutError, OSError):
                raise  # the peer vanished or stalled mid-frame: nothing of the frame was kept
            except Exception as exc:  # a bug must not kill the node; report it and keep serving
                log.exception("internal error handling %s from %s", op, self.peer)
                self.reply_error(header, RequestError(ErrorCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"), op)
                continue
            sock.settimeout(policy.payload_timeout)  # a client that stops reading its reply is dropped
            try:
                frame.send_frame(sock, reply, payloads)
            finally:
                if pushed is not None:  # answered (or the client is gone): now the early steps
                    node.after_push(*pushed)
                else:
                    node.after_reply(header, reply)
            if metrics:  # a pull's blocks copied into the client's shared cache are sent bytes too
                placed = sum(ref.nbytes for ref in reply.blocks if ref.placed)
                metrics.request(op, ErrorCode.OK, seconds=time.perf_counter() - started,
                                bytes_in=received, bytes_out=reply.payload_bytes + placed)

    def budget_exhausted(self) -> RequestError:
        return RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                            f"node {self.node.node_id!r} holds its limit of payload bytes in flight "
                            f"({self.policy.budget.limit_bytes} bytes, max_inflight_bytes); retry shortly")

    def run(self, header, view):
        """``node.handle``; a pull that waits is cancelled when the client hangs up meanwhile."""
        hangups = self.policy.hangups
        regions = self.regions
        if header.op != dp.OP_PULL or hangups is None or not header.min_step:
            return self.node.handle(header, view, regions=regions)  # nothing to wait for
        cancelled = threading.Event()
        node = self.node

        def on_hangup() -> None:
            cancelled.set()
            job = node.store.get(header.job)
            if job is not None:
                with job.cond:
                    job.cond.notify_all()

        handle = hangups.watch(self.sock, on_hangup)
        try:
            return node.handle(header, view, cancelled=cancelled, regions=regions)
        finally:
            hangups.unwatch(handle)

    def refuse(self, header, exc: RequestError, op: str, deadline: float) -> None:
        """Answer a frame refused before its payload was read, then read past the payload (the
        client may still be sending it): the connection stays on a frame boundary."""
        self.reply_error(header, exc, op)
        frame.skip_bytes(self.sock, header.payload_bytes, self.buffer, deadline)

    def receive_push(self, header, job, ticket, deadline: float):
        """Receive a PUSH block by block into the destinations the store picked, checking each
        block as it lands (the check overlaps the arrival of the next), then make it visible.

        Blocks the client left in its shared regions are copied out (and checked) after the
        payload. The client hangs up before it changes memory whose push it gave up on (it timed
        out on a stalled node), so a hang-up seen after the copy means the copy may be torn: the
        push is dropped, as if the connection had ended mid-payload."""
        node, sock = self.node, self.sock
        # A float32 block is checked as it arrives: over shm as it is copied out of the ring (one
        # pass, not two), over TCP piece by piece right after each lands, still in the cache.
        checks = not job.allow_nonfinite
        check_on_copy = checks and self.capabilities.checks_on_copy
        check_on_receive = checks and not check_on_copy and frame.receives_checked(sock)
        try:
            sourced = []
            for i, (ref, dest) in enumerate(zip(header.blocks, ticket.dests)):
                if dest is None:
                    continue
                if ref.src_region:
                    sourced.append(i)
                    continue
                if dest.dtype == torch.float32 and (check_on_copy or check_on_receive):
                    recv = frame.recv_checked_into if check_on_copy else frame.recv_f32_checked
                    job.check_received(ticket, i, finite=recv(sock, frame.tensor_bytes(dest), deadline))
                    continue
                frame.recv_exactly_into(sock, frame.tensor_bytes(dest), deadline)
                job.check_received(ticket, i)
            if sourced:
                node.take_push(self.regions, job, ticket, header, sourced)
                if _hung_up(sock):
                    raise ConnectionError("the client hung up while its push was copied out of its memory")
            return node.finish_push(header, job, ticket)
        finally:
            if not ticket.done:
                job.abort_push(ticket)

    def reply_error(self, header, exc: RequestError, op: str) -> None:
        node = self.node
        epoch = exc.epoch if isinstance(exc, NotOwnerError) else node.routing.epoch
        job = node.store.get(header.job)
        step = job.step if job is not None else 0
        if self.metrics:
            self.metrics.request(op, exc.code)
        log.debug("%s from rank %d failed: %s %s", op, header.rank, exc.code, exc)
        self.sock.settimeout(self.policy.payload_timeout)
        frame.send_frame(self.sock, frame.error_header(header.request_id, dp.ErrorCode.Value(exc.code), exc.reply_message,
                                                       epoch=epoch, step=step))


def _readable(sock, timeout: float | None) -> bool:
    """True once ``sock`` has bytes (or an end of stream) to read; False after ``timeout``."""
    if capabilities_of(sock).signals_between_frames:  # shm: control messages between frames are not a frame
        return sock.wait_readable(timeout)
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(None if timeout is None else int(timeout * 1000)))
    except (ValueError, OSError, TypeError):  # closed meanwhile, or no file descriptor: let the read say
        return True


def _hung_up(sock) -> bool:
    """True if the peer has closed its end (bytes it sent before may still be unread)."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _authenticate(sock, peer: str, policy: ConnectionPolicy, metrics) -> bool:
    """Run the HELLO challenge; False (after an UNAUTHENTICATED reply) if the peer fails it."""
    deadline = time.monotonic() + AUTH_TIMEOUT_SECONDS
    token = policy.cluster_token
    try:
        hello = frame.recv_header(sock, AUTH_LIMITS, deadline)
        if hello.op == dp.OP_HELLO:
            nonce = auth.new_nonce()
            frame.send_frame(sock, frame.FrameHeader(op=dp.OP_HELLO, request_id=hello.request_id, auth=nonce))
            answer = frame.recv_header(sock, AUTH_LIMITS, deadline)
            if answer.op == dp.OP_HELLO and auth.verify(token, nonce, answer.auth):
                frame.send_frame(sock, frame.FrameHeader(op=dp.OP_REPLY, request_id=answer.request_id))
                return True
            message = "wrong cluster token"
        else:
            message = "this node requires authentication: send HELLO with the cluster token first"
    except (FrameError, ConnectionError, TimeoutError, OSError) as exc:
        message = f"authentication failed: {exc}"
    finally:
        try:
            sock.settimeout(None)
        except OSError:
            pass
    policy.complaints.log(logging.WARNING, _peer_host(peer), "refused data-plane connection from %s: %s", peer, message)
    if metrics:
        metrics.request("OP_HELLO", ErrorCode.UNAUTHENTICATED)
    _send_quietly(sock, frame.error_header(0, dp.UNAUTHENTICATED, message))
    return False


def _send_quietly(sock, header) -> None:
    try:
        sock.settimeout(1.0)
        frame.send_frame(sock, header)
    except OSError:
        pass
