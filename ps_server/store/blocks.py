"""A block held by one PS node and its role there: records and transitions, no lock, no I/O
(callers hold the job's lock).

A block is its copy (``value``, ``state``, ``version``, ``step``, ``visible``) and ONE role; its
states (``role.state``)::

                               hold_copies / replay_steps(ahead)
               +--------+ -------------------------------------> +--------------+
  apply_copies |  copy  |                                        | copy holding |
   (new) ----> |        | <------------------------------------- | (Copy.held)  |
               +--------+      apply_copies / carry_copies       +--------------+
                 ^   |                                                  |
    set_primary  |   |  set_primary: gained      set_primary: gained    |
    lost: hands  |   +---------------------+----------------------------+
    over what it |                         |  is its previous primary alive?
    collected    |               no        |         yes
    (Handover)   |        +----------------+------------------+
                 |        v                                   v
            +-------------------+   accept_handover,   +----------------------+
  init,  -> |     primary       | <------------------- |  awaiting handover   |
  restore   | collecting step s |   release_expired_   |  (Takeover.until)    |
            +-------------------+   waits              +----------------------+
                |      ^
                +------+  applied: every rank committed s (or caught_up: the
                          previous primary's copy of a later step); collects s + 1

(both primary states go to copy when the routing moves the block away). A role is a frozen
record; a transition is a method that returns the next role, so nothing is reset by hand. Within
a role only the current :class:`Collection` changes in place (pushes arrive one by one).

Design: docs/architecture.md, "Block store" ("Block: its copy and one role", "Transitions").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple

import torch

from shardline.ps_server.store.common import as_fp32
from shardline.services.compression import decode_signs


# The states a block's role is in, as the diagram names them (``role.state``).
PRIMARY = "primary"
AWAITING_HANDOVER = "awaiting handover"
REPLICA = "copy"
HOLDING = "copy holding"


class Kept(NamedTuple):
    """A primary's value from before its last applied step (BSP with exact restarts): the step
    went from version ``before`` to ``after``; ``value``'s buffer is reused for the next one."""

    before: int
    after: int
    value: torch.Tensor


class Replay(NamedTuple):
    """A primary's last step applied at the commits (replicate_gradients): the version it stepped
    from, the mean gradient (None: zero) and the lr. The gradient is the spare buffer until the
    next step: the bytes stay as sent until every copy holder acknowledged them."""

    base: int
    grad: torch.Tensor | None
    lr: float


class Held(NamedTuple):
    """A copy its primary stepped ahead of the step's commits and sent (OP_REPLICATE staged)."""

    version: int
    step: int
    value: torch.Tensor
    state: dict


@dataclass(eq=False)
class Staged:
    """A block stepped before its step's commits, with the weight total and lrs of the pushes;
    ``value``/``state`` are private copies (None while still being computed)."""

    step: int
    total: float
    lrs: tuple
    value: torch.Tensor | None = None
    state: dict | None = None
    replay: Replay | None = None   # replicate_gradients: what the holders replay

    def computed(self, value: torch.Tensor, state: dict, replay: Replay | None) -> None:
        """The private copies are stepped (by the one caller that steps them, outside the lock)."""
        self.value, self.state, self.replay = value, state, replay


class _Fp32Block(NamedTuple):
    """What ``Collection.add`` needs of a PushRef for an fp32 gradient held here (a parked one):
    nothing to decode."""

    scale: None = None


_FP32_BLOCK = _Fp32Block()


class Parked(NamedTuple):
    """A contribution to a step's sum that arrived before a lower rank's (see Collection): the
    gradient of ``ranks`` in fp32 as sent (not yet weighted; a compressed one decoded), in a buffer
    of its own, and the ``factor`` it enters the sum with."""

    ranks: tuple
    grad: torch.Tensor
    factor: float


