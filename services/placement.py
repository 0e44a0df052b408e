"""Where each block of a job lives under a routing table: its primary (always ``ring.owner``), its
replicas and, while a ring change is pending, its learners.

Contract: pure, cached per (epoch, job); every node and worker computes the same owners from the
same routing table. A job's replication R is capped at the number of nodes in the ring; a job with
a reader rack keeps one copy of each block on that rack (``prefer_rack``).

Design: docs/architecture.md, "Ring and placement".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from shardline.services.blocks import block_hash, num_blocks
from shardline.services.pb import common_pb2
from shardline.services.ring import HashRing


def replication_of(spec: common_pb2.JobSpec, default: int) -> int:
    return int(spec.replication) if spec.replication else max(1, int(default))


def trainable_keys(spec: common_pb2.JobSpec) -> list[tuple[str, int]]:
    return [(t.name, i) for t in spec.tensors if t.trainable for i in range(_blocks(t, spec))]


def all_keys(spec: common_pb2.JobSpec) -> list[tuple[str, int]]:
    return [(t.name, i) for t in spec.tensors for i in range(_blocks(t, spec))]


def _blocks(tensor, spec) -> int:
    numel = 1
    for d in tensor.shape:
        numel *= int(d)
    return num_blocks(numel, int(spec.block_elements))


def _owners(ring: HashRing | None, racks: dict, job: str, key: tuple[str, int], r: int,
            reader_rack: str | None = None) -> tuple[str, ...]:
    if ring is None or len(ring) == 0:
        return ()
    key_hash = block_hash(job, key[0], key[1])
    return tuple(prefer_rack(ring, racks, key_hash, ring.owners(key_hash, min(r, len(ring)), racks), reader_rack))


def prefer_rack(ring: HashRing, racks: dict, key_hash: int, owners: list[str],
                reader_rack: str | None) -> list[str]:
    """``owners`` with one copy moved onto ``reader_rack`` (docs/architecture.md, "Reader racks").

    With at least 2 owners, none of them on ``reader_rack`` and a node of ``reader_rack`` in the
    ring, the last owner is replaced by the first node of that rack in the ring's walk from
    ``key_hash``. The primary never changes (workers route to ``ring.owner``), the other replicas
    keep their rack diversity, and a block that already has a copy there keeps its owners: so
    setting or clearing a preference moves only the blocks that lack a copy on the rack, by one
    replica each. Without a preference, or with a rack that has no node, ``owners`` is returned as is.
    """
    if not reader_rack or len(owners) < 2 or any(racks.get(n) == reader_rack for n in owners):
        return owners
    for node_id in ring.owners(key_hash, len(ring)):  # every node, in walk order
        if racks.get(node_id) == reader_rack:
            return owners[:-1] + [node_id]
    return owners


@dataclass
class JobPlacement:
    """Owners of every block of one job at one routing epoch (serving and pending rings)."""

    job: str
    replication: int
    owners: dict = field(default_factory=dict)          # key -> (primary, replica, ...)
    pending_owners: dict = field(default_factory=dict)  # key -> owners under the pending ring

    def primary(self, key) -> str | None:
        owners = self.owners.get(key)
        return owners[0] if owners else None

    def roles(self, node_id: str) -> tuple[set, set, set]:
        """(primary keys, replica keys, learner keys) of ``node_id``."""
        primary, replica, learner = set(), set(), set()
        for key, owners in self.owners.items():
            if owners and owners[0] == node_id:
                primary.add(key)
            elif node_id in owners:
                replica.add(key)
        for key, owners in self.pending_owners.items():
            if node_id in owners and node_id not in self.owners.get(key, ()):
                learner.add(key)
        return primary, replica, learner

    def copies_of(self, key) -> tuple[str, ...]:
        """Nodes that must receive the primary's copies of ``key``: replicas and learners."""
        owners = self.owners.get(key, ())
        extra = tuple(n for n in self.pending_owners.get(key, ()) if n not in owners)
        return owners[1:] + extra


def place(view, spec: common_pb2.JobSpec) -> JobPlacement:
    """The placement of ``spec``'s blocks under the RoutingView ``view`` (cached in the view: a
    view is one epoch's immutable table)."""
    key = (spec.name, spec.SerializeToString(deterministic=True))
    cached = view.placements.get(key)
    if cached is not None:
        return cached
    r = replication_of(spec, view.default_replication)
    racks = {**{n: i.rack for n, i in view.pending_nodes.items()}, **{n: i.rack for n, i in view.nodes.items()}}
    placement = JobPlacement(spec.name, r)
    serving_rack = view.reader_racks.get(spec.name)
    pending_rack = view.pending_reader_racks.get(spec.name)
    for block in all_keys(spec):
        placement.owners[block] = _owners(view.ring, racks, spec.name, block, r, serving_rack)
        if view.pending_ring is not None:
            placement.pending_owners[block] = _owners(view.pending_ring, racks, spec.name, block, r, pending_rack)
    view.placements[key] = placement
    return placement
