"""Ownership changes: which blocks this node applies, and the handover of the step in flight.

``set_primary`` applies the routing: a gained block becomes a Primary that collects the step it
holds and counts commits from the new epoch (``Copy.gained``); taken over from a primary that is
still alive, its pushes wait for that primary's :class:`Handover` (``accept_handover``) or until
the wait runs out (``release_expired_waits``). A lost block becomes a Copy (``Primary.lost``) and
hands over what it collected, so the pushes of a rank that died meanwhile are not lost. A
handover from a primary that applied a later step (it learnt the routing late) first moves the
block to that primary's copy (``Primary.caught_up``): workers may have seen that step already.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardline.ps_server.store.blocks import Block, Kept
from shardline.ps_server.store.common import clone_state


@dataclass(frozen=True)
class Handover:
    """What a block's previous primary collected for the step in flight when it lost the block:
    ``grad`` is the sum of weight * gradient of ``ranks`` (None: no gradient, or only zeros), as
    folded so far in rank order: a contribution parked behind a lower rank's is in neither (its
    ranks resend it at the new epoch, and the new primary folds it in its turn).
    ``version`` is its copy's version; ``copy`` its (value, state) when its last step changed it:
    an apply of the old primary that crossed the switch (its copy reached the new primary after
    the new primary took the block over, and was refused) is taken from here. ``previous`` is
    its ``(version, value)`` from before its last applied step (blocks.Kept; BSP with exact
    restarts): a rank redoing that step (it died after committing on some nodes only)
    recomputes it on those values at the new primary too."""

    key: tuple
    step: int
    grad: torch.Tensor | None
    ranks: tuple
    version: int = 0
    copy: tuple | None = None
    previous: tuple | None = None


def handover_of(key: tuple, block: Block) -> Handover:
    """What a primary ``block`` hands over as it loses the block. Lock held."""
    collecting = block.role.collecting
    grad = collecting.grad_buf.clone() if collecting.has_grad and collecting.received else None
    copy = None
    # Changed by one of its last two steps: maybe not at the new primary yet (a BSP primary serves
    # a step once its holders hold the one before: docs/architecture.md, "Reads before the
    # acknowledgement"; the new primary may lack both).
    if block.version > 0 and block.version >= block.step - 1:
        copy = (block.value.clone(), clone_state(block.state))
    kept = block.role.kept
    previous = (kept.before, kept.value) if kept is not None and kept.after == block.version else None
    return Handover(key, block.step, grad, tuple(sorted(collecting.received)), block.version, copy, previous)


class Ownership:
    """The ownership half of JobStore (see the module docstring)."""

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
                    # Its old primary's step in flight (a copy held ahead of it too) is collected again here.
                    block.role = block.role.gained(epoch, *awaiting.get(key, ()))
                    block.visible = block.step
                    gained.append(key)
                elif block.primary and not primary:
                    lost.append(handover_of(key, block))
                    block.role = block.role.lost()   # SSP: its workers push the steps ahead again at the new epoch
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
            expired = [b for b in self.blocks.values()
                       if b.primary and b.role.awaits_handover and not b.role.takeover.waiting(now)]
            for block in expired:
                block.role = block.role.stop_waiting()
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
                if block is None or not block.primary or block.role.takeover.source != sender:
                    continue
                if item.step > block.step and self._catch_up(block, item):
                    caught.setdefault(item.step - 1, []).append((item.key, block))
                if self.keeps_previous:
                    self._take_previous(block, item)
                if block.role.awaits_handover:
                    self._take_handover(block, item)
            for step, ready in sorted(caught.items()):
                self._publish(step, ready)
            self._follow_primaries()
            for step in {b.step for b in self.blocks.values() if b.primary}:
                self._apply_ready(step)  # blocks that waited (handed over or not) may apply now
            self.cond.notify_all()

    @staticmethod
    def _take_handover(block: Block, item: Handover) -> None:
        """The handover ``block`` waited for came: it collects its step with the gradients in
        ``item`` unless it moved past that step or took pushes meanwhile. Lock held."""
        role = block.role
        collecting = role.collecting
        if block.step != item.step or collecting.pushed_by or not item.ranks:
            block.role = role.stop_waiting()
            return
        buffer, has_grad = collecting.grad_buf, collecting.has_grad
        if item.grad is not None:
            if buffer is None:
                buffer = torch.empty_like(block.value)
            buffer.copy_(item.grad)
            has_grad = True
        block.role = role.handed_over(item.ranks, buffer, has_grad)

    @staticmethod
    def _take_previous(block: Block, item: Handover) -> None:
        """Keep the previous primary's value of ``block`` from before its last applied step
        (``Handover.previous``) where this node holds the version it led to and kept none of its
        own: a planned ring change (or an apply that crossed it) then loses nothing a restarted
        rank redoing that step needs (value_at). Call with the lock held."""
        kept = block.role.kept
        if item.previous is None or item.version != block.version or (kept is not None and kept.after == block.version):
            return
        before, value = item.previous   # older than item.version, the block's size (_handle_handover)
        block.role = block.role.keeping(Kept(before, block.version, value.view_as(block.value)))

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
        block.role = block.role.caught_up(block.step, item.step)   # SSP: with the pushes collected ahead for it
        block.step = item.step
        return True

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

    def drop_blocks(self, keys) -> int:
        """Forget blocks this node no longer holds a copy of. Returns how many went."""
        with self.cond:
            gone = 0
            for key in keys:
                block = self.blocks.pop(key, None)
                if block is not None:
                    self.bytes -= block.value.nbytes
                    gone += 1
            self.cond.notify_all()
            return gone