@dataclass(eq=False, slots=True)
class Collection:
    """A primary's gradients of one step: the sum of weight * gradient in ``grad_buf`` (the buffer
    outlives the step; it holds data only while ``has_grad``), the ranks that claimed a push
    (``pushed_by``) and whose push finished here and is in the sum (``received``), the rank
    receiving straight into ``grad_buf`` (``receiving``), the ranks whose gradient came by a
    handover (``handed``: their commits count at any epoch) and the block stepped ahead of the
    commits (``staged``).

    The sum is folded in ascending rank order, whatever order the pushes arrive in: a
    contribution (one rank's push, or an aggregate's, at its lowest rank) is folded only once
    every rank below it is settled (``settled_below``); until then it is ``parked`` (lowest rank
    -> :class:`Parked`) and folded by ``fold_parked`` when its turn comes. ``frontier``: every rank
    below it is known settled (docs/architecture.md, "Rank order")."""

    grad_buf: torch.Tensor | None = None
    has_grad: bool = False
    pushed_by: set = field(default_factory=set)
    received: set = field(default_factory=set)
    receiving: int | None = None
    handed: frozenset = frozenset()
    staged: Staged | None = None
    parked: dict | None = None
    frontier: int = 0

    def settled_below(self, rank: int, record: dict | None, since_epoch: int) -> bool:
        """Whether every rank below ``rank`` is settled for this step: its contribution is in the
        sum (a zero flag counts: ``received``), or it can no longer contribute: it committed the
        step (``record``: rank -> (weight, epoch), its commit counting at ``since_epoch``) without
        pushing the block (a rank's pushes of a step precede its commit). ``record`` None: the
        commits completed the step, every rank is settled."""
        if record is None:
            return True
        k, received, pushed_by = self.frontier, self.received, self.pushed_by
        while k < rank:
            if k not in received:
                commit = record.get(k)
                if commit is None or commit[1] < since_epoch or k in pushed_by:
                    break
            k += 1
        self.frontier = k
        return k >= rank

    def receive_into(self, rank: int, like: torch.Tensor) -> torch.Tensor:
        """``rank``'s push of the step's first gradient in rank order goes straight into the
        buffer (made on first use, shaped like ``like``); other pushes wait until it ends
        (``end_receiving``) before they fold anything."""
        if self.grad_buf is None:
            self.grad_buf = torch.empty_like(like)
        self.receiving = rank
        return self.grad_buf

    def received_into(self, rank: int, ranks: tuple, factor: float) -> None:
        """``rank``'s push, received straight into the buffer, is in the sum times ``factor``: the
        gradient of ``ranks`` (``rank``'s own, times its weight; or a host's aggregate, already
        weighted: factor 1), who all count as received."""
        if factor != 1.0:
            self.grad_buf.mul_(factor)
        self.has_grad = True
        self.received.update(ranks)
        self.end_receiving(rank)

    def end_receiving(self, rank: int) -> None:
        """``rank``'s push into the buffer ended (taken, a resend, or dropped)."""
        if self.receiving == rank:
            self.receiving = None

    def add(self, like: torch.Tensor, ref, payload: torch.Tensor, factor: float) -> None:
        """Add ``factor`` times a pushed gradient to the sum (a rank's weight; 1 for a host's
        aggregate, weighted already): ``payload`` as ``ref`` (a PushRef) describes it, packed signs
        each worth +-``ref.scale`` if compressed. The buffer, shaped like ``like``, is made on
        first use, and the first gradient is decoded straight into it."""
        if self.has_grad:
            self.grad_buf.add_(as_fp32(ref, payload), alpha=factor)
            return
        if self.grad_buf is None:
            self.grad_buf = torch.empty_like(like)
        if ref.scale is None:
            self.grad_buf.copy_(payload)  # also converts fp16/bf16 pushes to fp32
        else:
            decode_signs(payload, ref.numel, ref.scale, out=self.grad_buf)
        if factor != 1.0:
            self.grad_buf.mul_(factor)
        self.has_grad = True

    def park(self, ranks: tuple, grad: torch.Tensor, factor: float) -> None:
        """A contribution of ``ranks`` that arrived before a lower rank's settled: ``grad`` (fp32,
        a buffer of its own) waits for its turn in the fold."""
        if self.parked is None:
            self.parked = {}
        self.parked[ranks[0]] = Parked(ranks, grad, factor)

    def fold_parked(self, record: dict | None, since_epoch: int) -> list:
        """Fold the parked contributions whose turn came (``settled_below``; ``record`` None:
        all of them), in ascending rank order, each as the push would have been: the first copied
        and weighted, later ones added times their factor. Returns the buffers they held."""
        freed = []
        parked = self.parked
        while parked:
            low = min(parked)
            if not self.settled_below(low, record, since_epoch):
                break
            ranks, grad, factor = parked.pop(low)
            self.add(grad, _FP32_BLOCK, grad, factor)
            self.received.update(ranks)
            freed.append(grad)
        return freed

    def stage(self, step: int, total: float, lrs: tuple) -> Staged:
        """The block is being stepped ahead of the commits (pipelined apply) with these totals."""
        self.staged = Staged(step, total, lrs)
        return self.staged


