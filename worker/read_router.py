"""Which address a worker's pull goes to: its rack's cache (L2) when the routing lists one, else
the nearest PS node that holds the blocks.

Pushes go to the PS primaries. A BSP read of a new step (a pull, or the pull a commit carries)
goes to the nearest owner of each block, its primary or a replica (``sources``,
services/copy_reads.py: own host, then own rack, then the primary); a node that answers
COPY_BEHIND is read from no more for ``COPY_READ_RETRY_SECONDS`` (its blocks from their
primaries). With a rack cache, pulls go through it to the primaries. A pull through the
cache names the node it would have gone to (``FrameHeader.via_node``) and gets the reply that node
would give (rack_cache/cache.py). When the cache cannot be used — it does not answer within
``cache_timeout`` beyond the pull's wait (killed, paused), drops the connection, or refuses
with an error of its own — the pull goes to the node at once, the router logs it once and leaves
the cache alone for ``retry_seconds``, then tries it again. A refusal the node itself would give
(NOT_OWNER, TIMEOUT, UNKNOWN_JOB, ...) is the pull's answer, as from the node.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

from shardline.services.copy_reads import COPY_READ_RETRY_SECONDS, nearest_holder
from shardline.services.errors import ErrorCode
from shardline.services.placement import place

log = logging.getLogger("shardline.worker")

# How long past a pull's own wait a rack cache may take to answer before the pull goes to the PS.
CACHE_TIMEOUT_SECONDS = 5.0
# After a cache failed, pulls go to the PS nodes for this long before the cache is tried again.
CACHE_RETRY_SECONDS = 10.0
# A reader of a rack whose routing lists no usable cache looks at the routing again this often (at
# a pull), so a cache registered after it started (or again after a failure) is found.
CACHE_DISCOVERY_SECONDS = 10.0
# Error codes a cache passes on from the node: they are the pull's answer, not a failure of the cache.
NODE_ANSWERS = frozenset({ErrorCode.NOT_OWNER, ErrorCode.TIMEOUT, ErrorCode.UNKNOWN_JOB, ErrorCode.UNKNOWN_TENSOR,
                          ErrorCode.WORKER_LOST, ErrorCode.STALE_STEP})


def default_rack(rack: str | None) -> str | None:
    """``rack``, else ``$SHARDLINE_RACK`` (unset or empty: no rack)."""
    if rack is not None:
        return rack or None
    return os.environ.get("SHARDLINE_RACK") or None


class ReadRouter:
    """The pull target of one client (not thread-safe: the client is not)."""

    def __init__(self, rack: str | None, *, cache_timeout: float = CACHE_TIMEOUT_SECONDS,
                 retry_seconds: float = CACHE_RETRY_SECONDS, clock=time.monotonic):
        self.rack = rack
        self.cache_timeout = cache_timeout
        self.retry_seconds = retry_seconds
        self._clock = clock
        self._down_until = 0.0
        self._down: str | None = None   # the cache id the last failure was logged for
        self._look_at = clock() + CACHE_DISCOVERY_SECONDS
        self._behind: dict[str, float] = {}   # node -> until when its copies are not read
        self._sources: tuple | None = None    # (routing, spec, avoided, {key: node})

    def sources(self, routing, spec, rank: int, is_local: Callable[[str], bool]) -> dict:
        """``{key: node}``: where each block of the job ``spec`` is read from under ``routing``
        (nearest_holder). Cached until the routing view, the spec (a client replaces its spec
        when the job's revision changes; both are immutable once made) or the avoided nodes change:
        a pull asks this every time, and the placement's own cache key serializes the spec."""
        now = self._clock()
        for node in [n for n, until in self._behind.items() if until <= now]:
            del self._behind[node]
        avoided = frozenset(self._behind)
        cached = self._sources
        if cached is not None and cached[0] is routing and cached[1] is spec and cached[2] == avoided:
            return cached[3]
        racks = {n: info.rack for n, info in routing.nodes.items()}
        sources = {key: nearest_holder(owners, is_local=is_local, rack_of=racks.get, rack=self.rack, rank=rank,
                                       avoid=avoided)
                   for key, owners in place(routing, spec).owners.items() if owners}
        self._sources = (routing, spec, avoided, sources)
        return sources

    def copy_behind(self, node: str, exc: Exception) -> None:
        """``node`` could not serve a read from its copies: read its blocks' primaries for a while."""
        if node not in self._behind:
            log.info("node %s cannot serve reads from its copies (%s): reading the primaries for %g s",
                     node, exc, COPY_READ_RETRY_SECONDS)
        self._behind[node] = self._clock() + COPY_READ_RETRY_SECONDS

    def wants_routing(self, routing) -> bool:
        """True (at most every CACHE_DISCOVERY_SECONDS) if the client should refresh its routing to
        find its rack's cache: none listed, or the one listed failed."""
        if self.rack is None or self._clock() < self._look_at:
            return False
        self._look_at = self._clock() + CACHE_DISCOVERY_SECONDS
        return self._down is not None or not any(c.rack == self.rack for c in getattr(routing, "caches", ()))

    def cache_for(self, routing):
        """The CacheInfo to pull through, or None (no rack, none registered, or resting after a failure)."""
        if self.rack is None or self._clock() < self._down_until:
            return None
        for info in getattr(routing, "caches", ()):
            if info.rack == self.rack:
                return info
        return None

    def failed(self, info, exc: Exception) -> None:
        """The cache ``info`` could not serve a pull: pull from the nodes for ``retry_seconds``."""
        self._down_until = self._clock() + self.retry_seconds
        if self._down != info.cache_id:
            self._down = info.cache_id
            log.warning("rack cache %s failed (%s): pulling from the PS nodes; trying it again every %g s",
                        info.cache_id, exc, self.retry_seconds)

    def refused(self, info, exc: Exception) -> None:
        """The cache answered with an error of its own: this pull goes to the node."""
        log.debug("rack cache %s refused a pull (%s): pulling from the node", info.cache_id, exc)

    def succeeded(self, info) -> None:
        if self._down is not None:
            log.info("rack cache %s serves pulls again", info.cache_id)
            self._down = None
