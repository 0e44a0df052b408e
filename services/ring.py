"""CityHash64 consistent-hash ring with virtual nodes and rack-aware replica placement.

Positions live in the 64-bit space ``[0, 2**64)``. Virtual node ``i`` of node ``n`` sits at
``CityHash64(f"{n}#{i}")``; a key with hash ``h`` belongs to the first virtual node clockwise from
``h`` (the first position ``>= h``, wrapping past ``2**64 - 1`` to the smallest position). A virtual
node at position ``p`` therefore owns the arc ``(p_prev, p]``.

The ring is a pure function of ``{node_id: vnodes}``: the dispatcher publishes that table (with an
epoch) and every PS node and worker builds the same ring from it. Points at the same position
(a 64-bit collision) are ordered by node id, so ties are resolved identically everywhere.
"""

from __future__ import annotations

import bisect
import math
from typing import Mapping

import cityhash

from shardline.services.errors import ShardlineConfigError, ShardlineStateError

HASH_SPACE = 1 << 64
DEFAULT_VNODES_PER_CAPACITY = 128
# Bounds the ring a single registration can create (capacity 512 at the default density).
MAX_VNODES_PER_NODE = 65_536


def vnode_position(node_id: str, index: int) -> int:
    """Ring position of virtual node ``index`` of ``node_id``."""
    return cityhash.CityHash64(f"{node_id}#{index}")


def vnode_counts(
    capacities: Mapping[str, float], vnodes_per_capacity: int = DEFAULT_VNODES_PER_CAPACITY
) -> dict[str, int]:
    """Virtual-node count per node: ``max(1, round(capacity * vnodes_per_capacity))``.

    Capacities are relative weights and must be finite and > 0; a count above
    ``MAX_VNODES_PER_NODE`` is rejected. Raises ShardlineConfigError quoting the node and value.
    """
    if (
        not isinstance(vnodes_per_capacity, int)
        or isinstance(vnodes_per_capacity, bool)
        or vnodes_per_capacity < 1
    ):
        raise ShardlineConfigError(f"vnodes_per_capacity must be an integer >= 1, got {vnodes_per_capacity!r}")
    counts: dict[str, int] = {}
    for node_id, capacity in capacities.items():
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, (int, float))
            or not math.isfinite(capacity)
            or capacity <= 0
        ):
            raise ShardlineConfigError(f"capacity of node {node_id!r} must be a finite number > 0, got {capacity!r}")
        count = max(1, round(capacity * vnodes_per_capacity))
        if count > MAX_VNODES_PER_NODE:
            raise ShardlineConfigError(
                f"capacity of node {node_id!r} gives {count} virtual nodes "
                f"(more than {MAX_VNODES_PER_NODE}), got capacity {capacity!r}"
            )
        counts[node_id] = count
    return counts


def check_vnodes(vnodes: Mapping[str, int]) -> None:
    """ShardlineConfigError unless every node id is a non-empty string with 1..MAX_VNODES_PER_NODE
    virtual nodes."""
    for node_id, count in vnodes.items():
        if not isinstance(node_id, str) or not node_id:
            raise ShardlineConfigError(f"ring node id must be a non-empty string, got {node_id!r}")
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_VNODES_PER_NODE:
            raise ShardlineConfigError(
                f"virtual-node count of node {node_id!r} must be an integer in 1..{MAX_VNODES_PER_NODE}, got {count!r}"
            )


def _check_key_hash(key_hash: int) -> None:
    if not isinstance(key_hash, int) or isinstance(key_hash, bool) or not 0 <= key_hash < HASH_SPACE:
        raise ShardlineConfigError(f"key hash must be an integer in [0, 2**64), got {key_hash!r}")


