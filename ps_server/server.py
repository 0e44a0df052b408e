"""gRPC glue of a PS node: node status for operators and the CLI."""

from __future__ import annotations

from shardline.ps_server.node import PSNode
from shardline.services.daemon import create_grpc_server
from shardline.services.pb import ps_pb2, ps_pb2_grpc


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, node: PSNode):
        self._node = node

    def GetNodeStatus(self, request, context):
        blocks, nbytes = self._node.store.totals()
        status = ps_pb2.NodeStatus(node_id=self._node.node_id, epoch=self._node.routing.epoch, blocks=blocks, bytes=nbytes)
        for job in self._node.store.jobs():
            status.jobs.add(job=job.name, step=job.step, blocks=len(job.blocks), bytes=job.bytes)
        return status


def create_server(address: str, node: PSNode, *, cluster_token: bytes | None = None):
    """Start the PS gRPC server on ``address``. Returns (server, port, health servicer)."""
    servicer = ParameterServerServicer(node)
    return create_grpc_server(address, [lambda s: ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, s)],
                              cluster_token=cluster_token)
