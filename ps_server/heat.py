"""Access heat of one PS node: reads and writes per block, and the node's load, for its heartbeats.

Contract: pure and thread-safe (one lock); time comes from ``clock`` (monotonic seconds) or a
``now`` argument. Only client traffic counts (pulls and pushes, in bytes), never replication.
Counters are exact per block for at most ``max_tracked`` blocks (further ones count in the load
and ``untracked`` only). ``report()`` gives the load since the previous report and at most
``MAX_REPORTED`` blocks; counts not reported carry over, so the sum of a block's reports equals
its accesses. ``rack_reads()`` gives the bytes per (job, reader rack) since the previous call, at
most ``MAX_RACK_READS`` pairs.

Design: docs/architecture.md, "Heatmap, rebalancing and reader racks",
"Heatmap and rebalancing".
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from shardline.services.errors import ShardlineConfigError

MAX_REPORTED = 32
MAX_RACK_READS = 64   # (job, rack) pairs counted per heartbeat interval; further pairs wait for the next
DEFAULT_MAX_TRACKED = 1 << 20
DEFAULT_HALF_LIFE_SECONDS = 30.0


@dataclass(frozen=True)
class BlockHeat:
    """A block's counts since it was last reported."""

    job: str
    tensor: str
    block: int
    reads: int
    writes: int
    read_bytes: int
    write_bytes: int


@dataclass(frozen=True)
class LoadSample:
    """A node's load over ``interval_seconds`` (per-second rates)."""

    interval_seconds: float
    bytes_in_per_second: float
    bytes_out_per_second: float
    pulls_per_second: float
    pushes_per_second: float
    apply_seconds_per_second: float
    reads_per_second: float
    writes_per_second: float


class _Block:
    __slots__ = ("reads", "writes", "read_bytes", "write_bytes", "p_reads", "p_writes", "p_read_bytes",
                 "p_write_bytes", "score", "scored_at")

    def __init__(self, now: float):
        self.reads = self.writes = self.read_bytes = self.write_bytes = 0
        self.p_reads = self.p_writes = self.p_read_bytes = self.p_write_bytes = 0
        self.score = 0.0
        self.scored_at = now

    def decayed(self, now: float, half_life: float) -> float:
        return self.score * math.exp2(-max(0.0, now - self.scored_at) / half_life)


