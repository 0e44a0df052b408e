"""An attacker that knows a cluster's addresses but not its token: each method tries one attack and
returns how it ended -- a gRPC status code name, or the data-plane error code (``"CLOSED"`` when
the node hung up without one) -- so tests assert the refusal."""

from __future__ import annotations

import grpc
import torch

from shardline.services import frame
from shardline.services.daemon import grpc_channel
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, ps_pb2, ps_pb2_grpc
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.transport import tcp

TIMEOUT = 10.0


def _code(call) -> str:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code().name
    return "OK"


class Intruder:
    """Knows the dispatcher's address (``dispatcher``), and for the data plane a PS data address as a
    port scan would find it. Speaks the protocols correctly, only without the cluster token."""

    def __init__(self, dispatcher: str):
        self.dispatcher = dispatcher

    def _dispatcher(self, method: str, request) -> str:
        with grpc_channel(self.dispatcher) as channel:
            return _code(lambda: getattr(dispatcher_pb2_grpc.DispatcherStub(channel), method)(request, timeout=TIMEOUT))

    # -- control plane --
    def list_jobs(self) -> str:
        return self._dispatcher("GetClusterStatus", dispatcher_pb2.GetClusterStatusRequest())

    def get_routing(self) -> str:
        return self._dispatcher("GetRouting", dispatcher_pb2.GetRoutingRequest())

    def get_job(self, job: str) -> str:
        return self._dispatcher("GetJob", dispatcher_pb2.GetJobRequest(name=job))

    def create_job(self, job: str) -> str:
        spec = common_pb2.JobSpec(name=job, world_size=1, sync="asp")
        return self._dispatcher("CreateJob", dispatcher_pb2.CreateJobRequest(spec=spec))

    def impersonate_rank(self, job: str, rank: int) -> str:
        return self._dispatcher("WorkerHeartbeat", dispatcher_pb2.WorkerHeartbeatRequest(
            job=job, rank=rank, incarnation="intruder", step=0))

    def register_fake_node(self, node_id: str = "intruder-node") -> str:
        return self._dispatcher("RegisterNode", dispatcher_pb2.RegisterNodeRequest(
            node_id=node_id, rack="default", grpc_address="127.0.0.1:1", data_address="127.0.0.1:2", capacity=100.0,
            incarnation="intruder"))

    def delete_job(self, job: str) -> str:
        return self._dispatcher("DeleteJob", dispatcher_pb2.DeleteJobRequest(name=job))

    def node_status(self, ps_grpc: str) -> str:
        with grpc_channel(ps_grpc) as channel:
            return _code(lambda: ps_pb2_grpc.ParameterServerStub(channel).GetNodeStatus(
                ps_pb2.GetNodeStatusRequest(), timeout=TIMEOUT))

    # -- data plane: well-formed frames, no HELLO --
    def _frame(self, data_address: str, header: frame.FrameHeader, payloads=()) -> str:
        sock = tcp.connect(data_address, TIMEOUT)
        try:
            sock.settimeout(TIMEOUT)
            frame.send_frame(sock, header, list(payloads))
            reply = frame.recv_header(sock, frame.FrameLimits())
        except (OSError, ConnectionError):
            return "CLOSED"
        finally:
            sock.close()
        return dp.ErrorCode.Name(reply.code) if reply.op == dp.OP_ERROR else dp.Op.Name(reply.op)

    def pull(self, data_address: str, job: str, tensor: str, epoch: int = 1) -> str:
        header = frame.FrameHeader(op=dp.OP_PULL, request_id=1, job=job, epoch=epoch,
                                   blocks=[dp.BlockRef(tensor=tensor, index=0)])
        return self._frame(data_address, header)

    def push(self, data_address: str, job: str, tensor: str, grad: torch.Tensor, *, rank: int = 0, step: int = 0,
             epoch: int = 1) -> str:
        header = frame.FrameHeader(op=dp.OP_PUSH, request_id=1, job=job, epoch=epoch, step=step, rank=rank, weight=1.0,
                                   incarnation="intruder", blocks=[frame.block_ref(tensor, 0, grad)])
        return self._frame(data_address, header, [frame.tensor_bytes(grad)])

    def commit(self, data_address: str, job: str, *, rank: int = 0, step: int = 0, epoch: int = 1) -> str:
        header = frame.FrameHeader(op=dp.OP_COMMIT, request_id=1, job=job, epoch=epoch, step=step, rank=rank,
                                   weight=1.0, incarnation="intruder")
        return self._frame(data_address, header)