class HashRing:
    """An immutable consistent-hash ring built from ``{node_id: vnode_count}``.

    Lookups take a 64-bit key hash (e.g. ``services.blocks.block_hash``). Lookups on a ring with no
    nodes raise ShardlineStateError.
    """

    def __init__(self, vnodes: Mapping[str, int]):
        check_vnodes(vnodes)
        self._vnodes = dict(sorted(vnodes.items()))
        points = sorted(
            (vnode_position(node_id, i), node_id)
            for node_id, count in self._vnodes.items()
            for i in range(count)
        )
        self._positions = [p for p, _ in points]
        self._owners = [n for _, n in points]

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node ids on the ring, sorted."""
        return tuple(self._vnodes)

    @property
    def vnodes(self) -> dict[str, int]:
        """Copy of the ``{node_id: vnode_count}`` table the ring was built from."""
        return dict(self._vnodes)

    @property
    def num_points(self) -> int:
        """Total number of virtual nodes."""
        return len(self._positions)

    def __len__(self) -> int:
        """Number of (physical) nodes."""
        return len(self._vnodes)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._vnodes

    def _start_index(self, key_hash: int) -> int:
        _check_key_hash(key_hash)
        if not self._positions:
            raise ShardlineStateError("hash ring is empty: no nodes to own keys")
        index = bisect.bisect_left(self._positions, key_hash)
        return 0 if index == len(self._positions) else index

    def owner(self, key_hash: int) -> str:
        """The node owning ``key_hash``: the first virtual node at a position ``>= key_hash``, wrapping."""
        return self._owners[self._start_index(key_hash)]

    def owners(self, key_hash: int, n: int, racks: Mapping[str, str] | None = None) -> list[str]:
        """Up to ``n`` distinct nodes for ``key_hash``, walking clockwise from its position.

        The first entry is always ``owner(key_hash)``. With ``racks`` (``node_id -> rack``), nodes on
        racks not yet used are chosen first, in walk order; the remaining slots are then filled with
        further distinct nodes in walk order. A node missing from ``racks`` counts as a rack of its own.
        Returns fewer than ``n`` nodes only when the ring has fewer than ``n`` nodes.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ShardlineConfigError(f"replica count must be an integer >= 0, got {n!r}")
        start = self._start_index(key_hash)
        if n == 0:
            return []
        want = min(n, len(self._vnodes))

        def rack_of(node_id: str) -> object:
            return racks.get(node_id, ("node", node_id)) if racks is not None else ("node", node_id)

        # More racks than this cannot be found however far the walk goes.
        reachable_racks = len({rack_of(node_id) for node_id in self._vnodes})
        walk: list[str] = []  # distinct nodes in clockwise order
        seen_nodes: set[str] = set()
        seen_racks: set[object] = set()
        total = len(self._owners)
        for step in range(total):
            node_id = self._owners[(start + step) % total]
            if node_id in seen_nodes:
                continue
            seen_nodes.add(node_id)
            walk.append(node_id)
            seen_racks.add(rack_of(node_id))
            if len(walk) >= want and len(seen_racks) >= min(want, reachable_racks):
                break
        chosen: list[str] = []
        chosen_racks: set[object] = set()
        for node_id in walk:  # first pass: one node per rack
            if rack_of(node_id) not in chosen_racks:
                chosen_racks.add(rack_of(node_id))
                chosen.append(node_id)
                if len(chosen) == want:
                    return chosen
        for node_id in walk:  # then any further distinct nodes
            if node_id not in chosen:
                chosen.append(node_id)
                if len(chosen) == want:
                    break
        return chosen

    def share(self) -> dict[str, float]:
        """Fraction of the 2**64 hash space each node owns (sums to 1; empty ring: ``{}``)."""
        if not self._positions:
            return {}
        owned = dict.fromkeys(self._vnodes, 0)
        positions = self._positions
        # The first point also owns the wrapped arc after the last point.
        owned[self._owners[0]] += HASH_SPACE - positions[-1] + positions[0]
        for i in range(1, len(positions)):
            owned[self._owners[i]] += positions[i] - positions[i - 1]
        return {node_id: arc / HASH_SPACE for node_id, arc in owned.items()}


def load_adjusted_vnodes(
    base: dict[str, int],
    load: dict[str, float],
    current: dict[str, int],
    hysteresis: float = 0.1,
    *,
    min_factor: float = 0.25,
    max_factor: float = 4.0,
) -> dict[str, int]:
    """Virtual-node counts that move load away from overloaded nodes, without flapping.

    ``base`` is the capacity-derived count per node (``vnode_counts``) and defines the node set;
    ``load`` is a measured load per node (any non-negative unit, e.g. requests/s); ``current`` is
    the count in use now. A node's relative load is its load per base virtual node divided by the
    cluster's (``(load[n] / base[n]) / (sum(load) / sum(base))``), so a node that carries exactly its
    capacity's share has relative load 1. Its target is ``base[n] / relative_load``, clamped to
    ``[min_factor * base[n], max_factor * base[n]]`` and rounded (at least 1).

    Hysteresis: a node keeps its current count unless the target differs from it by more than
    ``hysteresis * current``. Because targets derive from ``base`` (not ``current``), applying the
    function again with the same load changes nothing. Nodes absent from ``load`` keep their current
    count; nodes absent from ``current`` start from ``base``; if the total load is 0 nothing moves.
    """
    check_vnodes(base)
    for node_id, count in current.items():
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ShardlineConfigError(f"current virtual-node count of node {node_id!r} must be an integer >= 1, got {count!r}")
    for node_id, value in load.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ShardlineConfigError(f"load of node {node_id!r} must be a finite number >= 0, got {value!r}")
    if isinstance(hysteresis, bool) or not isinstance(hysteresis, (int, float)) or not 0 <= hysteresis < 1:
        raise ShardlineConfigError(f"hysteresis must be a number in [0, 1), got {hysteresis!r}")
    if not (0 < min_factor <= 1 <= max_factor and math.isfinite(max_factor)):
        raise ShardlineConfigError(
            f"need 0 < min_factor <= 1 <= max_factor (finite), got min_factor={min_factor!r}, max_factor={max_factor!r}"
        )

    result = {node_id: current.get(node_id, count) for node_id, count in base.items()}
    measured = [node_id for node_id in base if node_id in load]
    total_load = sum(load[node_id] for node_id in measured)
    total_base = sum(base[node_id] for node_id in measured)
    if total_load <= 0:
        return result
    mean_per_vnode = total_load / total_base
    for node_id in measured:
        nominal = base[node_id]
        relative = (load[node_id] / nominal) / mean_per_vnode
        scale = max_factor if relative == 0 else min(max_factor, max(min_factor, 1.0 / relative))
        target = min(MAX_VNODES_PER_NODE, max(1, round(nominal * scale)))
        now = result[node_id]
        if abs(target - now) > hysteresis * now:
            result[node_id] = target
    return result
