"""The data-plane transport interface: what a transport (tcp.py, shm.py, rdma.py) and each of its
connections declare, so callers ask for a capability instead of probing for methods.

A :class:`Transport` connects and listens; :func:`shardline.services.transport.get_transport` is the
one factory. A connection has the socket methods the frame codec needs (:class:`Connection`) and
declares what it offers beyond them in ``CAPABILITIES`` (a plain TCP socket declares nothing:
:func:`capabilities_of` answers :data:`PLAIN` for it). A transport's ``capabilities`` are the most
its connections offer: ``auto`` reaches a remote peer over TCP, so ask the connection when it
matters. docs/architecture.md, "Transports and their capabilities".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol


@dataclass(frozen=True)
class Capabilities:
    """What a connection offers beyond a socket's methods."""

    # Memory regions shared with the peer (shm): share_region, unshare_region, region_size,
    # place / place_many (write into the peer's regions), take_many (copy out of them).
    shares_memory: bool = False
    # recv_checked_into: receives float32 bytes and checks them finite in the same pass (shm).
    checks_on_copy: bool = False
    # wait_readable(timeout): control messages arrive between frames, so readiness is the
    # connection's to tell, not the file descriptor's (shm).
    signals_between_frames: bool = False
    # sendall_many(buffers): one gathered send of a frame's parts (shm).
    gathers_sends: bool = False
    # Sends and receives through memory registered with the NIC (RDMA).
    registers_memory: bool = False


PLAIN = Capabilities()  # a TCP socket


class Connection(Protocol):
    """What the frame codec (services/frame.py) needs of a connection: a socket's methods."""

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int: ...

    def sendall(self, data) -> None: ...

    def settimeout(self, timeout: float | None) -> None: ...

    def gettimeout(self) -> float | None: ...

    def fileno(self) -> int: ...

    def shutdown(self, how: int) -> None: ...

    def close(self) -> None: ...


class Listener(Protocol):
    """A listening endpoint; ``address`` is the HOST:PORT peers connect to."""

    @property
    def address(self) -> str: ...

    @property
    def connections(self) -> int: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """A data-plane transport: ``NAME`` (tcp, shm, auto, rdma), the ``capabilities`` its
    connections may have, ``connect`` and ``listen`` (each accepted connection is handed to
    ``serve_connection(conn, peer)`` on a thread of its own)."""

    NAME: str

    @property
    def capabilities(self) -> Capabilities: ...

    def connect(self, address: str, connect_timeout: float = 10.0) -> Connection: ...

    def listen(self, host: str, port: int, serve_connection: Callable[[Connection, str], None], *,
               max_connections: int = 0, refuse=None) -> Listener: ...


def capabilities_of(conn) -> Capabilities:
    """The capabilities ``conn`` declares (its class's ``CAPABILITIES``); a plain socket: PLAIN."""
    return getattr(conn, "CAPABILITIES", PLAIN)
