"""TCP transport: blocking sockets, one thread per accepted connection.

Receivers read payloads with ``recv_into`` straight into preallocated buffers, so a 64 MB pull
costs one kernel copy on each side; TCP_NODELAY keeps small request latency low.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

from shardline.services.daemon import format_host_port, parse_host_port
from shardline.services.errors import ShardlineConnectionError
from shardline.services.transport.base import PLAIN, Capabilities

log = logging.getLogger("shardline.transport.tcp")

NAME = "tcp"


def _tune(sock: socket.socket) -> None:
    """TCP_NODELAY only. The socket buffers are left to the kernel's autotuning (tcp_rmem and
    tcp_wmem): a fixed SO_SNDBUF/SO_RCVBUF turns autotuning off, and the 4 MiB both ways this set
    before made a 64 MiB transfer 1.1-1.9x slower than an untuned socket on loopback (the larger
    send buffer lets the sender run further ahead, so the bytes leave the caches before the receiver
    copies them; bench/RESULTS.md), while between machines autotuning grows the window to the
    path's bandwidth-delay product, which a fixed size caps."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect(address: str, connect_timeout: float = 10.0) -> socket.socket:
    host, port = parse_host_port(address, what="data-plane address")
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as exc:
        raise ShardlineConnectionError(f"cannot connect to data plane at {address}: {exc}") from exc
    sock.settimeout(None)
    _tune(sock)
    return sock


class Listener:
    """Accepts connections and runs ``serve_connection(sock, peer)`` on a thread for each.

    With ``max_connections``, a connection beyond that many open ones gets no thread: it is handed
    to ``refuse(sock, peer)`` on the accepting thread (which must not block: tell the peer why
    in a small write) and closed. Subclasses listen on other sockets (services/transport/shm.py:
    a Unix socket sharing this listener's connection count) by overriding ``_accepted``."""

    def __init__(self, host: str, port: int, serve_connection: Callable[[socket.socket, str], None], *,
                 max_connections: int = 0, refuse: Callable[[socket.socket, str], None] | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        self.host = host
        self.port = sock.getsockname()[1]
        self._start(sock, serve_connection, max_connections, refuse)

    def _start(self, sock: socket.socket, serve_connection, max_connections: int, refuse, *,
               share: "Listener | None" = None) -> None:
        """Serve the bound, listening ``sock``; with ``share``, count connections against its limit."""
        self._sock = sock
        self._serve = serve_connection
        self.max_connections = max_connections
        self._refuse = refuse
        self._conns: set = share._conns if share is not None else set()
        self._lock = share._lock if share is not None else threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="dataplane-accept", daemon=True)
        self._thread.start()

    def _accepted(self, conn: socket.socket, addr) -> tuple[object, str]:
        """The connection object to serve for an accepted socket, and the peer's name for logs."""
        _tune(conn)
        return conn, f"{addr[0]}:{addr[1]}"

    @property
    def address(self) -> str:
        return format_host_port(self.host, self.port)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                raw, addr = self._sock.accept()
            except OSError:
                return
            try:
                conn, peer = self._accepted(raw, addr)
            except OSError:  # the peer went away before it was set up: not the listener's problem
                raw.close()
                continue
            with self._lock:
                full = bool(self.max_connections) and len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self._turn_away(conn, peer)
                continue
            threading.Thread(target=self._run, args=(conn, peer), name=f"dataplane-{peer}", daemon=True).start()

    def _turn_away(self, conn: socket.socket, peer: str) -> None:
        try:
            conn.settimeout(0.2)
            if self._refuse is not None:
                self._refuse(conn, peer)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def _run(self, conn: socket.socket, peer: str) -> None:
        try:
            self._serve(conn, peer)
        except Exception:  # a connection's failure must never take the listener down
            log.exception("data-plane connection from %s failed", peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def listen(host: str, port: int, serve_connection, *, max_connections: int = 0, refuse=None) -> Listener:
    return Listener(host, port, serve_connection, max_connections=max_connections, refuse=refuse)


class TcpTransport:
    """The Transport (services/transport/base.py) over TCP: plain sockets, no capabilities beyond them."""

    NAME = NAME
    capabilities: Capabilities = PLAIN

    @staticmethod
    def connect(address: str, connect_timeout: float = 10.0) -> socket.socket:
        return connect(address, connect_timeout)

    @staticmethod
    def listen(host: str, port: int, serve_connection, *, max_connections: int = 0, refuse=None) -> Listener:
        return listen(host, port, serve_connection, max_connections=max_connections, refuse=refuse)


TRANSPORT = TcpTransport()
