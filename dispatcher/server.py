"""gRPC glue for the dispatcher: the Dispatcher service over Membership, JobRegistry and fanout.

Errors map to status codes: ShardlineConfigError -> INVALID_ARGUMENT, UnknownJobError -> NOT_FOUND,
StateStoreError (the state could not be persisted; the message names the path) and
ShardlineConnectionError -> UNAVAILABLE, ShardlineStateError -> FAILED_PRECONDITION,
ShardlineTimeoutError -> DEADLINE_EXCEEDED; the status message says what is wrong. A background
thread expires silent nodes every ``EXPIRE_PERIOD_SECONDS`` and stops with the server. Calls to PS
nodes (DeleteJob, CheckpointJob) run on a thread pool of the servicer, outside every lock.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2

from shardline.dispatcher import metrics as M
from shardline.dispatcher.fanout import (
    DEFAULT_DROP_TIMEOUT,
    DEFAULT_STATUS_TIMEOUT,
    GrpcNodeCaller,
    NodeCaller,
    Target,
    coordinate_checkpoint,
    drop_everywhere,
)
from shardline.dispatcher.jobs import JobRecord, JobRegistry, UnknownJobError
from shardline.dispatcher.membership import ALIVE, Membership, NodeRecord, reachable_address
from shardline.dispatcher.state_store import StateStoreError, open_state_store
from shardline.services.daemon import create_grpc_server
from shardline.services.config import require_positive_number
from shardline.services.errors import (
    ShardlineConfigError,
    ShardlineConnectionError,
    ShardlineStateError,
    ShardlineTimeoutError,
)
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc

log = logging.getLogger("shardline.dispatcher")

EXPIRE_PERIOD_SECONDS = 0.25
# WaitJobReady re-checks this often whether its caller is still there or the server is stopping.
WAIT_SLICE_SECONDS = 0.5


def node_info(record: NodeRecord) -> common_pb2.NodeInfo:
    # NodeRecord's fields are NodeInfo's, by construction.
    return common_pb2.NodeInfo(**dataclasses.asdict(record))


def job_info(record: JobRecord) -> dispatcher_pb2.JobInfo:
    return dispatcher_pb2.JobInfo(
        spec=record.spec, ready=record.ready, created_unix_ms=record.created_unix_ms, uid=record.uid,
        has_checkpoint=record.has_checkpoint, checkpoint_step=record.checkpoint_step,
        durable_steps=record.durable_steps,
    )


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
    if isinstance(exc, (StateStoreError, ShardlineConnectionError)):  # before its base, ShardlineStateError
        return grpc.StatusCode.UNAVAILABLE
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
            elif isinstance(exc, StateStoreError):  # the change was refused, loudly: the disk needs attention
                M.state_store_write_failed()
                log.error("%s failed: %s", name, exc)
        else:
            return response
        context.abort(code, message)

    return wrapper


class DispatcherServicer(dispatcher_pb2_grpc.DispatcherServicer):
    """Implements protos/dispatcher.proto. ``clock`` is monotonic seconds (heartbeat ages).

    ``node_caller`` makes the calls to PS nodes (default: gRPC without a token), at most
    ``fanout_workers`` at once; ``drop_timeout`` and ``status_timeout`` bound each DropJob and
    GetNodeStatus call. ``close`` releases the pool and the state store.
    """

    def __init__(
        self,
        membership: Membership,
        jobs: JobRegistry,
        *,
        heartbeat_interval: float,
        clock: Callable[[], float] = time.monotonic,
        max_waiters: int = 32,
        node_caller: NodeCaller | None = None,
        fanout_workers: int = 16,
        drop_timeout: float = DEFAULT_DROP_TIMEOUT,
        status_timeout: float = DEFAULT_STATUS_TIMEOUT,
    ):
        self.membership = membership
        self.jobs = jobs
        self.heartbeat_interval = heartbeat_interval
        self._clock = clock
        # Waiters hold a server thread each; the cap keeps threads free for heartbeats.
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._stopping = threading.Event()
        self._caller = node_caller if node_caller is not None else GrpcNodeCaller()
        self._fanout = ThreadPoolExecutor(max_workers=fanout_workers, thread_name_prefix="dispatcher-fanout")
        self.drop_timeout = require_positive_number(drop_timeout, "drop_timeout (seconds)")
        self.status_timeout = require_positive_number(status_timeout, "status_timeout (seconds)")
        self._publish_gauges()

    def _publish_gauges(self) -> None:
        jobs = self.jobs.list()
        M.publish(self.membership.epoch, self.membership.all_nodes(self._clock()),
                  heartbeat_timeout=self.membership.heartbeat_timeout, jobs=len(jobs))
        M.publish_checkpoints({job.name: job.checkpoint_step for job in jobs if job.has_checkpoint})

    def expire(self) -> list[str]:
        """Declare silent nodes dead now; returns their ids. StateStoreError: none was declared dead."""
        try:
            expired = self.membership.expire(self._clock())
        except StateStoreError:
            M.state_store_write_failed()
            raise
        M.nodes_declared_dead(len(expired))
        if expired:
            log.warning("nodes declared dead (no heartbeat for %.3g s): %s", self.membership.heartbeat_timeout, ", ".join(expired))
        self._publish_gauges()
        return expired

    def stop(self) -> None:
        """Release WaitJobReady callers so the server can drain."""
        self._stopping.set()

    def close(self) -> None:
        """After the server stopped: end the fan-out pool and close the state store."""
        self._fanout.shutdown(wait=False, cancel_futures=True)
        self.membership.store.close()
        if self.jobs.store is not self.membership.store:
            self.jobs.store.close()

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
        before = self.membership.epoch
        registered = self.membership.heartbeat(request.node_id, self._clock(), request.blocks, request.bytes,
                                               request.epoch)
        epoch = self.membership.epoch
        if request.epoch > before:
            log.warning("node %s routes with epoch %d, above the dispatcher's %d: the dispatcher moved to epoch %d",
                        request.node_id, request.epoch, before, epoch)
        # Only a registered node's report counts for holders; any node is told what to drop.
        drop, steps = self.jobs.report_held(request.node_id, request.jobs, record=registered)
        if drop:
            log.info("node %s holds deleted or replaced jobs, told to drop them: %s", request.node_id, ", ".join(drop))
        return dispatcher_pb2.HeartbeatResponse(
            epoch=epoch, registered=registered, drop_jobs=drop,
            checkpoint_steps=[dispatcher_pb2.JobCheckpointStep(job=job, step=step) for job, step in sorted(steps.items())],
            unknown_jobs=self.jobs.unknown_held(request.jobs),
        )

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
    def DeleteJob(self, request, context):
        record = self.jobs.delete(request.name)  # tombstoned and durable before any node is told
        nodes = self.membership.all_nodes(self._clock())
        alive = [Target(n.node_id, n.grpc_address) for n in nodes if n.state == ALIVE]
        dead = [n.node_id for n in nodes if n.state != ALIVE]
        dropped, pending = drop_everywhere(self._caller, self._fanout, alive, dead, record.name, record.uid,
                                           drop_timeout=self.drop_timeout)
        log.info("job %s (uid %s) deleted; dropped on [%s], pending on [%s]", record.name, record.uid,
                 ", ".join(dropped), ", ".join(pending))
        self._publish_gauges()
        return dispatcher_pb2.DeleteJobResponse(uid=record.uid, dropped_on=dropped, pending_on=pending)

    @_rpc
    def CheckpointJob(self, request, context):
        timeout = request.timeout_seconds
        if not math.isfinite(timeout) or timeout <= 0:
            raise ShardlineConfigError(f"timeout_seconds must be a finite number > 0, got {timeout!r}")
        record = self.jobs.get(request.name)
        _epoch, alive = self.membership.routing_table()
        result = coordinate_checkpoint(
            self._caller, self._fanout, [Target(n.node_id, n.grpc_address) for n in alive], record.name, record.uid,
            asp=record.spec.sync == "asp", timeout=timeout, status_timeout=self.status_timeout,
        )
        log.info("job %s checkpointed at step %d on %s", record.name, result.step, ", ".join(result.nodes))
        return dispatcher_pb2.CheckpointJobResponse(step=result.step, nodes=result.nodes)

    @_rpc
    def RestoreJob(self, request, context):
        if not request.HasField("spec"):
            raise ShardlineConfigError("RestoreJob needs a spec")
        record, restored = self.jobs.restore(request.spec, request.uid, request.node_id)
        if restored:
            log.warning("job %s (uid %s) was re-registered from node %s's checkpoint (the dispatcher did not know it)",
                        record.name, record.uid, request.node_id)
            self._publish_gauges()
        return job_info(record)

    @_rpc
    def GetClusterStatus(self, request, context):
        now = self._clock()
        return dispatcher_pb2.ClusterStatus(
            routing=self._routing(),
            all_nodes=[node_info(n) for n in self.membership.all_nodes(now)],
            jobs=[job_info(j) for j in self.jobs.list()],
        )


def _log_recovery(state_dir: str | None, membership: Membership, jobs: JobRegistry) -> None:
    if not state_dir:
        log.warning("no state_dir: the dispatcher's state (jobs, node registrations, ring epoch) lives in memory "
                    "only; a restart forgets every job")
        return
    where = membership.store.location
    if membership.recovered_epoch is None:
        log.info("no previous state in %s: starting at epoch %d", where, membership.epoch)
        return
    nodes = membership.all_nodes(time.monotonic())
    log.info("recovered state from %s: epoch=%d (stored %d) nodes=%d (alive %d, each has one heartbeat timeout "
             "to heartbeat) jobs=%d", where, membership.epoch, membership.recovered_epoch, len(nodes),
             sum(1 for n in nodes if n.state == ALIVE), len(jobs.list()))


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
            except StateStoreError as exc:  # retried next pass; nothing was declared dead
                log.error("node expiry failed: %s", exc)
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

    def close(self) -> None:
        """Once ``stop``'s event is set: release the fan-out pool and close the state store."""
        self._servicer.close()

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
    state_dir: str | None = None,
) -> tuple[DispatcherServer, int, DispatcherServicer]:
    """Start a dispatcher on ``address`` (port 0: any free port). Returns (server, bound port, servicer).

    ``heartbeat_interval`` is what nodes are told to use; it must be below ``heartbeat_timeout`` or
    healthy nodes would be declared dead between heartbeats. ``state_dir``: where the state is kept
    across restarts (None: memory only, with a WARNING); what was recovered is logged. Raises
    ShardlineConfigError for bad arguments and StateStoreError if the state cannot be opened.
    Calls to PS nodes carry ``cluster_token``.
    """
    # Arguments first: a bad one must not touch the state (opening it persists a new epoch).
    require_positive_number(heartbeat_timeout, "heartbeat_timeout (seconds)")
    require_positive_number(heartbeat_interval, "heartbeat_interval (seconds)")
    if heartbeat_interval >= heartbeat_timeout:
        raise ShardlineConfigError(
            f"heartbeat_interval must be below heartbeat_timeout, got interval {heartbeat_interval!r} "
            f"and timeout {heartbeat_timeout!r}"
        )
    store = open_state_store(state_dir)
    try:
        membership = Membership(heartbeat_timeout, vnodes_per_capacity, store=store, now=time.monotonic())
        jobs = JobRegistry(store=store)
    except BaseException:
        store.close()
        raise
    _log_recovery(state_dir, membership, jobs)
    servicer = DispatcherServicer(
        membership, jobs, heartbeat_interval=heartbeat_interval, max_waiters=max(1, max_workers // 2),
        node_caller=GrpcNodeCaller(cluster_token),
    )
    try:
        grpc_server, port, health_servicer = create_grpc_server(
            address,
            [lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(servicer, s)],
            max_workers=max_workers,
            cluster_token=cluster_token,
        )
    except BaseException:
        servicer.close()  # releases the state store's lock for the next attempt
        raise
    return DispatcherServer(grpc_server, servicer, health_servicer), port, servicer
