"""The dispatcher's decayed access heatmap: per-node load and the hottest blocks cluster-wide.

Pure and thread-safe (one lock); every call takes ``now`` (monotonic seconds), so tests drive it
with a fake clock. Soft state: a new leader starts with an empty heatmap and learns it back from
the next heartbeats (rebalancing waits until it has enough, dispatcher/rebalance.py).

PS nodes report in each heartbeat their load over the interval since the previous one (rates,
ps_server/heat.py) and their hottest blocks with the counts since each was last reported. Every
quantity here is an exponentially decayed sum: a count ``c`` reported at ``t`` weighs
``c * 2**(-(now - t) / half_life)`` at ``now``. A rate is the decayed sum divided by the decayed
length of the window it covers, ``tau * (1 - exp(-age / tau))`` with ``tau = half_life / ln 2``
and ``age`` the time since the node's first report: so a steady rate reads as itself from the
first report on, and a rate that changes is followed within about one half-life.

Memory: one record per alive node and at most ``max_shards`` block records (the decayed-coldest
are dropped beyond it; the blocks of a heartbeat are at most ps_server.heat.MAX_REPORTED per node).
A block's share is its reads + writes over the cluster's reads + writes (all blocks, as the nodes'
loads count them).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from shardline.dispatcher.decay import DecayedSums
from shardline.services.config import require_nonnegative_number, require_positive_number
from shardline.services.errors import ShardlineConfigError

DEFAULT_HALF_LIFE_SECONDS = 30.0
DEFAULT_MAX_SHARDS = 4096
# Per-node fields of a NodeLoad, summed as counts (rate * interval) and decayed.
LOAD_FIELDS = ("bytes_in", "bytes_out", "pulls", "pushes", "apply_seconds", "reads", "writes")


@dataclass(frozen=True)
class NodeHeat:
    """A node's decayed load, per second."""

    node_id: str
    rack: str
    bytes_in_per_second: float
    bytes_out_per_second: float
    pulls_per_second: float
    pushes_per_second: float
    apply_seconds_per_second: float
    reads_per_second: float
    writes_per_second: float
    share: float                  # of the cluster's bytes in + out

    @property
    def bytes_per_second(self) -> float:
        return self.bytes_in_per_second + self.bytes_out_per_second


@dataclass(frozen=True)
class ShardHeat:
    """A block's decayed accesses, per second."""

    job: str
    tensor: str
    block: int
    node: str
    reads_per_second: float
    writes_per_second: float
    bytes_per_second: float
    share: float                  # of all reads + writes in the cluster


class _NodeRecord:
    __slots__ = ("rack", "first", "active", "sums")

    def __init__(self, rack: str, now: float):
        self.rack, self.first, self.sums = rack, now, DecayedSums(len(LOAD_FIELDS), now)
        self.active: float | None = None   # since when it reported any load (for covered())


class _ShardRecord:
    __slots__ = ("node", "sums", "first")

    def __init__(self, node: str, now: float):
        self.node, self.sums, self.first = node, DecayedSums(3, now), now   # reads, writes, bytes


