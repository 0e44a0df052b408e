"""RDMA/RoCE transport through pyverbs (imported lazily: most hosts have no RDMA stack).

A connection starts as a TCP connection (services/transport/tcp.py). A client with a usable
device sends an OFFER of its QP and receive ring (rdma_exchange.py) as the first bytes; the node
answers ACCEPT with its own and both bring their reliable-connected QP to RTS (the client then
sends one READY byte, so the node never sends before the client's QP can receive), or DECLINE
with a reason and the same connection goes on as plain TCP. Frames then travel as an
rdma_stream.RdmaConnection: small writes inline on TCP, payloads through registered buffers
reused for the connection's life. A node serves clients that send no offer (transport ``tcp``,
or no device) over TCP as before. Authentication (services/auth.py) runs afterwards over
whichever stream the connection became, like every other frame.

``auto`` (services/transport/__init__.py) uses this transport when pyverbs lists a device and
falls back per connection when the peer declines; explicit ``rdma`` makes a declined connection
an error. Sizes and the exchange timeout come from ``RdmaOptions.from_env()``.

Nothing of the device path has run on hardware yet (see docs/architecture.md, "RDMA transport").
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass

from shardline.services import frame
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError, ShardlineTimeoutError
from shardline.services.transport import rdma_exchange as rx
from shardline.services.transport import tcp
from shardline.services.transport.base import Capabilities
from shardline.services.transport.rdma_stream import RdmaConnection
from shardline.services.transport.rdma_pool import Credits, spare_slots

log = logging.getLogger("shardline.transport.rdma")

NAME = "rdma"
READY = b"\x01"
# A newer client's offer is skipped (then declined) up to this size.
MAX_FOREIGN_BODY_BYTES = 4096


def rdma_available() -> tuple[bool, str]:
    """(True, device) if pyverbs imports and lists at least one device, else (False, reason)."""
    if not os.path.isdir("/sys/class/infiniband"):
        return False, "the kernel exposes no RDMA devices (/sys/class/infiniband is absent)"
    from shardline.services.transport import rdma_verbs  # noqa: PLC0415 - imports pyverbs

    try:
        devices = rdma_verbs.list_devices()
    except ImportError as exc:
        return False, f"pyverbs is not installed ({exc})"
    except Exception as exc:  # pyverbs raises PyverbsRDMAError without a driver
        return False, f"pyverbs found no RDMA device ({exc})"
    if not devices:
        return False, "pyverbs found no RDMA device"
    return True, devices[0]


@dataclass(frozen=True)
class RdmaOptions:
    """Per-connection resources: ``buffers`` receive buffers of ``buffer_bytes`` (the peer's
    credits; a payload is sent in chunks of one buffer), ``send_buffers`` registered send
    buffers, writes of at most ``inline_bytes`` inline on TCP; the exchange must finish within
    ``exchange_timeout``. Each connection registers (buffers + spare + send_buffers) *
    buffer_bytes of memory once: 28 MiB with the defaults (16 + 4 + 8 buffers of 1 MiB)."""

    device: str = ""          # "" = the first device pyverbs lists
    port: int = 1
    gid_index: int = 0
    buffer_bytes: int = 1 << 20
    buffers: int = 16
    send_buffers: int = 8
    inline_bytes: int = 65536
    exchange_timeout: float = 10.0

    ENV = {"device": "SHARDLINE_RDMA_DEVICE", "port": "SHARDLINE_RDMA_PORT", "gid_index": "SHARDLINE_RDMA_GID_INDEX",
           "buffer_bytes": "SHARDLINE_RDMA_BUFFER_BYTES", "buffers": "SHARDLINE_RDMA_BUFFERS",
           "send_buffers": "SHARDLINE_RDMA_SEND_BUFFERS", "inline_bytes": "SHARDLINE_RDMA_INLINE_BYTES",
           "exchange_timeout": "SHARDLINE_RDMA_EXCHANGE_TIMEOUT"}

    def __post_init__(self):
        def bad(name, why):
            raise ShardlineConfigError(f"{self.ENV[name]} (rdma {name}) {why}, got {getattr(self, name)!r}")

        if not 1 <= self.port <= 255:
            bad("port", "must be in 1..255")
        if not 0 <= self.gid_index <= 255:
            bad("gid_index", "must be in 0..255")
        if not rx.MIN_SLOT_BYTES <= self.buffer_bytes <= rx.MAX_SLOT_BYTES or self.buffer_bytes % rx.MIN_SLOT_BYTES:
            bad("buffer_bytes", f"must be a multiple of {rx.MIN_SLOT_BYTES} in {rx.MIN_SLOT_BYTES}..{rx.MAX_SLOT_BYTES}")
        if not 2 <= self.buffers <= rx.MAX_SLOTS:
            bad("buffers", f"must be in 2..{rx.MAX_SLOTS}")
        if not 1 <= self.send_buffers <= rx.MAX_SLOTS:
            bad("send_buffers", f"must be in 1..{rx.MAX_SLOTS}")
        if not 0 <= self.inline_bytes <= 1 << 20:
            bad("inline_bytes", "must be in 0..1048576")
        if not self.exchange_timeout > 0:
            bad("exchange_timeout", "must be above 0 (seconds)")

    @classmethod
    def from_env(cls, environ=None) -> "RdmaOptions":
        environ = os.environ if environ is None else environ
        values = {}
        for name, var in cls.ENV.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            kind = type(getattr(cls, name))
            try:
                values[name] = kind(raw)
            except ValueError:
                raise ShardlineConfigError(f"{var} must be a {kind.__name__}, got {raw!r}") from None
        return cls(**values)


# --- the exchange on the TCP socket ---------------------------------------------------------------
def _recv_exactly(sock: socket.socket, n: int, deadline: float, peer: str, timeout: float) -> bytes:
    buf = bytearray(n)
    try:
        frame.recv_exactly_into(sock, memoryview(buf), deadline)
    except TimeoutError:
        raise ShardlineTimeoutError(f"RDMA exchange with {peer} did not complete within {timeout} s "
                                    f"(exchange_timeout)") from None
    except ConnectionError as exc:
        raise ShardlineConnectionError(f"{peer} closed the connection during the RDMA exchange ({exc})") from None
    return bytes(buf)


def read_message(sock, deadline: float, peer: str, timeout: float, *, head: bytes | None = None) -> rx.Message:
    """One exchange message (its 8-byte header already read if ``head``), all checks before the body."""
    head = head if head is not None else _recv_exactly(sock, rx.HEADER.size, deadline, peer, timeout)
    kind, body_len = rx.decode_header(head)
    return rx.decode_body(kind, _recv_exactly(sock, body_len, deadline, peer, timeout))


def _peek(sock: socket.socket, n: int, deadline: float) -> bytes:
    """Up to ``n`` first bytes without consuming them (fewer if the peer sends less by ``deadline``)."""
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            data = sock.recv(n, socket.MSG_PEEK)
        except (socket.timeout, OSError):
            break
        if not data:
            break
        if len(data) < n:
            time.sleep(0.001)  # a peek returns at once while any byte is queued: let the rest arrive
    return data


def _endpoint(options: RdmaOptions, device: str):
    from shardline.services.transport.rdma_verbs import VerbsEndpoint  # noqa: PLC0415 - imports pyverbs

    return VerbsEndpoint(device, port=options.port, gid_index=options.gid_index, slot_bytes=options.buffer_bytes,
                         data_slots=options.buffers, spare_slots=spare_slots(options.buffers),
                         send_slots=options.send_buffers)


def stream(sock, endpoint, local: rx.ConnParams, peer_params: rx.ConnParams, options: RdmaOptions, peer: str):
    """The RdmaConnection of a connected endpoint: chunks fit both sides' buffers, and credit
    messages in flight fit the peer's spare receive slots and this side's send queue."""
    from shardline.services.transport.rdma_stream import RdmaConnection  # noqa: PLC0415

    sock.settimeout(None)
    return RdmaConnection(sock, endpoint, Credits(peer_params.data_slots, local.data_slots), peer=peer,
                          peer_spare_slots=min(peer_params.spare_slots, local.spare_slots),
                          inline_max=options.inline_bytes,
                          chunk_bytes=min(local.slot_bytes, peer_params.slot_bytes))


class RdmaTransport:
    """The transport interface (``NAME``, ``connect``, ``listen``) over RDMA. ``required``: a
    connection whose peer declines RDMA fails instead of going on over TCP."""

    NAME = NAME
    # an RDMA connection's (a peer that declines RDMA gets a TCP socket: ask the connection)
    capabilities: Capabilities = RdmaConnection.CAPABILITIES

    def __init__(self, device: str = "", *, required: bool = False, options: RdmaOptions | None = None,
                 make_endpoint=_endpoint):
        self.options = options or RdmaOptions.from_env()
        self.device = self.options.device or device
        self.required = required
        self._make_endpoint = make_endpoint

    # --- client ------------------------------------------------------------------------------------
    def connect(self, address: str, connect_timeout: float = 10.0):
        sock = tcp.connect(address, connect_timeout)
        try:
            return self._upgrade(sock, address, connect_timeout)
        except BaseException:
            sock.close()
            raise

    def _upgrade(self, sock, address: str, connect_timeout: float):
        opts = self.options
        try:
            endpoint = self._make_endpoint(opts, self.device)
        except Exception as exc:  # no usable device here after all: plain TCP on this connection
            decision = rx.decide(f"cannot open RDMA device {self.device!r}: {exc}", None)
            return self._fall_back(sock, address, decision, connect_timeout, reconnect=False)
        try:
            local = endpoint.local_params()
            timeout = opts.exchange_timeout
            deadline = time.monotonic() + timeout
            sock.settimeout(timeout)
            sock.sendall(rx.encode(rx.OFFER, local))
            head = _recv_exactly(sock, rx.HEADER.size, deadline, address, timeout)
            # A node that predates RDMA reads the offer as a bad frame and answers with a frame.
            answer = read_message(sock, deadline, address, timeout, head=head) if head[:4] == rx.MAGIC else None
            decision = rx.decide(None, answer)
        except BaseException:
            endpoint.close()
            raise
        if not decision.use_rdma:
            endpoint.close()
            return self._fall_back(sock, address, decision, connect_timeout, reconnect=answer is None)
        try:
            endpoint.connect(answer.params, rx.negotiated_mtu(local, answer.params))
            sock.sendall(READY)
            conn = stream(sock, endpoint, local, answer.params, opts, address)
        except Exception as exc:  # noqa: BLE001 - the node waits for READY in vain and drops this connection
            endpoint.close()
            decision = rx.Decision(False, f"bringing up the RDMA queue pair failed: {exc}")
            return self._fall_back(sock, address, decision, connect_timeout, reconnect=True)
        log.debug("data plane to %s over RDMA (%s)", address, self.device)
        return conn

    def _fall_back(self, sock, address: str, decision: rx.Decision, connect_timeout: float, *, reconnect: bool):
        if self.required:
            raise ShardlineConnectionError(f"transport 'rdma' to {address}: {decision.reason}; use transport 'auto' "
                                           f"to fall back to TCP")
        log.info("data plane to %s over TCP: %s", address, decision.reason)
        if reconnect:  # the peer closes this connection (it saw a malformed frame, or no READY)
            sock.close()
            return tcp.connect(address, connect_timeout)  # with no offer: served over TCP
        sock.settimeout(None)
        return sock

    # --- node --------------------------------------------------------------------------------------
    def listen(self, host: str, port: int, serve_connection, *, max_connections: int = 0, refuse=None):
        return tcp.Listener(host, port, lambda sock, peer: self.serve(sock, peer, serve_connection),
                            max_connections=max_connections, refuse=refuse)

    def serve(self, sock, peer: str, serve_connection) -> None:
        """Run the node's side of the exchange if the peer offers one, then ``serve_connection``
        on the resulting stream (the TCP socket itself for a peer that offers nothing)."""
        opts = self.options
        timeout = opts.exchange_timeout
        deadline = time.monotonic() + timeout
        if _peek(sock, len(rx.MAGIC), deadline) != rx.MAGIC:
            sock.settimeout(None)
            serve_connection(sock, peer)
            return
        conn = self.accept_offer(sock, peer, deadline)
        if conn is None:
            return
        try:
            serve_connection(conn, peer)
        finally:
            if conn is not sock:
                conn.close()  # the QP and its registrations; the listener closes the TCP socket

    def accept_offer(self, sock, peer: str, deadline: float):
        """Answer the offer at the head of ``sock``: the stream to serve (an RdmaConnection, or
        ``sock`` after a DECLINE), or None when the connection is to be closed."""
        timeout = self.options.exchange_timeout
        try:
            head = _recv_exactly(sock, rx.HEADER.size, deadline, peer, timeout)
            try:
                kind, body_len = rx.decode_header(head)
            except rx.ExchangeVersionError as exc:
                # A newer client: skip its (bounded) body, decline, and go on over TCP.
                body_len = rx.HEADER.unpack(head)[3]
                if body_len > MAX_FOREIGN_BODY_BYTES:
                    raise rx.ExchangeError(f"{exc}; its body of {body_len} bytes is too large to skip") from None
                _recv_exactly(sock, body_len, deadline, peer, timeout)
                return self._decline(sock, peer, str(exc))
            offer = rx.decode_body(kind, _recv_exactly(sock, body_len, deadline, peer, timeout))
            if offer.kind != rx.OFFER:
                raise rx.ExchangeError(f"RDMA exchange: expected OFFER, got {rx.KIND_NAMES[offer.kind]}")
        except (rx.ExchangeError, ShardlineTimeoutError, ShardlineConnectionError, OSError) as exc:
            log.warning("refused data-plane connection from %s: %s", peer, exc)
            return None
        try:
            endpoint = self._make_endpoint(self.options, self.device)
        except Exception as exc:  # noqa: BLE001 - any device failure means: decline, serve over TCP
            return self._decline(sock, peer, f"cannot open RDMA device {self.device!r}: {exc}")
        try:
            local = endpoint.local_params()
            endpoint.connect(offer.params, rx.negotiated_mtu(local, offer.params))
        except Exception as exc:  # noqa: BLE001 - nothing is promised yet: decline, serve over TCP
            endpoint.close()
            return self._decline(sock, peer, f"bringing up the RDMA queue pair failed: {exc}")
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.sendall(rx.encode(rx.ACCEPT, local))
            if _recv_exactly(sock, len(READY), deadline, peer, timeout) != READY:
                raise rx.ExchangeError(f"RDMA exchange: {peer} sent no READY after ACCEPT")
            return stream(sock, endpoint, local, offer.params, self.options, peer)
        except Exception as exc:  # noqa: BLE001 - the connection is dropped whatever failed
            endpoint.close()
            log.warning("RDMA exchange with %s failed: %s", peer, exc)
            return None

    def _decline(self, sock, peer: str, reason: str):
        """DECLINE the offer and serve the connection over TCP (None if even that fails)."""
        try:
            sock.sendall(rx.encode(rx.DECLINE, reason=reason))
        except OSError as exc:
            log.warning("RDMA exchange with %s failed: %s", peer, exc)
            return None
        log.info("data plane from %s over TCP: declined RDMA (%s)", peer, reason)
        sock.settimeout(None)
        return sock


def transport(*, required: bool, device: str = "") -> RdmaTransport:
    return RdmaTransport(device, required=required)
