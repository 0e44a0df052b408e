"""JobStore: the blocks and sync state of one job on this node; NodeStore: all jobs on a node.

JobStore is the facade the rest of the PS uses. Its methods live in one module per concept, all
over the job's one lock (``cond``, an RLock inside: hooks may call back into the store):

=================  ==========================================================================
pushes.py          a worker's gradients, received into the blocks' collections
ahead.py           SSP: steps after the one a block collects
commits.py         BSP/SSP commits, and when a step's commit record is complete
apply.py           applying a step (clipping, ASP), publishing it to the copy holders
early.py           pipelined apply: blocks stepped before their step's commits
copies.py          the copy holder's side of replication
handover.py        ownership changes and the handover of the step in flight
reads.py           pulls, checkpoint snapshots and restores, freeze and fail
blocks.py          a block's roles (Primary, Copy) and their transitions
=================  ==========================================================================

Every mutating call validates the whole request before changing anything, so a rejected frame
leaves no partial update behind. The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable

import torch

from shardline.ps_server.optimizer import OptimizerConfig, group_configs, make_optimizer
from shardline.ps_server.store.ahead import AheadSteps
from shardline.ps_server.store.apply import Applying
from shardline.ps_server.store.blocks import Block
from shardline.ps_server.store.commits import Commits
from shardline.ps_server.store.common import STORAGE_DTYPES, LRs, StoreError, TensorMeta
from shardline.ps_server.store.copies import CopyHolder
from shardline.ps_server.store.early import EarlySteps
from shardline.ps_server.store.frozen_file import FrozenFile
from shardline.ps_server.store.handover import Ownership
from shardline.ps_server.store.pushes import Pushes
from shardline.ps_server.store.reads import Reads
from shardline.services.blocks import num_blocks
from shardline.services.compression import compression_of
from shardline.services.errors import ErrorCode, ShardlineConfigError
from shardline.services.extension import replay, revision_of
from shardline.services.pb import common_pb2
from shardline.services.tensor_checks import all_finite

log = logging.getLogger("shardline.ps.store")


class JobStore(Pushes, AheadSteps, Commits, Applying, EarlySteps, CopyHolder, Ownership, Reads):
    """Blocks and sync state of one job on this node. Thread-safe; pulls wait on ``cond``.

    Per block, ``step`` counts the job steps the copy has been carried through (applied or, for a
    block nobody pushed, skipped), ``visible`` the step pulls may see (a primary's step becomes
    visible once its replicas hold it), ``role`` whether this node applies it (blocks.py).
    ``self.step`` is the node's collecting step: the first step whose commit record is not
    complete. A block this node took over (failover, migration) may lag it by the step in flight:
    it collects pushes for its own ``step`` and applies once every rank committed that step again
    at an epoch >= the block's ``since_epoch`` (workers resend the step in flight when the routing
    epoch changes).
    """

    def __init__(self, spec: common_pb2.JobSpec, *, allow_nonfinite: bool | None = None,
                 spill_dir: str | None = None):
        self.spill_dir = spill_dir   # frozen values in a file there (frozen_file.py); None: in memory
        self.frozen_file: FrozenFile | None = None
        self.spec = common_pb2.JobSpec()
        self.spec.CopyFrom(spec)
        self.name = spec.name
        self.sync = spec.sync
        # BSP and SSP collect each step from every rank's commit; SSP up to ``staleness`` steps ahead.
        self.collects = spec.sync in ("bsp", "ssp")
        self.staleness = int(spec.staleness) if spec.sync == "ssp" else 0
        self.world_size = int(spec.world_size)
        self.block_elements = int(spec.block_elements)
        self.allow_nonfinite = spec.allow_nonfinite if allow_nonfinite is None else allow_nonfinite
        self.compression = compression_of(spec)
        # BSP: primaries keep each block's value from before its last step (blocks.Kept).
        self.keeps_previous = spec.sync == "bsp" and not spec.inexact_restarts
        # BSP/SSP: replicas get each step's mean gradient and lr and step their copies themselves
        # (ASP steps at every push, and keeps sending copies).
        self.replays_gradients = spec.replicate_gradients and spec.sync in ("bsp", "ssp")
        self.optimizer_config = OptimizerConfig.from_proto(spec.optimizer)
        # One optimizer per parameter group (torch.optim's param_groups); their state layouts agree
        # (checked when the job is created), so one block codec and checkpoint format serve all.
        self.group_optimizers = [make_optimizer(c) for c in group_configs(spec)]
        self.optimizer = self.group_optimizers[0]
        self.tensors: dict[str, TensorMeta] = {}
        self._add_tensors(spec)
        self._reserve_frozen()
        self.revision = revision_of(spec)   # the job revisions (extensions) this store holds
        self.blocks: dict[tuple[str, int], Block] = {}
        self.cond = threading.Condition()   # an RLock inside: hooks may call back into the store
        self.bytes = 0
        self.uid = ""                       # the job incarnation (dispatcher JobInfo.uid)
        self.frozen: str | None = None      # why pushes and commits are refused (node stopping)
        self.failed: StoreError | None = None   # set when a worker is lost and the job fails
        self._init_steps(spec)
        self._init_hooks()

    def _init_steps(self, spec: common_pb2.JobSpec) -> None:
        """What the job's steps collect, and counters of how they were applied."""
        self.step = 0                 # BSP: the first step whose commits are not complete
        # step -> rank -> (weight, epoch of its latest commit); kept while a block still collects it
        self.commits: dict[int, dict[int, tuple[float, int]]] = {}
        self.step_lrs: dict[int, LRs] = {}   # lr override named by each step's commits
        self.push_weights: dict[int, dict[int, float]] = {}
        self.push_lrs: dict[int, dict[int, tuple]] = {}   # BSP: step -> rank -> the lrs its pushes named
        # Blocks with a contribution parked (a push that came before a lower rank's: Collection),
        # and the fp32 buffers parked contributions were freed from, by size (pushes.py).
        self.parking_blocks: set = set()
        self.grad_pool: dict[int, list] = {}
        self.grad_pool_bytes = 0
        # Global gradient clipping (max_grad_norm > 0): this node's share of a step's squared norm
        # once every block it applies can take the step, and the clip coefficient once every
        # primary's share is known (ps_server/grad_norm.py gathers them).
        self.max_grad_norm = float(spec.max_grad_norm)
        self.norm_shares: dict[int, float] = {}
        self.clip_coefs: dict[int, float] = {}
        self.applied_early = 0   # blocks whose step was computed before the commits (pipelined apply)
        self.early_seconds = 0.0  # time spent stepping them (off the commit's path)
        self.early_unused = 0     # blocks stepped early whose result was not used (applied, moved or dropped meanwhile)
        self.aggregated_ranks = 0   # ranks whose gradients came in a host's aggregated push (resends not counted)
        self.copies_ahead = 0     # copy holder: copies installed from frames sent before the commits
        self.steps_replayed = 0   # copy holder: blocks stepped here from their primary's gradient
        self.copy_reads = 0       # copy holder: blocks of BSP reads served from copies held here
        self.reads_before_acks_served = 0   # primary: blocks of BSP reads served before their holders acked the step
        self.replica_divergences = 0   # copy holder: replayed blocks whose checksum differed from the primary's

    def _init_hooks(self) -> None:
        """The hooks other parts of the node register; all run under the lock."""
        # hook(job, step, sum_squares): this node's share of a step's squared norm is known.
        self.norm_hooks: list[Callable[["JobStore", int, float], None]] = []
        # hook(job, step) after every applied step (checkpoint triggers).
        self.boundary_hooks: list[Callable[["JobStore", int], None]] = []
        # hook(job, step, items) with the primary blocks just carried through ``step``, as (key,
        # block) pairs; returns True if copy holders must ack first (then mark_visible makes them visible).
        self.apply_hooks: list[Callable[["JobStore", int, list], bool]] = []
        # hook(job, items) with blocks stepped ahead of their step's commits, as (key, Staged)
        # pairs (replication sends the copies ahead).
        self.stage_hooks: list[Callable[["JobStore", list], None]] = []
        # unacked_by(job, blocks) -> who the applied, not yet visible ``blocks`` wait for (the
        # replicator's answer), for the message of a read that timed out waiting for them.
        self.unacked_by: Callable[["JobStore", list], str] | None = None

    def _add_tensors(self, spec: common_pb2.JobSpec) -> None:
        """The tensors of ``spec``: new ones added, known ones trainable in their (new) group."""
        for t in spec.tensors:
            meta = self.tensors.get(t.name)
            dtype = STORAGE_DTYPES[t.dtype or "float32"]
            if meta is None:
                numel = math.prod(t.shape)
                self.tensors[t.name] = TensorMeta(t.name, tuple(t.shape), numel, t.trainable,
                                                  num_blocks(numel, self.block_elements), int(t.group), dtype)
            else:
                meta.trainable, meta.group, meta.dtype = t.trainable, int(t.group), dtype

    def extend(self, spec: common_pb2.JobSpec) -> bool:
        """Take the job's newer revision ``spec`` (the dispatcher's): its new tensors, its unfrozen
        tensors trainable in their new group, the new groups' optimizers. Blocks of new tensors
        arrive by OP_INIT or as copies; an unfrozen tensor's blocks keep their values and their
        optimizer state, untouched while frozen, so its group starts from a fresh state as a new
        torch.optim group does. Returns False if ``spec`` is not newer. Raises StoreError
        INVALID_ARGUMENT if ``spec`` is not this job's spec plus revisions (services/extension.py)."""
        with self.cond:
            if revision_of(spec) <= self.revision:
                return False
            try:
                replay(self.spec, spec)
            except ShardlineConfigError as exc:
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"cannot extend job {self.name!r}: {exc}") from None
            self._add_tensors(spec)
            self._reserve_frozen()
            for key, block in self.blocks.items():   # unfrozen: fp32 in the heap, a fresh state (a frozen block keeps none)
                meta = self.tensors[key[0]]
                if meta.trainable and (block.value.dtype != meta.dtype or self.in_frozen_file(block.value)):
                    before, block.value = block.value, block.value.to(meta.dtype, copy=True)
                    self.bytes += block.value.nbytes - before.nbytes
                if not block.state:
                    block.state = self.fresh_state(key[0], block.value.numel())
            for group in spec.param_groups[len(self.group_optimizers):]:
                self.group_optimizers.append(make_optimizer(OptimizerConfig.from_proto(group)))
            self.spec = common_pb2.JobSpec()
            self.spec.CopyFrom(spec)
            self.revision = revision_of(spec)
            self.cond.notify_all()
            return True

    def check_revision(self, rank: int, step: int, revision: int, what: str) -> None:
        """A rank's push or commit of ``step`` sent at job ``revision``: one behind a revision that
        trains from ``step`` or earlier did not add the parameter group the other ranks added
        (BSP would average its missing gradients as zeros): INVALID_ARGUMENT."""
        if revision >= self.revision:
            return
        missed = self.spec.extensions[revision]
        if step >= missed.step:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"rank {rank}'s {what} of step {step} is at revision {revision} of job {self.name!r}, "
                             f"which is at revision {self.revision} since step {missed.step}: every rank must add the "
                             f"same parameter group (add_param_group) before step {missed.step}")

    def _reserve_frozen(self) -> None:
        """Slots in the job's frozen file (frozen_file.py) for the blocks of frozen tensors that have
        none, where the node keeps frozen values in files (``spill_dir``)."""
        if self.spill_dir is None:
            return
        wanted = [((name, i), self.expected_numel(name, i), meta.dtype) for name, meta in self.tensors.items()
                  if not meta.trainable for i in range(meta.blocks)]
        if not wanted:
            return
        if self.frozen_file is None:
            try:
                self.frozen_file = FrozenFile(self.spill_dir, self.name)
            except OSError as exc:
                log.warning("job %s: cannot create a file for its frozen values in %s (%s): they stay in memory",
                            self.name, self.spill_dir, exc)
                self.spill_dir = None
                return
        self.frozen_file.reserve(wanted)

    def in_frozen_file(self, value: torch.Tensor) -> bool:
        """Whether ``value`` is a slot of the job's frozen file (it is never written in place)."""
        return self.frozen_file is not None and self.frozen_file.holds(value)

    def keep_value(self, key: tuple[str, int], value: torch.Tensor) -> torch.Tensor:
        """``value`` (private, in the tensor's dtype) as block ``key``'s: in its slot of the frozen
        file where a frozen block has one (copied there), else itself."""
        if self.frozen_file is not None and not self.tensors[key[0]].trainable:
            return self.frozen_file.store(key, value)
        return value

    def release_frozen_pages(self) -> None:
        """Drop the frozen file's pages from the process's resident set (the page cache keeps them)."""
        if self.frozen_file is not None:
            self.frozen_file.release_pages()

    def close_files(self) -> None:
        if self.frozen_file is not None:
            self.frozen_file.close()

    def fresh_state(self, tensor: str, numel: int) -> dict:
        """A new block's optimizer state: the optimizer's fresh one for a trainable tensor, none
        for a frozen one (never stepped, so it would stay the fresh state: 8 bytes per parameter
        for AdamW kept for nothing; unfreezing gives it the fresh one, ``extend``)."""
        return self.optimizer.init_state(numel) if self.tensors[tensor].trainable else {}

    # --- validation -------------------------------------------------------------------------
    def expected_numel(self, tensor: str, index: int) -> int:
        meta = self.tensors.get(tensor)
        if meta is None:
            raise StoreError(ErrorCode.UNKNOWN_TENSOR, f"job {self.name!r} has no tensor {tensor!r}")
        if not 0 <= index < meta.blocks:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"tensor {tensor!r} has {meta.blocks} blocks, block index {index} is out of range")
        return min(self.block_elements, meta.numel - index * self.block_elements)

    def _block(self, tensor: str, index: int) -> Block:
        block = self.blocks.get((tensor, index))
        if block is None:  # blocks exist only at valid keys: name what is wrong with this one
            self.expected_numel(tensor, index)
            raise StoreError(ErrorCode.UNKNOWN_TENSOR,
                             f"block {tensor}[{index}] of job {self.name!r} was never initialized on this node")
        return block

    def _check_open(self, what: str) -> None:
        if self.failed is not None:
            raise self.failed
        if self.frozen is not None:
            raise StoreError(ErrorCode.UNAVAILABLE,
                             f"job {self.name!r} on this node takes no more {what}es: {self.frozen}")

    def group_lrs(self, lr: "float | tuple | list | None") -> LRs:
        """A step's learning rates as one per parameter group: None (the groups' own), one number
        (every group; what a single-group client sends) or one per group. Raises INVALID_ARGUMENT."""
        if lr is None:
            return None
        groups = len(self.group_optimizers)
        lrs = (lr,) * groups if isinstance(lr, (int, float)) else tuple(lr)
        if len(lrs) != groups:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"job {self.name!r} has {groups} parameter groups, the "
                                                         f"request names {len(lrs)} learning rates")
        for value in lrs:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"lr must be a finite number >= 0, got {value!r}")
        return tuple(float(v) for v in lrs)

    def _push_lrs(self, lr) -> LRs:
        """A push's lrs (see group_lrs). A BSP push carries them only so that blocks may be stepped
        before the commits: one naming another number of groups (resent from before
        add_param_group added one) carries none."""
        if self.collects and isinstance(lr, (tuple, list)) and len(lr) != len(self.group_optimizers):
            return None
        return self.group_lrs(lr)

    def _check_rank_and_weight(self, rank: int, weight: float) -> None:
        if not (math.isfinite(weight) and weight > 0):
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"weight must be a finite number > 0, got {weight!r}")
        if not 0 <= rank < self.world_size:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"rank {rank} out of range for world_size {self.world_size}")

    # --- operations -------------------------------------------------------------------------
    def init_blocks(self, items: list[tuple[str, int, torch.Tensor]]) -> int:
        """Set values of blocks this node lacks (existing blocks keep theirs). Returns how many were set."""
        for tensor, index, value in items:
            numel = self.expected_numel(tensor, index)
            if value.numel() != numel:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"block {tensor}[{index}] must have {numel} elements, got {value.numel()}")
            if not all_finite(value):
                raise StoreError(ErrorCode.NONFINITE,
                                 f"initial value of tensor {tensor!r} block {index} contains NaN or Inf")
        created = 0
        with self.cond:
            for tensor, index, value in items:
                if (tensor, index) in self.blocks:
                    continue
                v = self.keep_value((tensor, index), value.detach().to(self.tensors[tensor].dtype, copy=True))
                self.blocks[(tensor, index)] = Block(v, self.fresh_state(tensor, v.numel()), step=self.step,
                                                     visible=self.step)
                self.bytes += v.nbytes
                created += 1
        return created


