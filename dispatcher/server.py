"""gRPC glue for the dispatcher: the Dispatcher service over Membership, JobRegistry and fanout.

Leading. The servicer serves from a :class:`LeaderState` (a Membership and a JobRegistry over one
state store). A single dispatcher has one from the start and always leads. With an etcd
``state_store`` several dispatchers run a :class:`~shardline.dispatcher.leader.LeaderElection`:
the winner builds a fresh LeaderState over a store fenced by its term (the epoch comes back as
stored + 1, the nodes alive with one heartbeat timeout of grace) and reports SERVING on the health
service; the others, and a leader that lost its lease, hold none, answer every Dispatcher call
with UNAVAILABLE ``not the leader; the leader is HOST:PORT`` and trailing metadata
``shardline-leader: HOST:PORT``, and report NOT_SERVING.

Errors map to status codes: ShardlineConfigError -> INVALID_ARGUMENT, UnknownJobError -> NOT_FOUND,
StateStoreError (the state could not be persisted; the message names the path) and
ShardlineConnectionError -> UNAVAILABLE, ShardlineStateError -> FAILED_PRECONDITION,
ShardlineTimeoutError -> DEADLINE_EXCEEDED; the status message says what is wrong. A background
thread expires silent nodes every ``EXPIRE_PERIOD_SECONDS`` and stops with the server; with a
``rebalance_interval`` another one plans rebalances of the ring from the heartbeats' heat
(dispatcher/heatmap.py, dispatcher/rebalance.py) and starts them as pending ring changes. Calls to PS
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
from typing import Callable, Mapping

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
from shardline.dispatcher.cache_registry import CacheRegistry
from shardline.dispatcher.heatmap import DEFAULT_HALF_LIFE_SECONDS, Heatmap
from shardline.dispatcher.holders import SoleHolders
from shardline.dispatcher.isolation import DEFAULT_ISOLATION_SHARE, DEFAULT_ISOLATION_TIMEOUT_SECONDS, check_share, check_timeout
from shardline.dispatcher.reader_racks import ReaderRacks
from shardline.dispatcher.leases import DEFAULT_LEASE_TIMEOUT_SECONDS, WorkerLeases
from shardline.dispatcher import rebalance as rebalance_policy
from shardline.dispatcher import replay_policy
from shardline.dispatcher.jobs import JobRecord, JobRegistry, UnknownJobError
from shardline.dispatcher.leader import Holder, LeaderElection, lease_ttl
from shardline.dispatcher.membership import ALIVE, Membership, NodeRecord, reachable_address, validate_address
from shardline.dispatcher.state_store import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_STATE_PREFIX,
    Fence,
    StateStoreError,
    open_state_store,
    state_backend,
)
from shardline.services import build_fingerprint
from shardline.services.daemon import create_grpc_server, format_host_port, parse_host_port
from shardline.services.config import require_positive_number
from shardline.services.dispatcher_client import LEADER_METADATA_KEY
from shardline.services.errors import (
    NotLeaderError,
    ShardlineConfigError,
    ShardlineConnectionError,
    ShardlineStateError,
    ShardlineTimeoutError,
)
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from shardline.services.ring import vnode_counts

log = logging.getLogger("shardline.dispatcher")

EXPIRE_PERIOD_SECONDS = 0.25
DEFAULT_REBALANCE_INTERVAL_SECONDS = 60.0
DEFAULT_HOT_SHARDS = 32
# WaitJobReady re-checks this often whether its caller is still there or the server is stopping.
WAIT_SLICE_SECONDS = 0.5
# A ring change pending this long is logged, naming the nodes it waits for (and again as often).
RING_CHANGE_WARN_SECONDS = 60.0


def node_info(record: NodeRecord) -> common_pb2.NodeInfo:
    # NodeRecord's fields are NodeInfo's, by construction.
    return common_pb2.NodeInfo(**dataclasses.asdict(record))


def lease_info(lease, now: float) -> dispatcher_pb2.WorkerLease:
    return dispatcher_pb2.WorkerLease(job=lease.job, rank=lease.rank, incarnation=lease.incarnation,
                                      state="lost" if lease.lost_at is not None else "alive",
                                      age_seconds=max(0.0, now - lease.last), lost_unix_ms=int((lease.lost_at or 0) * 1000),
                                      step=lease.step)


def job_info(record: JobRecord) -> dispatcher_pb2.JobInfo:
    return dispatcher_pb2.JobInfo(
        spec=record.spec, ready=record.ready, created_unix_ms=record.created_unix_ms, uid=record.uid,
        has_checkpoint=record.has_checkpoint, checkpoint_step=record.checkpoint_step,
        durable_steps=record.durable_steps, ready_revision=record.ready_revision,
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
        except NotLeaderError as exc:  # clients follow the metadata to the leader
            context.set_trailing_metadata(((LEADER_METADATA_KEY, exc.leader),))
            code, message = grpc.StatusCode.UNAVAILABLE, str(exc)
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


@dataclasses.dataclass(frozen=True)
class LeaderState:
    """What a leading dispatcher serves from; ``term`` is the election term it was built in (None:
    a single dispatcher, which always leads)."""

    membership: Membership
    jobs: JobRegistry
    term: Holder | None = None
    leases: WorkerLeases | None = None   # soft state: a new leader starts with none
    caches: CacheRegistry | None = None  # soft state too: caches register again with a new leader
    heatmap: Heatmap | None = None       # soft state too: learnt back from the next heartbeats
    reader_racks: ReaderRacks | None = None  # soft state too (dispatcher/reader_racks.py)

    def __post_init__(self):
        if self.leases is None:
            object.__setattr__(self, "leases", WorkerLeases(self._lease_policy))
        if self.caches is None:  # a cache's lease: as long as a PS node may stay silent
            object.__setattr__(self, "caches", CacheRegistry(self.membership.heartbeat_timeout))
        if self.heatmap is None:
            object.__setattr__(self, "heatmap", Heatmap())
        if self.reader_racks is None:
            object.__setattr__(self, "reader_racks", ReaderRacks(self.heatmap.half_life))

    def _lease_policy(self, job: str):
        try:
            spec = self.jobs.get(job).spec
        except UnknownJobError:
            return None
        return spec.worker_lease_timeout_seconds or DEFAULT_LEASE_TIMEOUT_SECONDS, spec.on_worker_failure or "wait"

    def close(self) -> None:
        self.membership.store.close()
        if self.jobs.store is not self.membership.store:
            self.jobs.store.close()


class DispatcherServicer(dispatcher_pb2_grpc.DispatcherServicer):
    """Implements protos/dispatcher.proto. ``clock`` is monotonic seconds (heartbeat ages).

    Given ``membership`` and ``jobs`` it leads from the start (a single dispatcher). Given neither,
    it follows until :meth:`install` (the election's ``on_elected``), and :meth:`drop` ends
    leading (``on_deposed``); ``election`` (set before serving) says who leads and whether a term
    still holds. ``node_caller`` makes the calls to PS nodes (default: gRPC without a token), at
    most ``fanout_workers`` at once; ``drop_timeout`` and ``status_timeout`` bound each DropJob and
    GetNodeStatus call. ``close`` releases the pool and the state store.
    """

    def __init__(
        self,
        membership: Membership | None,
        jobs: JobRegistry | None,
        *,
        heartbeat_interval: float,
        clock: Callable[[], float] = time.monotonic,
        max_waiters: int = 32,
        node_caller: NodeCaller | None = None,
        fanout_workers: int = 16,
        drop_timeout: float = DEFAULT_DROP_TIMEOUT,
        status_timeout: float = DEFAULT_STATUS_TIMEOUT,
        election: LeaderElection | None = None,
        security_flags: Mapping[str, bool] | None = None,
        heat_half_life: float = DEFAULT_HALF_LIFE_SECONDS,
        rebalance_interval: float = DEFAULT_REBALANCE_INTERVAL_SECONDS,
        reader_racks: bool = False,
    ):
        """``security_flags``: how this dispatcher is secured, as ClusterStatus fields (``insecure``,
        ``cluster_token``, ``tls``), reported by GetClusterStatus. ``heat_half_life``: of the access
        heatmap; ``rebalance_interval``: seconds between rebalance plans (0: off); ``reader_racks``:
        also move each job's reader rack every interval (``update_reader_racks``)."""
        if (membership is None) != (jobs is None):
            raise ShardlineConfigError("DispatcherServicer needs both membership and jobs, or neither (a follower)")
        self.heat_half_life = require_positive_number(heat_half_life, "heat_half_life (seconds)")
        self.rebalance_interval = _rebalance_interval(rebalance_interval)
        if not isinstance(reader_racks, bool):
            raise ShardlineConfigError(f"reader_racks must be true or false, got {reader_racks!r}")
        self.reader_racks = reader_racks
        self._last_rebalance: tuple[float, str] | None = None   # (when, what) under the current leader state
        self._ring_change_seen: tuple[int, float, float] = (0, 0.0, 0.0)   # (pending epoch, since, last warned)
        self._kept_logged: dict[str, str] = {}   # silent nodes kept in the ring, as last logged
        self._state: LeaderState | None = (LeaderState(membership, jobs, heatmap=Heatmap(self.heat_half_life))
                                           if membership is not None else None)
        self.election = election
        self.security_flags = dict(security_flags or {})
        self.heartbeat_interval = heartbeat_interval
        self._clock = clock
        # Waiters hold a server thread each; the cap keeps threads free for heartbeats.
        self._waiters = threading.BoundedSemaphore(max_waiters)
        self._stopping = threading.Event()
        # A job's replay decision and a node's registration read each other's state: one at a time
        # (dispatcher/replay_policy.py), so no node of another build slips in beside a new replaying job.
        self._replay_lock = threading.Lock()
        self._caller = node_caller if node_caller is not None else GrpcNodeCaller()
        self._fanout = ThreadPoolExecutor(max_workers=fanout_workers, thread_name_prefix="dispatcher-fanout")
        self.drop_timeout = require_positive_number(drop_timeout, "drop_timeout (seconds)")
        self.status_timeout = require_positive_number(status_timeout, "status_timeout (seconds)")
        if self._state is not None:
            self._publish_gauges(self._state)

    # -- leading --------------------------------------------------------------------------------

    @property
    def membership(self) -> Membership | None:
        """The leader state's membership (None while following)."""
        state = self._state
        return state.membership if state is not None else None

    @property
    def jobs(self) -> JobRegistry | None:
        state = self._state
        return state.jobs if state is not None else None

    def _current(self, state: LeaderState | None) -> bool:
        return state is not None and state is self._state and (
            state.term is None or (self.election is not None and self.election.holds(state.term)))

    def _leading(self) -> LeaderState:
        """The state to serve from; NotLeaderError naming the leader unless this dispatcher leads now."""
        state = self._state
        if self._current(state):
            return state
        leader = self.election.leader if self.election is not None else ""
        if leader and leader == self.election.address:
            raise NotLeaderError("not the leader right now (taking over or stepping down); retry shortly", leader)
        if leader:
            raise NotLeaderError(f"not the leader; the leader is {leader}", leader)
        raise NotLeaderError("not the leader; no leader is elected yet (is etcd reachable?)")

    def install(self, membership: Membership, jobs: JobRegistry, term: Holder) -> None:
        """Lead from ``membership`` and ``jobs`` (built over a store fenced by ``term``)."""
        state = LeaderState(membership, jobs, term, heatmap=Heatmap(self.heat_half_life))
        self._last_rebalance = None
        old, self._state = self._state, state
        if old is not None:
            old.close()
        self._publish_gauges(state)

    def drop(self) -> None:
        """Stop leading at once: forget the in-memory state (etcd keeps it for the next leader)."""
        old, self._state = self._state, None
        if old is not None:
            old.close()  # waits for a write in flight; later ones fail (closed)

    def _publish_gauges(self, state: LeaderState) -> None:
        jobs = state.jobs.list()
        now = self._clock()
        M.publish(state.membership.epoch, state.membership.all_nodes(now),
                  heartbeat_timeout=state.membership.heartbeat_timeout, jobs=len(jobs))
        serving = {n.node_id for n in state.membership.routing_table()[1]}
        loads = state.heatmap.nodes(now, only=serving)
        M.publish_heat(loads, state.heatmap.hottest(now, DEFAULT_HOT_SHARDS * 4),
                       rebalance_policy.imbalance({n.node_id: n.bytes_per_second for n in loads}))
        M.publish_checkpoints({job.name: job.checkpoint_step for job in jobs if job.has_checkpoint})

    def expire(self) -> list[str]:
        """Declare silent nodes dead now (a follower: none); returns their ids. StateStoreError: none
        was declared dead."""
        state = self._state
        if not self._current(state):
            M.ring_change(0.0, 0)   # a follower reports no change pending (the leader does)
            return []
        guard = state.membership.isolation
        was_isolated = guard.isolated
        try:
            expired = state.membership.expire(self._clock())
        except StateStoreError:
            M.state_store_write_failed()
            raise
        if was_isolated and not guard.isolated:
            state.leases.extend(self._clock())   # their renewals could not arrive either
        if not guard.isolated:
            for lease in state.leases.expire(self._clock()):
                log.warning("job %s: rank %d (incarnation %s) lost: no heartbeat for %.3g s", lease.job, lease.rank,
                            lease.incarnation, self._clock() - lease.last)
        self._report_kept(state.membership.kept())
        M.failure_detection(guard.isolated, len(self._kept_logged))
        M.nodes_declared_dead(len(expired))
        for node_id in expired:
            state.heatmap.forget_node(node_id)
        if expired:
            log.warning("nodes declared dead (no heartbeat for %.3g s): %s", state.membership.heartbeat_timeout,
                        ", ".join(expired))
        self._watch_ring_change(state)
        self._publish_gauges(state)
        return expired

    def _report_kept(self, kept: dict[str, str]) -> None:
        """Log the silent nodes kept in the ring (dispatcher/membership.py), once each time one is
        kept, and when one is not any more."""
        for node_id, what in kept.items():
            if node_id not in self._kept_logged:
                log.warning("node %s is silent but not declared dead: it holds blocks no node that heartbeats holds "
                            "(%s); they stay routed to it, and workers wait for it, until it or another holder "
                            "answers", node_id, what)
        for node_id in self._kept_logged.keys() - kept.keys():
            log.info("node %s is no longer kept in the ring for its blocks (it answers again, or another holder does)",
                     node_id)
        self._kept_logged = dict(kept)

    def _watch_ring_change(self, state: LeaderState) -> None:
        """Publish how long a ring change has waited and for how many nodes, and name them once it
        has been pending for RING_CHANGE_WARN_SECONDS (and again every as long): it has no
        deadline of its own, as a sync takes as long as the bytes it moves, so a node that cannot
        get in sync is named."""
        pending, waiting = state.membership.waiting_for()
        now = self._clock()
        seen, since, warned = self._ring_change_seen
        if pending != seen:
            self._ring_change_seen = (pending, now, now)
            M.ring_change(0.0, len(waiting))
            return
        M.ring_change(now - since if pending else 0.0, len(waiting))
        if pending and now - warned >= RING_CHANGE_WARN_SECONDS:
            log.warning("the ring change to epoch %d has been pending for %.0f s; it waits for %s", pending,
                        now - since, "; ".join(f"{node} ({why})" for node, why in waiting.items())
                        or "no node now (it switches at the next heartbeat)")
            self._ring_change_seen = (pending, since, now)

    def stop(self) -> None:
        """Release WaitJobReady callers so the server can drain."""
        self._stopping.set()

    def close(self) -> None:
        """After the server stopped: end the fan-out pool and close the state store."""
        self._fanout.shutdown(wait=False, cancel_futures=True)
        self.drop()

    @_rpc
    def RegisterNode(self, request, context):
        state = self._leading()
        before = state.membership.epoch
        peer = context.peer()
        with self._replay_lock:
            replaying = [record.name for record in state.jobs.list() if replay_policy.replays(record.spec)]
            replay_policy.check_registration(request.node_id, build_fingerprint.validate(request.build_fingerprint),
                                             state.membership.fingerprints(but=request.node_id), replaying)
            epoch = state.membership.register(
                request.node_id, request.rack, reachable_address(request.grpc_address, peer),
                reachable_address(request.data_address, peer), request.capacity, self._clock(),
                incarnation=request.incarnation, insecure=request.insecure,
                remembered=(request.remembered.epoch, list(request.remembered.nodes)) if request.HasField("remembered")
                else None, build_fingerprint=request.build_fingerprint,
            )
        if epoch != before:
            log.info(
                "node %s registered (rack %s, grpc %s, data %s, capacity %g): epoch %d",
                request.node_id, request.rack, request.grpc_address, request.data_address, request.capacity, epoch,
            )
        self._publish_gauges(state)
        return dispatcher_pb2.RegisterNodeResponse(epoch=epoch, heartbeat_interval_seconds=self.heartbeat_interval,
                                                   heartbeat_timeout_seconds=state.membership.heartbeat_timeout)

    @_rpc
    def Heartbeat(self, request, context):
        state = self._leading()
        before = state.membership.epoch
        registered = state.membership.heartbeat(request.node_id, self._clock(), request.blocks, request.bytes,
                                                request.epoch, insecure=request.insecure,
                                                build_fingerprint=request.build_fingerprint)
        epoch = state.membership.epoch
        if request.epoch > before:
            log.warning("node %s routes with epoch %d, above the dispatcher's %d: the dispatcher moved to epoch %d",
                        request.node_id, request.epoch, before, epoch)
        if registered and (request.HasField("load") or request.hot):
            try:
                state.heatmap.report(request.node_id, request.load.rack, request.load, request.hot, self._clock())
            except ShardlineConfigError as exc:  # a bad heat report must not fail the heartbeat (liveness)
                log.warning("node %s: heat report ignored: %s", request.node_id, exc)
        for reads in request.rack_reads if registered else ():
            state.reader_racks.report(reads.rack, {reads.job: reads.bytes}, self._clock())
        # Every heartbeat says whether the node is in sync now (0: not, or no ring change): a node
        # that reported ready and then began another sync (a job it learnt late) no longer counts.
        # Nor does one that does not hold every job: it has none of a missing job's blocks. The
        # job list is read once, after jobs_version (a job created after that takes reports back).
        jobs_version = state.membership.jobs_version
        pending = state.membership.pending_epoch
        jobs = state.jobs.incarnations() if pending or (registered and request.ready_epoch) else {}
        switched = False
        if registered:
            ready, why = self._checked_ready(request, jobs)
            switched = state.membership.report_ready(request.node_id, ready, jobs_version=jobs_version, why=why)
            if switched:
                snap = state.membership.snapshot()
                log.info("ring change complete: serving %s at epoch %d", ", ".join(n.node_id for n in snap.serving),
                         snap.epoch)
                epoch = snap.epoch
        # Only a registered node's report counts for holders; any node is told what to drop.
        drop, steps = state.jobs.report_held(request.node_id, request.jobs, record=registered)
        if drop:
            log.info("node %s holds deleted or replaced jobs, told to drop them: %s", request.node_id, ", ".join(drop))
        return dispatcher_pb2.HeartbeatResponse(
            epoch=epoch, registered=registered, drop_jobs=drop,
            checkpoint_steps=[dispatcher_pb2.JobCheckpointStep(job=job, step=step) for job, step in sorted(steps.items())],
            unknown_jobs=state.jobs.unknown_held(request.jobs),
            failed_jobs=state.leases.failed(),
            # during a ring change (still on after this report): every job and its revision to hold
            **({"jobs": list(jobs), "job_revisions": {name: revision for name, (_uid, revision) in jobs.items()}}
               if pending and not switched else {}),
        )

    @staticmethod
    def _checked_ready(request, jobs: dict[str, tuple[str, int]]) -> tuple[int, str]:
        """A heartbeat's ``ready_epoch``, 0 if the node lacks one of ``jobs`` (name -> (uid,
        revision): it holds none, another incarnation, or an older revision), and why a report of
        0 is one."""
        ready, why = request.ready_epoch, ""
        if ready:
            held = {held.job: held for held in request.jobs}
            missing = [name for name, (uid, revision) in jobs.items()
                       if name not in held or (held[name].uid and uid and held[name].uid != uid)
                       or held[name].revision < revision]
            if missing:
                ready = 0
                why = f"does not hold job(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} yet"
        return ready, why

    def _routing(self, state: LeaderState) -> common_pb2.RoutingTable:
        snap = state.membership.snapshot(self._clock())
        return common_pb2.RoutingTable(epoch=snap.epoch, nodes=[node_info(n) for n in snap.serving],
                                       pending_epoch=snap.pending_epoch,
                                       pending_nodes=[node_info(n) for n in snap.pending],
                                       default_replication=state.jobs.default_replication,
                                       caches=state.caches.live(self._clock()),
                                       reader_racks=snap.reader_racks, pending_reader_racks=snap.pending_reader_racks)

    @_rpc
    def RegisterCache(self, request, context):
        state = self._leading()
        info = common_pb2.CacheInfo()
        info.CopyFrom(request.cache)
        peer = context.peer()
        info.data_address = reachable_address(info.data_address, peer)
        info.grpc_address = reachable_address(info.grpc_address, peer) if info.grpc_address else ""
        state.caches.register(info, self._clock())
        log.info("rack cache %s registered (rack %s, data %s, %d bytes)", info.cache_id, info.rack, info.data_address,
                 info.capacity_bytes)
        return dispatcher_pb2.CacheRegisterResponse(heartbeat_interval_seconds=self.heartbeat_interval,
                                                    lease_seconds=state.caches.lease_seconds)

    @_rpc
    def CacheHeartbeat(self, request, context):
        state = self._leading()
        registered = state.caches.heartbeat(request.cache_id, request.incarnation, self._clock(),
                                            resident_bytes=request.resident_bytes, hits=request.hits,
                                            misses=request.misses)
        return dispatcher_pb2.CacheHeartbeatResponse(
            registered=registered, epoch=state.membership.epoch,
            jobs=[dispatcher_pb2.CacheJob(name=j.name, uid=j.uid) for j in state.jobs.list()])

    @_rpc
    def WorkerHeartbeat(self, request, context):
        state = self._leading()
        record = state.jobs.get(request.job)
        if not 0 <= request.rank < record.spec.world_size:
            raise ShardlineConfigError(f"rank {request.rank} out of range for job {request.job!r} of world size "
                                       f"{record.spec.world_size}")
        if not request.incarnation:
            raise ShardlineConfigError("WorkerHeartbeat needs the worker's incarnation")
        now = self._clock()
        state.leases.heartbeat(request.job, request.rank, request.incarnation, request.step, now,
                               leaving=request.leaving, world_size=record.spec.world_size)
        timeout = record.spec.worker_lease_timeout_seconds or DEFAULT_LEASE_TIMEOUT_SECONDS
        lost = [lease_info(lease, now) for lease in state.leases.of_job(request.job)
                if lease.lost_at is not None and lease.rank != request.rank]
        return dispatcher_pb2.WorkerHeartbeatResponse(lost=lost, failed=state.leases.failed().get(request.job, ""),
                                                      interval_seconds=min(5.0, max(0.2, timeout / 4)))

    @_rpc
    def DrainNode(self, request, context):
        state = self._leading()
        pending = state.membership.drain(request.node_id, leaving=request.leaving)
        log.info("draining node %s: its blocks move to the other nodes (pending ring of epoch %d)", request.node_id,
                 pending)
        self._publish_gauges(state)
        return dispatcher_pb2.DrainNodeResponse(epoch=pending)

    @_rpc
    def GetRouting(self, request, context):
        state = self._leading()
        if request.known_epoch:   # a watcher asking whether the routing moved: cheap while it did not
            epoch, pending = state.membership.epochs()
            if (request.known_epoch, request.known_pending_epoch) == (epoch, pending):
                return common_pb2.RoutingTable(epoch=epoch, pending_epoch=pending, unchanged=True)
        return self._routing(state)

    @_rpc
    def CreateJob(self, request, context):
        if not request.HasField("spec"):
            raise ShardlineConfigError("CreateJob needs a spec")
        state = self._leading()
        with self._replay_lock:
            record, created = state.jobs.create(request.spec, fingerprints=state.membership.fingerprints())
        if created:
            state.membership.jobs_changed()  # a pending ring change waits until every node holds it
            log.info("job %s created (%d tensors, %s, world size %d)", record.name, len(record.spec.tensors),
                     record.spec.sync, record.spec.world_size)
            self._publish_gauges(state)  # the job count is current at once, not at the next expiry pass
        return dispatcher_pb2.CreateJobResponse(job=job_info(record), created=created)

    @_rpc
    def GetJob(self, request, context):
        return job_info(self._leading().jobs.get(request.name))

    @_rpc
    def WaitJobReady(self, request, context):
        timeout = request.timeout_seconds
        if not math.isfinite(timeout) or timeout < 0:
            raise ShardlineConfigError(f"timeout_seconds must be a finite number >= 0, got {timeout!r}")
        state = self._leading()
        state.jobs.get(request.name)  # unknown job or bad arguments fail before taking a slot
        if not self._waiters.acquire(blocking=False):
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many concurrent WaitJobReady calls; retry later")
        try:
            # Wait in slices so a cancelled caller or a stopping server frees the thread promptly.
            deadline = time.monotonic() + max(0.0, timeout)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    return job_info(state.jobs.wait_ready(request.name, max(0.0, min(WAIT_SLICE_SECONDS, remaining)),
                                                          revision=request.revision))
                except ShardlineTimeoutError:
                    if remaining <= WAIT_SLICE_SECONDS:
                        what = f"revision {request.revision} of job" if request.revision else "job"
                        raise ShardlineTimeoutError(
                            f"{what} {request.name!r} was not marked ready within {timeout:g} s"
                        ) from None
                if self._stopping.is_set():
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, "dispatcher is shutting down")
                if not self._current(state):  # deposed meanwhile: the caller asks the new leader
                    self._leading()
                if not context.is_active():
                    raise _Abort(grpc.StatusCode.CANCELLED, "caller went away")
        finally:
            self._waiters.release()

    @_rpc
    def MarkJobReady(self, request, context):
        record = self._leading().jobs.mark_ready(request.name, request.revision)
        if request.revision:
            log.info("job %s revision %d ready", record.name, request.revision)
        else:
            log.info("job %s ready", record.name)
        return job_info(record)

    @_rpc
    def ExtendJob(self, request, context):
        if not request.HasField("extension"):
            raise ShardlineConfigError("ExtendJob needs an extension")
        ext = request.extension
        state = self._leading()
        record, applied = state.jobs.extend(request.name, request.uid, ext)
        if applied:
            state.membership.jobs_changed()  # a pending ring change waits until every node holds the new tensors
            log.info("job %s extended to revision %d from step %d: a parameter group with %d new tensor(s), %d "
                     "unfrozen", record.name, ext.revision, ext.step, len(ext.tensors), len(ext.unfreeze))
        return dispatcher_pb2.ExtendJobResponse(job=job_info(record), applied=applied)

    @_rpc
    def DeleteJob(self, request, context):
        state = self._leading()
        record = state.jobs.delete(request.name)  # tombstoned and durable before any node is told
        state.heatmap.forget_job(record.name)
        nodes = state.membership.all_nodes(self._clock())
        alive = [Target(n.node_id, n.grpc_address) for n in nodes if n.state == ALIVE]
        dead = [n.node_id for n in nodes if n.state != ALIVE]
        dropped, pending = drop_everywhere(self._caller, self._fanout, alive, dead, record.name, record.uid,
                                           drop_timeout=self.drop_timeout)
        log.info("job %s (uid %s) deleted; dropped on [%s], pending on [%s]", record.name, record.uid,
                 ", ".join(dropped), ", ".join(pending))
        self._publish_gauges(state)
        return dispatcher_pb2.DeleteJobResponse(uid=record.uid, dropped_on=dropped, pending_on=pending)

    @_rpc
    def CheckpointJob(self, request, context):
        timeout = request.timeout_seconds
        if not math.isfinite(timeout) or timeout <= 0:
            raise ShardlineConfigError(f"timeout_seconds must be a finite number > 0, got {timeout!r}")
        state = self._leading()
        record = state.jobs.get(request.name)
        _epoch, alive = state.membership.routing_table()
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
        state = self._leading()
        record, restored = state.jobs.restore(request.spec, request.uid, request.node_id)
        if restored:
            log.warning("job %s (uid %s) was re-registered from node %s's checkpoint (the dispatcher did not know it)",
                        record.name, record.uid, request.node_id)
            self._publish_gauges(state)
        return job_info(record)

    @_rpc
    def GetHotShards(self, request, context):
        state = self._leading()
        now = self._clock()
        snap = state.membership.snapshot(now)
        serving = {n.node_id for n in snap.serving}
        shards = state.heatmap.hottest(now, int(request.limit) or DEFAULT_HOT_SHARDS, request.job)
        return dispatcher_pb2.HeatMap(
            shards=[dispatcher_pb2.HeatShard(**dataclasses.asdict(s)) for s in shards],
            nodes=[dispatcher_pb2.NodeLoad(
                node_id=n.node_id, rack=n.rack, bytes_in_per_second=n.bytes_in_per_second,
                bytes_out_per_second=n.bytes_out_per_second, pulls_per_second=n.pulls_per_second,
                pushes_per_second=n.pushes_per_second, apply_seconds_per_second=n.apply_seconds_per_second,
                reads_per_second=n.reads_per_second, writes_per_second=n.writes_per_second, share=n.share)
                for n in state.heatmap.nodes(now, only=serving)],
            half_life_seconds=state.heatmap.half_life, accesses_per_second=state.heatmap.accesses_per_second(now),
            epoch=snap.epoch, rebalance_interval_seconds=self.rebalance_interval,
            last_rebalance=self._last_rebalance[1] if self._last_rebalance else "",
        )

    def rebalance(self) -> rebalance_policy.Plan | None:
        """Plan a rebalance from the heatmap and start it (a pending ring change); None: nothing moved.
        A follower, a heatmap that does not cover every serving node for one interval yet, or a ring
        change in progress: nothing."""
        state = self._state
        if not self._current(state) or not self.rebalance_interval:
            return None
        now = self._clock()
        base, current, pending = state.membership.ring_counts()
        # Plans wait for a heatmap of about two half-lives (every node's, and since the last move):
        # what it holds then is mostly the load of now, not of the start-up or of the ring before.
        settle = max(self.rebalance_interval, 2 * state.heatmap.half_life)
        if pending or not state.heatmap.covered(current, now, settle):
            return None
        loads = {n.node_id: n.bytes_per_second for n in state.heatmap.nodes(now, only=set(current))}
        last = self._last_rebalance[0] if self._last_rebalance else None
        racks = {n.node_id: n.rack for n in state.membership.routing_table(now)[1]}
        readers, _changing = state.membership.reader_racks()
        plan = rebalance_policy.plan(base, current, loads, state.heatmap.block_bytes(now), now=now, last_change=last,
                                     cooldown=settle, pending=pending, node_racks=racks, reader_racks=readers)
        if plan is None:
            return None
        try:
            epoch = state.membership.rebalance(plan.vnodes)
        except ShardlineStateError as exc:  # a change started meanwhile: plan again next interval
            log.info("rebalance skipped: %s", exc)
            return None
        self._last_rebalance = (now, plan.describe())
        M.rebalance_started()
        log.info("rebalancing the ring (pending epoch %d): %s", epoch, plan.describe())
        self._publish_gauges(state)
        return plan

    def update_reader_racks(self) -> int:
        """Decide each job's reader rack from the reads measured and start the change (a pending
        ring change); returns its pending epoch (0: nothing changed). A follower, the option off, a
        ring change in progress or a tracker not yet warm: nothing."""
        state = self._state
        if not self._current(state) or not self.reader_racks:
            return 0
        now = self._clock()
        current, pending = state.membership.reader_racks()
        if pending:
            return 0
        replication = {j.name: int(j.spec.replication) or state.jobs.default_replication for j in state.jobs.list()}
        state.reader_racks.forget(state.reader_racks.jobs() - set(replication))  # deleted jobs
        racks = {n.rack for n in state.membership.snapshot().serving}
        wanted = state.reader_racks.decide(current, replication, racks, now)
        if wanted == current:
            return 0
        try:
            epoch = state.membership.set_reader_racks(wanted)
        except ShardlineStateError as exc:  # a change started meanwhile: decided again next interval
            log.info("reader-rack change skipped: %s", exc)
            return 0
        log.info("moving reader racks (pending epoch %d): %s", epoch, wanted or "none")
        return epoch

    @_rpc
    def GetClusterStatus(self, request, context):
        state = self._leading()
        now = self._clock()
        status = dispatcher_pb2.ClusterStatus(
            routing=self._routing(state),
            all_nodes=[node_info(n) for n in state.membership.all_nodes(now)],
            jobs=[job_info(j) for j in state.jobs.list()],
            workers=[lease_info(lease, now) for lease in state.leases.all()],
            **self.security_flags,
        )
        if self.election is not None:
            status.leader = self.election.address
            status.dispatchers.extend(
                dispatcher_pb2.DispatcherInfo(address=a, role="leader" if a == status.leader else "follower")
                for a in self.election.dispatchers)
        return status


