"""Ports on 127.0.0.1 for tests that run in parallel with other tests' daemons."""

from __future__ import annotations

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

    def __enter__(self) -> "ClosedPort":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def free_port() -> int:
    """A port that was free a moment ago, for a daemon the test starts on it next (the daemon binds
    it within moments; a test that needs connections refused uses :class:`ClosedPort`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
