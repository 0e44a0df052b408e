"""A routing table as both PS nodes and workers use it: epoch, nodes, and the ring built from them.

Workers locate blocks locally: the dispatcher publishes ``(node_id, vnodes)`` per alive node and
every party builds the identical CityHash64 ring from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardline.services.blocks import block_hash
from shardline.services.pb import common_pb2
from shardline.services.ring import HashRing


# Blocks whose owner a view remembers (~200 bytes each); beyond that owners are computed each time.
OWNER_CACHE_ENTRIES = 1 << 18


@dataclass(frozen=True)
class RoutingView:
    epoch: int
    nodes: dict  # node_id -> common_pb2.NodeInfo (the serving ring's nodes)
    ring: HashRing | None
    # A ring change in progress: the ring the cluster moves to (services/placement.py).
    pending_epoch: int = 0
    pending_nodes: dict = field(default_factory=dict)
    pending_ring: HashRing | None = None
    default_replication: int = 1
    caches: tuple = ()  # common_pb2.CacheInfo of the rack caches (L2) with a live lease
    reader_racks: dict = field(default_factory=dict)          # job -> preferred rack (serving ring)
    pending_reader_racks: dict = field(default_factory=dict)  # job -> preferred rack (pending ring)
    placements: dict = field(default_factory=dict, compare=False, repr=False)  # cache of placement.place
    owners: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # cache of owner()

    @classmethod
    def from_proto(cls, table: common_pb2.RoutingTable) -> "RoutingView":
        nodes = {n.node_id: n for n in table.nodes}
        pending = {n.node_id: n for n in table.pending_nodes}
        return cls(int(table.epoch), nodes, _ring(nodes), int(table.pending_epoch), pending,
                   _ring(pending) if table.pending_epoch else None, int(table.default_replication) or 1,
                   tuple(table.caches), dict(table.reader_racks), dict(table.pending_reader_racks))

    @classmethod
    def empty(cls) -> "RoutingView":
        return cls(0, {}, None)

    def address_of(self, node_id: str) -> str | None:
        """Data-plane address of a node of the serving or the pending ring (None if unknown)."""
        info = self.nodes.get(node_id) or self.pending_nodes.get(node_id)
        return info.data_address if info is not None else None

    def owner(self, job: str, tensor: str, index: int) -> str:
        """The serving ring's node for the block (cached: every push and pull asks for each block,
        a client several times per step, and a view never changes)."""
        key = (job, tensor, index)
        node = self.owners.get(key)
        if node is not None:
            return node
        if self.ring is None:
            from shardline.services.errors import ShardlineStateError

            raise ShardlineStateError(f"routing table at epoch {self.epoch} has no alive PS nodes")
        node = self.ring.owner(block_hash(job, tensor, index))
        if len(self.owners) < OWNER_CACHE_ENTRIES:
            self.owners[key] = node
        return node

    def data_address(self, node_id: str) -> str:
        return self.nodes[node_id].data_address


def _ring(nodes: dict) -> HashRing | None:
    return HashRing({n.node_id: max(1, n.vnodes) for n in nodes.values()}) if nodes else None
