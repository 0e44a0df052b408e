"""Block store and synchronization for one PS node: pure logic, no sockets.

A node holds, per job, the blocks the ring assigns it: fp32 master values, optimizer state and a
version (the job step that last changed the block; initial values are version 0).

Sync modes (SPEC "Training semantics"):

* **BSP** — workers push gradients for step ``v`` then commit ``v``. Once all ``world_size``
  workers committed ``v``, every block that received a push (a payload or a zero flag) from any
  worker is stepped with the weighted mean ``sum(w_i * g_i) / sum(w_i)`` over *all* committed
  workers (a worker that pushed nothing for a block contributes zero), and moves to version
  ``v + 1``; blocks nobody pushed are not stepped, as ``torch.optim`` skips ``grad is None``.
  The job step becomes ``v + 1`` and waiting pulls wake up.
* **SSP** (``staleness`` s >= 1) — BSP's aggregation, with up to s steps after the job step in
  flight: a block takes pushes (and the node commits) of steps up to ``job step + s``, each step
  ahead collected in its own accumulator (``Block.ahead``), and steps are applied in order, each
  once every rank committed it, with the weighted mean of that step's gradients. A push or commit
  beyond ``job step + s`` is refused (STALE_STEP): a worker following the pull rule (it computes
  step v on parameters of version >= v - s) never sends one. Pulls may be served while a step is
  applied, so they copy under the lock and see only blocks their replicas hold.
* **ASP** — each push frame is applied on arrival as one update (weights ignored); the job step
  counts applied frames and touched blocks take the new step as their version.

**Pipelined apply** (BSP without ``max_grad_norm``): a block whose gradient from every rank of the
step arrived here (a zero flag counts), with every rank's pushes naming the step's lrs, is stepped
at once by the push that completed it — outside the lock, on private copies of its value and state
(``Staged``) — so the optimizer work overlaps the other blocks' pushes and the slowest rank's
backward. Nothing else changes: the block keeps its step, its visible value, its gradient sum and
its pushers until the commits complete the step; then ``_apply_ready`` installs the staged copies
instead of stepping, provided the commits' total weight and lrs are the ones staged with (else it
steps the kept gradient sum as before). Pulls, copies to replicas, checkpoints and handovers thus
see exactly what they saw without it. A rank's commit must name the lrs its pushes named.

Every mutating call validates the whole request before changing anything, so a rejected frame
leaves no partial update behind.

Retries are idempotent within a step: a rank's push of a block it already pushed in the step is
received and ignored (a client resending after a lost reply or a node restart), and a rank's
repeated commit of a step it committed (or of a step already applied) is acknowledged again.

Checkpoints: ``boundary_hooks`` run under the job lock right after a step is applied (the only
moments when no gradient of the next step has arrived yet), ``snapshot`` copies blocks there, and
``restore`` loads a checkpoint into a fresh job. ``freeze`` makes a stopping node refuse further
pushes and commits (``UNAVAILABLE``) so that its last checkpoint holds its last step.
"""

from __future__ import annotations

import math
import time
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from shardline.ps_server.optimizer import OptimizerConfig, group_configs, make_optimizer
from shardline.services.blocks import num_blocks
from shardline.services.compression import compression_of, decode_signs, padding_problem, sign_nbytes
from shardline.services.errors import RequestError as StoreError, ShardlineConfigError
from shardline.services.extension import replay, revision_of
from shardline.services.tensor_checks import CONCAT_BELOW_BYTES, all_finite, first_nonfinite
from shardline.services.pb import common_pb2

# A step's learning rates, one per parameter group; None: each group's own lr.
LRs = tuple[float, ...] | None


# How long a push waits for another rank's in-flight push of the same block (only a stalled
# sender holds one that long; the data plane also times out stalled payloads).
RESERVATION_TIMEOUT_SECONDS = 60.0
# A push's blocks smaller than CHECK_ALONE_BYTES are checked for NaN/Inf together, up to
# CHECK_BATCH_BYTES at a time (still cache-hot), instead of one call each (~10 us apiece); larger
# ones are checked alone as they land.
CHECK_ALONE_BYTES = CONCAT_BELOW_BYTES
CHECK_BATCH_BYTES = 256 << 10
# SSP: how long a pull, once wait_for_step let it through, waits for a step applied just then to
# be held by the replicas (a TIMEOUT reply: the worker asks again).
VISIBILITY_TIMEOUT_SECONDS = 10.0


def _total_weight(weights) -> float:
    """The sum of a step's weights, exactly rounded (math.fsum): the same whatever order the
    pushes or commits that carry them arrived in."""
    return math.fsum(weights)


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    numel: int
    trainable: bool
    blocks: int
    group: int = 0       # the parameter group whose hyperparameters step it


@dataclass(eq=False)
class Block:
    value: torch.Tensor                      # 1-D fp32 master copy
    state: dict
    version: int = 0                         # the job step that last changed it
    step: int = 0                            # job steps this copy was carried through
    visible: int = 0                         # pulls may see it at steps up to this
    primary: bool = True                     # this node applies it (else its primary sends copies)
    since_epoch: int = 0                     # commits for its step count from this epoch (taken over)
    # Steps [lo, hi) this node did not apply but took from its previous primary's copy (_catch_up):
    # a push of one of them, still in flight then, is a resend (that primary applied it with it).
    adopted: tuple[int, int] = (0, 0)
    # Sum of weight * grad for the step being collected; the buffer lives as long as the block
    # (allocated once, not per step) and holds data only while has_grad is set.
    grad_buf: torch.Tensor | None = None
    has_grad: bool = False
    receiving: int | None = None   # rank whose push is being received straight into grad_buf
    pushed_by: set = field(default_factory=set)
    received: set = field(default_factory=set)   # ranks whose push of the step finished here
    # Taken over from a live primary mid-step: pushes wait (until ``awaiting`` on the monotonic
    # clock) for the gradients it collected (``accept_handover``); the ranks they came from
    # (``handed``) count with their commits of any epoch.
    awaiting: float = 0.0
    awaiting_from: str = ""
    handed: set = field(default_factory=set)
    ahead: dict = field(default_factory=dict)    # SSP: step -> AheadGrads of a step after ``step``
    staged: "Staged | None" = None   # the block stepped ahead of its step's commits (pipelined apply)
    # A copy holder: (version, step, value, state) its primary stepped ahead and sent before the
    # commits (OP_REPLICATE staged); installed when a later frame names it (carry_copies).
    pending: tuple | None = None
    # BSP primary: (version before, version after, value before) of its last applied step. A rank
    # that restarts to redo that step (it died after committing on another node, and a node that
    # lacked its commit died too) recomputes it on these values (value_at); the buffer is reused.
    previous: tuple | None = None
    # Primary of a job with replicate_gradients: (version before, mean gradient or None, lr) of its
    # last step applied at the commits, which the copy holders replay (ps_server/replication.py).
    # The gradient is then the spare buffer: the next step collects into the other one, so the
    # bytes stay as sent until every holder acknowledged them (long before the step after next).
    replay: tuple | None = None
    grad_spare: torch.Tensor | None = None


@dataclass(eq=False)
class AheadGrads:
    """SSP: a block's gradients of one step after the step it collects, until it reaches it."""

    grad_buf: torch.Tensor | None = None
    has_grad: bool = False
    pushed_by: set = field(default_factory=set)
    received: set = field(default_factory=set)


@dataclass(eq=False)
class Staged:
    """A block stepped before its step's commits, with the weight total and lrs of the pushes;
    ``value``/``state`` are private copies (None while still being computed)."""

    step: int
    total: float
    lrs: tuple
    value: torch.Tensor | None = None
    state: dict | None = None
    replay: tuple | None = None   # replicate_gradients: (version stepped from, mean gradient, lr)


class PushRef(NamedTuple):
    """One block of a push as its frame header describes it (a named tuple: a push makes one per
    block, at a third of a frozen dataclass's cost)."""

    tensor: str
    index: int
    zero: bool
    numel: int
    dtype: torch.dtype
    scale: float | None = None   # a compressed block (SIGN1): packed signs, each worth +-scale


def _fill(dest: torch.Tensor, ref: PushRef, payload: torch.Tensor) -> None:
    """``dest`` (fp32) = the pushed block's gradient, decoded straight into it if compressed."""
    if ref.scale is None:
        dest.copy_(payload)  # also converts fp16/bf16 pushes to fp32
    else:
        decode_signs(payload, ref.numel, ref.scale, out=dest)


def _as_fp32(ref: PushRef, payload: torch.Tensor) -> torch.Tensor:
    """The pushed block's gradient in fp32 (decoded if compressed): one block at most."""
    if ref.scale is None:
        return payload.to(torch.float32)
    return decode_signs(payload, ref.numel, ref.scale)


@dataclass(eq=False)
class PushTicket:
    """A push between begin_push and finish_push/abort_push."""

    rank: int
    step: int
    weight: float
    refs: list
    blocks: list = field(default_factory=list)
    dests: list = field(default_factory=list)    # tensor to receive each block into (None: zero flag)
    direct: list = field(default_factory=list)   # True: dest is the block's own gradient buffer
    resent: list = field(default_factory=list)   # True: the rank already pushed this block this step (ignored)
    error: "StoreError | None" = None
    done: bool = False
    lr: "LRs" = None          # ASP: lr override for this update, one per parameter group
    commit_follows: bool = False   # BSP: the rank commits next: its blocks are left for the commit
    early: list = field(default_factory=list)   # staged by finish_push(defer_early=True), for step_early
    unchecked: list = field(default_factory=list)   # received small blocks (indices) not yet checked
    unchecked_bytes: int = 0


