"""Applying a step: the commits of step ``s`` are complete, every primary block that collects it
is stepped (or installs the copy stepped early, ps_server/store/early.py) and collects ``s + 1``.

A block counts the commits only when every rank's was made at an epoch >= its ``since_epoch`` (or
its gradient came by a handover) and it waits for no handover. With global clipping
(``max_grad_norm``) a step first waits for the norm: this node's share (sum of squares of the mean
gradients of the blocks it applies) goes to the norm hooks (ps_server/grad_norm.py), which answer
with the clip coefficient (``apply_clipped``). Once applied, the apply hooks send the blocks to their
copy holders (visible to pulls once those acknowledge, ``mark_visible``), and the boundary hooks
run (checkpoints: no gradient of the next step has arrived yet). ASP applies each push on arrival.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import time

import torch

from shardline.ps_server.store.blocks import Block, Kept, Replay
from shardline.ps_server.store.common import LRs, as_fp32, total_weight
from shardline.ps_server.store.pushes import PushTicket


class Applying:
    """The apply half of JobStore (see the module docstring)."""

    def _apply_ready(self, step: int) -> None:
        """Apply ``step`` to every primary block that can take it now. Call with the lock held."""
        record = self.commits.get(step, {})
        if len(record) < self.world_size or step > self.step:  # SSP: a step ahead applies after those before it
            return
        ready = self._ready_for(step, record)
        total = total_weight(weight for weight, _epoch in record.values())
        coef = 1.0
        if self.max_grad_norm and ready:
            coef = self.clip_coefs.get(step)
            if coef is None:
                self._share_norm(step, ready, total)
                return
        lagging = step < self.step   # blocks taken over catch up on the steps the workers resent
        self._apply_blocks(step, ready, total, coef, keep_epoch=bool(self.staleness) or lagging)
        self._publish(step, ready)
        if step == self.step:
            self.step = step + 1
            self._run_boundary_hooks()
        self._forget_old_steps()
        self.cond.notify_all()
        if self.staleness or lagging:
            self._apply_ready(step + 1)  # SSP, a block catching up: the next step may be complete already

    def _ready_for(self, step: int, record: dict) -> list:
        """The primary blocks that collect ``step`` and count every rank's commit ``record``."""
        now = time.monotonic()
        oldest = min(epoch for _w, epoch in record.values())   # every commit counts where since_epoch <= it

        def counts(block: Block) -> bool:
            role = block.role
            until = role.takeover.until
            if until and now < until:   # role.takeover.waiting(now), inline: once per block and step
                return False
            return role.since_epoch <= oldest or all(epoch >= role.since_epoch or rank in role.collecting.handed
                                                     for rank, (_w, epoch) in record.items())

        return [(k, b) for k, b in self.blocks.items() if b.primary and b.step == step and counts(b)]

    def _apply_blocks(self, step: int, ready: list, total: float, coef: float, *, keep_epoch: bool) -> None:
        """Step the ``ready`` blocks that got a push of ``step`` (installing a copy stepped early
        where it was stepped with this weight total and these lrs); every ready block then
        collects ``step + 1``, counting commits from its ``since_epoch`` still with ``keep_epoch``
        (SSP, and a block behind the job step: commits of its next step counted before the
        takeover went with pushes to its previous primary). Lock held."""
        lrs = self.step_lrs.get(step)
        stepping = []   # (group, value, mean gradient, state): stepped together below
        keeping, kept = [], []   # where the values stepped in place are kept (blocks.Kept), and those values
        next_roles = []
        for key, block in ready:
            role = block.role
            keep, replay = role.kept, None
            if role.collecting.pushed_by:
                if role.collecting.parked:   # every rank committed: nothing parked waits any longer
                    self._fold_all(block)
                keeps = self.keeps_previous and not (keep is not None and keep[:2] == (block.version, step + 1))
                before = None if role.collecting.staged is None else self._install_early(block, step, total, lrs, coef)
                if before is not None:   # the value just replaced is the one to keep: no copy
                    keep = Kept(block.version, step + 1, before) if keeps else keep
                else:
                    if keeps:
                        keep = Kept(block.version, step + 1, self.previous_buffer(block))
                        keeping.append(keep.value)
                        kept.append(block.value)
                    replay = self._stepping(key, block, total, coef, lrs, stepping)
                block.version = step + 1
            next_roles.append((block, role.applied(step + 1, keep_epoch=keep_epoch, kept=keep,
                                                   replay=replay)))
        if kept:
            torch._foreach_copy_(keeping, kept)
        self._step_blocks(stepping, lrs)
        for block, role in next_roles:
            block.role = role
            block.step = step + 1

    def _install_early(self, block: Block, step: int, total: float, lrs: LRs, coef: float) -> torch.Tensor | None:
        """Install the copy of ``block`` stepped when its pushes completed, if it was stepped with
        the commits' weight total and lrs. Returns the value it replaced (None: not installed)."""
        staged = block.role.collecting.staged
        if (staged is None or staged.value is None or coef != 1.0 or staged.step != step or staged.total != total
                or staged.lrs != lrs):
            return None
        before = block.value
        block.value, block.state = staged.value, staged.state
        self.applied_early += 1
        return before

    def _stepping(self, key: tuple, block: Block, total: float, coef: float, lrs: LRs, stepping: list) -> Replay | None:
        """Queue ``block`` to be stepped with its mean gradient; returns what its holders replay."""
        collecting = block.role.collecting
        grad = None
        if collecting.has_grad:
            grad = collecting.grad_buf.div_(total) if total != 1.0 else collecting.grad_buf
            if coef < 1.0:
                grad.mul_(coef)
        group = self.tensors[key[0]].group
        stepping.append((group, block.value, grad, block.state))
        return Replay(block.version, grad, self._lr_of(group, lrs)) if self.replays_gradients else None

    def _lr_of(self, group: int, lrs: LRs) -> float:
        """The lr ``_step_blocks`` steps ``group`` with under ``lrs`` (None: the group's own)."""
        lr = lrs[group] if lrs is not None else None
        return float(self.group_optimizers[group].lr if lr is None else lr)

    def _step_blocks(self, items: list, lrs: LRs) -> None:
        """Step ``(group, value, grad, state)`` items, each group's blocks in one multi-tensor call
        (BlockOptimizer.step_many) at the group's lr of ``lrs`` (None: its own)."""
        by_group: dict[int, list] = {}
        for group, value, grad, state in items:
            by_group.setdefault(group, []).append((value, grad, state))
        for group, blocks in sorted(by_group.items()):
            values, grads, states = (list(column) for column in zip(*blocks))
            self.group_optimizers[group].step_many(values, grads, states, lr=None if lrs is None else lrs[group])

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

    def mark_visible(self, blocks: list, step: int) -> None:
        """The replicas acknowledged ``blocks`` at ``step``: pulls may see them."""
        with self.cond:
            for block in blocks:
                block.visible = max(block.visible, min(step, block.step))
            self.cond.notify_all()

    def _run_boundary_hooks(self) -> None:
        for hook in self.boundary_hooks:
            hook(self, self.step)

    # --- clipping -------------------------------------------------------------------------
    def _share_norm(self, step: int, ready: list, total: float) -> None:
        """With clipping, a step waits for the global norm: once every block this node applies can
        take it, compute this node's share (sum of squares of the mean gradient, in float64) and
        hand it to the norm hooks. Call with the lock held."""
        pending = sum(1 for b in self.blocks.values() if b.primary and b.step == step)
        if len(ready) < pending or step in self.norm_shares:
            return  # the norm spans every block: wait for the rest (handovers) / already shared
        share = 0.0
        for _key, block in ready:
            collecting = block.role.collecting
            if collecting.parked:   # the norm is the folded sum's, as the step will be
                self._fold_all(block)
            if collecting.pushed_by and collecting.has_grad:
                share += float(collecting.grad_buf.double().square().sum()) / (total * total)
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

    # --- ASP ------------------------------------------------------------------------------
    def _apply_asp(self, ticket: PushTicket) -> None:
        """ASP: a push is one update, applied on arrival; the job step counts them. Lock held."""
        new_version = self.step + 1
        for ref, block, dest in zip(ticket.refs, ticket.blocks, ticket.dests):
            group = self.tensors[ref.tensor].group
            self.group_optimizers[group].step(block.value, None if dest is None else as_fp32(ref, dest), block.state,
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
