"""gRPC glue of a PS node: node status, on-demand checkpoints, job removal, commit records."""

from __future__ import annotations

import math

import grpc

from shardline.ps_server.memory_report import job_report, process_memory, receive_buffer_bytes
from shardline.ps_server.node import PSNode
from shardline.ps_server.store import StoreError
from shardline.services.daemon import create_grpc_server
from shardline.services.errors import ErrorCode
from shardline.services.pb import ps_pb2, ps_pb2_grpc

# StoreError codes -> gRPC status codes (anything else is INTERNAL)
_STATUS = {
    ErrorCode.UNKNOWN_JOB: grpc.StatusCode.NOT_FOUND,
    ErrorCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
MAX_CHECKPOINT_WAIT_SECONDS = 3600.0


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, node: PSNode):
        self._node = node

    def GetNodeStatus(self, request, context):
        node = self._node
        blocks, nbytes = node.store.totals()
        rss, anon = process_memory()
        status = ps_pb2.NodeStatus(node_id=node.node_id, epoch=node.routing.epoch, blocks=blocks, bytes=nbytes,
                                   rss_bytes=rss, anon_bytes=anon, receive_buffer_bytes=receive_buffer_bytes(node))
        images = node.delta_history.job_bytes()
        for held, job in zip(node.held_jobs(), node.store.jobs()):
            report = job_report(job, images)
            progress = status.jobs.add(job=held.job, step=held.step, blocks=len(job.blocks), bytes=job.bytes,
                                       uid=held.uid, has_durable=held.has_durable, durable_step=held.durable_step,
                                       parameters=report.parameters)
            for kind, value in report.bytes.items():
                progress.memory.add(kind=kind, bytes=value)
        return status

    def Checkpoint(self, request, context):
        checkpointer = self._node.checkpointer
        if checkpointer is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"node {self._node.node_id!r} has no checkpoint_dir: it cannot checkpoint")
        timeout = request.timeout_seconds or 60.0
        if not math.isfinite(timeout) or timeout <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds must be a finite number > 0, got {timeout!r}")
        try:
            result = checkpointer.request(request.job, int(request.step), min(timeout, MAX_CHECKPOINT_WAIT_SECONDS))
        except StoreError as exc:
            context.abort(_STATUS.get(exc.code, grpc.StatusCode.INTERNAL), f"node {self._node.node_id!r}: {exc}")
        return ps_pb2.CheckpointReply(job=request.job, step=result.step, past=result.past,
                                      bytes_written=result.bytes_written)

    def DropJob(self, request, context):
        return ps_pb2.DropJobReply(dropped=self._node.drop_job(request.job, request.uid))

    def ReportGradNorm(self, request, context):
        if self._node.grad_norms is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"node {self._node.node_id!r} does not clip gradients")
        self._node.grad_norms.receive(request)
        return ps_pb2.GradNormAck()

    def GetCommits(self, request, context):
        job = self._node.store.get(request.job)
        if job is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"node {self._node.node_id!r} does not hold job {request.job!r}")
        commits, lr = job.commits_of(int(request.step))
        reply = ps_pb2.StepCommits(step=request.step, group_lrs=lr or ())
        for rank, (weight, epoch) in sorted(commits.items()):
            reply.commits.add(rank=rank, weight=weight, epoch=epoch)
        return reply


def create_server(address: str, node: PSNode, *, cluster_token: bytes | None = None, tls=None):
    """Start the PS gRPC server on ``address`` (TLS with ``tls``, a services.security.ServerTLS).
    Returns (server, port, health servicer)."""
    servicer = ParameterServerServicer(node)
    return create_grpc_server(address, [lambda s: ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, s)],
                              cluster_token=cluster_token, tls=tls)