@dataclass(frozen=True)
class Handover:
    """What a block's previous primary collected for the step in flight when it lost the block:
    ``grad`` is the sum of weight * gradient of ``ranks`` (None: no gradient, or only zeros).
    ``version`` is its copy's version; ``copy`` its (value, state) when its last step changed it:
    an apply of the old primary that crossed the switch (its copy reached the new primary after
    the new primary took the block over, and was refused) is taken from here. ``previous`` is
    its ``(version, value)`` from before its last applied step (``Block.previous``; BSP with
    exact restarts): a rank redoing that step (it died after committing on some nodes only)
    recomputes it on those values at the new primary too."""

    key: tuple
    step: int
    grad: torch.Tensor | None
    ranks: tuple
    version: int = 0
    copy: tuple | None = None
    previous: tuple | None = None


@dataclass
class PushItem:
    tensor: str
    index: int
    grad: torch.Tensor | None  # None: the block's gradient is exactly zero (sent as a flag)


def _lacking(keys: list, message: str) -> StoreError:
    """UNAVAILABLE for a copy holder that lacks the versions of ``keys`` a frame builds on; the
    keys travel along (``.keys``) so the holder can ask its primary for them (a sync)."""
    error = StoreError("UNAVAILABLE", message)
    error.keys = list(keys)
    return error


