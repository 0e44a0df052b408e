"""gRPC glue for the dispatcher: the Dispatcher service over Membership and JobRegistry.

Errors map to status codes: ShardlineConfigError -> INVALID_ARGUMENT, UnknownJobError -> NOT_FOUND,
ShardlineStateError -> FAILED_PRECONDITION, ShardlineTimeoutError -> DEADLINE_EXCEEDED; the
status message says what is wrong. A background thread expires silent nodes every
``EXPIRE_PERIOD_SECONDS`` and stops with the server.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from shardline.dispatcher import metrics as M
from shardline.dispatcher.jobs import JobRecord, JobRegistry, UnknownJobError
from shardline.dispatcher.membership import Membership, NodeRecord, reachable_address
from shardline.services.daemon import create_grpc_server
from shardline.services.config import require_positive_number
from shardline.services.errors import ShardlineConfigError, ShardlineStateError, ShardlineTimeoutError
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc

log = logging.getLogger("shardline.dispatcher")

EXPIRE_PERIOD_SECONDS = 0.25
# WaitJobReady re-checks this often whether its caller is still there or the server is stopping.
WAIT_SLICE_SECONDS = 0.5


def node_info(record: NodeRecord) -> common_pb2.NodeInfo:
    # NodeRecord's fields are NodeInfo's, by construction.
    return common_pb2.NodeInfo(**dataclasses.asdict(record))


def job_info(record: JobRecord) -> dispatcher_pb2.JobInfo:
    return dispatcher_pb2.JobInfo(spec=record.spec, ready=record.ready, created_unix_ms=record.created_unix_ms)


class _Abort(Exception):
    """Raised inside a handler to end the call with a specific status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _status_of(exc: Exception) -> grpc.StatusCode:
    if isinstance(exc, ShardlineConfigError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, UnknownJobError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, ShardlineStateError):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ShardlineTimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL


