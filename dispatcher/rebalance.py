"""When and how the ring's virtual-node counts follow measured load (bytes/s in + out of each
node): pure policy, no I/O, deterministic.

Contract: the plan is predicted from the blocks' rates, not from the ring in use, so planning again
with the same load finds the same counts (a move is never undone by measuring after it). Counts
stay within ``[min_factor, max_factor]`` times the capacity-derived ``base``; nudges toward
readers' racks are kept only within the balance band (capacity first, locality where it allows).
Nothing moves while a ring change is pending, within the cool-down, when the cluster carries less
than ``min_load`` bytes/s, when the measured max/mean is within ``tolerance`` of 1, or when the
predicted max/mean after the move does not improve by ``min_improvement`` on both the model's
ratio for the ring in use and the measured one; a node's count within
``hysteresis`` of its current one is kept.

Design: docs/architecture.md, "Heatmap, rebalancing and reader racks".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from shardline.services.blocks import block_hash
from shardline.services.errors import ShardlineConfigError
from shardline.services.ring import HASH_SPACE, MAX_VNODES_PER_NODE, load_adjusted_vnodes, vnode_position

DEFAULT_MIN_IMPROVEMENT = 0.05
DEFAULT_TOLERANCE = 0.05
DEFAULT_HYSTERESIS = 0.05
DEFAULT_MIN_LOAD = 1024.0          # bytes/s: below it the cluster counts as idle
MIN_FACTOR, MAX_FACTOR = 0.25, 4.0
_ROUNDS = 8
_NUDGES = (0.7, 0.85, 0.93, 1.07, 1.18, 1.4)


@dataclass(frozen=True)
class Plan:
    """A rebalance to apply: the new counts and the max/mean load ratios behind it."""

    vnodes: dict
    measured: float               # max/mean of the measured load
    predicted_before: float       # ... predicted under the current ring
    predicted_after: float        # ... predicted under ``vnodes``

    def describe(self) -> str:
        return (f"max/mean load {self.measured:.3f} measured, {self.predicted_before:.3f} predicted now, "
                f"{self.predicted_after:.3f} predicted after: vnodes "
                + ", ".join(f"{n}={c}" for n, c in sorted(self.vnodes.items())))


def imbalance(load: Mapping[str, float]) -> float:
    """max/mean of ``load`` (1.0 when empty or all zero)."""
    values = list(load.values())
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


class LoadModel:
    """Predicted per-node load of a ring, from measured node loads and known block rates.

    Rings are evaluated with numpy (the search evaluates hundreds): the same ownership as
    ``services.ring.HashRing`` (first position >= the key's hash, wrapping; equal positions
    ordered by node id), checked against it in tests/unit/test_heatmap.py."""

    def __init__(self, node_load: Mapping[str, float], block_bytes: Mapping[tuple, float], nodes):
        self.nodes = sorted(nodes)
        items = sorted(block_bytes.items())
        self.blocks = [key for key, _ in items]   # (job, tensor, index), the model's block order
        self._hashes = np.array([block_hash(job, tensor, index) for (job, tensor, index), _ in items], dtype=np.uint64)
        self._rates = np.array([rate for _, rate in items], dtype=np.float64)
        # What the nodes carry beyond the known blocks, spread like uniformly hashed keys. A total,
        # so that it does not depend on the ring the load was measured under.
        self.residual = max(0.0, sum(node_load.get(n, 0.0) for n in self.nodes) - float(self._rates.sum()))
        self._points: dict[str, np.ndarray] = {}
        self._last_ring: tuple | None = None

    @property
    def rates(self) -> np.ndarray:
        return self._rates

    def _positions(self, node: str, count: int) -> np.ndarray:
        cached = self._points.get(node)
        if cached is None or len(cached) < count:
            cached = self._points[node] = np.array([vnode_position(node, i) for i in range(max(count, 2 * count))],
                                                   dtype=np.uint64)
        return cached[:count]

    def owners_of(self, vnodes: Mapping[str, int]) -> list[str]:
        """The owner of every known block (in the model's block order) under ``vnodes``."""
        index, order, _ = self._ring(vnodes)
        return [self.nodes[i] for i in order[index]]

    def _ring(self, vnodes: Mapping[str, int]):
        # One entry: a trial's balance and its owners (toward_readers) come from the same ring.
        key = tuple(sorted(vnodes.items()))
        if self._last_ring is not None and self._last_ring[0] == key:
            return self._last_ring[1]
        ring = self._build_ring(vnodes)
        self._last_ring = (key, ring)
        return ring

    def _build_ring(self, vnodes: Mapping[str, int]):
        ids = [i for i, n in enumerate(self.nodes) for _ in range(vnodes[n])]
        pos = np.concatenate([self._positions(n, vnodes[n]) for n in self.nodes])
        owner = np.array(ids, dtype=np.int64)
        sort = np.lexsort((owner, pos))
        pos, owner = pos[sort], owner[sort]
        index = np.searchsorted(pos, self._hashes, side="left")
        index[index == len(pos)] = 0
        return index, owner, pos

    def predict(self, vnodes: Mapping[str, int]) -> dict:
        index, owner, pos = self._ring(vnodes)
        load = np.bincount(owner[index], weights=self._rates, minlength=len(self.nodes)) if len(self._rates) else \
            np.zeros(len(self.nodes))
        if self.residual:
            # arc (p_prev, p] belongs to p's node; the first point also owns the wrapped arc
            arcs = np.empty(len(pos), dtype=np.float64)
            arcs[1:] = (pos[1:] - pos[:-1]).astype(np.float64)
            arcs[0] = float(HASH_SPACE - int(pos[-1]) + int(pos[0]))
            share = np.bincount(owner, weights=arcs, minlength=len(self.nodes)) / float(HASH_SPACE)
            load = load + self.residual * share
        return {n: float(load[i]) for i, n in enumerate(self.nodes)}


def _clamp(vnodes: Mapping[str, int], base: Mapping[str, int], min_factor: float, max_factor: float) -> dict:
    return {n: min(MAX_VNODES_PER_NODE, max(1, math.ceil(base[n] * min_factor), min(int(base[n] * max_factor), c)))
            for n, c in vnodes.items()}


def search(model: LoadModel, base: Mapping[str, int], *, min_factor: float = MIN_FACTOR,
           max_factor: float = MAX_FACTOR) -> tuple[dict, float]:
    """The counts with the lowest predicted max/mean found from ``base``, within ``[min_factor,
    max_factor]`` times it (docs/architecture.md, "Heatmap, rebalancing and reader racks")."""
    best = dict(base)
    best_ratio = imbalance(model.predict(best))
    v = dict(base)
    for _ in range(_ROUNDS):  # proportional steps
        v = _clamp(load_adjusted_vnodes(v, model.predict(v), v, 0.0, min_factor=0.5, max_factor=2.0),
                   base, min_factor, max_factor)
        ratio = imbalance(model.predict(v))
        if ratio < best_ratio - 1e-12:
            best, best_ratio = dict(v), ratio
    for _ in range(_ROUNDS):  # then single-node nudges while they help
        improved = False
        for node in sorted(best):
            for factor in _NUDGES:
                trial = _clamp({**best, node: max(1, round(best[node] * factor))}, base, min_factor, max_factor)
                if trial == best:
                    continue
                ratio = imbalance(model.predict(trial))
                if ratio < best_ratio - 1e-12:
                    best, best_ratio, improved = trial, ratio, True
        if not improved:
            break
    return best, best_ratio


def rack_local_bytes(model: LoadModel, vnodes: Mapping[str, int], wanted: list) -> float:
    """Bytes/s of the known blocks owned under ``vnodes`` on the rack ``wanted`` names for each
    (the model's block order; None: no preference)."""
    owners = model.owners_of(vnodes)
    return float(sum(rate for owner, want, rate in zip(owners, wanted, model.rates) if want is not None
                     and owner in want))


def toward_readers(model: LoadModel, best: Mapping[str, int], base: Mapping[str, int], limit: float,
                   readers: list, *, min_factor: float = MIN_FACTOR, max_factor: float = MAX_FACTOR) -> dict:
    """``best`` nudged toward rack-local ownership of the blocks ``readers`` names (per block in
    the model's order: the set of nodes on its readers' rack, or None) while the predicted max/mean
    stays <= ``limit``. Deterministic."""
    if not any(r for r in readers):
        return dict(best)
    best = dict(best)
    local = rack_local_bytes(model, best, readers)
    for _ in range(_ROUNDS):
        improved = False
        for node in sorted(best):
            for factor in _NUDGES:
                trial = _clamp({**best, node: max(1, round(best[node] * factor))}, base, min_factor, max_factor)
                if trial == best or imbalance(model.predict(trial)) > limit + 1e-12:
                    continue
                gained = rack_local_bytes(model, trial, readers)
                if gained > local + 1e-9:
                    best, local, improved = trial, gained, True
        if not improved:
            break
    return best


def plan(base: Mapping[str, int], current: Mapping[str, int], node_load: Mapping[str, float],
         block_bytes: Mapping[tuple, float], *, now: float, last_change: float | None, cooldown: float,
         pending: bool, min_improvement: float = DEFAULT_MIN_IMPROVEMENT, tolerance: float = DEFAULT_TOLERANCE,
         hysteresis: float = DEFAULT_HYSTERESIS, min_load: float = DEFAULT_MIN_LOAD,
         node_racks: Mapping[str, str] | None = None, reader_racks: Mapping[str, str] | None = None) -> Plan | None:
    """New virtual-node counts for the serving nodes, or None to leave the ring as it is.

    ``base``: capacity-derived counts of the serving nodes; ``current``: their counts now;
    ``node_load``: measured bytes/s per node (a serving node without a measurement: no plan);
    ``block_bytes``: bytes/s of the blocks the heatmap knows, ``(job, tensor, index) -> rate``;
    ``last_change``: when the last rebalance was applied (None: never); ``node_racks``: node ->
    rack and ``reader_racks``: job -> its readers' rack, for the tie-break toward the readers' rack.
    Design: docs/architecture.md, "Heatmap, rebalancing and reader racks".
    """
    if set(base) != set(current):
        raise ShardlineConfigError(f"base and current counts name different nodes: {sorted(base)} vs {sorted(current)}")
    for name, value in (("min_improvement", min_improvement), ("tolerance", tolerance), ("hysteresis", hysteresis),
                        ("min_load", min_load), ("cooldown", cooldown)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ShardlineConfigError(f"rebalance {name} must be a finite number >= 0, got {value!r}")
    if pending or len(current) < 2 or any(n not in node_load for n in current):
        return None
    if last_change is not None and now - last_change < cooldown:
        return None
    measured_load = {n: float(node_load[n]) for n in current}
    if sum(measured_load.values()) < min_load:
        return None                                      # idle: nothing to balance
    measured = imbalance(measured_load)
    if measured <= 1.0 + tolerance:
        return None                                      # balanced enough
    model = LoadModel(measured_load, block_bytes, current)
    before = imbalance(model.predict(current))
    best, best_ratio = search(model, base)
    if node_racks and reader_racks:
        on_rack = {}
        for node in current:
            on_rack.setdefault(node_racks.get(node), set()).add(node)
        wanted = [on_rack.get(reader_racks[job]) if job in reader_racks else None for job, _t, _i in model.blocks]
        best = toward_readers(model, best, base, max(best_ratio, 1.0 + tolerance), wanted)
    new = {n: best[n] if abs(best[n] - current[n]) > hysteresis * current[n] else current[n] for n in current}
    after = imbalance(model.predict(new))
    # The gain counts against the lower of the model's ratio for the ring in use and the one
    # measured: the model (block rates where the ring puts them) may be off by more than a
    # marginal gain, and a move it mispredicts can leave the load worse than it was.
    if new == dict(current) or min(before, measured) - after < min_improvement:
        return None
    return Plan(new, measured, before, after)