def _clone_state(state: dict) -> dict:
    """A private copy of a block's optimizer state (tensors cloned, counters as they are)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _add_weighted(holder, like: torch.Tensor, ref: "PushRef", payload: torch.Tensor, weight: float) -> None:
    """Add ``weight`` times the pushed block's gradient (``payload`` as ``ref`` describes it,
    decoded if compressed) to ``holder``'s gradient sum (a Block or AheadGrads: ``grad_buf``,
    ``has_grad``); its buffer, shaped like ``like``, is made on first use."""
    if holder.has_grad:
        holder.grad_buf.add_(_as_fp32(ref, payload), alpha=weight)
        return
    if holder.grad_buf is None:
        holder.grad_buf = torch.empty_like(like)
    _fill(holder.grad_buf, ref, payload)
    if weight != 1.0:
        holder.grad_buf.mul_(weight)
    holder.has_grad = True


class JobStore:
    """Blocks and sync state of one job on this node. Thread-safe; pulls wait on ``cond``.

    Per block, ``step`` counts the job steps the copy has been carried through (applied or, for a
    block nobody pushed, skipped), ``visible`` the step pulls may see (a primary's step becomes
    visible once its replicas hold it), ``primary`` whether this node applies it (a replica's or
    learner's copy is written by its primary through ``apply_copies``). ``self.step`` is the node's
    collecting step: the first step whose commit record is not complete. A block this node took
    over (failover, migration) may lag it by the step in flight: it collects pushes for its own
    ``step`` and applies once every rank committed that step again at an epoch >= the block's
    ``since_epoch`` (workers resend the step in flight when the routing epoch changes).
    """

    def __init__(self, spec: common_pb2.JobSpec, *, allow_nonfinite: bool | None = None):
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
        # BSP: primaries keep each block's value from before its last step (Block.previous).
        self.keeps_previous = spec.sync == "bsp" and not spec.inexact_restarts
        # BSP/SSP: replicas get each step's mean gradient and lr and step their copies themselves
        # (ASP steps at every push, and keeps sending copies).
        self.replays_gradients = spec.replicate_gradients and spec.sync in ("bsp", "ssp")
        self.steps_replayed = 0   # copy holder: blocks stepped here from their primary's gradient
        self.optimizer_config = OptimizerConfig.from_proto(spec.optimizer)
        # One optimizer per parameter group (torch.optim's param_groups); their state layouts agree
        # (checked when the job is created), so one block codec and checkpoint format serve all.
        self.group_optimizers = [make_optimizer(c) for c in group_configs(spec)]
        self.optimizer = self.group_optimizers[0]
        self.tensors: dict[str, TensorMeta] = {}
        for t in spec.tensors:
            numel = math.prod(t.shape)
            self.tensors[t.name] = TensorMeta(t.name, tuple(t.shape), numel, t.trainable,
                                              num_blocks(numel, self.block_elements), int(t.group))
        self.revision = revision_of(spec)   # the job revisions (extensions) this store holds
        self.blocks: dict[tuple[str, int], Block] = {}
        self.step = 0                 # BSP: the first step whose commits are not complete
        # step -> rank -> (weight, epoch of its latest commit); kept while a block still collects it
        self.commits: dict[int, dict[int, tuple[float, int]]] = {}
        self.step_lrs: dict[int, LRs] = {}   # lr override named by each step's commits
        # Global gradient clipping (max_grad_norm > 0): this node's share of a step's squared norm
        # once every block it applies can take the step, and the clip coefficient once every
        # primary's share is known (ps_server/grad_norm.py gathers them).
        self.max_grad_norm = float(spec.max_grad_norm)
        self.norm_shares: dict[int, float] = {}
        self.clip_coefs: dict[int, float] = {}
        # Called as hook(job, step, sum_squares) under the lock when this node's share of a step is known.
        self.norm_hooks: list[Callable[["JobStore", int, float], None]] = []
        self.push_weights: dict[int, dict[int, float]] = {}
        self.push_lrs: dict[int, dict[int, tuple]] = {}   # BSP: step -> rank -> the lrs its pushes named
        self.applied_early = 0   # blocks whose step was computed before the commits (pipelined apply)
        self.early_seconds = 0.0  # time spent stepping them (off the commit's path)
        self.early_unused = 0     # blocks stepped early whose result was not used (applied, moved or dropped meanwhile)
        self.copies_ahead = 0     # copy holder: copies installed from frames sent before the commits
        self.cond = threading.Condition()   # an RLock inside: hooks may call back into the store
        self.bytes = 0
        self.uid = ""                       # the job incarnation (dispatcher JobInfo.uid)
        self.frozen: str | None = None      # why pushes and commits are refused (node stopping)
        self.failed: StoreError | None = None   # set when a worker is lost and the job fails
        # Called as hook(job, step) under the lock after every applied step (checkpoint triggers).
        self.boundary_hooks: list[Callable[["JobStore", int], None]] = []
        # Called as hook(job, step, items) under the lock with the primary blocks just carried
        # through ``step``, as (key, block) pairs; returns True if copy holders must ack first
        # (then mark_visible makes them visible).
        self.apply_hooks: list[Callable[["JobStore", int, list], bool]] = []
        # Called as hook(job, items) under the lock with blocks stepped ahead of their step's
        # commits, as (key, Staged) pairs (replication sends the copies ahead).
        self.stage_hooks: list[Callable[["JobStore", list], None]] = []

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
                raise StoreError("INVALID_ARGUMENT", f"cannot extend job {self.name!r}: {exc}") from None
            for t in spec.tensors:
                meta = self.tensors.get(t.name)
                if meta is None:
                    numel = math.prod(t.shape)
                    self.tensors[t.name] = TensorMeta(t.name, tuple(t.shape), numel, t.trainable,
                                                      num_blocks(numel, self.block_elements), int(t.group))
                else:
                    meta.trainable, meta.group = t.trainable, int(t.group)
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
            raise StoreError("INVALID_ARGUMENT",
                             f"rank {rank}'s {what} of step {step} is at revision {revision} of job {self.name!r}, which "
                             f"is at revision {self.revision} since step {missed.step}: every rank must add the same "
                             f"parameter group (add_param_group) before step {missed.step}")

    @property
    def committed(self) -> dict[int, float]:
        """Ranks that committed the step being collected, and their weights."""
        return {rank: weight for rank, (weight, _epoch) in self.commits.get(self.step, {}).items()}

    # --- validation -------------------------------------------------------------------------
    def expected_numel(self, tensor: str, index: int) -> int:
        meta = self.tensors.get(tensor)
        if meta is None:
            raise StoreError("UNKNOWN_TENSOR", f"job {self.name!r} has no tensor {tensor!r}")
        if not 0 <= index < meta.blocks:
            raise StoreError("INVALID_ARGUMENT",
                             f"tensor {tensor!r} has {meta.blocks} blocks, block index {index} is out of range")
        return min(self.block_elements, meta.numel - index * self.block_elements)

    def _block(self, tensor: str, index: int) -> Block:
        block = self.blocks.get((tensor, index))
        if block is None:  # blocks exist only at valid keys: name what is wrong with this one
            self.expected_numel(tensor, index)
            raise StoreError("UNKNOWN_TENSOR", f"block {tensor}[{index}] of job {self.name!r} was never initialized on this node")
        return block

    def _check_open(self, what: str) -> None:
        if self.failed is not None:
            raise self.failed
        if self.frozen is not None:
            raise StoreError("UNAVAILABLE", f"job {self.name!r} on this node takes no more {what}es: {self.frozen}")

    # --- operations -------------------------------------------------------------------------
    def init_blocks(self, items: list[tuple[str, int, torch.Tensor]]) -> int:
        """Set values of blocks this node lacks (existing blocks keep theirs). Returns how many were set."""
        for tensor, index, value in items:
            numel = self.expected_numel(tensor, index)
            if value.numel() != numel:
                raise StoreError("INVALID_ARGUMENT",
                                 f"block {tensor}[{index}] must have {numel} elements, got {value.numel()}")
            if not all_finite(value):
                raise StoreError("NONFINITE", f"initial value of tensor {tensor!r} block {index} contains NaN or Inf")
        created = 0
        with self.cond:
            for tensor, index, value in items:
                if (tensor, index) in self.blocks:
                    continue
                v = value.detach().to(torch.float32).clone()
                self.blocks[(tensor, index)] = Block(v, self.optimizer.init_state(v.numel()), step=self.step,
                                                     visible=self.step)
                self.bytes += v.numel() * 4
                created += 1
        return created

    def group_lrs(self, lr: "float | tuple | list | None") -> "LRs":
        """A step's learning rates as one per parameter group: None (the groups' own), one number
        (every group; what a single-group client sends) or one per group. Raises INVALID_ARGUMENT."""
        if lr is None:
            return None
        groups = len(self.group_optimizers)
        lrs = (lr,) * groups if isinstance(lr, (int, float)) else tuple(lr)
        if len(lrs) != groups:
            raise StoreError("INVALID_ARGUMENT", f"job {self.name!r} has {groups} parameter groups, the request names "
                                                 f"{len(lrs)} learning rates")
        for value in lrs:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise StoreError("INVALID_ARGUMENT", f"lr must be a finite number >= 0, got {value!r}")
        return tuple(float(v) for v in lrs)

    def _check_rank_and_weight(self, rank: int, weight: float) -> None:
        if not (math.isfinite(weight) and weight > 0):
            raise StoreError("INVALID_ARGUMENT", f"weight must be a finite number > 0, got {weight!r}")
        if not 0 <= rank < self.world_size:
            raise StoreError("INVALID_ARGUMENT", f"rank {rank} out of range for world_size {self.world_size}")

    def _check_push_weight(self, what: str, rank: int, step: int, weight: float) -> None:
        """A rank's pushes and commit of a step carry one weight. Call with the lock held."""
        pushed = self.push_weights.get(step, {}).get(rank)
        if pushed is not None and pushed != weight:
            raise StoreError("INVALID_ARGUMENT",
                             f"rank {rank}'s {what} for step {step} has weight {weight!r}, its pushes had {pushed!r}")

    def _check_push_lr(self, what: str, rank: int, step: int, lrs: "LRs") -> None:
        """A rank's pushes and commit of a step name one lr (its pushes' lrs may step blocks before
        the commits: a commit naming others is refused, never applied). Call with the lock held."""
        pushed = self.push_lrs.get(step, {}).get(rank)
        if pushed is not None and pushed != lrs:
            raise StoreError("INVALID_ARGUMENT",
                             f"rank {rank}'s {what} for step {step} has lr {lrs!r}, its pushes had {pushed!r}")

    def _push_lrs(self, lr) -> "LRs":
        """A push's lrs (see group_lrs). A BSP push carries them only so that blocks may be stepped
        before the commits: one naming another number of groups (resent from before
        add_param_group added one) carries none."""
        if self.collects and isinstance(lr, (tuple, list)) and len(lr) != len(self.group_optimizers):
            return None
        return self.group_lrs(lr)

    # --- pushes ---------------------------------------------------------------------------
    # A push is begun (validated, destinations chosen), its blocks are received one by one and
    # checked as each arrives (so the check overlaps the rest of the transfer), then finished
    # (made visible) or aborted. A block's first BSP gradient of a step is received straight into
    # the block's gradient buffer; later ones (to be added) go to the connection's scratch buffer,
    # as do compressed (sign) blocks, decoded into the gradient buffer when the push finishes.

    def begin_push(self, rank: int, step: int, weight: float, refs: list[PushRef], scratch: bytearray | None,
                   lr: float | None = None, commit_follows: bool = False) -> "PushTicket":
        """Validate a push and reserve where each block's bytes go. Nothing is visible until finish_push.

        ``refs`` are in payload order; ``scratch`` must hold the whole payload (blocks received
        into it sit at their payload offsets). BSP: each block takes gradients for its own step;
        a block already past ``step`` (the step was applied: a resend) or pushed by this rank in
        an earlier frame receives the bytes and ignores them.
        """
        self._check_rank_and_weight(rank, weight)
        for ref in refs:
            numel = self.expected_numel(ref.tensor, ref.index)
            if not self.tensors[ref.tensor].trainable:
                raise StoreError("INVALID_ARGUMENT", f"tensor {ref.tensor!r} is frozen: it takes no gradients")
            if not ref.zero and ref.numel != numel:
                raise StoreError("INVALID_ARGUMENT",
                                 f"gradient for {ref.tensor}[{ref.index}] must have {numel} elements, got {ref.numel}")
            if ref.scale is not None and not ref.zero and self.compression != "sign":
                raise StoreError("INVALID_ARGUMENT", f"job {self.name!r} has compression {self.compression!r}: it takes "
                                                     f"no sign-compressed gradients ({ref.tensor}[{ref.index}])")
        ticket = PushTicket(rank, step, weight, refs, lr=self._push_lrs(lr), commit_follows=commit_follows)
        # BSP, a push its rank's commit follows (its blocks are not stepped early): the first push of
        # a block in the step keeps its value for a restarted rank (see Block.previous) now, while
        # the slowest rank is still on its way, rather than in the apply, which is on every rank's path.
        keep = commit_follows and self.keeps_previous
        keeping = []   # (block, version, value, buffer): copied once the lock is released
        with self.cond:
            self._check_open("push")
            blocks = [self._block(ref.tensor, ref.index) for ref in refs]
            now = time.monotonic()
            for ref, block in zip(refs, blocks):
                if not block.primary:
                    raise StoreError("NOT_OWNER", f"block {ref.tensor}[{ref.index}] is a replica here")
                if block.awaiting and now < block.awaiting:
                    raise StoreError("UNAVAILABLE", f"block {ref.tensor}[{ref.index}] waits for the gradients its previous "
                                                    f"primary {block.awaiting_from!r} collected for step {block.step}; "
                                                    f"retry shortly")
            if self.collects:
                self._check_push_weight("push", rank, step, weight)
                if ticket.lr is not None:
                    self._check_push_lr("push", rank, step, ticket.lr)
                seen = set()
                for ref, block in zip(refs, blocks):
                    if block in seen:
                        raise StoreError("INVALID_ARGUMENT", f"rank {rank} pushed block {ref.tensor}[{ref.index}] twice in one frame")
                    seen.add(block)
                    if block.step < step:
                        self._check_ahead(step, f"push for step {step} but block {ref.tensor}[{ref.index}] of job "
                                                f"{self.name!r} is collecting step {block.step} on this node")
                    # Applied already, or pushed in an earlier frame of this step: a resend, ignored.
                    ticket.resent.append(block.step > step or rank in self._collector(block, step).pushed_by)
                if not all(ticket.resent):
                    self.push_weights.setdefault(step, {})[rank] = weight
                    if ticket.lr is not None:
                        self.push_lrs.setdefault(step, {})[rank] = ticket.lr
                for block, resent in zip(blocks, ticket.resent):
                    if not resent:
                        if keep and block.step == step and not block.pushed_by:
                            keeping.append((block, block.version, block.value, self._previous_buffer(block)))
                        self._collector(block, step).pushed_by.add(rank)  # claimed now; released again by abort_push
            else:
                ticket.resent = [False] * len(refs)
            offset = 0
            for ref, block, resent in zip(refs, blocks, ticket.resent):
                dest = None
                if not ref.zero:
                    if (self.collects and ref.dtype == torch.float32 and not block.has_grad
                            and block.receiving is None and not resent and block.step == step):
                        if block.grad_buf is None:
                            block.grad_buf = torch.empty_like(block.value)
                        block.receiving = rank
                        dest = block.grad_buf
                        ticket.direct.append(True)
                    else:
                        count = ref.numel if ref.scale is None else sign_nbytes(ref.numel)
                        dest = torch.frombuffer(scratch, dtype=ref.dtype, count=count, offset=offset)
                        ticket.direct.append(False)
                    offset += dest.numel() * dest.element_size()
                else:
                    ticket.direct.append(False)
                ticket.dests.append(dest)
            ticket.blocks = blocks
        if keeping:  # no step changes these values before this rank commits (after this push)
            torch._foreach_copy_([buffer for *_, buffer in keeping], [value for _b, _v, value, _ in keeping])
            with self.cond:
                for block, version, _value, buffer in keeping:
                    if block.version == version and block.step == step:
                        block.previous = (version, step + 1, buffer)
        return ticket

    def check_received(self, ticket: "PushTicket", i: int, finite: bool | None = None) -> None:
        """Check block ``i`` of a push right after its bytes arrived (NaN/Inf, unless allowed);
        blocks under CHECK_ALONE_BYTES are checked in batches (the last by finish_push).
        ``finite``: the block was checked as it was copied in (the shm ring; only a plain float32
        block of a job that checks): it is not checked again."""
        dest, ref = ticket.dests[i], ticket.refs[i]
        if dest is None or ticket.error is not None:
            return
        if ref.scale is not None:  # packed signs: finite by construction (the scale was checked with the header)
            problem = padding_problem(dest, ref.numel)
            if problem:
                ticket.error = StoreError("INVALID_ARGUMENT", f"gradient for {ref.tensor}[{ref.index}]: {problem}")
            return
        if self.allow_nonfinite:
            return
        if finite is not None:
            self._check_unchecked(ticket)  # the blocks before it first: the first bad block is the one named
            if not finite:
                self.refuse_nonfinite(ticket, i)
            return
        nbytes = dest.numel() * dest.element_size()
        if nbytes >= CHECK_ALONE_BYTES:  # checked alone, after the smaller ones that came before it
            self._check_unchecked(ticket)
        ticket.unchecked.append(i)
        ticket.unchecked_bytes += nbytes
        if nbytes >= CHECK_ALONE_BYTES or ticket.unchecked_bytes >= CHECK_BATCH_BYTES:
            self._check_unchecked(ticket)

    def _check_unchecked(self, ticket: "PushTicket") -> None:
        """Check the received blocks check_received left for a batch; the first with NaN/Inf fails the push."""
        indices, ticket.unchecked, ticket.unchecked_bytes = ticket.unchecked, [], 0
        if not indices or ticket.error is not None:
            return
        bad = first_nonfinite([ticket.dests[i] for i in indices])
        if bad is not None:
            self.refuse_nonfinite(ticket, indices[bad])

    @staticmethod
    def refuse_nonfinite(ticket: "PushTicket", i: int) -> None:
        """Fail the push (unless it failed already) for the NaN/Inf in its block ``i``."""
        if ticket.error is None:
            ref = ticket.refs[i]
            ticket.error = StoreError("NONFINITE", f"gradient for tensor {ref.tensor!r} (block {ref.index}) contains NaN or Inf")

    def finish_push(self, ticket: "PushTicket", *, defer_early: bool = False) -> int:
        """Make a fully received push visible (BSP: accumulate; ASP: apply). Returns the job step.

        Blocks the push completed (every rank pushed them) are stepped early (pipelined apply)
        before this returns, or with ``defer_early`` left on the ticket for :meth:`step_early`:
        the data plane answers the push first, so the pusher's next frame is not held up by a
        step that is not part of taking the push (the commit finds it done, or steps the block
        itself if it is not)."""
        self._check_unchecked(ticket)
        if ticket.error is not None:
            self.abort_push(ticket)
            raise ticket.error
        with self.cond:
            if self.frozen is not None or self.failed is not None:
                self._release(ticket)
                self._check_open("push")
            if self.sync == "asp":
                self._apply_asp(ticket)
                return self.step
            self._check_still_collecting(ticket)
            w = ticket.weight
            for ref, block, dest, direct, resent in zip(ticket.refs, ticket.blocks, ticket.dests, ticket.direct,
                                                        ticket.resent):
                if block.step < ticket.step:  # SSP: a step after the one the block collects
                    self._collect_ahead(block, ticket, ref, dest, resent)
                    continue
                if dest is None or resent:
                    if not resent and block.step == ticket.step:
                        block.received.add(ticket.rank)
                    continue
                if direct:
                    block.receiving = None
                    if w != 1.0:
                        block.grad_buf.mul_(w)
                    block.has_grad = True
                    block.received.add(ticket.rank)
                    continue
                # Another rank may still be receiving this block's first gradient into grad_buf.
                if not self.cond.wait_for(lambda: block.receiving is None, timeout=RESERVATION_TIMEOUT_SECONDS):
                    self._release(ticket)
                    raise StoreError("TIMEOUT", f"rank {block.receiving} did not finish sending block gradients "
                                                f"within {RESERVATION_TIMEOUT_SECONDS:g} s")
                _add_weighted(block, block.value, ref, dest, w)
                # Received only once added: the wait above releases the lock, and a handover or an
                # early step taken meanwhile must not count a rank whose gradient is not in the sum.
                if block.step == ticket.step:
                    block.received.add(ticket.rank)
            ticket.done = True
            early = self._stage_early(ticket)
            job_step = self.step
            self.cond.notify_all()
        if defer_early:
            ticket.early = early
        elif early:
            self._step_early(early)
        return job_step

    def step_early(self, ticket: "PushTicket") -> None:
        """Step the blocks ``finish_push(ticket, defer_early=True)`` staged (once)."""
        items, ticket.early = ticket.early, []
        if items:
            self._step_early(items)

    def _check_still_collecting(self, ticket: "PushTicket") -> None:
        """Before a BSP/SSP push changes anything: every block it claimed is still this node's
        and still collects the push's step. Else nothing of it is kept: NOT_OWNER (the block
        changed owner meanwhile and was handed over without this push; the worker resends it to
        the new owner) or STALE_STEP (the step was applied here meanwhile: a commit of this rank
        counted without this push). A block that took the step from its previous primary's copy
        meanwhile (``_catch_up``: that primary applied it, with this rank's push to it) takes the
        push as the resend it is. Call with the lock held."""
        for i, (ref, block) in enumerate(zip(ticket.refs, ticket.blocks)):
            if ticket.resent[i]:
                continue
            if not block.primary:
                self._release(ticket)
                raise StoreError("NOT_OWNER", f"block {ref.tensor}[{ref.index}] changed owner while its push was "
                                              f"in flight")
            if block.step <= ticket.step:
                continue
            if block.adopted[0] <= ticket.step < block.adopted[1]:
                ticket.resent[i] = True   # ignored as a resend from here on (its claim went with the catch-up)
                if ticket.direct[i] and block.receiving == ticket.rank:
                    block.receiving = None
            elif ticket.dests[i] is not None:  # applied here while the push was in flight
                self._release(ticket)
                raise StoreError("STALE_STEP", f"step {ticket.step} was applied while its push was in flight "
                                               f"(block {ref.tensor}[{ref.index}] is at step {block.step}, taken over "
                                               f"at epoch {block.since_epoch}; job step {self.step})")

    def abort_push(self, ticket: "PushTicket") -> None:
        """Forget a push that failed or whose connection broke: nothing of it stays."""
        with self.cond:
            self._release(ticket)

    def _release(self, ticket: "PushTicket") -> None:
        if ticket.done:
            return
        ticket.done = True
        for block, direct, resent in zip(ticket.blocks, ticket.direct, ticket.resent or [False] * len(ticket.blocks)):
            if direct and block.receiving == ticket.rank:
                block.receiving = None
            if self.collects and not resent:
                self._collector(block, ticket.step).pushed_by.discard(ticket.rank)
        if self.collects and not any(ticket.rank in self._pushed_by(b, ticket.step) for b in self.blocks.values()):
            self.push_weights.get(ticket.step, {}).pop(ticket.rank, None)
            self.push_lrs.get(ticket.step, {}).pop(ticket.rank, None)
        self.cond.notify_all()

    # --- SSP: steps ahead of a block's ------------------------------------------------------
    def _check_ahead(self, step: int, refusal: str) -> None:
        """A push or commit of ``step``, after the step its block (or this node) collects: SSP takes
        steps up to ``job step + staleness``; anything else is refused with ``refusal``."""
        if self.staleness and step <= self.step + self.staleness:
            return
        bound = (f" (SSP: at most staleness {self.staleness} steps after it, up to step "
                 f"{self.step + self.staleness})") if self.staleness else ""
        raise StoreError("STALE_STEP", refusal + bound)

    @staticmethod
    def _collector(block: Block, step: int):
        """What collects ``block``'s pushes of ``step``: the block itself for its own step (or an
        applied one: a resend), else (SSP) the accumulator of that step ahead, made on first use."""
        return block if step <= block.step else block.ahead.setdefault(step, AheadGrads())

    @staticmethod
    def _pushed_by(block: Block, step: int) -> set:
        """Ranks whose push of ``step`` ``block`` holds (claimed or received)."""
        if step == block.step:
            return block.pushed_by
        ahead = block.ahead.get(step)
        return ahead.pushed_by if ahead is not None else set()

    def _collect_ahead(self, block: Block, ticket: "PushTicket", ref: "PushRef", grad: torch.Tensor | None,
                       resent: bool) -> None:
        """Finish a push of a step after ``block``'s own: into that step's accumulator. Call with the lock held."""
        ahead = self._collector(block, ticket.step)
        if resent:
            return
        ahead.received.add(ticket.rank)
        if grad is not None:
            _add_weighted(ahead, block.value, ref, grad, ticket.weight)

    @staticmethod
    def _take_ahead(block: Block) -> None:
        """``block`` just moved to its next step: what was collected for that step ahead becomes its
        own. (Its ``since_epoch`` stays: commits of a step ahead that came before the block was
        taken over went with pushes to the previous primary, which hands over only its own step;
        the workers push and commit those steps again at the new epoch.)"""
        ahead = block.ahead.pop(block.step, None)
        if ahead is None:
            return
        if ahead.has_grad:
            block.grad_buf, ahead.grad_buf = ahead.grad_buf, block.grad_buf  # no copy
        block.has_grad, block.pushed_by, block.received = ahead.has_grad, ahead.pushed_by, ahead.received

    def _wait_visible(self, blocks: list[Block]) -> None:
        """SSP: a step may be applied while a pull is served; wait until every primary of
        ``blocks`` is visible at its newest step (its replicas hold it). Call with the lock held."""
        if not self.cond.wait_for(lambda: all(b.visible >= b.step or not b.primary for b in blocks),
                                  timeout=VISIBILITY_TIMEOUT_SECONDS):
            raise StoreError("TIMEOUT", f"the replicas of job {self.name!r} did not acknowledge its newest step "
                                        f"within {VISIBILITY_TIMEOUT_SECONDS:g} s")

    def push(self, rank: int, step: int, weight: float, items: list[PushItem], lr: float | tuple | None = None,
             commit_follows: bool = False) -> int:
        """Push already-received gradients in one call (same path as the data plane; ``lr`` and
        ``commit_follows`` as a frame's). Returns the job step."""
        refs = [PushRef(i.tensor, i.index, i.grad is None, 0 if i.grad is None else i.grad.numel(),
                        torch.float32 if i.grad is None else i.grad.dtype) for i in items]
        scratch = bytearray(sum(0 if i.grad is None else i.grad.numel() * i.grad.element_size() for i in items))
        ticket = self.begin_push(rank, step, weight, refs, scratch, lr=lr, commit_follows=commit_follows)
        for n, item in enumerate(items):
            if item.grad is not None:
                ticket.dests[n].copy_(item.grad.reshape(-1))
                self.check_received(ticket, n)
        return self.finish_push(ticket)

    def commit(self, rank: int, step: int, weight: float, lr: float | tuple | None = None, epoch: int = 0) -> int:
        """BSP: rank finished step ``step`` on every node. Applies what the step completes. Returns the job step.

        ``lr`` overrides the job's learning rates for this step (schedules): one per parameter group,
        or one number for every group (see group_lrs); all ranks must agree.
        ``epoch`` is the routing epoch the rank committed at: a block this node took over at a
        later epoch waits for commits at that epoch (the rank resent the step's pushes first).
        A resent commit (its reply was lost, the rank resends after a routing change, or the step
        was applied meanwhile) is acknowledged again.
        """
        lr = self.group_lrs(lr)
        if not self.collects:
            raise StoreError("INVALID_ARGUMENT", f"commit is only used in BSP and SSP; job {self.name!r} is {self.sync!r}")
        self._check_rank_and_weight(rank, weight)
        with self.cond:
            self._check_open("commit")
            if step > self.step and not self.blocks and not self.commits:
                self.step = step  # a node that holds nothing of the job yet joins at the job's step
            if step > self.step:
                self._check_ahead(step, f"commit for step {step} but job {self.name!r} is collecting step "
                                        f"{self.step} on this node")
            record = self.commits.get(step)
            if record is None:
                if step < self.step and not any(b.primary and b.step == step for b in self.blocks.values()):
                    return self.step  # applied already, and no block here still collects it
                record = self.commits[step] = {}
            previous = record.get(rank)
            if previous is not None and previous[0] != weight:
                raise StoreError("STALE_STEP", f"rank {rank} already committed step {step} with weight {previous[0]!r}, "
                                               f"not {weight!r}")
            self._check_push_weight("commit", rank, step, weight)
            self._check_push_lr("commit", rank, step, lr)
            if record and step in self.step_lrs and lr != self.step_lrs[step] and previous is None:
                raise StoreError("INVALID_ARGUMENT",
                                 f"rank {rank} commits step {step} with lr {lr!r}, other ranks with {self.step_lrs[step]!r}")
            self.step_lrs.setdefault(step, lr)
            record[rank] = (weight, max(epoch, previous[1] if previous else 0))
            self._apply_ready(step)
            return self.step

    def adopt_commits(self, step: int, commits: dict[int, tuple[float, int]], lr: "LRs | float") -> int:
        """Commits of ``step`` learned from another node (a rank died between its commits to the
        nodes: every commit means the rank finished pushing everywhere). Returns the job step."""
        with self.cond:
            if step != self.step or not self.collects:
                return self.step
            record = self.commits.setdefault(step, {})
            for rank, (weight, epoch) in commits.items():
                if rank not in record and 0 <= rank < self.world_size:
                    record[rank] = (weight, epoch)
            if step not in self.step_lrs:
                self.step_lrs[step] = self.group_lrs(lr)
            self._apply_ready(step)
            return self.step

    def _apply_ready(self, step: int) -> None:
        """Apply ``step`` to every primary block that can take it now. Call with the lock held."""
        record = self.commits.get(step, {})
        if len(record) < self.world_size or step > self.step:  # SSP: a step ahead applies after those before it
            return
        now = time.monotonic()

        def counts(block) -> bool:  # every rank's commit is valid for this block (see the class doc)
            if block.awaiting and now < block.awaiting:
                return False
            return all(epoch >= block.since_epoch or rank in block.handed for rank, (_w, epoch) in record.items())

        ready = [(k, b) for k, b in self.blocks.items() if b.primary and b.step == step and counts(b)]
        total = _total_weight(weight for weight, _epoch in record.values())
        coef = 1.0
        if self.max_grad_norm and ready:
            coef = self.clip_coefs.get(step)
            if coef is None:
                self._share_norm(step, ready, total)
                return
        lrs = self.step_lrs.get(step)
        stepping = []   # (group, value, mean gradient, state): stepped together below
        keep = self.keeps_previous
        kept, keeping = [], []   # the values stepped in place below, and where their previous ones go
        for key, block in ready:
            block.replay = None
            if block.pushed_by:
                staged = block.staged
                if (staged is not None and staged.value is not None and coef == 1.0 and staged.step == step
                        and staged.total == total and staged.lrs == lrs):
                    if keep and not self._kept_for(block, step):  # the value just replaced: no copy
                        block.previous = (block.version, step + 1, block.value)
                    block.value, block.state = staged.value, staged.state   # stepped when its pushes completed
                    self.applied_early += 1
                else:
                    if keep and not self._kept_for(block, step):
                        buffer = self._previous_buffer(block)
                        block.previous = (block.version, step + 1, buffer)
                        kept.append(block.value)
                        keeping.append(buffer)
                    grad = None
                    if block.has_grad:
                        grad = block.grad_buf.div_(total) if total != 1.0 else block.grad_buf
                        if coef < 1.0:
                            grad.mul_(coef)
                    group = self.tensors[key[0]].group
                    stepping.append((group, block.value, grad, block.state))
                    if self.replays_gradients:
                        block.replay = (block.version, grad, self._lr_of(group, lrs))
                block.version = step + 1
        if kept:
            torch._foreach_copy_(keeping, kept)
        self._step_blocks(stepping, lrs)
        for key, block in ready:
            if block.replay is not None and block.replay[1] is not None:  # keep it as sent (Block.replay)
                block.grad_buf, block.grad_spare = block.grad_spare, block.grad_buf
            block.step = step + 1
            block.since_epoch = block.since_epoch if self.staleness else 0  # SSP: see _take_ahead
            block.has_grad = False
            block.pushed_by, block.received, block.handed, block.awaiting = set(), set(), set(), 0.0
            block.staged = None
            self._take_ahead(block)
        self._publish(step, ready)
        if step == self.step:
            self.step = step + 1
            self._run_boundary_hooks()
        self._forget_old_steps()
        self.cond.notify_all()
        if self.staleness:
            self._apply_ready(step + 1)  # SSP: the next step may have been complete already

    def _lr_of(self, group: int, lrs: "LRs") -> float:
        """The lr ``_step_blocks`` steps ``group`` with under ``lrs`` (None: the group's own)."""
        lr = lrs[group] if lrs is not None else None
        return float(self.group_optimizers[group].lr if lr is None else lr)

    @staticmethod
    def _previous_buffer(block: Block) -> torch.Tensor:
        """Where ``block``'s value from before its next step goes (Block.previous): the buffer of
        its last one (nobody reads that once a rank pushes or commits the next step). Lock held."""
        return block.previous[2] if block.previous is not None else torch.empty_like(block.value)

    @staticmethod
    def _kept_for(block: Block, step: int) -> bool:
        """Whether a push of ``step`` already kept ``block``'s value from before it. Lock held."""
        return block.previous is not None and block.previous[:2] == (block.version, step + 1)

    def _step_blocks(self, items: list, lrs: "LRs") -> None:
        """Step ``(group, value, grad, state)`` items, each group's blocks in one multi-tensor call
        (BlockOptimizer.step_many) at the group's lr of ``lrs`` (None: its own)."""
        by_group: dict[int, list] = {}
        for group, value, grad, state in items:
            by_group.setdefault(group, []).append((value, grad, state))
        for group, blocks in sorted(by_group.items()):
            values, grads, states = (list(column) for column in zip(*blocks))
            self.group_optimizers[group].step_many(values, grads, states, lr=None if lrs is None else lrs[group])

    def all_pushed(self, block: Block, step: int) -> bool:
        """Whether every rank's gradient (or zero flag) of ``step`` for ``block`` arrived here: none
        is still being received, none came by a handover (its weight is another node's). Call with
        the lock held."""
        return (block.primary and block.step == step and len(block.received) == self.world_size
                and block.receiving is None and not block.handed and not block.awaiting)

    def _stage_early(self, ticket: "PushTicket") -> list:
        """Pipelined apply, first half (the lock held): the blocks of a finished BSP push that every
        rank has now pushed, marked as being stepped early, when that is safe: no clipping (it
        needs every block's norm first) and every rank's pushes named the same lrs (an older
        client's carry none) and weight; and useful: not when the pusher commits next (the commit
        steps them one round trip later without the copies). Returns ``(group, block, Staged)`` items for _step_early."""
        step = ticket.step
        if self.sync != "bsp" or self.max_grad_norm or ticket.commit_follows:
            return []
        weights, lrs = self.push_weights.get(step, {}), self.push_lrs.get(step, {})
        if len(weights) < self.world_size or len(lrs) < self.world_size:
            return []
        step_lrs = next(iter(lrs.values()))
        if any(v != step_lrs for v in lrs.values()):
            return []  # the commits will refuse the ranks that differ
        total = _total_weight(weights.values())
        items = []
        for ref, block in zip(ticket.refs, ticket.blocks):
            if block.staged is None and block.pushed_by and self.all_pushed(block, step):
                block.staged = Staged(step, total, step_lrs)
                items.append((self.tensors[ref.tensor].group, (ref.tensor, ref.index), block, block.staged))
        return items

    def _step_early(self, items: list) -> None:
        """Pipelined apply, second half (the lock not held): step private copies of the staged
        blocks; a block that was applied, handed over or dropped meanwhile (its ``staged`` is no
        longer this one) discards its copies. Only this call writes the copies; the block's own
        value, state and gradient sum are only read (they change only after ``staged`` did)."""
        started = time.perf_counter()
        stepping, done = [], []
        lrs = items[0][3].lrs
        for group, key, block, staged in items:
            value = block.value.clone()
            state = _clone_state(block.state)
            grad = None
            if block.has_grad:
                grad = block.grad_buf if staged.total == 1.0 else torch.div(block.grad_buf, staged.total)
            stepping.append((group, value, grad, state))
            replay = (block.version, grad, self._lr_of(group, lrs)) if self.replays_gradients else None
            done.append((key, block, staged, value, state, replay))
        self._step_blocks(stepping, lrs)
        with self.cond:
            installed = []
            for key, block, staged, value, state, replay in done:
                if block.staged is staged:
                    staged.value, staged.state, staged.replay = value, state, replay
                    installed.append((key, staged))
                else:
                    self.early_unused += 1
            for hook in self.stage_hooks:
                hook(self, installed)
            self.early_seconds += time.perf_counter() - started

    def _share_norm(self, step: int, ready: list, total: float) -> None:
        """With clipping, a step waits for the global norm: once every block this node applies can
        take it, compute this node's share (sum of squares of the mean gradient, in float64) and
        hand it to the norm hooks. Call with the lock held."""
        pending = sum(1 for b in self.blocks.values() if b.primary and b.step == step)
        if len(ready) < pending or step in self.norm_shares:
            return  # the norm spans every block: wait for the rest (handovers) / already shared
        share = 0.0
        for _key, block in ready:
            if block.pushed_by and block.has_grad:
                share += float(block.grad_buf.double().square().sum()) / (total * total)
        self.norm_shares[step] = share
        for hook in self.norm_hooks:
            hook(self, step, share)

    def reshare_norms(self) -> None:
        """The blocks this node applies changed (a routing change): shares of steps not applied yet
        are computed again over the new blocks (and sent again, at the new epoch)."""
        with self.cond:
            for step in [s for s in self.norm_shares if s not in self.clip_coefs]:
                del self.norm_shares[step]
                self._apply_ready(step)

    def decided_coef(self, step: int) -> float | None:
        """The clip coefficient this node stepped ``step`` with (None: not stepped with one, or forgotten)."""
        with self.cond:
            return self.clip_coefs.get(step)

    def apply_clipped(self, step: int, coef: float) -> int:
        """Every primary's share of ``step`` is known: step it with the mean gradient times ``coef``
        (min(1, max_grad_norm / (norm + 1e-6)), as clip_grad_norm_). Returns the job step."""
        with self.cond:
            if step in self.clip_coefs or step not in self.norm_shares:
                return self.step
            self.clip_coefs[step] = coef
            self._apply_ready(step)
            return self.step

    def mark_visible(self, blocks: list, step: int) -> None:
        """The replicas acknowledged ``blocks`` at ``step``: pulls may see them."""
        with self.cond:
            for block in blocks:
                block.visible = max(block.visible, min(step, block.step))
            self.cond.notify_all()

    def _forget_old_steps(self) -> None:
        oldest = min((b.step for b in self.blocks.values() if b.primary), default=self.step)
        oldest = min(oldest, self.step)
        for table in (self.commits, self.step_lrs, self.push_weights, self.push_lrs, self.norm_shares, self.clip_coefs):
            for s in [s for s in table if s < oldest - 1]:  # keep the last applied step's record for adoption
                del table[s]

    def commits_of(self, step: int) -> tuple[dict[int, tuple[float, int]], "LRs"]:
        """The commit record of ``step`` (for a node that missed a rank's commit), and its lr."""
        with self.cond:
            return dict(self.commits.get(step, {})), self.step_lrs.get(step)

    def missing_ranks(self, step: int | None = None) -> list[int]:
        """Ranks that did not commit ``step`` (default: the step being collected) on this node."""
        step = self.step if step is None else step
        with self.cond:
            return sorted(set(range(self.world_size)) - set(self.commits.get(step, {})))

    def _apply_asp(self, ticket: "PushTicket") -> None:
        new_version = self.step + 1
        for ref, block, dest in zip(ticket.refs, ticket.blocks, ticket.dests):
            group = self.tensors[ref.tensor].group
            self.group_optimizers[group].step(block.value, None if dest is None else _as_fp32(ref, dest), block.state,
                                              lr=None if ticket.lr is None else ticket.lr[group])
            block.version = new_version
        self.step = new_version
        for block in self.blocks.values():
            if block.primary:
                block.step = block.visible = new_version
        items = [((ref.tensor, ref.index), block) for ref, block in zip(ticket.refs, ticket.blocks)]
        for hook in self.apply_hooks:
            hook(self, new_version - 1, items)
        ticket.done = True
        self._run_boundary_hooks()
        self.cond.notify_all()

    def _run_boundary_hooks(self) -> None:
        for hook in self.boundary_hooks:
            hook(self, self.step)

    # --- replicas and ownership -------------------------------------------------------------
    def apply_copies(self, copies: list) -> None:
        """Install blocks sent by their primary (replication, a sync or a migration): each item is
        ``(tensor, index, version, step, value, state)``; a copy older than the one held is ignored.
        ``value`` and the state's tensors become the block's own (private copies the caller hands
        over, as BlockCodec.unpack makes them): no second copy before the primary's ack."""
        for tensor, index, version, step, value, state in copies:
            numel = self.expected_numel(tensor, index)
            if value.numel() != numel:
                raise StoreError("INVALID_ARGUMENT", f"copy of block {tensor}[{index}] must have {numel} elements")
        with self.cond:
            self._follow_copies(step for _t, _i, _v, step, _value, _s in copies)
            for tensor, index, version, step, value, state in copies:
                block = self.blocks.get((tensor, index))
                if block is None:
                    block = self.blocks[(tensor, index)] = Block(value, dict(state), version=version,
                                                                 step=step, visible=step, primary=False)
                    self.bytes += value.numel() * 4
                    continue
                if block.primary or step < block.step:
                    continue  # this node applies it now, or holds a newer copy
                block.value, block.state = value, dict(state)   # readers of the old copy keep it
                block.version, block.step, block.visible = version, step, step
                block.pending = None
            self.cond.notify_all()

    def hold_copies(self, copies: list) -> None:
        """Copies their primary stepped ahead of the step's commits (``(tensor, index, version,
        step, value, state)``, private): held apart until ``carry_copies`` names them."""
        for tensor, index, _version, _step, value, _state in copies:
            if value.numel() != self.expected_numel(tensor, index):
                raise StoreError("INVALID_ARGUMENT", f"copy of block {tensor}[{index}] has {value.numel()} elements")
        with self.cond:
            for tensor, index, version, step, value, state in copies:
                block = self.blocks.get((tensor, index))
                if block is not None and not block.primary and step > block.step:
                    block.pending = (version, step, value, dict(state))

    def replay_steps(self, items: list, *, ahead: bool = False) -> None:
        """Step copies the way their primary stepped its blocks (replicate_gradients): each item is
        ``(tensor, index, version, step, base_version, lr, grad)`` (grad None: a zero gradient).
        A copy held at ``base_version`` is stepped out of place (private copies of value and state:
        readers of the old copy keep it) with its group's optimizer, as the primary steps, and
        becomes ``version`` at ``step``; with ``ahead`` (the primary stepped it before the step's
        commits) the result is held apart as a copy sent ahead is (``hold_copies``), until a later
        frame names it. A copy already at ``step`` or past it is left alone (a repeat). Raises
        StoreError UNAVAILABLE, after the rest, if a copy is missing or at another version (its
        primary drops this node from the in-sync holders and it syncs a full copy); ahead, such a
        copy is only not held (the frame that names it finds it lacking)."""
        for tensor, index, _version, _step, _base, lr, grad in items:
            numel = self.expected_numel(tensor, index)
            if grad is not None and grad.numel() != numel:
                raise StoreError("INVALID_ARGUMENT", f"gradient of block {tensor}[{index}] must have {numel} elements")
            self.group_lrs(lr)   # a finite number >= 0, as a push's or commit's lr
        missing, taken = [], []
        with self.cond:
            if not ahead:
                self._follow_copies(step for _t, _i, _v, step, _b, _lr, _g in items)
            for tensor, index, version, step, base, lr, grad in items:
                key = (tensor, index)
                block = self.blocks.get(key)
                if block is not None and (block.primary or step <= block.step):
                    continue  # this node applies it now, or holds this step already
                if block is None or block.version != base:
                    missing.append(key)
                    continue
                taken.append((key, block, base, version, step, self.tensors[tensor].group, lr, grad,
                              block.value.clone(), _clone_state(block.state)))
        # Stepped outside the lock (the clones are private) as the primary steps: one multi-tensor
        # call per group and lr (BlockOptimizer.step_many).
        batches: dict[tuple, list] = {}
        for *_head, group, lr, grad, value, state in taken:
            batches.setdefault((group, lr), []).append((value, grad, state))
        for (group, lr), batch in batches.items():
            values, grads, states = (list(column) for column in zip(*batch))
            self.group_optimizers[group].step_many(values, grads, states, lr=lr)
        with self.cond:
            for key, block, base, version, step, _group, _lr, _grad, value, state in taken:
                if self.blocks.get(key) is not block or block.primary or block.version != base or step <= block.step:
                    continue  # taken over, re-synced or dropped meanwhile: what it holds now stands
                self.steps_replayed += 1
                if ahead:
                    block.pending = (version, step, value, state)
                    continue
                block.value, block.state = value, state
                block.version, block.step, block.visible = version, step, step
                block.pending = None
            self.cond.notify_all()
        if missing and not ahead:
            raise _lacking(missing, f"blocks {missing[:4]} of job {self.name!r} are not at the version their "
                                    f"primary stepped them from (a step this node did not get)")

    def carry_copies(self, items: list) -> None:
        """Their primary carried copies through a step: ``(key, version, step)``. A copy at that
        version moves to the step; one the primary stepped ahead (``hold_copies``) is installed.
        Raises StoreError UNAVAILABLE, after the rest, if a held copy lacks that version (this
        node did not get a step it must hold: its primary drops it from the in-sync holders and it
        syncs again) instead of acknowledging a step it does not hold."""
        missing = []
        with self.cond:
            self._follow_copies(step for _k, _v, step in items)
            for key, version, step in items:
                block = self.blocks.get(key)
                if block is None or block.primary or step <= block.step:
                    continue
                if block.pending is not None and block.pending[:2] == (version, step):
                    _v, _s, value, state = block.pending
                    block.value, block.state = value, state
                    block.version = version
                    self.copies_ahead += 1
                if block.version == version:
                    block.step = block.visible = step
                else:
                    missing.append(key)
                block.pending = None
            self.cond.notify_all()
        if missing:
            raise _lacking(missing, f"blocks {missing[:4]} of job {self.name!r} lack the version their primary "
                                            f"carried them through (a copy of a step this node did not get)")

    def _follow_copies(self, steps) -> None:
        """A node that applies none of the job's blocks (it only keeps copies, or is about to take
        some over) collects the step its primaries are at, so that it is current when it starts
        applying. Call with the lock held."""
        if not any(b.primary for b in self.blocks.values()):
            self.step = max(self.step, max(steps, default=self.step))

    def _follow_primaries(self) -> None:
        """The job step never lags every block this node applies (blocks it took over, synced
        from their previous owner, collect later steps than a node that joined empty). Call with
        the lock held."""
        steps = [b.step for b in self.blocks.values() if b.primary]
        if steps and self.collects:
            self.step = max(self.step, min(steps))

    def applied_here(self, keys) -> list:
        """The blocks of ``keys`` this node is the primary of (one look under the lock)."""
        with self.cond:
            return [key for key in keys if (block := self.blocks.get(key)) is not None and block.primary]

    def oldest_step(self) -> int:
        """BSP: the oldest step a block this node applies still collects (at most the job step):
        lower than the job step when a block changed owner while its step was in flight."""
        with self.cond:
            return min([self.step] + [b.step for b in self.blocks.values() if b.primary])

    def set_primary(self, keys: set, epoch: int, awaiting: dict | None = None) -> tuple[list, list[Handover]]:
        """This node applies exactly the blocks in ``keys`` from ``epoch`` on. Returns (gained
        keys, handovers of the lost blocks).

        A gained block collects the step it holds and waits for commits at ``epoch``; ``awaiting``
        maps gained keys to ``(previous primary, deadline)``: their pushes wait for its handover.
        A lost block hands over what it collected (the caller sends it to the new primary: the
        pushes of a rank that died meanwhile are not lost) and forgets it."""
        gained, lost = [], []
        awaiting = awaiting or {}
        with self.cond:
            for key, block in self.blocks.items():
                primary = key in keys
                if primary and not block.primary:
                    block.primary, block.since_epoch = True, epoch
                    block.visible = block.step
                    block.pending = None   # its old primary's step in flight: collected again here
                    if key in awaiting:
                        block.awaiting_from, block.awaiting = awaiting[key]
                    gained.append(key)
                elif block.primary and not primary:
                    grad = block.grad_buf.clone() if block.has_grad and block.received else None
                    copy = None
                    if block.version == block.step > 0:  # changed by its last step: maybe not at the new primary yet
                        copy = (block.value.clone(), _clone_state(block.state))
                    previous = None
                    if block.previous is not None and block.previous[1] == block.version:  # its buffer is let go below
                        previous = (block.previous[0], block.previous[2])
                    lost.append(Handover(key, block.step, grad, tuple(sorted(block.received)), block.version, copy,
                                         previous))
                    block.primary = False
                    block.has_grad, block.pushed_by, block.receiving = False, set(), None
                    block.received, block.handed, block.awaiting = set(), set(), 0.0
                    block.staged, block.previous = None, None
                    block.ahead = {}  # SSP: its workers push the steps ahead again at the new epoch
            if gained:
                self._follow_primaries()
                for step in {self.blocks[k].step for k in gained}:
                    self._apply_ready(step)
            self.cond.notify_all()
        return gained, lost

    def release_expired_waits(self) -> int:
        """Stop waiting for handovers that did not come in time (the previous primary died at the
        switch); apply what can be applied now. Returns how many blocks stopped waiting."""
        now = time.monotonic()
        with self.cond:
            expired = [b for b in self.blocks.values() if b.primary and b.awaiting and now >= b.awaiting]
            for block in expired:
                block.awaiting = 0.0
            for step in {b.step for b in expired}:
                self._apply_ready(step)
            return len(expired)

    def accept_handover(self, sender: str, items: list[Handover]) -> None:
        """Take what ``sender``, a block's previous primary, collected for the step in flight. A
        block that already moved past that step, or that took pushes meanwhile (the wait timed
        out), keeps its own.

        A block behind the sender's copy first catches up with it (``_catch_up``): the sender
        applied a step after this node took the block over (it learnt the new routing later), and
        workers may have seen that step already, so they will not push it again."""
        with self.cond:
            caught: dict[int, list] = {}
            for item in items:
                block = self.blocks.get(item.key)
                if block is None or not block.primary or block.awaiting_from != sender:
                    continue
                if item.step > block.step and self._catch_up(block, item):
                    caught.setdefault(item.step - 1, []).append((item.key, block))
                if self.keeps_previous:
                    self._take_previous(block, item)
                if not block.awaiting:
                    continue
                block.awaiting = 0.0
                if block.step != item.step or block.pushed_by or not item.ranks:
                    continue
                if item.grad is not None:
                    if block.grad_buf is None:
                        block.grad_buf = torch.empty_like(block.value)
                    block.grad_buf.copy_(item.grad)
                    block.has_grad = True
                block.pushed_by, block.received, block.handed = set(item.ranks), set(item.ranks), set(item.ranks)
            for step, ready in sorted(caught.items()):
                self._publish(step, ready)
            self._follow_primaries()
            for step in {b.step for b in self.blocks.values() if b.primary}:
                self._apply_ready(step)  # blocks that waited (handed over or not) may apply now
            self.cond.notify_all()

    @staticmethod
    def _take_previous(block: Block, item: Handover) -> None:
        """Keep the previous primary's value of ``block`` from before its last applied step
        (``Handover.previous``) where this node holds the version it led to and kept none of its
        own: a planned ring change (or an apply that crossed it) then loses nothing a restarted
        rank redoing that step needs (value_at). Call with the lock held."""
        if item.previous is None or item.version != block.version or (
                block.previous is not None and block.previous[1] == block.version):
            return
        before, value = item.previous   # older than item.version, the block's size (_handle_handover)
        block.previous = (before, block.version, value.view_as(block.value))

    @staticmethod
    def _catch_up(block: Block, item: Handover) -> bool:
        """Move ``block`` (this node applies it, one step or more behind) to the previous primary's
        copy in ``item``; what it collected of its own step is dropped (that step is applied).
        False if the copy cannot be taken (no payload and another version: the block keeps its
        step). Call with the lock held."""
        if item.copy is not None:
            value, state = item.copy
            block.value, block.state, block.version = value, dict(state), item.version
        elif item.version != block.version:
            return False
        block.adopted = (block.step, item.step)
        block.step = item.step
        block.has_grad, block.pushed_by, block.received, block.handed = False, set(), set(), set()
        block.staged, block.pending = None, None
        block.ahead = {s: a for s, a in block.ahead.items() if s >= block.step}
        JobStore._take_ahead(block)  # SSP: pushes of the step it reaches, collected ahead
        return True

    def _publish(self, step: int, ready: list) -> None:
        """``ready`` (key, block) pairs were just carried through ``step``: the apply hooks send
        them to their copy holders; visible once those acknowledge (at once without any). Call
        with the lock held."""
        wait_for_replicas = False
        for hook in self.apply_hooks:
            wait_for_replicas = hook(self, step, ready) or wait_for_replicas
        if not wait_for_replicas:
            for _key, block in ready:
                block.visible = block.step

    def drop_blocks(self, keys) -> int:
        """Forget blocks this node no longer holds a copy of. Returns how many went."""
        with self.cond:
            gone = 0
            for key in keys:
                block = self.blocks.pop(key, None)
                if block is not None:
                    self.bytes -= block.value.numel() * 4
                    gone += 1
            self.cond.notify_all()
            return gone

    # --- checkpoints ------------------------------------------------------------------------
    def snapshot(self, since: dict[tuple[str, int], int] | None = None):
        """Copy, under the lock, the blocks whose version differs from ``since`` (all with None).

        Returns ``(step, held, copies)``: ``held`` maps every block to its version, ``copies`` is a
        list of ``(tensor, index, version, value, state)`` private copies. Call at a step boundary
        (a boundary hook, or a node that is stopping) so no gradient of the next step is included.
        """
        with self.cond:
            # A checkpoint of step s holds only what is exactly the state of s: a copy is that only
            # if its primary carried it through s (a lagging one, its copies still on the way, may
            # have changed since: restored at s it would pass for current and could overwrite the
            # primary's own copy in a sync) and not past a change after s (that belongs to a later
            # checkpoint); a frozen tensor's copy never changes (kept: no rewrite when it is back).
            # A copy left out is synced from its primary after a restore.
            blocks = {key: b for key, b in self.blocks.items()
                      if b.primary or b.version <= self.step <= b.step
                      or (not self.tensors[key[0]].trainable and b.version <= self.step)}
            held = {key: block.version for key, block in blocks.items()}
            copies = []
            for (tensor, index), block in blocks.items():
                if since is not None and since.get((tensor, index)) == block.version:
                    continue
                state = _clone_state(block.state)
                copies.append((tensor, index, block.version, block.value.clone(), state))
            return self.step, held, copies

    def restore(self, step: int, blocks: dict) -> None:
        """Load a checkpoint into this (fresh) job: ``blocks`` maps (tensor, index) to (version,
        value, state). Validated like initial values; the job then continues from ``step``."""
        items = [(tensor, index, value) for (tensor, index), (_v, value, _s) in blocks.items()]
        with self.cond:
            if self.blocks:
                raise StoreError("INVALID_ARGUMENT", f"job {self.name!r} already holds blocks; restore needs a fresh job")
            self.step = int(step)
            self.init_blocks(items)
            for key, (version, _value, state) in blocks.items():
                block = self.blocks[key]
                template = block.state
                if set(state) != set(template):
                    raise StoreError("INVALID_ARGUMENT", f"checkpointed optimizer state of {key[0]}[{key[1]}] has "
                                                         f"{sorted(state)}, the job's optimizer keeps {sorted(template)}")
                block.state = {k: (v.clone() if isinstance(v, torch.Tensor) else int(v)) for k, v in state.items()}
                block.version = int(version)
            self.cond.notify_all()

    def freeze(self, reason: str) -> None:
        """Refuse further pushes and commits (the node is stopping); pulls are still served."""
        with self.cond:
            self.frozen = reason
            self.cond.notify_all()

    def fail(self, code: str, message: str) -> None:
        """The job failed (a worker was lost and the job says fail): every request, waiting pulls
        included, gets ``code`` with ``message``."""
        with self.cond:
            if self.failed is None:
                self.failed = StoreError(code, message)
            self.cond.notify_all()

    # --- pulls ------------------------------------------------------------------------------
    def wait_for_step(self, min_step: int, timeout: float, keys=None,
                      interrupted: Callable[[], bool] | None = None) -> int:
        """Block until the job step is >= ``min_step`` and every block of ``keys`` is visible at it
        (SSP: and at its newest step; see changed_blocks) (no busy polling). Raises StoreError: TIMEOUT naming the ranks that did not commit;
        NOT_OWNER when ``interrupted()`` (the routing changed under the wait)."""
        blocks = [self._block(t, i) for t, i in keys] if keys else []
        with self.cond:
            def ready() -> bool:
                return self.failed is not None or bool(interrupted and interrupted()) or (
                    self.step >= min_step and all(not b.primary or (b.visible >= min_step and (
                        not self.staleness or b.visible >= b.step)) for b in blocks))

            if not self.cond.wait_for(ready, timeout=timeout):
                missing = self.missing_ranks(self.step)
                waiting = f"; ranks {missing} did not commit step {self.step}" if missing and self.collects else ""
                raise StoreError("TIMEOUT", f"job {self.name!r} did not reach step {min_step} within {timeout:g} s "
                                            f"(at {self.step}{waiting})")
            if self.failed is not None:
                raise self.failed
            if interrupted is not None and interrupted():
                raise StoreError("NOT_OWNER", f"the routing changed while the pull of job {self.name!r} waited")
            for block, key in zip(blocks, keys or []):
                if not block.primary:
                    raise StoreError("NOT_OWNER", f"block {key[0]}[{key[1]}] is no longer applied by this node")
            return self.step

    def changed_blocks(self, wanted: list[tuple[str, int, int | None]], *, copy: bool,
                       dtypes: list[torch.dtype] | None = None,
                       at_step: int | None = None) -> tuple[int, list[tuple[str, int, int, torch.Tensor]]]:
        """Blocks whose version is newer than the client's (``None`` = client has nothing).

        Returns (job step, [(tensor, index, version, value)]). ``copy`` snapshots values under the
        lock (needed in ASP, where another push may step a block while it is being sent, and in SSP,
        where another rank's commit may; SSP also waits until each wanted block is visible at its
        newest step, so no pull sees a step its replicas do not hold).
        ``dtypes`` (one per wanted block, default float32) is what each value is returned in: a
        block wanted in another dtype is a converted copy of the fp32 master (``.to()``: round to
        nearest even), made under the lock with ``copy``, else after it (BSP: no step is applied
        while the pulls of a step are served, which is also why the fp32 masters go out as they are).
        The copies are the reply's buffer: half the bytes of the fp32 values for bfloat16.
        ``at_step`` (BSP, a restarted rank redoing that step): each block's value after exactly
        ``at_step`` steps where this node still holds it (see value_at), else its current one.
        """
        dtypes = dtypes or [torch.float32] * len(wanted)
        with self.cond:
            if self.staleness:
                self._wait_visible([self._block(tensor, index) for tensor, index, _ in wanted])
            changed = []
            for (tensor, index, have), dtype in zip(wanted, dtypes):
                block = self._block(tensor, index)
                version, value = (block.version, block.value) if at_step is None else self.value_at(block, at_step)
                if have is None or version > have:
                    value = value.to(dtype, copy=True) if copy else value
                    changed.append((tensor, index, version, value, dtype))
            step = self.step
        return step, [(tensor, index, version, value if value.dtype == dtype else value.to(dtype))
                      for tensor, index, version, value, dtype in changed]

    @staticmethod
    def value_at(block: Block, step: int) -> tuple[int, torch.Tensor]:
        """``(version, value)`` of ``block`` after exactly ``step`` steps: its current ones if no
        later step changed it, the ones from before its last applied step if that step is
        ``step`` or later and this node kept them, else (nothing older is kept) its current ones.
        Call with the lock held."""
        if block.version > step and block.previous is not None:
            before, after, value = block.previous
            if after == block.version and before <= step:
                return before, value
        return block.version, block.value


class NodeStore:
    """All jobs on a node."""

    def __init__(self):
        self._jobs: dict[str, JobStore] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> JobStore | None:
        return self._jobs.get(name)

    def add(self, spec: common_pb2.JobSpec, uid: str = "",
            on_create: "Callable[[JobStore], None] | None" = None) -> JobStore:
        """The job named by ``spec``, created if missing (then ``on_create(job)`` runs first, so
        no other thread sees the job before it is set up)."""
        with self._lock:
            job = self._jobs.get(spec.name)
            if job is None:
                job = JobStore(spec)
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
            return self._jobs.pop(name, None)

    def totals(self) -> tuple[int, int]:
        jobs = self.jobs()
        return sum(len(j.blocks) for j in jobs), sum(j.bytes for j in jobs)