def _rpc(method: Callable) -> Callable:
    """Turn Shardline errors into a status code with the error's message (the gRPC metrics
    interceptor counts every call by method and code)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: "DispatcherServicer", request, context: grpc.ServicerContext):
        try:
            response = method(self, request, context)
        except _Abort as abort:
            code, message = abort.code, abort.message
        except Exception as exc:  # every failure must reach the caller as a status, not a hang
            code = _status_of(exc)
            message = str(exc) if code != grpc.StatusCode.INTERNAL else f"internal error: {type(exc).__name__}: {exc}"
            if code == grpc.StatusCode.INTERNAL:
                log.exception("%s failed", name)
        else:
            return response
        context.abort(code, message)

    return wrapper


class DispatcherServicer(dispatcher_pb2_grpc.DispatcherServicer):
    """Implements protos/dispatcher.proto. ``clock`` is monotonic seconds (heartbeat ages)."""

    def __init__(
        self,
        membership: Membership,
        jobs: JobRegistry,
        *,
        heartbeat_interval: float,
        clock: Callable[[], float] = time.monotonic,
        max_waiters: int = 32,
    ):
        self.membership = membership
        self.jobs = jobs
        self.heartbeat_interval = heartbeat_interval
        self._clock = clock
        # Waiters hold a server thread each; the cap keeps threads free for heartbeats.
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._stopping = threading.Event()
        self._publish_gauges()

    def _publish_gauges(self) -> None:
        M.publish(self.membership.epoch, self.membership.all_nodes(self._clock()),
                  heartbeat_timeout=self.membership.heartbeat_timeout, jobs=len(self.jobs.list()))

    def expire(self) -> list[str]:
        """Declare silent nodes dead now; returns their ids."""
        expired = self.membership.expire(self._clock())
        M.nodes_declared_dead(len(expired))
        if expired:
            log.warning("nodes declared dead (no heartbeat for %.3g s): %s", self.membership.heartbeat_timeout, ", ".join(expired))
        self._publish_gauges()
        return expired

    def stop(self) -> None:
        """Release WaitJobReady callers so the server can drain."""
        self._stopping.set()

    @_rpc
    def RegisterNode(self, request, context):
        before = self.membership.epoch
        peer = context.peer()
        epoch = self.membership.register(
            request.node_id, request.rack, reachable_address(request.grpc_address, peer),
            reachable_address(request.data_address, peer), request.capacity, self._clock()
        )
        if epoch != before:
            log.info(
                "node %s registered (rack %s, grpc %s, data %s, capacity %g): epoch %d",
                request.node_id, request.rack, request.grpc_address, request.data_address, request.capacity, epoch,
            )
        self._publish_gauges()
        return dispatcher_pb2.RegisterNodeResponse(epoch=epoch, heartbeat_interval_seconds=self.heartbeat_interval)

    @_rpc
    def Heartbeat(self, request, context):
        registered = self.membership.heartbeat(request.node_id, self._clock(), request.blocks, request.bytes)
        return dispatcher_pb2.HeartbeatResponse(epoch=self.membership.epoch, registered=registered)

    def _routing(self) -> common_pb2.RoutingTable:
        epoch, nodes = self.membership.routing_table(self._clock())
        return common_pb2.RoutingTable(epoch=epoch, nodes=[node_info(n) for n in nodes])

    @_rpc
    def GetRouting(self, request, context):
        return self._routing()

    @_rpc
    def CreateJob(self, request, context):
        if not request.HasField("spec"):
            raise ShardlineConfigError("CreateJob needs a spec")
        record, created = self.jobs.create(request.spec)
        if created:
            log.info("job %s created (%d tensors, %s, world size %d)", record.name, len(record.spec.tensors),
                     record.spec.sync, record.spec.world_size)
            self._publish_gauges()  # the job count is current at once, not at the next expiry pass
        return dispatcher_pb2.CreateJobResponse(job=job_info(record), created=created)

    @_rpc
    def GetJob(self, request, context):
        return job_info(self.jobs.get(request.name))

    @_rpc
    def WaitJobReady(self, request, context):
        timeout = request.timeout_seconds
        if not math.isfinite(timeout) or timeout < 0:
            raise ShardlineConfigError(f"timeout_seconds must be a finite number >= 0, got {timeout!r}")
        self.jobs.get(request.name)  # unknown job or bad arguments fail before taking a slot
        if not self._waiters.acquire(blocking=False):
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent WaitJobReady calls; retry later")
        try:
            # Wait in slices so a cancelled caller or a stopping server frees the thread promptly.
            deadline = time.monotonic() + max(0.0, timeout)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    return job_info(self.jobs.wait_ready(request.name, max(0.0, min(WAIT_SLICE_SECONDS, remaining))))
                except ShardlineTimeoutError:
                    if remaining <= WAIT_SLICE_SECONDS:
                        raise ShardlineTimeoutError(
                            f"job {request.name!r} was not marked ready within {timeout:g} s"
                        ) from None
                if self._stopping.is_set():
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, "dispatcher is shutting down")
                if not context.is_active():
                    raise _Abort(grpc.StatusCode.CANCELLED, "caller went away")
        finally:
            self._waiters.release()

    @_rpc
    def MarkJobReady(self, request, context):
        record = self.jobs.mark_ready(request.name)
        log.info("job %s ready", record.name)
        return job_info(record)

    @_rpc
    def GetClusterStatus(self, request, context):
        now = self._clock()
        return dispatcher_pb2.ClusterStatus(
            routing=self._routing(),
            all_nodes=[node_info(n) for n in self.membership.all_nodes(now)],
            jobs=[job_info(j) for j in self.jobs.list()],
        )


class DispatcherServer:
    """The running gRPC server and its expiry thread; ``stop`` ends both.

    Other ``grpc.Server`` methods (``wait_for_termination`` ...) pass through.
    """

    def __init__(self, server: grpc.Server, servicer: DispatcherServicer, health_servicer: health.HealthServicer):
        self._server = server
        self._servicer = servicer
        self._health = health_servicer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._expire_loop, name="dispatcher-expire", daemon=True)
        self._thread.start()

    def _expire_loop(self) -> None:
        while not self._stop.wait(EXPIRE_PERIOD_SECONDS):
            try:
                self._servicer.expire()
            except Exception:  # keep detecting failures whatever one pass hit
                log.exception("node expiry failed")

    def stop(self, grace: float | None) -> threading.Event:
        """Stop expiring nodes, report NOT_SERVING, release waiters and stop the gRPC server."""
        self._stop.set()
        self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._servicer.stop()
        done = self._server.stop(grace)
        self._thread.join(timeout=EXPIRE_PERIOD_SECONDS * 4)
        return done

    def __getattr__(self, name: str):
        return getattr(self._server, name)


def create_server(
    address: str,
    *,
    heartbeat_timeout: float = 5.0,
    heartbeat_interval: float = 1.0,
    vnodes_per_capacity: int = 128,
    max_workers: int = 64,
    cluster_token: bytes | None = None,
) -> tuple[DispatcherServer, int, DispatcherServicer]:
    """Start a dispatcher on ``address`` (port 0: any free port). Returns (server, bound port, servicer).

    ``heartbeat_interval`` is what nodes are told to use; it must be below ``heartbeat_timeout`` or
    healthy nodes would be declared dead between heartbeats.
    """
    membership = Membership(heartbeat_timeout, vnodes_per_capacity)  # validates both
    require_positive_number(heartbeat_interval, "heartbeat_interval (seconds)")
    if heartbeat_interval >= heartbeat_timeout:
        raise ShardlineConfigError(
            f"heartbeat_interval must be below heartbeat_timeout, got interval {heartbeat_interval!r} "
            f"and timeout {heartbeat_timeout!r}"
        )
    servicer = DispatcherServicer(
        membership, JobRegistry(), heartbeat_interval=heartbeat_interval, max_waiters=max(1, max_workers // 2)
    )
    grpc_server, port, health_servicer = create_grpc_server(
        address,
        [lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(servicer, s)],
        max_workers=max_workers,
        cluster_token=cluster_token,
    )
    return DispatcherServer(grpc_server, servicer, health_servicer), port, servicer
