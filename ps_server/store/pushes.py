"""Pushes: a worker's gradients for one step, received into the blocks' collections.

A push is begun (validated, destinations chosen), its blocks are received one by one and checked
as each arrives (so the check overlaps the rest of the transfer), then finished (BSP/SSP: added to
each block's :class:`~shardline.ps_server.store.blocks.Collection`; ASP: applied) or aborted,
leaving nothing behind. A block's gradients of a BSP step are summed in ascending rank order,
whatever order they arrive in (:class:`~shardline.ps_server.store.blocks.Collection`): the first
in that order is received straight into the collection's buffer; later ones (to be added) go to
the connection's scratch buffer, as do compressed (sign) blocks, decoded into the sum when the
push finishes; one that arrives before a lower rank's is copied from scratch into a buffer of its
own when the push finishes, and parked until its turn (so a push that never finishes holds no
memory past its connection's scratch). A rank's push of a block it already pushed
in the step (or of a step already applied) is received and ignored: a resend.

An aggregated push (:class:`Aggregate`: a host's leader sends one push on behalf of several
ranks, its payload their weighted sum) counts, block by block, as a push of every one of its
ranks: their weights and lrs are recorded as their own pushes' would be, the payload enters the
sum as it is (weighted already), and every rank counts as received. A block all of its ranks
pushed already is a resend; one that only some of them pushed refuses the whole push
(AGGREGATE_CONFLICT), and the ranks push alone.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from shardline.ps_server.store.blocks import Block, Kept
from shardline.ps_server.store.common import LRs, StoreError
from shardline.services.compression import decode_signs, padding_problem, sign_nbytes
from shardline.services.errors import ErrorCode
from shardline.services.frame import aggregate_problem
from shardline.services.tensor_checks import CONCAT_BELOW_BYTES, first_nonfinite

# How long a push waits for another rank's in-flight push of the same block (only a stalled
# sender holds one that long; the data plane also times out stalled payloads).
RESERVATION_TIMEOUT_SECONDS = 60.0
NO_COMMITS: dict = {}   # the commit record of a step nobody committed yet
# A push's blocks smaller than CHECK_ALONE_BYTES are checked for NaN/Inf together, up to
# CHECK_BATCH_BYTES at a time (still cache-hot), instead of one call each (~10 us apiece); larger
# ones are checked alone as they land.
CHECK_ALONE_BYTES = CONCAT_BELOW_BYTES
CHECK_BATCH_BYTES = 256 << 10


class Aggregate(NamedTuple):
    """The ranks whose gradients every block of an aggregated push sums (ascending, distinct, at
    least two, the sender among them) and each one's weight, in the same order
    (``FrameHeader.agg_ranks``/``agg_weights``)."""

    ranks: tuple[int, ...]
    weights: tuple[float, ...]


class PushRef(NamedTuple):
    """One block of a push as its frame header describes it (a named tuple: a push makes one per
    block, at a third of a frozen dataclass's cost)."""

    tensor: str
    index: int
    zero: bool
    numel: int
    dtype: torch.dtype
    scale: float | None = None   # a compressed block (SIGN1): packed signs, each worth +-scale


@dataclass
class PushItem:
    tensor: str
    index: int
    grad: torch.Tensor | None  # None: the block's gradient is exactly zero (sent as a flag)


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
    aggregate: Aggregate | None = None   # the ranks (and weights) the push sums; None: ``rank``'s alone
    # The blocks received into the scratch buffer (not straight into a gradient buffer), packed in
    # payload order: their bytes, and (index, offset, count, dtype) of each while not bound yet.
    scratch_bytes: int = 0
    unbound: list = field(default_factory=list)
    # Set from the above once (read per block): the ranks whose gradients the push carries, and what
    # its payload is multiplied by on its way into a block's sum (the rank's weight; 1 for an
    # aggregate, whose payload is weighted already).
    ranks: tuple = field(init=False)
    factor: float = field(init=False)

    def __post_init__(self) -> None:
        aggregate = self.aggregate
        self.ranks = (self.rank,) if aggregate is None else aggregate.ranks
        self.factor = self.weight if aggregate is None else 1.0

    def bind_scratch(self, scratch: bytearray) -> None:
        """begin_push(scratch=None): the blocks that go through the scratch buffer are received
        into ``scratch`` (at least ``scratch_bytes``), packed in payload order."""
        for i, offset, count, dtype in self.unbound:
            self.dests[i] = torch.frombuffer(scratch, dtype=dtype, count=count, offset=offset)
        self.unbound = []

    def rank_weights(self):
        """(rank, weight) of every rank the push carries."""
        return ((self.rank, self.weight),) if self.aggregate is None else zip(*self.aggregate)


class Pushes:
    """The push half of JobStore (see the module docstring)."""

    def begin_push(self, rank: int, step: int, weight: float, refs: list[PushRef], scratch: bytearray | None,
                   lr: float | None = None, commit_follows: bool = False,
                   aggregate: Aggregate | None = None) -> PushTicket:
        """Validate a push and reserve where each block's bytes go. Nothing is visible until finish_push.

        ``refs`` are in payload order. A block not received straight into its gradient buffer
        goes through ``scratch``, packed in payload order: it must hold ``ticket.scratch_bytes``
        (the whole payload always does); None: bind it later (``PushTicket.bind_scratch``), once
        the caller knows how much it needs. BSP: each block takes gradients for its own step;
        a block already past ``step`` (the step was applied: a resend) or pushed by this rank in
        an earlier frame receives the bytes and ignores them.

        ``aggregate`` (BSP/SSP): the push is a host's sum over these ranks, sent by ``rank``
        (module docstring); a block some but not all of them pushed already refuses the whole
        push with AGGREGATE_CONFLICT, before anything is claimed.
        """
        self._check_rank_and_weight(rank, weight)
        if aggregate is not None:
            self._check_aggregate(rank, weight, aggregate, refs)
        self._check_push_refs(refs)
        ticket = PushTicket(rank, step, weight, refs, lr=self._push_lrs(lr), commit_follows=commit_follows,
                            aggregate=aggregate)
        with self.cond:
            self._check_open("push")
            ticket.blocks = [self._block(ref.tensor, ref.index) for ref in refs]
            self._check_applied_here(ticket)
            # BSP, a push its rank's commit follows (its blocks are not stepped early): the first push
            # of a block in the step keeps its value for a restarted rank (see blocks.Kept) now, while
            # the slowest rank is still on its way, rather than in the apply, on every rank's path.
            keeping = self._claim(ticket, commit_follows and self.keeps_previous) if self.collects else []
            if not self.collects:
                ticket.resent = [False] * len(refs)
            self._choose_dests(ticket)
            if scratch is not None:
                ticket.bind_scratch(scratch)
        if keeping:
            self._keep_previous(keeping, step)
        return ticket

    def _check_aggregate(self, rank: int, weight: float, aggregate: Aggregate, refs: list[PushRef]) -> None:
        """An aggregated push is well formed (frame.aggregate_problem) and fits the job: BSP/SSP,
        ranks below the world size, no sign-compressed blocks (the sum of several ranks' gradients
        has no one rank's error feedback). Raises INVALID_ARGUMENT."""
        problem = aggregate_problem(rank, weight, aggregate.ranks, aggregate.weights)
        if problem:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, problem)
        if not self.collects:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"job {self.name!r} is {self.sync!r}: aggregated pushes "
                                                         f"are for BSP and SSP jobs (ranks {list(aggregate.ranks)})")
        if aggregate.ranks[-1] >= self.world_size:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"aggregated push names ranks {list(aggregate.ranks)}: rank "
                                                         f"{aggregate.ranks[-1]} is out of range for world_size "
                                                         f"{self.world_size}")
        if self.compression == "sign" or any(ref.scale is not None for ref in refs):
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"job {self.name!r} has compression {self.compression!r}: an aggregated push (ranks "
                             f"{list(aggregate.ranks)}) carries plain float32/float16/bfloat16 sums, not "
                             f"sign-compressed blocks")

    def _check_push_refs(self, refs: list[PushRef]) -> None:
        for ref in refs:
            numel = self.expected_numel(ref.tensor, ref.index)
            if not self.tensors[ref.tensor].trainable:
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"tensor {ref.tensor!r} is frozen: it takes no gradients")
            if not ref.zero and ref.numel != numel:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"gradient for {ref.tensor}[{ref.index}] must have {numel} elements, got {ref.numel}")
            if ref.scale is not None and not ref.zero and self.compression != "sign":
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"job {self.name!r} has compression {self.compression!r}: it takes "
                                 f"no sign-compressed gradients ({ref.tensor}[{ref.index}])")

    def _check_applied_here(self, ticket: PushTicket) -> None:
        """Every block of the push is a primary here, not waiting for a handover. Lock held."""
        now = time.monotonic()
        for ref, block in zip(ticket.refs, ticket.blocks):
            if not block.primary:
                raise StoreError(ErrorCode.NOT_OWNER, f"block {ref.tensor}[{ref.index}] is a replica here")
            takeover = block.role.takeover
            if takeover.until and now < takeover.until:   # takeover.waiting(now), inline: once per block and push
                raise StoreError(ErrorCode.UNAVAILABLE,
                                 f"block {ref.tensor}[{ref.index}] waits for the gradients its previous primary "
                                 f"{takeover.source!r} collected for step {block.step}; retry shortly")

    def _claim(self, ticket: PushTicket, keep: bool) -> list:
        """BSP/SSP: mark each block pushed by the push's ranks in its step (released again by
        abort_push), or as a resend. Returns the blocks whose value to keep (blocks.Kept) as
        ``(block, version, value, buffer)``. Lock held."""
        rank, step = ticket.rank, ticket.step
        for r, weight in ticket.rank_weights():
            self._check_push_weight("push", r, step, weight)
            if ticket.lr is not None:
                self._check_push_lr("push", r, step, ticket.lr)
        seen = set()
        for ref, block in zip(ticket.refs, ticket.blocks):
            if block in seen:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"rank {rank} pushed block {ref.tensor}[{ref.index}] twice in one frame")
            seen.add(block)
            if block.step < step:
                self._check_ahead(step, f"push for step {step} but block {ref.tensor}[{ref.index}] of job "
                                        f"{self.name!r} is collecting step {block.step} on this node")
            # Applied already, or pushed in an earlier frame of this step: a resend, ignored.
            if ticket.aggregate is None:
                ticket.resent.append(block.step > step or rank in block.role.collector(step, block.step).pushed_by)
            else:
                ticket.resent.append(block.step > step or self._aggregate_resent(ticket, ref, block))
        if not all(ticket.resent):
            weights = self.push_weights.setdefault(step, {})
            lrs = self.push_lrs.setdefault(step, {}) if ticket.lr is not None else None
            for r, weight in ticket.rank_weights():
                weights[r] = weight
                if lrs is not None:
                    lrs[r] = ticket.lr
        keeping = []
        for block, resent in zip(ticket.blocks, ticket.resent):
            if resent:
                continue
            role = block.role
            if keep and block.step == step and not role.collecting.pushed_by:
                keeping.append((block, block.version, block.value, self.previous_buffer(block)))
            role.collector(step, block.step).pushed_by.update(ticket.ranks)
        return keeping

    @staticmethod
    def _aggregate_resent(ticket: PushTicket, ref: PushRef, block: Block) -> bool:
        """An aggregated push's block of the step the block collects (or one ahead): a resend if
        every rank of the aggregate pushed it already, new if none did; AGGREGATE_CONFLICT if only
        some did (one pushed alone: the sum would count it twice). Lock held, nothing claimed yet."""
        pushed_by = block.role.collector(ticket.step, block.step).pushed_by
        ranks = ticket.aggregate.ranks
        pushed = [r for r in ranks if r in pushed_by]
        if not pushed:
            return False
        if len(pushed) == len(ranks):
            return True
        raise StoreError(ErrorCode.AGGREGATE_CONFLICT,
                         f"block {ref.tensor}[{ref.index}] of step {ticket.step} was pushed by rank(s) {pushed} but "
                         f"not by {[r for r in ranks if r not in pushed_by]}: the aggregated push of ranks "
                         f"{list(ranks)} is refused whole; its ranks push alone")

    def _choose_dests(self, ticket: PushTicket) -> None:
        """Where each block's bytes go: the block's own gradient buffer (its first fp32 gradient
        of the step in rank order: nothing folded yet, every lower rank settled), else the scratch
        buffer, packed in payload order (``ticket.unbound`` until ``bind_scratch``; one that
        arrived before a lower rank's is copied into a parked buffer when the push finishes); None
        for a zero flag."""
        offset = 0
        record = self.commits.get(ticket.step, NO_COMMITS)
        for i, (ref, block, resent) in enumerate(zip(ticket.refs, ticket.blocks, ticket.resent)):
            direct, dest = False, None
            if not ref.zero:
                collecting = block.role.collecting
                if (self.collects and ref.dtype == torch.float32 and not collecting.has_grad
                        and collecting.receiving is None and not resent and block.step == ticket.step
                        and collecting.settled_below(ticket.ranks[0], record, block.role.since_epoch)):
                    dest, direct = collecting.receive_into(ticket.rank, block.value), True
                else:
                    count = ref.numel if ref.scale is None else sign_nbytes(ref.numel)
                    ticket.unbound.append((i, offset, count, ref.dtype))
                    offset += count * ref.dtype.itemsize
            ticket.direct.append(direct)
            ticket.dests.append(dest)
        ticket.scratch_bytes = offset

    def _keep_previous(self, keeping: list, step: int) -> None:
        """Copy the values kept by _claim (no step changes them before this rank commits, after
        this push), outside the lock, then keep them on the blocks still at that version."""
        torch._foreach_copy_([buffer for *_, buffer in keeping], [value for _b, _v, value, _ in keeping])
        with self.cond:
            for block, version, _value, buffer in keeping:
                if block.primary and block.version == version and block.step == step:
                    block.role = block.role.keeping(Kept(version, step + 1, buffer))

    @staticmethod
    def previous_buffer(block: Block) -> torch.Tensor:
        """Where a primary's value from before its next step goes (blocks.Kept): the buffer of its
        last one (nobody reads that once a rank pushes or commits the next step). Lock held."""
        kept = block.role.kept
        return kept.value if kept is not None else torch.empty_like(block.value)

    def check_received(self, ticket: PushTicket, i: int, finite: bool | None = None) -> None:
        """Check block ``i`` of a push right after its bytes arrived (NaN/Inf, unless allowed);
        blocks under CHECK_ALONE_BYTES are checked in batches (the last by finish_push).
        ``finite``: the block was checked as it was copied in (the shm ring) or as it landed (a
        TCP receive; either only a plain float32 block of a job that checks): it is not checked again."""
        dest, ref = ticket.dests[i], ticket.refs[i]
        if dest is None or ticket.error is not None:
            return
        if ref.scale is not None:  # packed signs: finite by construction (the scale was checked with the header)
            problem = padding_problem(dest, ref.numel)
            if problem:
                ticket.error = StoreError(ErrorCode.INVALID_ARGUMENT,
                                          f"gradient for {ref.tensor}[{ref.index}]: {problem}")
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

    def _check_unchecked(self, ticket: PushTicket) -> None:
        """Check the received blocks check_received left for a batch; the first with NaN/Inf fails the push."""
        indices, ticket.unchecked, ticket.unchecked_bytes = ticket.unchecked, [], 0
        if not indices or ticket.error is not None:
            return
        bad = first_nonfinite([ticket.dests[i] for i in indices])
        if bad is not None:
            self.refuse_nonfinite(ticket, indices[bad])

    @staticmethod
    def refuse_nonfinite(ticket: PushTicket, i: int) -> None:
        """Fail the push (unless it failed already) for the NaN/Inf in its block ``i``."""
        if ticket.error is None:
            ref = ticket.refs[i]
            ticket.error = StoreError(ErrorCode.NONFINITE,
                                      f"gradient for tensor {ref.tensor!r} (block {ref.index}) contains NaN or Inf")

    def finish_push(self, ticket: PushTicket, *, defer_early: bool = False) -> int:
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
            for n in range(len(ticket.refs)):
                self._take_block(ticket, n)
            ticket.done = True
            if ticket.aggregate is not None and not all(ticket.resent):
                self.aggregated_ranks += len(ticket.aggregate.ranks)
            early = self._stage_early(ticket)
            job_step = self.step
            self.cond.notify_all()
        if defer_early:
            ticket.early = early
        elif early:
            self._step_early(early)
        return job_step

    def _take_block(self, ticket: PushTicket, n: int) -> None:
        """Fold block ``n`` of a received BSP/SSP push into what its block collects, or park it
        until the ranks below it settle. Lock held."""
        block, dest, resent = ticket.blocks[n], ticket.dests[n], ticket.resent[n]
        # Not primary: lost while an earlier block of the push waited (the lock released); its
        # collection went with the role, and the worker resends the step at the new epoch.
        if resent or not block.primary:
            return
        if block.step < ticket.step:  # SSP: a step after the one the block collects
            self._contribute(block, block.role.collector(ticket.step, block.step), ticket, n)
            return
        collecting = block.role.collecting
        if ticket.direct[n]:   # the first in rank order, received straight into the sum
            collecting.received_into(ticket.rank, ticket.ranks, ticket.factor)
            self._fold_parked(block, collecting, ticket.step)
            return
        # Its turn in the fold, but another push may still be receiving into the buffer (one of an
        # applied step, still arriving): the sum waits for it.
        if dest is not None and collecting.receiving is not None and self._in_order(block, collecting, ticket):
            if not self.cond.wait_for(lambda: not block.primary or block.role.collecting.receiving is None,
                                      timeout=RESERVATION_TIMEOUT_SECONDS):
                self._release(ticket)
                raise StoreError(ErrorCode.TIMEOUT, f"rank {block.role.collecting.receiving} did not finish sending "
                                                    f"block gradients within {RESERVATION_TIMEOUT_SECONDS:g} s")
            if not block.primary or block.step != ticket.step:   # lost (as above) or applied during the wait
                return
            collecting = block.role.collecting   # the wait released the lock
        self._contribute(block, collecting, ticket, n)

    def _in_order(self, block: Block, collection, ticket: PushTicket) -> bool:
        """Whether the push's contribution (at its lowest rank) may be folded into ``collection``
        now: every rank below it is settled (Collection.settled_below). Lock held."""
        return collection.settled_below(ticket.ranks[0], self.commits.get(ticket.step, NO_COMMITS),
                                        block.role.since_epoch)

    def _contribute(self, block: Block, collection, ticket: PushTicket, n: int) -> None:
        """Block ``n`` of the push into ``collection`` (the step's): a zero flag settles its ranks;
        a gradient is folded into the sum if its turn came and nobody receives into the buffer,
        else parked in a buffer of its own. Then whatever it let through is folded. The ranks count
        as received only once in the sum: a handover or an early step taken while the lock is
        released must not count a rank whose gradient is not in it. Lock held."""
        ref, dest = ticket.refs[n], ticket.dests[n]
        if dest is None:
            collection.received.update(ticket.ranks)
        elif collection.receiving is None and self._in_order(block, collection, ticket):
            collection.add(block.value, ref, dest, ticket.factor)
            collection.received.update(ticket.ranks)
        else:   # from scratch (reused by the connection's next frame): a copy in fp32
            grad = self._grad_buffer(block.value)
            if ref.scale is None:
                grad.copy_(dest)
            else:
                decode_signs(dest, ref.numel, ref.scale, out=grad)
            collection.park(ticket.ranks, grad, ticket.factor)
            self.parking_blocks.add(block)
        self._fold_parked(block, collection, ticket.step)

    def _fold_parked(self, block: Block, collection, step: int) -> None:
        """Fold the parked contributions of ``collection`` (``block``'s of ``step``) whose turn came,
        unless a push still receives into its buffer (that push's end folds them). Lock held."""
        if collection.parked and collection.receiving is None:
            self._free_grads(collection.fold_parked(self.commits.get(step, NO_COMMITS), block.role.since_epoch))

    def _fold_settled(self) -> None:
        """A commit may settle ranks that pushed nothing of a block: fold what was parked behind
        them. Lock held."""
        for block in list(self.parking_blocks):
            role = block.role
            if not role.primary:
                self.parking_blocks.discard(block)
                continue
            waiting = False
            for step, collection in ((block.step, role.collecting), *role.ahead.items()):
                self._fold_parked(block, collection, step)
                waiting = waiting or bool(collection.parked)
            if not waiting:
                self.parking_blocks.discard(block)

    def _fold_all(self, block: Block) -> None:
        """The commits completed ``block``'s step: every rank is settled, whatever is parked is
        folded (in rank order). Lock held."""
        role = block.role
        self._free_grads(role.collecting.fold_parked(None, 0))
        if not any(c.parked for c in role.ahead.values()):
            self.parking_blocks.discard(block)

    def _grad_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An fp32 buffer shaped like ``like`` for a contribution to park (from the pool). Lock held."""
        pool = self.grad_pool.get(like.numel())
        if pool:
            buffer = pool.pop()
            self.grad_pool_bytes -= buffer.numel() * 4
            return buffer
        return torch.empty_like(like)

    def _free_grads(self, buffers: list) -> None:
        """Parked buffers no longer needed: kept for the next ones while the pool holds less than
        ``world_size`` blocks' worth, else freed. Lock held."""
        limit = self.world_size * self.block_elements * 4
        for buffer in buffers:
            nbytes = buffer.numel() * 4
            if self.grad_pool_bytes + nbytes > limit:
                return
            self.grad_pool.setdefault(buffer.numel(), []).append(buffer)
            self.grad_pool_bytes += nbytes

    def step_early(self, ticket: PushTicket) -> None:
        """Step the blocks ``finish_push(ticket, defer_early=True)`` staged (once)."""
        items, ticket.early = ticket.early, []
        if items:
            self._step_early(items)

    def _check_still_collecting(self, ticket: PushTicket) -> None:
        """Before a BSP/SSP push changes anything: every block it claimed is still this node's
        and still collects the push's step. Else nothing of it is kept: NOT_OWNER (the block
        changed owner meanwhile and was handed over without this push; the worker resends it to
        the new owner) or STALE_STEP (the step was applied here meanwhile: a commit of this rank
        counted without this push). A block that took the step from its previous primary's copy
        meanwhile (``caught_up``: that primary applied it, with this rank's push to it) takes the
        push as the resend it is. Call with the lock held."""
        for i, (ref, block) in enumerate(zip(ticket.refs, ticket.blocks)):
            if ticket.resent[i]:
                continue
            role = block.role
            # A block received into directly and lost and gained again meanwhile collects anew.
            moved = ticket.direct[i] and block.step == ticket.step and role.primary \
                and role.collecting.receiving != ticket.rank
            if not role.primary or moved:
                self._release(ticket)
                raise StoreError(ErrorCode.NOT_OWNER, f"block {ref.tensor}[{ref.index}] changed owner while its push "
                                                      f"was in flight")
            if block.step <= ticket.step:
                continue
            adopted = role.takeover.adopted
            if adopted[0] <= ticket.step < adopted[1]:
                ticket.resent[i] = True   # ignored as a resend from here on (its claim went with the catch-up)
                if ticket.direct[i]:
                    role.collecting.end_receiving(ticket.rank)
                    self._fold_parked(block, role.collecting, block.step)
            elif ticket.dests[i] is not None:  # applied here while the push was in flight
                self._release(ticket)
                raise StoreError(ErrorCode.STALE_STEP,
                                 f"step {ticket.step} was applied while its push was in flight (block "
                                 f"{ref.tensor}[{ref.index}] is at step {block.step}, taken over at epoch "
                                 f"{role.since_epoch}; job step {self.step})")

    def abort_push(self, ticket: PushTicket) -> None:
        """Forget a push that failed or whose connection broke: nothing of it stays."""
        with self.cond:
            self._release(ticket)

    def _release(self, ticket: PushTicket) -> None:
        if ticket.done:
            return
        ticket.done = True
        rank, step, ranks = ticket.rank, ticket.step, ticket.ranks
        for block, direct, resent in zip(ticket.blocks, ticket.direct, ticket.resent or [False] * len(ticket.blocks)):
            role = block.role
            if not role.primary:   # lost meanwhile: its collection went with it
                continue
            if direct:
                role.collecting.end_receiving(rank)
                self._fold_parked(block, role.collecting, block.step)   # what waited for the buffer
            if self.collects and not resent:
                role.collector(step, block.step).pushed_by.difference_update(ranks)
        for r in ranks if self.collects else ():
            if not any(b.primary and r in b.role.pushed_by(step, b.step) for b in self.blocks.values()):
                self.push_weights.get(step, {}).pop(r, None)
                self.push_lrs.get(step, {}).pop(r, None)
        self.cond.notify_all()

    def push(self, rank: int, step: int, weight: float, items: list[PushItem], lr: float | tuple | None = None,
             commit_follows: bool = False, aggregate: Aggregate | None = None) -> int:
        """Push already-received gradients in one call (same path as the data plane; ``lr``,
        ``commit_follows`` and ``aggregate`` as a frame's). Returns the job step."""
        refs = [PushRef(i.tensor, i.index, i.grad is None, 0 if i.grad is None else i.grad.numel(),
                        torch.float32 if i.grad is None else i.grad.dtype) for i in items]
        scratch = bytearray(sum(0 if i.grad is None else i.grad.numel() * i.grad.element_size() for i in items))
        ticket = self.begin_push(rank, step, weight, refs, scratch, lr=lr, commit_follows=commit_follows,
                                 aggregate=aggregate)
        for n, item in enumerate(items):
            if item.grad is not None:
                ticket.dests[n].copy_(item.grad.reshape(-1))
                self.check_received(ticket, n)
        return self.finish_push(ticket)