@dataclass(frozen=True)
class Takeover:
    """How a primary came by a block: ``source`` is the previous primary (alive at the switch)
    whose handover it takes; pushes wait for it until ``until`` (monotonic clock; 0: no wait);
    steps ``adopted`` = [lo, hi) it did not apply but took from that primary's copy (a push of one
    of them still in flight then is a resend: that primary applied it with it)."""

    source: str = ""
    until: float = 0.0
    adopted: tuple[int, int] = (0, 0)

    def waiting(self, now: float) -> bool:
        return bool(self.until) and now < self.until

    def stopped(self) -> Takeover:
        """No more waiting for the handover (it came, or the wait ran out)."""
        return self if not self.until else Takeover(self.source, 0.0, self.adopted)


NO_TAKEOVER = Takeover()


# Not frozen only for speed (a frozen dataclass's __init__ costs ~1 us more, and the apply makes
# one Primary per block and step); no code writes its fields: tests/unit/test_block_roles.py checks.
@dataclass(eq=False, slots=True)
class Primary:
    """This node applies the block. ``collecting``: the step's :class:`Collection`; ``ahead``
    (SSP): collections of later steps; ``since_epoch``: commits count from this routing epoch;
    ``takeover``: the previous primary it waits for and the steps adopted from its copy; ``kept``:
    the value from before its last step (a restarted rank redoing it); ``replay``: its last step's
    mean gradient, which copy holders replay; ``spare``: the other gradient buffer.
    (docs/architecture.md, "Block store", "Block: its copy and one role".)"""

    primary: ClassVar[bool] = True
    since_epoch: int = 0
    collecting: Collection = field(default_factory=Collection)
    ahead: dict = field(default_factory=dict)   # SSP: step -> Collection of a step after ``Block.step``
    takeover: Takeover = NO_TAKEOVER
    kept: Kept | None = None
    replay: Replay | None = None
    spare: torch.Tensor | None = None

    @property
    def awaits_handover(self) -> bool:
        """Taken over from a live primary whose handover has not come nor been given up on."""
        return bool(self.takeover.until)

    @property
    def state(self) -> str:
        return AWAITING_HANDOVER if self.takeover.until else PRIMARY

    def collector(self, step: int, block_step: int) -> Collection:
        """What collects pushes of ``step``: the current collection for the block's own step (or an
        applied one: a resend), else (SSP) that step's collection ahead, made on first use."""
        if step <= block_step:
            return self.collecting
        ahead = self.ahead.get(step)
        if ahead is None:
            ahead = self.ahead[step] = Collection()
        return ahead

    def pushed_by(self, step: int, block_step: int) -> set:
        """Ranks whose push of ``step`` this block holds (claimed or received)."""
        if step == block_step:
            return self.collecting.pushed_by
        ahead = self.ahead.get(step)
        return ahead.pushed_by if ahead is not None else set()

    # --- transitions ----------------------------------------------------------------------
    def _but(self, *, collecting: Collection | None = None, ahead: dict | None = None,
             takeover: Takeover | None = None, kept: Kept | None = None) -> Primary:
        """This role with the given records changed (dataclasses.replace, without its cost: the
        apply makes one per block and step)."""
        return Primary(self.since_epoch, self.collecting if collecting is None else collecting,
                       self.ahead if ahead is None else ahead, self.takeover if takeover is None else takeover,
                       self.kept if kept is None else kept, self.replay, self.spare)

    def keeping(self, kept: Kept) -> Primary:
        """The value from before the step being collected was kept (blocks.Kept)."""
        return self._but(kept=kept)

    def stop_waiting(self) -> Primary:
        """The handover came, or the wait for it ran out."""
        return self._but(takeover=self.takeover.stopped())

    def handed_over(self, ranks: tuple, grad_buf: torch.Tensor | None, has_grad: bool) -> Primary:
        """Collects the step with what the previous primary collected of it (from ``ranks``)."""
        # A rank still receiving into the buffer (its step adopted by caught_up) keeps its claim.
        collecting = Collection(grad_buf, has_grad, set(ranks), set(ranks), self.collecting.receiving,
                                handed=frozenset(ranks))
        return self._but(collecting=collecting, takeover=self.takeover.stopped())

    def _then_collect(self, step: int, buffer: torch.Tensor | None,
                      receiving: int | None = None) -> tuple[Collection, dict]:
        """The collection of ``step`` (what was collected ahead for it, else an empty one over
        ``buffer``, the last one's: allocated once per block), and the collections after it."""
        if not self.ahead:   # BSP, and SSP with nothing ahead: the common case, made cheap
            return Collection(buffer, receiving=receiving), {}
        later = {s: c for s, c in self.ahead.items() if s > step}
        taken = self.ahead.get(step)
        if taken is None:
            return Collection(buffer, receiving=receiving), later
        # What it parked goes with it, folded in rank order into whichever buffer it takes.
        return Collection(taken.grad_buf if taken.has_grad else buffer, taken.has_grad, taken.pushed_by,
                          taken.received, receiving, parked=taken.parked), later

    def applied(self, next_step: int, *, keep_epoch: bool, kept: Kept | None, replay: Replay | None) -> Primary:
        """Its step was applied at the commits: it collects ``next_step`` (SSP: with what came
        ahead for it). ``keep_epoch`` (SSP): commits of a step ahead counted before a takeover
        went with pushes to the previous primary, which hands over only its own step; the
        workers send those steps again at the new epoch. A replayed gradient stays as sent (it
        becomes the spare buffer)."""
        buffer, spare = self.collecting.grad_buf, self.spare
        if replay is not None and replay.grad is not None:
            buffer, spare = spare, buffer
        # A rank's push of the applied step still being received into the buffer (a resend, refused
        # STALE_STEP when it ends) keeps its claim: no push of the next step writes there meanwhile.
        collecting, ahead = self._then_collect(next_step, buffer, self.collecting.receiving)
        return Primary(self.since_epoch if keep_epoch else 0, collecting, ahead, self.takeover.stopped(), kept, replay,
                       spare)

    def caught_up(self, behind: int, step: int) -> Primary:
        """Moved from step ``behind`` to the previous primary's copy at ``step`` (that primary
        applied the steps between): what it collected of its own step is dropped. A rank still
        receiving into the buffer keeps its claim until its push ends (as a resend)."""
        collecting, ahead = self._then_collect(step, self.collecting.grad_buf, self.collecting.receiving)
        takeover = Takeover(self.takeover.source, self.takeover.until, (behind, step))
        return self._but(collecting=collecting, ahead=ahead, takeover=takeover)

    def lost(self) -> Copy:
        """The routing moved the block away: a copy here from now on (the caller hands over)."""
        return COPY