class HeatCounter:
    """Per-block read/write counters and the node's load (see the module docstring)."""

    def __init__(self, *, max_tracked: int = DEFAULT_MAX_TRACKED, half_life: float = DEFAULT_HALF_LIFE_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(max_tracked, bool) or not isinstance(max_tracked, int) or max_tracked < 0:
            raise ShardlineConfigError(f"max_tracked must be an integer >= 0, got {max_tracked!r}")
        if isinstance(half_life, bool) or not isinstance(half_life, (int, float)) or not (
                math.isfinite(half_life) and half_life > 0):
            raise ShardlineConfigError(f"heat half_life must be a finite number > 0 (seconds), got {half_life!r}")
        self.max_tracked, self.half_life, self._clock = max_tracked, float(half_life), clock
        self._lock = threading.Lock()
        self._blocks: dict[tuple[str, str, int], _Block] = {}
        self.untracked = 0          # accesses of blocks beyond max_tracked (counted in the load only)
        self._last_report = clock()
        self._interval = dict.fromkeys(("bytes_in", "bytes_out", "pulls", "pushes", "apply", "reads", "writes"), 0)
        self._rack_reads: dict[tuple[str, str], int] = {}

    def _entry(self, key: tuple[str, str, int], now: float) -> _Block | None:
        entry = self._blocks.get(key)
        if entry is None and len(self._blocks) < self.max_tracked:
            entry = self._blocks[key] = _Block(now)
        return entry

    def _record(self, job: str, blocks: Iterable[tuple[str, int, int]], write: bool, now: float | None) -> None:
        now = self._clock() if now is None else now
        half_life = self.half_life
        decay: dict[float, float] = {}   # by scored_at: the blocks of one request were mostly scored together
        accesses = nbytes_total = 0
        with self._lock:
            get = self._blocks.get
            for tensor, index, nbytes in blocks:
                accesses += 1
                nbytes_total += nbytes
                entry = get((job, tensor, index))
                if entry is None:
                    entry = self._entry((job, tensor, int(index)), now)
                    if entry is None:
                        self.untracked += 1
                        continue
                if write:
                    entry.writes += 1
                    entry.write_bytes += nbytes
                    entry.p_writes += 1
                    entry.p_write_bytes += nbytes
                else:
                    entry.reads += 1
                    entry.read_bytes += nbytes
                    entry.p_reads += 1
                    entry.p_read_bytes += nbytes
                # entry.decayed(now, half_life), its factor computed once per scored_at
                factor = decay.get(entry.scored_at)
                if factor is None:
                    factor = decay[entry.scored_at] = math.exp2(-max(0.0, now - entry.scored_at) / half_life)
                # at least 1 per access, so accesses of zero flags or empty deltas still rank
                entry.score = entry.score * factor + max(1, nbytes)
                entry.scored_at = now
            iv = self._interval
            iv["pushes" if write else "pulls"] += 1
            iv["writes" if write else "reads"] += accesses
            iv["bytes_in" if write else "bytes_out"] += nbytes_total

    def record_reads(self, job: str, blocks: Iterable[tuple[str, int, int]], now: float | None = None,
                     rack: str = "") -> None:
        """One pull answered with ``blocks`` (``(tensor, index, bytes sent)``; empty: nothing changed),
        for a reader on ``rack`` (empty: not named)."""
        blocks = list(blocks)
        self._record(job, blocks, False, now)
        self.record_rack_read(job, rack, sum(n for _, _, n in blocks))

    def record_rack_read(self, job: str, rack: str, nbytes: int) -> None:
        """``nbytes`` sent to a reader on ``rack`` (empty: not named; nothing counted)."""
        if rack:
            with self._lock:
                key = (job, rack)
                if key in self._rack_reads or len(self._rack_reads) < MAX_RACK_READS:
                    self._rack_reads[key] = self._rack_reads.get(key, 0) + nbytes

    def rack_reads(self) -> dict[tuple[str, str], int]:
        """Bytes sent per (job, reader rack) since the previous call (those sums restart at 0)."""
        with self._lock:
            out, self._rack_reads = self._rack_reads, {}
            return out

    def record_writes(self, job: str, blocks: Iterable[tuple[str, int, int]], now: float | None = None) -> None:
        """One push received carrying ``blocks`` (``(tensor, index, bytes received)``)."""
        self._record(job, blocks, True, now)

    def record_apply(self, seconds: float) -> None:
        """Time spent applying a step's optimizer."""
        with self._lock:
            self._interval["apply"] += max(0.0, float(seconds))

    def totals(self, job: str, tensor: str, block: int) -> tuple[int, int, int, int] | None:
        """Exact ``(reads, writes, read_bytes, write_bytes)`` of a block since counting began (None: untracked)."""
        with self._lock:
            e = self._blocks.get((job, tensor, int(block)))
            return None if e is None else (e.reads, e.writes, e.read_bytes, e.write_bytes)

    def drop_job(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._blocks if k[0] == job]:
                del self._blocks[key]

    def report(self, k: int = MAX_REPORTED, now: float | None = None) -> tuple[LoadSample, list[BlockHeat]]:
        """The load since the last report and up to ``k`` hottest blocks with counts since they were
        last reported (those counts restart at 0; the others carry over)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_REPORTED:
            raise ShardlineConfigError(f"heat report size must be an integer in 0..{MAX_REPORTED}, got {k!r}")
        now = self._clock() if now is None else now
        with self._lock:
            seconds = max(1e-9, now - self._last_report)
            iv = self._interval
            load = LoadSample(seconds, iv["bytes_in"] / seconds, iv["bytes_out"] / seconds, iv["pulls"] / seconds,
                              iv["pushes"] / seconds, iv["apply"] / seconds, iv["reads"] / seconds,
                              iv["writes"] / seconds)
            for name in iv:
                iv[name] = 0
            self._last_report = now
            fresh = [(key, e) for key, e in self._blocks.items() if e.p_reads or e.p_writes]
            hottest = heapq.nlargest(k, fresh, key=lambda item: (item[1].p_reads + item[1].p_writes,
                                                                 item[1].decayed(now, self.half_life), item[0]))
            out = []
            for (job, tensor, block), e in hottest:
                out.append(BlockHeat(job, tensor, block, e.p_reads, e.p_writes, e.p_read_bytes, e.p_write_bytes))
                e.p_reads = e.p_writes = e.p_read_bytes = e.p_write_bytes = 0
            return load, out


def rack_reads_report(counter: HeatCounter) -> list:
    """``counter.rack_reads()`` as HeartbeatRequest ``rack_reads`` (RackReads)."""
    from shardline.services.pb import dispatcher_pb2

    return [dispatcher_pb2.RackReads(job=job, rack=rack, bytes=n) for (job, rack), n in sorted(counter.rack_reads().items())]


def heat_report(counter: HeatCounter, node_id: str, rack: str, now: float | None = None):
    """``counter.report()`` as HeartbeatRequest fields: ``(NodeLoad, [HeatEntry, ...])``. The counts
    of a heartbeat that does not arrive are lost (one interval's worth)."""
    from shardline.services.pb import dispatcher_pb2

    load, hot = counter.report(now=now)
    return (dispatcher_pb2.NodeLoad(node_id=node_id, rack=rack, interval_seconds=load.interval_seconds,
                                    bytes_in_per_second=load.bytes_in_per_second,
                                    bytes_out_per_second=load.bytes_out_per_second,
                                    pulls_per_second=load.pulls_per_second, pushes_per_second=load.pushes_per_second,
                                    apply_seconds_per_second=load.apply_seconds_per_second,
                                    reads_per_second=load.reads_per_second, writes_per_second=load.writes_per_second),
            [dispatcher_pb2.HeatEntry(job=h.job, tensor=h.tensor, block=h.block, reads=h.reads, writes=h.writes,
                                      read_bytes=h.read_bytes, write_bytes=h.write_bytes) for h in hot])
