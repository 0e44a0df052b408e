"""Client of the dispatcher's control plane, shared by PS nodes, workers and the CLI.

gRPC status codes become Shardline errors: NOT_FOUND -> ``None`` from getters, INVALID_ARGUMENT
-> ShardlineConfigError, FAILED_PRECONDITION -> ShardlineStateError, DEADLINE_EXCEEDED ->
ShardlineTimeoutError, UNAVAILABLE -> ShardlineConnectionError.
"""

from __future__ import annotations

import time

import grpc

from shardline.services.daemon import grpc_channel
from shardline.services.errors import (
    ShardlineConfigError,
    ShardlineConnectionError,
    ShardlineError,
    ShardlineStateError,
    ShardlineTimeoutError,
)
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: ShardlineConfigError,
    grpc.StatusCode.FAILED_PRECONDITION: ShardlineStateError,
    grpc.StatusCode.ALREADY_EXISTS: ShardlineStateError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ShardlineTimeoutError,
    grpc.StatusCode.UNAVAILABLE: ShardlineConnectionError,
    grpc.StatusCode.UNAUTHENTICATED: ShardlineConfigError,  # a token is missing or wrong
}


def _translate(exc: grpc.RpcError, what: str) -> ShardlineError:
    cls = _ERRORS.get(exc.code(), ShardlineError)
    return cls(f"{what}: {exc.details()} ({exc.code().name})")


class DispatcherClient:
    def __init__(self, address: str, *, rpc_timeout: float = 10.0, cluster_token: bytes | None = None):
        self.address = address
        self.rpc_timeout = rpc_timeout
        self._channel = grpc_channel(address, cluster_token)
        self._stub = dispatcher_pb2_grpc.DispatcherStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, name: str, request, *, timeout: float | None = None, not_found_none: bool = False):
        try:
            return getattr(self._stub, name)(request, timeout=timeout or self.rpc_timeout)
        except grpc.RpcError as exc:
            if not_found_none and exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise _translate(exc, f"dispatcher {self.address} {name}") from None

    def wait_until_reachable(self, connect_timeout: float) -> None:
        """Retry until the dispatcher answers (daemons may start in any order)."""
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                grpc.channel_ready_future(self._channel).result(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
                return
            except grpc.FutureTimeoutError:
                if time.monotonic() >= deadline:
                    raise ShardlineTimeoutError(
                        f"dispatcher at {self.address} not reachable within {connect_timeout:g} s") from None

    def register_node(self, **fields) -> dispatcher_pb2.RegisterNodeResponse:
        return self._call("RegisterNode", dispatcher_pb2.RegisterNodeRequest(**fields))

    def heartbeat(self, *, timeout: float | None = None, **fields) -> dispatcher_pb2.HeartbeatResponse:
        return self._call("Heartbeat", dispatcher_pb2.HeartbeatRequest(**fields), timeout=timeout)

    def get_routing(self) -> common_pb2.RoutingTable:
        return self._call("GetRouting", dispatcher_pb2.GetRoutingRequest())

    def get_job(self, name: str) -> dispatcher_pb2.JobInfo | None:
        return self._call("GetJob", dispatcher_pb2.GetJobRequest(name=name), not_found_none=True)

    def create_job(self, spec: common_pb2.JobSpec) -> dispatcher_pb2.CreateJobResponse:
        return self._call("CreateJob", dispatcher_pb2.CreateJobRequest(spec=spec))

    def wait_job_ready(self, name: str, timeout: float) -> dispatcher_pb2.JobInfo:
        return self._call("WaitJobReady", dispatcher_pb2.WaitJobReadyRequest(name=name, timeout_seconds=timeout),
                          timeout=timeout + self.rpc_timeout)

    def mark_job_ready(self, name: str) -> dispatcher_pb2.JobInfo:
        return self._call("MarkJobReady", dispatcher_pb2.MarkJobReadyRequest(name=name))

    def cluster_status(self) -> dispatcher_pb2.ClusterStatus:
        return self._call("GetClusterStatus", dispatcher_pb2.GetClusterStatusRequest())

    def delete_job(self, name: str) -> dispatcher_pb2.DeleteJobResponse | None:
        """Delete a job; None if there is no such job."""
        return self._call("DeleteJob", dispatcher_pb2.DeleteJobRequest(name=name), not_found_none=True)

    def checkpoint_job(self, name: str, timeout: float) -> dispatcher_pb2.CheckpointJobResponse:
        """Returns once every node holding the job has one same step durable (the response's step)."""
        return self._call("CheckpointJob", dispatcher_pb2.CheckpointJobRequest(name=name, timeout_seconds=timeout),
                          timeout=timeout + self.rpc_timeout)

    def restore_job(self, spec: common_pb2.JobSpec, uid: str, node_id: str) -> dispatcher_pb2.JobInfo:
        return self._call("RestoreJob", dispatcher_pb2.RestoreJobRequest(spec=spec, uid=uid, node_id=node_id))