@dataclass(frozen=True, eq=False)
class Copy:
    """Its primary (another node) sends copies; ``held``: a copy sent ahead of the step's commits."""

    primary: ClassVar[bool] = False
    held: Held | None = None

    @property
    def state(self) -> str:
        return HOLDING if self.held is not None else REPLICA

    def holding(self, held: Held) -> Copy:
        return Copy(held)

    def installed(self) -> Copy:
        """A frame carried the copy to a step (or a newer copy came): nothing held any more."""
        return COPY

    def gained(self, epoch: int, source: str = "", until: float = 0.0) -> Primary:
        """The routing makes this node the block's primary from ``epoch`` on; ``source``: the live
        previous primary whose handover pushes wait for until ``until``."""
        return Primary(since_epoch=epoch, takeover=Takeover(source, until))


COPY = Copy()


@dataclass(eq=False)
class Block:
    """One block's copy on this node and its role (module docstring)."""

    value: torch.Tensor                      # 1-D fp32 master copy
    state: dict
    version: int = 0                         # the job step that last changed it
    step: int = 0                            # job steps this copy was carried through
    visible: int = 0                         # pulls may see it at steps up to this
    role: Primary | Copy = field(default_factory=Primary)

    @property
    def primary(self) -> bool:
        """Whether this node applies it."""
        return self.role.primary

    @property
    def replay(self) -> Replay | None:
        """A primary's last step for its copy holders to replay (replicate_gradients)."""
        return self.role.replay if self.role.primary else None

    @property
    def previous(self) -> Kept | None:
        """A primary's value from before its last step, if kept."""
        return self.role.kept if self.role.primary else None

    @property
    def awaiting(self) -> float:
        """A primary's deadline for the handover it waits for (0: none)."""
        return self.role.takeover.until if self.role.primary else 0.0

    def install(self, value: torch.Tensor, state: dict, version: int, step: int) -> None:
        """A copy from its primary: the block holds it at ``step`` (nothing held apart any more)."""
        self.value, self.state, self.version = value, state, version
        self.step = self.visible = step
        self.role = COPY
