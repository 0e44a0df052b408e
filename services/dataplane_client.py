"""The client end of a data-plane connection, shared by workers and by PS nodes talking to peers.

A connection authenticates once (services/auth.py: the node answers HELLO with a nonce when it has
a cluster token), then carries requests one at a time (``lock`` serializes them): a frame out,
a reply header back. Callers that expect a reply payload (pulls) read it themselves from ``sock``.
"""

from __future__ import annotations

import socket
import threading

from shardline.services import auth, frame
from shardline.services.errors import RemoteError, ShardlineConfigError, ShardlineConnectionError
from shardline.services.pb import dataplane_pb2 as dp

# Replies come from nodes this client chose to talk to; their size follows what it asked for.
REPLY_LIMITS = frame.FrameLimits(max_payload_bytes=1 << 40)


class DataPlaneConnection:
    """One data-plane connection to a PS node at ``address``; requests on it are serialized."""

    def __init__(self, address: str, transport, connect_timeout: float, cluster_token: bytes | None):
        self.address = address
        self.sock = transport.connect(address, connect_timeout)
        self.lock = threading.Lock()
        try:
            self._hello(cluster_token, connect_timeout)
        except BaseException:
            self.close()
            raise

    def _hello(self, token: bytes | None, timeout: float) -> None:
        """Authenticate (services/auth.py): the node answers with a nonce if it wants proof."""
        self.sock.settimeout(timeout)
        try:
            frame.send_frame(self.sock, frame.FrameHeader(op=dp.OP_HELLO))
            reply = frame.recv_header(self.sock, REPLY_LIMITS)
            if reply.op == dp.OP_HELLO and reply.auth:
                if token is None:
                    raise ShardlineConfigError(f"PS node at {self.address} requires the cluster token; none configured")
                frame.send_frame(self.sock, frame.FrameHeader(op=dp.OP_HELLO, auth=auth.response(token, reply.auth)))
                reply = frame.recv_header(self.sock, REPLY_LIMITS)
            if reply.op == dp.OP_ERROR:
                raise RemoteError(dp.ErrorCode.Name(reply.code), reply.message)
        finally:
            self.sock.settimeout(None)

    def request(self, header: frame.FrameHeader, payloads=(), *, timeout: float | None = None) -> frame.FrameHeader:
        """Send a frame and return the reply header (no reply payload expected). An error reply
        raises RemoteError; a broken connection ShardlineConnectionError (the connection is closed)."""
        with self.lock:
            try:
                self.sock.settimeout(timeout)
                frame.send_frame(self.sock, header, list(payloads))
                reply = frame.recv_header(self.sock, REPLY_LIMITS)
            except (OSError, ConnectionError) as exc:
                self.close()
                raise ShardlineConnectionError(f"data plane to {self.address}: {exc}") from exc
            finally:
                try:
                    self.sock.settimeout(None)
                except OSError:
                    pass
        if reply.op == dp.OP_ERROR:
            raise RemoteError(dp.ErrorCode.Name(reply.code), reply.message, epoch=reply.epoch, step=reply.step)
        return reply

    def abort(self) -> None:
        """From another thread: end the connection at once, so a request waiting on it (a send
        or a reply from a node that stopped answering) fails now. Its owner closes it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def retransmitting(self) -> bool:
        """TCP is resending data the peer has not acknowledged (the network lost it): after a cut
        its retries come further and further apart, so a connection that waited one out may sit
        idle for seconds after the network is back. False for other transports."""
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)
        except (OSError, AttributeError):
            return False
        return len(info) >= 5 and (info[2] > 0 or info[4] > 0)   # tcpi_retransmits, tcpi_backoff

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
