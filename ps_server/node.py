"""Request handling of one PS node: frame headers in, replies out. No sockets here.

``precheck`` runs on a header before its payload is read (so nothing is allocated for a frame
that will be refused); ``handle`` runs the operation on the received payload. Both raise
``StoreError`` (services/errors.RequestError) with an ``ErrorCode``, NotOwnerError with the node's
epoch, which the connection loop (services/dataplane_server.py) turns into an error reply.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from shardline.ps_server.admission import NameMisses
from shardline.ps_server.delta_history import DEFAULT_MAX_BYTES, DeltaHistory, subscriber_blocks
from shardline.ps_server.heat import HeatCounter
from shardline.services.placement import place
from shardline.ps_server.store import Aggregate, JobStore, NodeStore, PushRef, PushTicket, StoreError
from shardline.services import frame
from shardline.services.blocks import runs_of
from shardline.services.copy_reads import COPY_READ_TIMEOUT_SECONDS, copies_may_serve
from shardline.services.request_checks import check_want_dtypes, refuse_duplicates
from shardline.services.errors import ErrorCode, NotOwnerError, ShardlineError
from shardline.services.names import JOB_NAME_RE
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.routing import RoutingView

log = logging.getLogger("shardline.ps")

# Longest a single waiting pull may block server-side; clients ask for less.
MAX_PULL_WAIT_SECONDS = 600.0
# Longest pushes to a block taken over from a live primary wait for its handover (it is asked at
# once; a primary that stopped answering meanwhile is not waited for longer).
HANDOVER_TIMEOUT_SECONDS = 3.0
# A frame naming a job revision the dispatcher did not have when last asked is refused without
# asking again for this long (a sender cannot make the node query the dispatcher per frame).
REVISION_MISS_SECONDS = 1.0
# A commit that completes a step and carries a pull answers with the step's blocks once their copy
# holders acknowledged them, waiting at most this long (well under a worker's I/O timeout); after
# it the commit is answered without them, and the worker's own pull waits as any pull does.
CARRIED_PULL_WAIT_SECONDS = 1.0
# A one-copy pull placing (or a push taking) at least this many bytes shares its copies with a helper
# thread; such a pull's copies bypass the node's caches (more than they would keep; _copycheck.c).
PARALLEL_PLACE_BYTES = 8 * 1024 * 1024
# A large pull's placed blocks, and a push's blocks taken from a client's region, are copied this
# much at a time: the pieces the node's two copy threads take in turn as each finishes one (so
# neither waits for the other at the end, and the first bad block of a push is found early).
COPY_PIECE_BYTES = 1024 * 1024


# Ops whose frames carry tensor bytes; every other op's payload must be empty.
_PAYLOAD_OPS = frozenset({dp.OP_INIT, dp.OP_PUSH, dp.OP_REPLICATE})


def header_lrs(header: frame.FrameHeader):
    """The learning rates a commit or ASP push names: one per parameter group, one for every group, or None."""
    if header.group_lrs:
        return tuple(header.group_lrs)
    return header.lr if header.has_lr else None


def _placements(job: JobStore, header: frame.FrameHeader, regions) -> dict:
    """The blocks a pull asks to have placed in its connection's regions: {(tensor, index):
    (region, offset)}, each checked to fit (StoreError INVALID_ARGUMENT) before anything waits."""
    placements, sizes = {}, {}
    for ref in header.blocks:
        if not ref.dest_region:
            continue
        if header.subscriber:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, "a subscriber's pull cannot place blocks in a region")
        itemsize = frame.ITEMSIZE[ref.want_dtype or dp.FLOAT32]
        _check_in_region(regions, sizes, ref.dest_region, ref.dest_offset,
                         job.expected_numel(ref.tensor, ref.index) * itemsize, itemsize, "pull places", ref)
        placements[(ref.tensor, ref.index)] = (ref.dest_region, ref.dest_offset)
    return placements


def _check_sources(header: frame.FrameHeader, regions) -> None:
    """A push's blocks left in the client's regions (``BlockRef.src_region``, shm only) each lie
    inside a region its connection shared: StoreError INVALID_ARGUMENT otherwise, before anything
    is reserved."""
    sizes = {}
    for ref in header.blocks:
        if ref.src_region:
            _check_in_region(regions, sizes, ref.src_region, ref.src_offset, ref.nbytes, frame.ITEMSIZE[ref.dtype],
                             "push takes", ref)


def _check_in_region(regions, sizes: dict, region_id: int, offset: int, nbytes: int, itemsize: int, what: str,
                     ref) -> None:
    """``nbytes`` at ``offset`` of the connection's peer region ``region_id``, aligned to ``itemsize``,
    for block ``ref`` (``what`` it is: the error names it). ``sizes`` keeps the sizes looked up
    for one frame's blocks (a pass over 64 blocks asks for the same region 64 times)."""
    size = sizes.get(region_id)
    if size is None:
        size = sizes[region_id] = 0 if regions is None else regions.region_size(region_id)
    if not size:
        raise StoreError(ErrorCode.INVALID_ARGUMENT,
                         f"{what} {ref.tensor}[{ref.index}] from/into region {region_id}, which "
                         f"this connection did not share (regions exist over shm only)")
    if offset % itemsize or offset + nbytes > size:
        raise StoreError(ErrorCode.INVALID_ARGUMENT,
                         f"{what} {ref.tensor}[{ref.index}]: {nbytes} bytes do not fit at offset "
                         f"{offset} of region {region_id} ({size} bytes, aligned to {itemsize})")


