"""Ports on 127.0.0.1 for tests that run in parallel with other tests' daemons."""

from __future__ import annotations

import random
import socket


class ClosedPort:
    """A port on 127.0.0.1 where connections are refused until ``release()``.

    The port stays bound (not listening) meanwhile, so the kernel gives it to no other socket. A port
    that was merely free a moment ago once went to a parallel test's dispatcher, and a test that
    expected "connection refused" met that dispatcher's token check instead."""

    def __init__(self) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"

    def release(self) -> None:
        """Free the port, e.g. for the daemon a test starts on it next."""
        self._socket.close()


# free_port picks from below the kernel's ephemeral range, which no socket bound to port 0 (every
# other test's daemons) and no outgoing connection is given: only another free_port could pick the
# same port before the daemon binds it, one chance in thousands.
FIXED_PORTS_LOW = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def free_port() -> int:
    """A port that was free a moment ago, for a daemon the test starts on it next, on a port it
    must know in advance (to restart on it, or to write it in a unit file). A test that needs
    connections refused uses :class:`ClosedPort`."""
    high = _ephemeral_low()
    candidates = random.sample(range(FIXED_PORTS_LOW, high), 64) if high > FIXED_PORTS_LOW + 1000 else []
    for port in [*candidates, 0]:   # 0: the kernel's pick, if none below its range is free
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")
