"""What a PS node admits, bounded: bytes of payloads in flight, and lookups of job names.

``PayloadBudget`` is the node-wide budget for payload buffers (a frame's bytes between its header
and its reply); a connection reserves what its frame needs before allocating it, waits a bounded
time when the node is at its budget, and gets RESOURCE_EXHAUSTED after that.
``NameMisses`` remembers, briefly, job names the dispatcher said do not exist, so a flood of frames
naming unknown jobs costs the dispatcher one call per name per ``ttl_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
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


DEFAULT_MISS_TTL_SECONDS = 1.0
MAX_MISSES = 4096


class NameMisses:
    """Names recently found not to exist, each remembered for ``ttl_seconds`` (at most ``max_entries``)."""

    def __init__(self, ttl_seconds: float = DEFAULT_MISS_TTL_SECONDS, *, max_entries: int = MAX_MISSES,
                 clock: Callable[[], float] = time.monotonic):
        self.ttl_seconds = ttl_seconds
        self._max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._until: OrderedDict[str, float] = OrderedDict()

    def add(self, name: str) -> None:
        with self._lock:
            self._until[name] = self._clock() + self.ttl_seconds
            self._until.move_to_end(name)
            while len(self._until) > self._max_entries:
                self._until.popitem(last=False)

    def discard(self, name: str) -> None:
        with self._lock:
            self._until.pop(name, None)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            until = self._until.get(name)
            if until is None:
                return False
            if self._clock() >= until:
                del self._until[name]
                return False
            return True
