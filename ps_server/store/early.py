"""Pipelined apply (BSP without ``max_grad_norm``): a block stepped before its step's commits.

A block whose gradient from every rank of the step arrived here (a zero flag counts), with every
rank's pushes naming the step's lrs, is stepped at once by the push that completed it -- outside
the lock, on private copies of its value and state (:class:`~shardline.ps_server.store.blocks.Staged`,
held by its Collection) -- so the optimizer work overlaps the other blocks' pushes and the slowest
rank's backward. Nothing else changes: the block keeps its step, its visible value, its gradient
sum and its pushers until the commits complete the step; then the apply installs the staged
copies instead of stepping, provided the commits' total weight and lrs are the ones staged with
(else it steps the kept gradient sum as before). Pulls, copies to replicas, checkpoints and
handovers thus see exactly what they saw without it. The stage hooks send the staged copies to the
copy holders ahead of the commits (ps_server/replication.py).

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import time

import torch

from shardline.ps_server.store.blocks import Block, Replay
from shardline.ps_server.store.common import clone_state, total_weight
from shardline.ps_server.store.pushes import PushTicket


class EarlySteps:
    """The pipelined-apply half of JobStore (see the module docstring)."""

    def all_pushed(self, block: Block, step: int) -> bool:
        """Whether every rank's gradient (or zero flag) of ``step`` for ``block`` arrived here and is
        in the sum (once every rank's arrived none is parked: the sum is the fold in rank order):
        none is still being received, none came by a handover (its weight is another node's). Call
        with the lock held."""
        if not block.primary or block.step != step or block.role.awaits_handover:
            return False
        collecting = block.role.collecting
        return len(collecting.received) == self.world_size and collecting.receiving is None and not collecting.handed

    def _stage_early(self, ticket: PushTicket) -> list:
        """First half (the lock held): the blocks of a finished BSP push that every rank has now
        pushed, marked as being stepped early, when that is safe: no clipping (it needs every
        block's norm first) and every rank's pushes named the same lrs (an older client's carry
        none) and weight; and useful: not when the pusher commits next (the commit steps them one
        round trip later without the copies). Returns ``(group, key, block, Staged, Collection)``
        items for _step_early."""
        step = ticket.step
        if self.sync != "bsp" or self.max_grad_norm or ticket.commit_follows:
            return []
        weights, lrs = self.push_weights.get(step, {}), self.push_lrs.get(step, {})
        if len(weights) < self.world_size or len(lrs) < self.world_size:
            return []
        step_lrs = next(iter(lrs.values()))
        if any(v != step_lrs for v in lrs.values()):
            return []  # the commits will refuse the ranks that differ
        total = total_weight(weights.values())
        items = []
        for ref, block in zip(ticket.refs, ticket.blocks):
            if not self.all_pushed(block, step):
                continue
            collecting = block.role.collecting
            if collecting.staged is None and collecting.pushed_by:
                items.append((self.tensors[ref.tensor].group, (ref.tensor, ref.index), block,
                              collecting.stage(step, total, step_lrs), collecting))
        return items

    def _step_early(self, items: list) -> None:
        """Second half (the lock not held): step private copies of the staged blocks; a block that
        was applied, handed over or dropped meanwhile (its collection no longer holds this
        ``staged``) discards its copies. Only this call writes the copies; the block's own value,
        state and gradient sum are only read (they change only after ``staged`` did)."""
        started = time.perf_counter()
        stepping, done = [], []
        lrs = items[0][3].lrs
        for group, key, block, staged, collecting in items:
            value = block.value.clone()
            state = clone_state(block.state)
            grad = None
            if collecting.has_grad:
                grad = collecting.grad_buf if staged.total == 1.0 else torch.div(collecting.grad_buf, staged.total)
            stepping.append((group, value, grad, state))
            replay = Replay(block.version, grad, self._lr_of(group, lrs)) if self.replays_gradients else None
            done.append((key, block, staged, value, state, replay))
        self._step_blocks(stepping, lrs)
        with self.cond:
            installed = []
            for key, block, staged, value, state, replay in done:
                if block.primary and block.role.collecting.staged is staged:
                    staged.computed(value, state, replay)
                    installed.append((key, staged))
                else:
                    self.early_unused += 1
            for hook in self.stage_hooks:
                hook(self, installed)
            self.early_seconds += time.perf_counter() - started
