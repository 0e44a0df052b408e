"""Rate-limited logging for conditions a peer can trigger at will (malformed frames, failed
authentication): one line per key (a peer host) per interval, the next one saying how many were
suppressed meanwhile, so a flood cannot fill the journal or slow the node down."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

DEFAULT_INTERVAL_SECONDS = 10.0
# Peers remembered at once; the least recently logged is forgotten first (a flood from many
# addresses costs bounded memory and at worst logs more lines).
MAX_KEYS = 1024


class RateLimitedLog:
    """``log(level, key, msg, *args)`` writes at most one line per ``key`` per ``interval_seconds``."""

    def __init__(self, logger: logging.Logger, interval_seconds: float = DEFAULT_INTERVAL_SECONDS, *,
                 max_keys: int = MAX_KEYS, clock: Callable[[], float] = time.monotonic):
        self._logger = logger
        self.interval_seconds = interval_seconds
        self._max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._last: OrderedDict[str, list] = OrderedDict()   # key -> [time logged, suppressed since]

    def log(self, level: int, key: str, msg: str, *args) -> bool:
        """Log unless ``key`` logged within the interval (then count it). True if a line was written."""
        now = self._clock()
        with self._lock:
            entry = self._last.get(key)
            if entry is not None and now - entry[0] < self.interval_seconds:
                entry[1] += 1
                return False
            suppressed = entry[1] if entry is not None else 0
            self._last[key] = [now, 0]
            self._last.move_to_end(key)
            while len(self._last) > self._max_keys:
                self._last.popitem(last=False)
        if suppressed:
            msg += f" ({suppressed} more like this from {key} in the last {self.interval_seconds:g} s)"
        self._logger.log(level, msg, *args)
        return True

    def suppressed(self, key: str) -> int:
        with self._lock:
            entry = self._last.get(key)
            return entry[1] if entry is not None else 0
