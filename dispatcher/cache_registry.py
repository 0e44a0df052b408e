"""The rack caches a leading dispatcher lists in the routing table: registrations with a lease.

Soft state, like worker leases: a new leader starts with none and learns each cache from its next
heartbeat (answered ``registered: false``, so the cache registers again within one heartbeat
interval; readers pull from the PS nodes meanwhile). A cache silent for ``lease_seconds`` is no
longer listed; a registration from a new process of the same cache id replaces the old one.
Caches are advisory (a reader that cannot use its cache pulls from the node), so their changes do
not move the routing epoch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shardline.services.config import require_positive_number
from shardline.services.errors import ShardlineConfigError
from shardline.services.names import JOB_NAME_RE
from shardline.services.pb import common_pb2


@dataclass
class _Registered:
    info: common_pb2.CacheInfo
    last: float


class CacheRegistry:
    """Caches by id; ``lease_seconds``: how long one may stay silent and still be listed."""

    def __init__(self, lease_seconds: float):
        self.lease_seconds = require_positive_number(lease_seconds, "cache lease (seconds)")
        self._caches: dict[str, _Registered] = {}
        self._lock = threading.Lock()

    def register(self, info: common_pb2.CacheInfo, now: float) -> None:
        """Add or replace ``info`` (ShardlineConfigError naming what is missing or wrong)."""
        for field in ("cache_id", "rack", "data_address", "incarnation"):
            if not getattr(info, field):
                raise ShardlineConfigError(f"RegisterCache needs {field}")
        if not JOB_NAME_RE.fullmatch(info.cache_id) or not JOB_NAME_RE.fullmatch(info.rack):
            raise ShardlineConfigError(f"cache id and rack must match {JOB_NAME_RE.pattern}, got "
                                       f"{info.cache_id[:200]!r} and {info.rack[:200]!r}")
        copy = common_pb2.CacheInfo()
        copy.CopyFrom(info)
        with self._lock:
            self._caches[info.cache_id] = _Registered(copy, now)

    def heartbeat(self, cache_id: str, incarnation: str, now: float, *, resident_bytes: int = 0, hits: int = 0,
                  misses: int = 0) -> bool:
        """Renew the lease; False if this process of the cache is not registered (register again)."""
        with self._lock:
            entry = self._caches.get(cache_id)
            if entry is None or entry.info.incarnation != incarnation or now - entry.last > self.lease_seconds:
                return False
            entry.last = now
            entry.info.resident_bytes, entry.info.hits, entry.info.misses = resident_bytes, hits, misses
            return True

    def live(self, now: float) -> list[common_pb2.CacheInfo]:
        """The caches within their lease, by rack then id (expired ones are forgotten)."""
        with self._lock:
            for cache_id in [c for c, e in self._caches.items() if now - e.last > self.lease_seconds]:
                del self._caches[cache_id]
            out = []
            for entry in sorted(self._caches.values(), key=lambda e: (e.info.rack, e.info.cache_id)):
                info = common_pb2.CacheInfo()
                info.CopyFrom(entry.info)
                info.heartbeat_age_seconds = max(0.0, now - entry.last)
                out.append(info)
            return out