def _rebalance_interval(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ShardlineConfigError(f"rebalance_interval must be a finite number of seconds >= 0 (0: off), got {value!r}")
    return float(value)


def _state_over(store, heartbeat_timeout: float, vnodes_per_capacity: int, replication: int,
                heartbeat_interval: float | None = None, isolation_share: float = DEFAULT_ISOLATION_SHARE,
                isolation_timeout: float = DEFAULT_ISOLATION_TIMEOUT_SECONDS):
    """Membership and jobs over ``store``; nodes that join a cluster holding job data sync first,
    and silent nodes that hold blocks alone stay in the ring (dispatcher/holders.py)."""
    jobs = JobRegistry(store=store, default_replication=replication)
    membership = Membership(heartbeat_timeout, vnodes_per_capacity, store=store, now=time.monotonic(),
                            has_data=lambda: bool(jobs.list()), sole_holders=SoleHolders(jobs),
                            heartbeat_interval=heartbeat_interval, isolation_share=isolation_share,
                            isolation_timeout=isolation_timeout)
    return membership, jobs


def _log_recovery(memory_only: bool, membership: Membership, jobs: JobRegistry) -> None:
    if memory_only:
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
    """The running gRPC server, its expiry thread and (with etcd) its election; ``stop`` ends them.

    Other ``grpc.Server`` methods (``wait_for_termination`` ...) pass through.
    """

    def __init__(self, server: grpc.Server, servicer: DispatcherServicer, health_servicer: health.HealthServicer,
                 election: LeaderElection | None = None):
        self._server = server
        self._servicer = servicer
        self._health = health_servicer
        self.election = election
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._expire_loop, name="dispatcher-expire", daemon=True)
        self._thread.start()
        self._rebalancer = None
        if servicer.rebalance_interval:
            self._rebalancer = threading.Thread(target=self._rebalance_loop, name="dispatcher-rebalance", daemon=True)
            self._rebalancer.start()

    def _rebalance_loop(self) -> None:
        while not self._stop.wait(self._servicer.rebalance_interval):
            try:
                self._servicer.rebalance()
                self._servicer.update_reader_racks()
            except StateStoreError as exc:  # nothing changed; planned again next interval
                log.error("rebalance failed: %s", exc)
            except Exception:
                log.exception("rebalance failed")

    def _expire_loop(self) -> None:
        while not self._stop.wait(EXPIRE_PERIOD_SECONDS):
            try:
                self._servicer.expire()
            except StateStoreError as exc:  # retried next pass; nothing was declared dead
                log.error("node expiry failed: %s", exc)
            except Exception:  # keep detecting failures whatever one pass hit
                log.exception("node expiry failed")

    def stop(self, grace: float | None) -> threading.Event:
        """Stop expiring nodes, report NOT_SERVING, release waiters, hand the leadership over
        (resign: another dispatcher takes over at once) and stop the gRPC server."""
        self._stop.set()
        self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._servicer.stop()
        if self.election is not None:
            self.election.close()
        done = self._server.stop(grace)
        self._thread.join(timeout=EXPIRE_PERIOD_SECONDS * 4)
        if self._rebalancer is not None:
            self._rebalancer.join(timeout=EXPIRE_PERIOD_SECONDS * 4)
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
    server_tls=None,
    tls_ca: bytes | None = None,
    insecure: bool = False,
    state_dir: str | None = None,
    state_store: str | None = None,
    state_prefix: str = DEFAULT_STATE_PREFIX,
    leader_lease_timeout: float = 3.0,
    advertise_address: str | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    replication: int = 2,
    heat_half_life: float = DEFAULT_HALF_LIFE_SECONDS,
    rebalance_interval: float = DEFAULT_REBALANCE_INTERVAL_SECONDS,
    reader_racks: bool = False,
    isolation_share: float = DEFAULT_ISOLATION_SHARE,
    isolation_timeout: float = DEFAULT_ISOLATION_TIMEOUT_SECONDS,
) -> tuple[DispatcherServer, int, DispatcherServicer]:
    """Start a dispatcher on ``address`` (port 0: any free port). Returns (server, bound port, servicer).

    ``heartbeat_interval`` is what nodes are told to use; it must be below ``heartbeat_timeout`` or
    healthy nodes would be declared dead between heartbeats. ``state_dir``: where the state is kept
    across restarts (None: memory only, with a WARNING); what was recovered is logged.
    ``state_store`` (``etcd://HOST:PORT[,...]``, exclusive with ``state_dir``): the state lives in
    etcd under ``state_prefix`` and this dispatcher campaigns for the leadership with a lease of
    ``leader_lease_timeout`` whole seconds, naming ``advertise_address`` (default: the ``address``
    host and the bound port) as the leader's; it serves as a follower until elected. Raises
    ShardlineConfigError for bad arguments, StateStoreError if the state cannot be opened, and
    ShardlineTimeoutError naming the endpoints if etcd does not answer within ``connect_timeout``.
    Calls to PS nodes carry ``cluster_token`` and use TLS with ``tls_ca`` (PEM); ``server_tls`` (a
    services.security.ServerTLS) makes the server speak TLS; ``insecure`` (exposed without a token)
    is shown in the cluster status. ``replication``: copies of every block for jobs that do not set
    their own. ``heat_half_life``: of the access heatmap; ``rebalance_interval``: seconds between
    rebalances of the ring from measured load (0: never). ``isolation_share`` and
    ``isolation_timeout``: when silent nodes suggest this dispatcher's own isolation
    (dispatcher/isolation.py).
    """
    security = dict(cluster_token=cluster_token, server_tls=server_tls, tls_ca=tls_ca,
                    security_flags={"insecure": insecure, "cluster_token": cluster_token is not None,
                                    "tls": server_tls is not None},
                    heat_half_life=heat_half_life, rebalance_interval=rebalance_interval, reader_racks=reader_racks)
    require_positive_number(heat_half_life, "heat_half_life (seconds)")
    _rebalance_interval(rebalance_interval)
    # Arguments first: a bad one must not touch the state (opening it persists a new epoch).
    require_positive_number(heartbeat_timeout, "heartbeat_timeout (seconds)")
    require_positive_number(heartbeat_interval, "heartbeat_interval (seconds)")
    if heartbeat_interval >= heartbeat_timeout:
        raise ShardlineConfigError(
            f"heartbeat_interval must be below heartbeat_timeout, got interval {heartbeat_interval!r} "
            f"and timeout {heartbeat_timeout!r}"
        )
    detection = dict(heartbeat_interval=heartbeat_interval, isolation_share=check_share(isolation_share),
                     isolation_timeout=check_timeout(isolation_timeout))
    backend = state_backend(state_dir, state_store)
    if backend == "etcd":
        return _create_replicated_server(
            address, heartbeat_timeout=heartbeat_timeout, **detection,
            vnodes_per_capacity=vnodes_per_capacity, max_workers=max_workers, **security,
            state_store=state_store, state_prefix=state_prefix, leader_lease_timeout=leader_lease_timeout,
            advertise_address=advertise_address, connect_timeout=connect_timeout, replication=replication)
    store = open_state_store(state_dir)
    try:
        membership, jobs = _state_over(store, heartbeat_timeout, vnodes_per_capacity, replication, **detection)
    except BaseException:
        store.close()
        raise
    _log_recovery(backend == "memory", membership, jobs)
    servicer = DispatcherServicer(
        membership, jobs, heartbeat_interval=heartbeat_interval, max_waiters=max(1, max_workers // 2),
        node_caller=GrpcNodeCaller(cluster_token, tls_ca), security_flags=security["security_flags"],
        heat_half_life=heat_half_life, rebalance_interval=rebalance_interval, reader_racks=reader_racks,
    )
    try:
        grpc_server, port, health_servicer = create_grpc_server(
            address,
            [lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(servicer, s)],
            max_workers=max_workers,
            cluster_token=cluster_token,
            tls=server_tls,
        )
    except BaseException:
        servicer.close()  # releases the state store's lock for the next attempt
        raise
    return DispatcherServer(grpc_server, servicer, health_servicer), port, servicer


def _create_replicated_server(address: str, *, heartbeat_timeout: float, heartbeat_interval: float,
                              isolation_share: float, isolation_timeout: float,
                              vnodes_per_capacity: int, max_workers: int, cluster_token: bytes | None,
                              server_tls, tls_ca: bytes | None, security_flags: Mapping[str, bool],
                              state_store: str, state_prefix: str, leader_lease_timeout: float,
                              advertise_address: str | None, connect_timeout: float, replication: int,
                              heat_half_life: float, rebalance_interval: float, reader_racks: bool = False):
    """create_server with an etcd state store: a follower that campaigns (create_server's contract)."""
    from shardline.dispatcher.state_etcd import EtcdElectionBackend, parse_etcd_url, validate_prefix

    ttl = lease_ttl(leader_lease_timeout)
    validate_prefix(state_prefix)
    if advertise_address is not None:
        validate_address(advertise_address, "advertise_address")
    require_positive_number(connect_timeout, "connect_timeout (seconds)")
    vnode_counts({}, vnodes_per_capacity)  # validates the density before anything starts
    # A slow request must not eat the renewal: each election request gets a third of the TTL.
    election_backend = EtcdElectionBackend(parse_etcd_url(state_store), state_prefix, request_timeout=ttl / 3)
    try:
        election_backend.wait_reachable(connect_timeout)
    except BaseException:
        election_backend.close()
        raise
    servicer = DispatcherServicer(
        None, None, heartbeat_interval=heartbeat_interval, max_waiters=max(1, max_workers // 2),
        node_caller=GrpcNodeCaller(cluster_token, tls_ca), security_flags=security_flags,
        heat_half_life=heat_half_life, rebalance_interval=rebalance_interval, reader_racks=reader_racks,
    )
    try:
        grpc_server, port, health_servicer = create_grpc_server(
            address, [lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(servicer, s)],
            max_workers=max_workers, cluster_token=cluster_token, tls=server_tls,
        )
    except BaseException:
        servicer.close()
        election_backend.close()
        raise
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # until elected
    host, _ = parse_host_port(address, what="--listen")
    advertised = advertise_address or format_host_port(host, port)
    if host in ("0.0.0.0", "::", ""):
        log.warning("advertising %s as this dispatcher's address: set advertise_address to one that clients and "
                    "the other dispatchers can dial", advertised)

    def on_elected(term: Holder) -> None:
        # The whole state, read under the new term: the epoch comes back as stored + 1.
        store = open_state_store(None, state_store, prefix=state_prefix, fence=Fence(term.token, election.step_down),
                                 connect_timeout=ttl)
        try:
            membership, jobs = _state_over(store, heartbeat_timeout, vnodes_per_capacity, replication,
                                           heartbeat_interval, isolation_share, isolation_timeout)
        except BaseException:
            store.close()
            raise
        _log_recovery(False, membership, jobs)
        servicer.install(membership, jobs, term)
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("leading at epoch %d", membership.epoch)

    def on_deposed(reason: str) -> None:
        health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        servicer.drop()

    election = LeaderElection(election_backend, advertised, ttl, on_elected=on_elected, on_deposed=on_deposed)
    servicer.election = election
    election.start()
    log.info("campaigning for the leadership as %s (state in %s under %s, lease %d s)", advertised, state_store,
             state_prefix, ttl)
    return DispatcherServer(grpc_server, servicer, health_servicer, election), port, servicer
