"""A routing table as both PS nodes and workers use it: epoch, nodes, and the ring built from them.

Workers locate blocks locally: the dispatcher publishes ``(node_id, vnodes)`` per alive node and
every party builds the identical CityHash64 ring from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.services.blocks import block_hash
from shardline.services.pb import common_pb2
from shardline.services.ring import HashRing


@dataclass(frozen=True)
class RoutingView:
    epoch: int
    nodes: dict  # node_id -> common_pb2.NodeInfo
    ring: HashRing | None

    @classmethod
    def from_proto(cls, table: common_pb2.RoutingTable) -> "RoutingView":
        nodes = {n.node_id: n for n in table.nodes}
        ring = HashRing({n.node_id: max(1, n.vnodes) for n in table.nodes}) if nodes else None
        return cls(int(table.epoch), nodes, ring)

    @classmethod
    def empty(cls) -> "RoutingView":
        return cls(0, {}, None)

    def owner(self, job: str, tensor: str, index: int) -> str:
        if self.ring is None:
            from shardline.services.errors import ShardlineStateError

            raise ShardlineStateError(f"routing table at epoch {self.epoch} has no alive PS nodes")
        return self.ring.owner(block_hash(job, tensor, index))

    def data_address(self, node_id: str) -> str:
        return self.nodes[node_id].data_address