class Heatmap:
    """The decayed heatmap (see the module docstring)."""

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE_SECONDS, *, max_shards: int = DEFAULT_MAX_SHARDS):
        self.half_life = require_positive_number(half_life, "heat_half_life (seconds)")
        if isinstance(max_shards, bool) or not isinstance(max_shards, int) or max_shards < 1:
            raise ShardlineConfigError(f"max_shards must be an integer >= 1, got {max_shards!r}")
        self.max_shards = max_shards
        self._tau = self.half_life / math.log(2)
        self._lock = threading.Lock()
        self._nodes: dict[str, _NodeRecord] = {}
        self._shards: dict[tuple[str, str, int], _ShardRecord] = {}

    def _window(self, first: float, now: float) -> float:
        age = max(now - first, 1e-3)
        return self._tau * -math.expm1(-age / self._tau)

    def report(self, node_id: str, rack: str, load, hot, now: float) -> None:
        """A heartbeat's ``load`` (a NodeLoad: rates over ``interval_seconds``) and ``hot`` (HeatEntry
        counts). A load without an interval (a node that does not measure) adds nothing."""
        interval = require_nonnegative_number(load.interval_seconds, "load interval_seconds") if load is not None else 0.0
        amounts = None
        if interval > 0:
            amounts = [require_nonnegative_number(getattr(load, f"{name}_per_second"), f"load {name}_per_second") * interval
                       for name in LOAD_FIELDS]
        # What arrived over the interval has decayed over it too (as if spread evenly across it).
        spread = self._tau * -math.expm1(-interval / self._tau) / interval if interval > 0 else 1.0
        if amounts is not None:
            amounts = [a * spread for a in amounts]
        entries = [(e.job, e.tensor, int(e.block), require_nonnegative_number(e.reads, "reads") * spread,
                    require_nonnegative_number(e.writes, "writes") * spread,
                    (require_nonnegative_number(e.read_bytes, "read_bytes") + require_nonnegative_number(e.write_bytes, "write_bytes")) * spread) for e in hot]
        with self._lock:
            record = self._nodes.get(node_id)
            if record is None:
                # The first report covers the interval before it: the window starts there.
                record = self._nodes[node_id] = _NodeRecord(rack, now - interval)
            record.rack = rack or record.rack
            if amounts is not None:
                record.sums.add(now, self.half_life, amounts)
                if record.active is None and any(amounts):
                    record.active = now - interval
            for job, tensor, block, reads, writes, nbytes in entries:
                shard = self._shards.get((job, tensor, block))
                if shard is None:
                    shard = self._shards[(job, tensor, block)] = _ShardRecord(node_id, record.first)
                shard.node = node_id
                shard.sums.add(now, self.half_life, (reads, writes, nbytes))
            if len(self._shards) > self.max_shards:
                self._prune(now)

    def _prune(self, now: float) -> None:
        for shard in self._shards.values():
            shard.sums.advance(now, self.half_life)
        keep = sorted(self._shards.items(), key=lambda kv: -(kv[1].sums.values[0] + kv[1].sums.values[1]))
        self._shards = dict(keep[: self.max_shards * 3 // 4])

    def forget_node(self, node_id: str) -> None:
        """A node left (declared dead): its load stops counting; its blocks' records stay until
        another node reports them or they decay out."""
        with self._lock:
            self._nodes.pop(node_id, None)

    def forget_job(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._shards if k[0] == job]:
                del self._shards[key]

    def nodes(self, now: float, only: set | None = None) -> list[NodeHeat]:
        """Every reporting node's decayed load (``only``: those ids), by id.

        Each as of its last report: between reports a node's sums only decay, so rates read at
        ``now`` would dip until its next heartbeat (a sawtooth of one interval's decay between
        nodes heartbeating at different moments)."""
        with self._lock:
            rates = {}
            for node_id, record in self._nodes.items():
                if only is not None and node_id not in only:
                    continue
                at = record.sums.at
                window = self._window(record.first, at)
                rates[node_id] = (record.rack, [v / window for v in record.sums.values])
        total = sum(r[0] + r[1] for _, r in rates.values())
        return [NodeHeat(node_id, rack, *r, share=(r[0] + r[1]) / total if total > 0 else 0.0)
                for node_id, (rack, r) in sorted(rates.items())]

    def accesses_per_second(self, now: float) -> float:
        """Reads + writes of every block, cluster-wide."""
        return sum(n.reads_per_second + n.writes_per_second for n in self.nodes(now))

    def hottest(self, now: float, limit: int = 32, job: str = "") -> list[ShardHeat]:
        """The ``limit`` blocks with the most decayed accesses (reads + writes), hottest first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ShardlineConfigError(f"limit must be an integer >= 0, got {limit!r}")
        total = self.accesses_per_second(now)
        with self._lock:
            rows = []
            for (j, tensor, block), shard in self._shards.items():
                if job and j != job:
                    continue
                # as of its node's last report, like the nodes' loads (a block it left decays on)
                node = self._nodes.get(shard.node)
                at = max(shard.sums.at, node.sums.at if node is not None else now)
                shard.sums.advance(at, self.half_life)
                window = self._window(shard.first, at)
                reads, writes, nbytes = (v / window for v in shard.sums.values)
                rows.append(ShardHeat(j, tensor, block, shard.node, reads, writes, nbytes,
                                      (reads + writes) / total if total > 0 else 0.0))
        rows.sort(key=lambda r: (-(r.reads_per_second + r.writes_per_second), r.job, r.tensor, r.block))
        return rows[:limit]

    def block_bytes(self, now: float) -> dict[tuple[str, str, int], float]:
        """Bytes per second of every block in the heatmap (what rebalancing can place)."""
        return {(s.job, s.tensor, s.block): s.bytes_per_second for s in self.hottest(now, len(self._shards))}

    def covered(self, node_ids, now: float, seconds: float) -> bool:
        """Every node of ``node_ids`` has reported load for at least ``seconds`` (enough to act on:
        a start-up, such as every worker's first pull, has mostly decayed by then)."""
        with self._lock:
            return all(n in self._nodes and self._nodes[n].active is not None
                       and now - self._nodes[n].active >= seconds for n in node_ids)
