"""The budget of payload bytes in flight on one data-plane server (a PS node, a rack cache).

``PayloadBudget`` is the server-wide budget for payload buffers (a frame's bytes between its header
and its reply); a connection reserves what its frame needs before allocating it, waits a bounded
time when the server is at its budget, and gets RESOURCE_EXHAUSTED after that
(services/dataplane_server.py).
"""

from __future__ import annotations

import threading
from typing import Callable


class PayloadBudget:
    """A byte semaphore: ``reserve(n, timeout)`` blocks until ``n`` bytes are free or the timeout passes."""

    def __init__(self, limit_bytes: int, on_change: Callable[[int], None] | None = None):
        if limit_bytes <= 0:
            raise ValueError(f"payload budget must be > 0 bytes, got {limit_bytes!r}")
        self.limit_bytes = limit_bytes
        self._in_use = 0
        self._cond = threading.Condition()
        self._on_change = on_change

    @property
    def in_use(self) -> int:
        with self._cond:
            return self._in_use

    def reserve(self, nbytes: int, timeout: float) -> bool:
        """Take ``nbytes`` of the budget; False if they did not become free within ``timeout``
        (or can never be: more than the whole budget)."""
        if nbytes <= 0:
            return True
        if nbytes > self.limit_bytes:
            return False
        with self._cond:
            if not self._cond.wait_for(lambda: self._in_use + nbytes <= self.limit_bytes, timeout=timeout):
                return False
            self._in_use += nbytes
            in_use = self._in_use
        if self._on_change is not None:
            self._on_change(in_use)
        return True

    def release(self, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            self._in_use = max(0, self._in_use - nbytes)
            in_use = self._in_use
            self._cond.notify_all()
        if self._on_change is not None:
            self._on_change(in_use)
