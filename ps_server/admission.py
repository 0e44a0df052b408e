"""What a PS node admits, bounded: lookups of job names (the payload bytes in flight are bounded by
services/payload_budget.py, shared with the rack cache).

``NameMisses`` remembers, briefly, job names the dispatcher said do not exist, so a flood of frames
naming unknown jobs costs the dispatcher one call per name per ``ttl_seconds``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable


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