class NodeStore:
    """All jobs on a node."""

    def __init__(self, spill_dir: str | None = None):
        self._jobs: dict[str, JobStore] = {}
        self._lock = threading.Lock()
        self.spill_dir = spill_dir   # where jobs keep their frozen values in files (None: in memory)

    def get(self, name: str) -> JobStore | None:
        return self._jobs.get(name)

    def add(self, spec: common_pb2.JobSpec, uid: str = "",
            on_create: "Callable[[JobStore], None] | None" = None) -> JobStore:
        """The job named by ``spec``, created if missing (then ``on_create(job)`` runs first, so
        no other thread sees the job before it is set up)."""
        with self._lock:
            job = self._jobs.get(spec.name)
            if job is None:
                job = JobStore(spec, spill_dir=self.spill_dir)
                job.uid = uid
                if on_create is not None:
                    on_create(job)
                self._jobs[spec.name] = job
            return job

    def jobs(self) -> list[JobStore]:
        with self._lock:
            return list(self._jobs.values())

    def remove(self, name: str) -> JobStore | None:
        with self._lock:
            job = self._jobs.pop(name, None)
        if job is not None:
            job.close_files()
        return job

    def release_frozen_pages(self) -> None:
        """Every job's frozen values out of the resident set (the heartbeat loop, each beat)."""
        for job in self.jobs():
            job.release_frozen_pages()

    def totals(self) -> tuple[int, int]:
        jobs = self.jobs()
        return sum(len(j.blocks) for j in jobs), sum(j.bytes for j in jobs)