def _pieces(items: list, nbytes) -> tuple[list[list], bool]:
    """``items`` in order, in runs of about COPY_PIECE_BYTES (``nbytes(item)`` each; a larger item is
    a piece of its own): the pieces PSNode._share hands out; and whether the copy is large (two
    pieces or more, PARALLEL_PLACE_BYTES in all): shared with the helper thread."""
    pieces = runs_of(items, nbytes, COPY_PIECE_BYTES)
    return pieces, len(pieces) > 1 and sum(nbytes(item) for item in items) >= PARALLEL_PLACE_BYTES


class PSNode:
    """A PS node's data-plane logic.

    ``fetch_job(name)`` returns the job's ``JobInfo`` (spec and uid) from the dispatcher or None if
    unknown; ``fetch_routing()`` returns the current ``RoutingTable``. Both are injected so unit
    tests run without a dispatcher. ``checkpointer`` (ps_server/checkpointer.py), when the node has
    a checkpoint directory, is attached to every job the node holds; so is ``replicator``
    (ps_server/replication.py), which keeps copies of blocks on the nodes the placement names.

    On every routing change the node re-assigns its roles per block (services/placement.py):
    blocks it now applies, blocks it keeps copies of, blocks it no longer holds; waiting pulls
    return NOT_OWNER so that clients refresh too.
    """

    def __init__(self, node_id: str, fetch_job: Callable[[str], "dispatcher_pb2.JobInfo | None"],
                 fetch_routing: Callable[[], common_pb2.RoutingTable], *, metrics=None, checkpointer=None):
        self.node_id = node_id
        self.store = NodeStore()
        self.name_misses = NameMisses()
        self._fetch_job = fetch_job
        self._fetch_routing = fetch_routing
        self._routing = RoutingView.empty()
        self._previous = RoutingView.empty()   # the routing before the last change (who held what)
        self._routing_lock = threading.Lock()
        self.metrics = metrics
        self.checkpointer = checkpointer
        self.replicator = None
        # The newest routing epoch whose roles (primaries, handovers queued) are assigned; the
        # routing itself is swapped in first, so another thread may see it a little earlier.
        self.roles_epoch = 0
        # bf16 images sent to subscribers, the bases of their element-level deltas (delta_history_bytes)
        self.delta_history = DeltaHistory(DEFAULT_MAX_BYTES)
        self.payload_budget = None   # services/payload_budget.py: the data plane's receive buffers (memory reports)
        self.grad_norms = None   # ps_server/grad_norm.py GradNormExchange: jobs with max_grad_norm
        self.settle_commits: Callable[[], object] | None = None   # the commit relay's settle()
        self._settled_epoch = 0
        self._jobs_listed_epoch = 0   # the pending epoch whose job list this node holds every job of (hold_jobs)
        self._revision_lock = threading.Lock()
        self._revision_misses: dict[str, tuple[float, int]] = {}  # job -> (when, revision the dispatcher had)
        # Cleared while the node restores its checkpoints: requests get UNAVAILABLE meanwhile.
        self.serving = threading.Event()
        self.serving.set()
        self.heat = HeatCounter()   # reads/writes per block and the node's load, for heartbeats
        self._place_pool: ThreadPoolExecutor | None = None   # helps copy large one-copy pulls (_place)
        self._place_pool_lock = threading.Lock()

    # --- routing ----------------------------------------------------------------------------
    @property
    def routing(self) -> RoutingView:
        return self._routing

    def update_routing(self, table: common_pb2.RoutingTable) -> None:
        view = RoutingView.from_proto(table)
        with self._routing_lock:
            old = self._routing
            if view.epoch < old.epoch:
                return  # a deposed dispatcher's table, or one that lags: never go back
            changed = (view.epoch, view.pending_epoch) != (old.epoch, old.pending_epoch)
            self._routing = view
            if changed:
                self._previous = old
        if changed:
            if self.replicator is not None:
                self.replicator.links.abandon_gone()   # before the roles: the acks they wait for
            for job in self.store.jobs():
                self.assign_roles(job, old)
                with job.cond:
                    job.cond.notify_all()  # waiting pulls check the epoch again
            if self.grad_norms is not None:
                self.grad_norms.on_routing_change()
            with self._routing_lock:   # only the thread that assigned them: another may still be at it
                self.roles_epoch = max(self.roles_epoch, view.epoch)

    def remembered_routing(self) -> common_pb2.RoutingTable | None:
        """The serving ring this node routes by, if it holds job data: what it registers again
        with (a dispatcher that lost its state takes the ring back from it). None: nothing held."""
        view = self._routing
        if view.ring is None or not self.store.jobs():
            return None
        return common_pb2.RoutingTable(epoch=view.epoch, nodes=list(view.nodes.values()))

    def refresh_routing(self) -> RoutingView:
        self.update_routing(self._fetch_routing())
        return self._routing

    def refresh_routing_quietly(self) -> None:
        try:
            self.refresh_routing()
        except Exception as exc:  # the heartbeat will bring it
            log.debug("routing refresh failed: %s", exc)

    def assign_roles(self, job: JobStore, previous: RoutingView | None = None) -> None:
        """Apply exactly the blocks the routing makes this node the primary of, and have the
        replicator bring the copies it should hold in sync (``previous``: the routing before)."""
        view = self._routing
        if view.ring is None:
            return
        placement = place(view, job.spec)
        primary, replica, learner = placement.roles(self.node_id)
        awaiting = self._handovers_due(job, view, previous, primary)
        self._set_primary(job, primary, view, awaiting)
        if self.replicator is not None:
            self.replicator.resync(job, placement, primary, replica | learner, previous or self._previous,
                                   poke={node for node, _deadline in awaiting.values()})

    def _handovers_due(self, job: JobStore, view: RoutingView, previous: RoutingView | None, primary: set) -> dict:
        """Blocks this node takes over from a primary that is still alive (it serves on, or it
        was draining): their pushes wait, at most HANDOVER_TIMEOUT_SECONDS, for what it collected
        of the step in flight. A primary that died hands nothing over."""
        if previous is None or previous.ring is None or self.replicator is None:
            return {}
        before = place(previous, job.spec)
        draining = set(previous.nodes) - set(previous.pending_nodes) if previous.pending_epoch else set()
        deadline = time.monotonic() + HANDOVER_TIMEOUT_SECONDS
        due = {}
        with job.cond:
            for key in primary:
                block = job.blocks.get(key)
                if block is None or block.primary:
                    continue
                owner = before.primary(key)
                if owner and owner != self.node_id and (owner in view.nodes or owner in draining):
                    due[key] = (owner, deadline)
        return due

    def _set_primary(self, job: JobStore, primary: set, view: RoutingView, awaiting: dict | None = None) -> None:
        _gained, handovers = job.set_primary(primary, view.epoch, awaiting)
        if handovers and self.replicator is not None:
            self.replicator.hand_over(job, handovers)

    # --- jobs -------------------------------------------------------------------------------
    def job(self, name: str, *, trust_misses: bool = True) -> JobStore:
        """The job ``name``, asking the dispatcher for a job this node does not hold yet.

        Raises StoreError UNKNOWN_JOB for a name that is invalid or that the dispatcher does not
        know (remembered for ``name_misses.ttl_seconds``, unless ``trust_misses`` is False: the job's
        creator and peer nodes know it exists), UNAVAILABLE when the dispatcher cannot be asked."""
        job = self.store.get(name)
        if job is not None:
            return job
        if not name:
            raise StoreError(ErrorCode.UNKNOWN_JOB, "frame names no job")
        if not JOB_NAME_RE.fullmatch(name):
            raise StoreError(ErrorCode.UNKNOWN_JOB,
                             f"no job is named {name[:200]!r}: a job name is 1..128 characters of "
                             f"[A-Za-z0-9._-]")
        if trust_misses and name in self.name_misses:
            raise StoreError(ErrorCode.UNKNOWN_JOB, f"job {name!r} does not exist on this cluster")
        try:
            info = self._fetch_job(name)
        except ShardlineError as exc:
            raise StoreError(ErrorCode.UNAVAILABLE,
                             f"node {self.node_id!r} cannot look job {name!r} up: {exc}") from None
        if info is None:
            self.name_misses.add(name)
            raise StoreError(ErrorCode.UNKNOWN_JOB, f"job {name!r} does not exist on this cluster")
        self.name_misses.discard(name)
        return self.add_job(info.spec, info.uid)

    def add_job(self, spec: common_pb2.JobSpec, uid: str, restored=None) -> JobStore:
        """Hold a job (``restored``: the LoadedCheckpoint its blocks come from)."""
        created = []

        def setup(job: JobStore) -> None:
            if restored is not None:
                job.restore(restored.step, restored.blocks)
            if self.checkpointer is not None:
                self.checkpointer.attach(job, spec, restored)
            if self.replicator is not None:
                self.replicator.attach(job)
            if self.grad_norms is not None:
                self.grad_norms.attach(job)
            created.append(job)

        job = self.store.add(spec, uid, on_create=setup)
        if created:
            self.assign_roles(job)
        return job

    def catch_up(self, job: JobStore, revision: int) -> JobStore:
        """A frame names ``revision`` of ``job``, newer than this node holds: take the job's spec
        from the dispatcher and extend the store (new tensors, unfrozen ones, new groups), then
        place the new blocks (roles, copies to sync). Raises StoreError: UNAVAILABLE when the
        dispatcher cannot be asked, INVALID_ARGUMENT when it does not have ``revision`` either."""
        with self._revision_lock:
            if job.revision >= revision:
                return job
            miss = self._revision_misses.get(job.name)
            if miss is None or time.monotonic() - miss[0] >= REVISION_MISS_SECONDS or miss[1] >= revision:
                try:
                    info = self._fetch_job(job.name)
                except ShardlineError as exc:
                    raise StoreError(ErrorCode.UNAVAILABLE,
                                     f"node {self.node_id!r} cannot look revision {revision} of job "
                                     f"{job.name!r} up: {exc}") from None
                if info is not None and (not job.uid or not info.uid or info.uid == job.uid) \
                        and job.extend(info.spec):
                    log.info("job %s extended to revision %d (%d tensors, %d parameter groups)", job.name,
                             job.revision, len(job.tensors), len(job.group_optimizers))
                    self._revision_misses.pop(job.name, None)
                    self.assign_roles(job, RoutingView.empty())  # the routing did not change: nothing moved
                else:
                    self._revision_misses[job.name] = (time.monotonic(), job.revision)
            if job.revision < revision:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"the frame names revision {revision} of job {job.name!r}; the "
                                 f"dispatcher has revision {job.revision}")
        return job

    def on_synced(self, job: JobStore, primary: str) -> None:
        """A sync with ``primary`` completed: blocks this node applies may have arrived."""
        view = self._routing
        primary_keys, _replica, _learner = place(view, job.spec).roles(self.node_id)
        self._set_primary(job, primary_keys, view)

    def drop_job(self, name: str, uid: str = "") -> bool:
        """Forget a job (its blocks, and its checkpoints); ``uid`` set: only that incarnation."""
        job = self.store.get(name)
        if job is None or (uid and job.uid != uid):
            if job is None and self.checkpointer is not None and name in self.checkpointer.ckdir.jobs():
                self.checkpointer.ckdir.delete_job(name)
                return True
            return False
        job.freeze("the job was deleted")
        self.store.remove(name)
        if self.checkpointer is not None:
            self.checkpointer.drop(name)
        if self.replicator is not None:
            self.replicator.forget(name)
        self.heat.drop_job(name)
        self.delta_history.forget_job(job.uid, name)
        log.info("job %s (uid %s) dropped", name, job.uid or "-")
        return True

    def hold_jobs(self, names, revisions=None) -> bool:
        """A ring change is pending and the dispatcher lists its jobs (``names``, a heartbeat's
        reply, and ``revisions``: name -> the job's revision): hold each at that revision, so the
        replicator syncs the blocks this node will own. Until this has run for the pending epoch,
        ``ready_epoch`` reports nothing: a node that (re)joins holds no job yet, and reporting
        ready before it learnt them would switch the ring with none of its blocks synced (a
        handover sent to it then finds no block and is lost). True when this made the pending
        epoch's readiness reportable (the caller reports it at once)."""
        pending = self._routing.pending_epoch
        complete = True
        revisions = revisions or {}
        for name in names:
            job = self.store.get(name)
            if job is not None and job.revision >= revisions.get(name, 0):
                continue
            try:
                if job is None:
                    self.job(name, trust_misses=False)   # the dispatcher just listed it
                else:   # extended since: its new tensors' blocks are to sync too
                    self.catch_up(job, revisions[name])
            except StoreError as exc:
                complete = complete and exc.code == ErrorCode.UNKNOWN_JOB   # deleted meanwhile: nothing to sync
                log.debug("job %s: %s", name, exc)
        if not (pending and complete) or self._jobs_listed_epoch == pending:
            return False
        self._jobs_listed_epoch = pending
        return True

    def held_jobs(self) -> list[dispatcher_pb2.HeldJob]:
        """What heartbeats report: every job held, its step and latest durable checkpoint."""
        held = []
        for job in self.store.jobs():
            durable = None if self.checkpointer is None else self.checkpointer.durable_step(job.name)
            held.append(dispatcher_pb2.HeldJob(job=job.name, uid=job.uid, step=job.step, has_durable=durable is not None,
                                               durable_step=durable or 0, revision=job.revision))
        return held

    def ready_epoch(self) -> int:
        """The pending ring's epoch once every copy this node holds under it is in sync (the
        dispatcher switches when all nodes report it), else 0."""
        view = self._routing
        # roles_epoch: the thread that set this view may still be assigning its roles (a frame or an
        # ack that met the newer epoch refreshed it first): the syncs it asks for are not due yet.
        if not view.pending_epoch or self._jobs_listed_epoch != view.pending_epoch or self.roles_epoch < view.epoch or (
                self.replicator is not None and not self.replicator.ready()):
            return 0
        if self.settle_commits is not None and self._settled_epoch != view.pending_epoch:
            # Before blocks change owner: complete every step a rank committed on another node only
            # (it died between its commits). Moved mid-step, such a block would need the rank's
            # gradients again, computed from parameters other nodes already stepped.
            self.settle_commits()
            self._settled_epoch = view.pending_epoch
        return view.pending_epoch

    def freeze(self, reason: str) -> None:
        """A stopping node: every job refuses further pushes and commits (UNAVAILABLE)."""
        for job in self.store.jobs():
            job.freeze(reason)

    # --- frames -----------------------------------------------------------------------------
    def precheck(self, header: frame.FrameHeader) -> None:
        """Validate a header against node state before its payload is read."""
        if header.op == dp.OP_PING:
            return
        if header.op not in (dp.OP_INIT, dp.OP_PUSH, dp.OP_COMMIT, dp.OP_PULL, dp.OP_REPLICATE, dp.OP_SYNC):
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"op {dp.Op.Name(header.op)} is not a request")
        if header.payload_bytes and header.op not in _PAYLOAD_OPS:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"{dp.Op.Name(header.op)} carries no payload, the frame claims "
                             f"{header.payload_bytes} bytes")
        peer_op = header.op in (dp.OP_REPLICATE, dp.OP_SYNC)
        if peer_op and self.replicator is None:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"node {self.node_id!r} does not replicate")
        if not self.serving.is_set() and not peer_op:
            raise StoreError(ErrorCode.UNAVAILABLE,
                             f"node {self.node_id!r} is restoring its checkpoints; retry shortly")
        refuse_duplicates(header)
        check_want_dtypes(header)
        job = self.job(header.job, trust_misses=not (peer_op or header.op == dp.OP_INIT))
        if header.revision > job.revision:
            self.catch_up(job, header.revision)
        if header.op in (dp.OP_PUSH, dp.OP_COMMIT):
            job.check_revision(header.rank, header.step, header.revision, "push" if header.op == dp.OP_PUSH else "commit")
        if header.pull_applied and (header.op != dp.OP_COMMIT or job.sync != "bsp" or header.subscriber
                                    or header.at_step):
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"pull_applied is for a worker's commits of BSP jobs; this is a "
                             f"{dp.Op.Name(header.op)} of a {job.sync} job"
                             f"{' (subscriber/at_step set)' if header.subscriber or header.at_step else ''}")
        routing = self._routing
        if header.epoch > routing.epoch:
            routing = self.refresh_routing()
        if header.epoch < routing.epoch and not (header.op == dp.OP_REPLICATE
                                                 and header.replicate_kind in frame.SYNC_ANSWER_KINDS):
            raise NotOwnerError(ErrorCode.NOT_OWNER, f"{'node ' + repr(header.node) if peer_op else 'client'} routes "
                                f"with epoch {header.epoch}, node is at epoch {routing.epoch}", epoch=routing.epoch)
        if peer_op:
            # Copies are checked block by block as they are installed (replication.py); here only
            # that the payload is no larger than copies of these blocks can be.
            for ref in header.blocks:
                numel = job.expected_numel(ref.tensor, ref.index)
                if not ref.zero and ref.numel > self._copy_numel_bound(
                        job, numel, header.replicate_kind == dp.REPLICATE_HANDOVER and not ref.copy):
                    raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                     f"copy of {ref.tensor}[{ref.index}] claims {ref.numel} "
                                     f"elements, more than a copy of this block holds")
            return
        op, owner, node_id = header.op, routing.owner, self.node_id
        sized = op in (dp.OP_INIT, dp.OP_PUSH)
        fetching = op != dp.OP_INIT and self.replicator is not None and self.replicator.fetching(job.name)
        copy_reads = self._copy_reads(job, header)
        owners = None   # the placement's owners, once a block this node is not the primary of needs them
        for ref in header.blocks:
            tensor, index = ref.tensor, ref.index
            numel = job.expected_numel(tensor, index)
            if owner(job.name, tensor, index) != node_id:
                if copy_reads and owners is None:
                    owners = place(routing, job.spec).owners
                if not copy_reads or node_id not in owners.get((tensor, index), ())[1:]:   # not its replica
                    raise NotOwnerError(ErrorCode.NOT_OWNER, f"block {tensor}[{index}] is not owned by node "
                                        f"{node_id!r} at epoch {routing.epoch}", epoch=routing.epoch)
            if fetching and (tensor, index) not in job.blocks:
                raise StoreError(ErrorCode.UNAVAILABLE, f"node {node_id!r} is still receiving block {tensor}[{index}] "
                                                        f"(it took it over at epoch {routing.epoch}); retry shortly")
            if sized and not ref.zero and ref.numel != numel:
                raise StoreError(ErrorCode.INVALID_ARGUMENT, 
                                 f"block {tensor}[{index}] has {numel} elements, frame sends {ref.numel}")
            if op == dp.OP_INIT and ref.dtype != dp.FLOAT32:
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"initial values of {tensor!r} must be float32")
        if header.op == dp.OP_PULL and not (math.isfinite(header.wait_timeout_seconds)
                                            and header.wait_timeout_seconds >= 0):
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"wait_timeout_seconds must be a finite number >= 0 (0: the default "
                             f"wait), got {header.wait_timeout_seconds!r}")
        if header.op == dp.OP_PULL and not header.blocks and self.replicator is not None \
                and self.replicator.fetching(job.name):
            # the job step it would report describes none of the blocks it is taking over yet
            raise StoreError(ErrorCode.UNAVAILABLE,
                             f"node {self.node_id!r} is still receiving blocks of job {job.name!r} "
                             f"(it took them over at epoch {routing.epoch}); retry shortly")
        if self.checkpointer is not None and header.op != dp.OP_INIT:
            self.checkpointer.on_request(job)  # the first one after init checkpoints step 0

    def _copy_reads(self, job: JobStore, header: frame.FrameHeader) -> bool:
        """Whether ``header`` is a read this node may serve from its copies (services/copy_reads.py)."""
        return self.replicator is not None and copies_may_serve(
            header.op, job.sync, min_step=header.min_step, subscriber=header.subscriber, at_step=header.at_step,
            pull_applied=header.pull_applied)

    def _read_copies(self, job: JobStore, header: frame.FrameHeader) -> frozenset:
        """The keys of ``header``'s read this node serves from its copies (wait_for_step's
        ``copies``): those it is not the primary of (precheck let through only its replicas')."""
        if not self._copy_reads(job, header):
            return frozenset()
        owner, node_id = self._routing.owner, self.node_id
        return frozenset((r.tensor, r.index) for r in header.blocks if owner(job.name, r.tensor, r.index) != node_id)

    def _place(self, regions, places: list) -> None:
        """Copy ``places`` ((region, offset, value)) into the connection's regions. A large pull's
        copies are shared with the helper thread (``_share``) and bypass the node's caches (they
        would not keep it; the client reads it, the node never does)."""
        if not places:
            return
        if sum(value.nbytes for _region, _offset, value in places) < PARALLEL_PLACE_BYTES:
            regions.place_many(places)   # one call: a pull of many small blocks pays per piece and block
            return
        pieces, large = _pieces(places, lambda place: place[2].nbytes)
        if not large:
            regions.place_many(places)
            return
        self._share(functools.partial(regions.place_many, stream=True), pieces)

    def _share(self, work, pieces: list, helper: bool = True) -> list:
        """``work(piece)`` for each of ``pieces`` in order, by this thread and (``helper``) one
        helper thread at once, each taking the next piece when it finishes one (a copy to or from a
        client's region is the whole transfer: two cores copy 64 MiB in about two thirds of the time
        one takes, and taking pieces as they come leaves neither waiting for the other at the end,
        as fixed halves did: the helper starts later and is slowed by the GIL). If the helper is
        busy with another request, this thread does every piece.

        A piece whose ``work`` returns a value (a push's first bad block) is the last one started;
        every piece before it is done. Returns those values, in no order."""
        queue, taking, found = iter(pieces), threading.Lock(), []

        def drain() -> None:
            while not found:
                with taking:
                    piece = next(queue, None)
                if piece is None:
                    return
                value = work(piece)
                if value is not None:
                    found.append(value)

        if not helper:
            drain()
            return found
        with self._place_pool_lock:
            if self._place_pool is None:
                self._place_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardline-place")
        helping = self._place_pool.submit(drain)
        drain()
        if not helping.cancel():
            helping.result()
        return found

    def take_push(self, regions, job: JobStore, ticket: PushTicket, header: frame.FrameHeader,
                  indices: list[int]) -> None:
        """Copy the push's blocks ``indices``, which the client left in its shared regions
        (``src_region``), into their destinations, checking each copy for NaN/Inf as it is made (a
        failure is left on the ticket, for finish_push): piece by piece, shared with the helper
        thread when large. Only the node's own copy is checked, never the client's memory, which
        the client could still change (ShmConnection.take_many, tensor_checks.copy_span_checked)."""
        blocks, dests, checked = header.blocks, ticket.dests, not job.allow_nonfinite

        def take(piece: list) -> int | None:
            bad = regions.take_many([(blocks[i].src_region, blocks[i].src_offset, dests[i]) for i in piece],
                                    checked=checked)
            return None if bad is None else piece[bad]

        if sum(dests[i].nbytes for i in indices) < PARALLEL_PLACE_BYTES:   # one thread: one call, no pieces
            bad = take(indices)
            found = [] if bad is None else [bad]
        else:
            pieces, large = _pieces(indices, lambda i: dests[i].nbytes)
            found = self._share(take, pieces, helper=large)
        if found:  # every piece before the last one started was checked: the least is the first bad block
            job.refuse_nonfinite(ticket, min(found))

    def _copy_numel_bound(self, job: JobStore, numel: int, handover: bool) -> int:
        if handover or self.replicator is None:
            return numel  # a handover carries a gradient sum (its copies are checked as copies)
        return self.replicator.codec(job).packed_numel(numel)

    def _reply(self, header: frame.FrameHeader) -> frame.FrameHeader:
        return frame.FrameHeader(op=dp.OP_REPLY, request_id=header.request_id, job=header.job, epoch=self._routing.epoch)

    def begin_push(self, header: frame.FrameHeader, scratch: bytearray | None,
                   regions=None) -> tuple[JobStore, PushTicket]:
        """Start a prechecked PUSH: returns where each block's payload goes (see JobStore.begin_push).
        ``scratch`` receives the blocks, payload or taken from ``regions`` (the shm connection),
        that do not go straight into a gradient buffer; None: the caller binds it later
        (``PushTicket.bind_scratch``, ``ticket.scratch_bytes`` of it)."""
        _check_sources(header, regions)
        job = self.job(header.job)
        refs = [PushRef(ref.tensor, ref.index, ref.zero, ref.numel, torch.uint8, ref.scale) if ref.dtype == dp.SIGN1
                else PushRef(ref.tensor, ref.index, ref.zero, ref.numel, frame.TORCH_DTYPE.get(ref.dtype, torch.float32))
                for ref in header.blocks]
        aggregate = Aggregate(tuple(header.agg_ranks), tuple(header.agg_weights)) if header.agg_ranks else None
        return job, job.begin_push(header.rank, header.step, header.weight or 1.0, refs, scratch, lr=header_lrs(header),
                                   commit_follows=header.commit_follows, aggregate=aggregate)

    def finish_push(self, header: frame.FrameHeader, job: JobStore, ticket: PushTicket) -> frame.FrameHeader:
        """Make the received push visible and return its reply; blocks it completed are left on
        the ticket, for :meth:`after_push` once the reply went out."""
        reply = self._reply(header)
        started = time.perf_counter()
        reply.step = job.finish_push(ticket, defer_early=True)
        elapsed = time.perf_counter() - started
        if job.sync == "asp":  # ASP applies the push here
            self.heat.record_apply(elapsed)
            if self.metrics is not None:
                self.metrics.apply(job.name, elapsed)
        return reply

    def after_push(self, header: frame.FrameHeader, job: JobStore, ticket: PushTicket) -> None:
        """After a push's reply went out: step the blocks it completed early (pipelined apply),
        then count its writes (ps_server/heat.py; a pass over every block, which the pusher need
        not wait for). A failure here fails no request: the step's commits step those blocks
        themselves."""
        try:
            job.step_early(ticket)
        except Exception:  # noqa: BLE001 - the push was answered; its commit takes the normal path
            log.exception("job %s: stepping blocks early after a push failed; the commits step them", job.name)
        self.heat.record_writes(job.name, [(ref.tensor, ref.index, ref.nbytes) for ref in header.blocks])

    def handle(self, header: frame.FrameHeader, payload, *, cancelled: threading.Event | None = None,
               regions=None) -> tuple[frame.FrameHeader, list]:
        """Run a prechecked request other than PUSH. ``payload`` holds ``header.payload_bytes`` bytes.

        ``cancelled`` set (the client hung up) ends a waiting pull: ConnectionAbortedError.
        ``regions``: the shm connection the request came on (its peer's regions take the blocks
        a pull asks to be placed, ``BlockRef.dest_region``); None on other transports."""
        reply = self._reply(header)
        if header.op == dp.OP_PING:
            return reply, []
        job = self.job(header.job)
        weight = header.weight if header.weight else 1.0
        if header.op == dp.OP_INIT:
            items = [(ref.tensor, ref.index, t) for ref, t in frame.payload_views(payload, header.blocks)]
            if any(t is None for _, _, t in items):
                raise StoreError(ErrorCode.INVALID_ARGUMENT, "initial values cannot be zero flags")
            job.init_blocks(items)
            if self.replicator is not None:  # acknowledged once the copy holders have them too
                self.replicator.replicate_init(job, [(t, i) for t, i, _v in items])
            reply.step = job.step
            return reply, []
        if header.op == dp.OP_REPLICATE:
            self.replicator.handle_replicate(job, header, payload)
            reply.step = job.step
            return reply, []
        if header.op == dp.OP_SYNC:
            self.replicator.handle_sync(job, header.node, header.blocks, header.epoch)
            reply.step = job.step
            return reply, []
        if header.op == dp.OP_COMMIT:
            lr = header_lrs(header)
            epoch = header.epoch
            placements = _placements(job, header, regions) if header.pull_applied else {}  # checked before it counts
            started = time.perf_counter()
            if self.metrics is None:
                reply.step = job.commit(header.rank, header.step, weight, lr=lr, epoch=epoch)
            else:  # barrier and optimizer apply time (the last commit of a step applies it)
                reply.step = self.metrics.timed_commit(
                    job.name, header.step, lambda: job.commit(header.rank, header.step, weight, lr=lr, epoch=epoch))
            if reply.step <= header.step:
                return reply, []
            self.heat.record_apply(time.perf_counter() - started)  # this commit applied the step (or it was before)
            if not header.pull_applied:
                return reply, []
            try:  # the carried pull: its blocks once visible at the new step (their copy holders have it)
                job.wait_for_step(header.step + 1, CARRIED_PULL_WAIT_SECONDS,
                                  [(ref.tensor, ref.index) for ref in header.blocks],
                                  interrupted=lambda: self._routing.epoch > header.epoch,
                                  copies=self._read_copies(job, header), copies_within=CARRIED_PULL_WAIT_SECONDS,
                                  reader_resends=header.resends_previous_step)
            except StoreError:
                return reply, []  # (a slow copy holder, the routing moved): the worker's own pull waits
            reply.pull_applied = True
            payloads = self._pull_reply(job, header, reply, placements, regions)
            self._say_durable(job, header, reply)
            return reply, payloads
        # OP_PULL
        placements = _placements(job, header, regions)
        timeout = min(header.wait_timeout_seconds or 60.0, MAX_PULL_WAIT_SECONDS)
        started = time.perf_counter()
        try:
            keys = [(ref.tensor, ref.index) for ref in header.blocks]
            # A subscriber's pull without a min_step asks for the node's step, once its blocks are
            # visible at it (the reply says which step it waited for).
            min_step = header.min_step or (job.step if header.subscriber else 0)
            job.wait_for_step(min_step, timeout, keys,
                              interrupted=lambda: self._routing.epoch > header.epoch or (
                                  cancelled is not None and cancelled.is_set()),
                              copies=self._read_copies(job, header), copies_within=COPY_READ_TIMEOUT_SECONDS,
                              reader_resends=header.resends_previous_step and not header.subscriber)
        except StoreError:
            if cancelled is not None and cancelled.is_set():
                raise ConnectionAbortedError("the client closed the connection while its pull waited") from None
            raise
        finally:
            if self.metrics is not None:
                self.metrics.pull_wait(job.name, time.perf_counter() - started)
        payloads = self._pull_reply(job, header, reply, placements, regions, min_step=min_step)
        self._say_durable(job, header, reply)
        return reply, payloads

    @staticmethod
    def _say_durable(job: JobStore, header: frame.FrameHeader, reply: frame.FrameHeader) -> None:
        """A reply to a worker that resends its previous step names the step its records may be
        forgotten before (JobStore.durable_step), read after the reply's blocks were chosen."""
        if header.resends_previous_step and job.collects:
            reply.resends_previous_step = True   # the durable_step counts (0 included)
            reply.durable_step = job.durable_step()

    def _pull_reply(self, job: JobStore, header: frame.FrameHeader, reply: frame.FrameHeader, placements: dict,
                    regions, min_step: int = 0) -> list:
        """Fill ``reply`` with the blocks of ``header`` (a pull, or a commit carrying one) newer than
        the requester holds, placing those it asked to have placed; returns the payload buffers."""
        wanted = [(ref.tensor, ref.index, ref.version if ref.has else None) for ref in header.blocks]
        dtypes = [frame.PULL_DTYPES[ref.want_dtype] for ref in header.blocks]
        # A subscriber does not hold the step back as a worker does: its copies are made under the lock
        # (so are a restarted rank's values of an older step: the next apply writes over them).
        at_step = header.step if header.at_step else None
        step, blocks = job.changed_blocks(wanted, copy=job.sync != "bsp" or header.subscriber or header.at_step,
                                          dtypes=dtypes, at_step=at_step)
        reply.step = step
        reply.revision = job.revision  # a reader that holds an older spec learns tensors were added
        # A worker learning where to resume asks from step 0; steady-state pulls skip the scan.
        reply.oldest_step = min(step, job.oldest_step()) if header.op == dp.OP_PULL and header.min_step == 0 else step
        if header.subscriber:  # checksums and element-level deltas (ps_server/delta_history.py)
            reply.min_step = min_step
            bases = {(t, i): v for t, i, v in wanted if v is not None}
            sent = subscriber_blocks(self.delta_history, (job.uid, job.name), blocks, bases)
            reply.blocks.extend(ref for ref, _ in sent)
            # where the job's readers are (subscriber pulls count in no other heat)
            self.heat.record_rack_read(job.name, header.reader_rack, sum(ref.nbytes for ref, _ in sent))
            return [payload for _, payload in sent]
        payloads, places = [], []
        add, wire_dtype, placed_at = reply.blocks.add, frame.WIRE_DTYPE, placements.get   # once, not per block
        for tensor, index, version, value in blocks:   # values of wire dtypes (fp32, bf16)
            place = placed_at((tensor, index))
            if place is not None:  # one copy, straight into the client's cache
                places.append((*place, value))
            else:
                payloads.append(frame.tensor_bytes(value))
            add(tensor=tensor, index=index, dtype=wire_dtype[value.dtype], numel=value.numel(), nbytes=value.nbytes,
                version=version, placed=place is not None)
        self._place(regions, places)
        return payloads

    def after_reply(self, header: frame.FrameHeader, reply: frame.FrameHeader) -> None:
        """After the reply to a request other than a push went out: if it answered a pull (or a
        commit that carried one), count its reads (ps_server/heat.py; a pass over every block,
        which the reader need not wait for). A subscriber's reads were counted with its reply."""
        if header.subscriber or not (header.op == dp.OP_PULL or reply.pull_applied):
            return
        self.heat.record_reads(header.job, [(ref.tensor, ref.index, ref.nbytes) for ref in reply.blocks],
                               rack=header.reader_rack)
