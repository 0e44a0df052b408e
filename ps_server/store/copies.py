"""The copy holder's side of replication: blocks whose primary is another node.

A copy changes only by what its primary sends (ps_server/replication.py): a full copy
(``apply_copies``: replication, a sync, a migration), a copy stepped ahead of the step's commits
held apart (``hold_copies``, the role ``Copy(held=...)``) until a frame carries it to its step
(``carry_copies``), or the step's mean gradient to replay on the copy (``replay_steps``,
replicate_gradients). A frame that builds on a version this node lacks is answered UNAVAILABLE
with the keys (``common.lacking``): its primary drops this node from the in-sync holders and it
syncs a full copy, instead of acknowledging a step it does not hold.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import torch

from shardline.ps_server.store.blocks import COPY, Block, Held
from shardline.ps_server.store.common import StoreError, clone_state, lacking
from shardline.services import failpoints
from shardline.services.errors import ErrorCode

REPLAY_DIVERGE = "ps.replay_diverge"   # failpoint: a replayed copy made to differ (tests)
# A frame's replayed copies are stepped in batches of at most this many elements: each batch's
# private clones of value and state are installed before the next is made, so the transient of a
# large job's replay is a batch's, not every copy's (AdamW: 12 bytes per element).
REPLAY_BATCH_ELEMENTS = 4 * 1024 * 1024


class CopyHolder:
    """The copy-holder half of JobStore (see the module docstring)."""

    def apply_copies(self, copies: list) -> None:
        """Install blocks sent by their primary (replication, a sync or a migration): each item is
        ``(tensor, index, version, step, value, state)``; a copy older than the one held is ignored.
        ``value`` and the state's tensors become the block's own (private copies the caller hands
        over, as BlockCodec.unpack makes them): no second copy before the primary's ack."""
        for tensor, index, version, step, value, state in copies:
            numel = self.expected_numel(tensor, index)
            if value.numel() != numel:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"copy of block {tensor}[{index}] must have {numel} elements")
        with self.cond:
            self._follow_copies(step for _t, _i, _v, step, _value, _s in copies)
            for tensor, index, version, step, value, state in copies:
                block = self.blocks.get((tensor, index))
                if block is None:
                    value = self.keep_value((tensor, index), value)
                    self.blocks[(tensor, index)] = Block(value, dict(state), version=version, step=step,
                                                         visible=step, role=COPY)
                    self.bytes += value.nbytes
                elif not block.primary and step >= block.step:  # else this node applies it, or holds a newer copy
                    if self.in_frozen_file(block.value) and torch.equal(block.value, value):
                        value = block.value   # a frozen block sent again (a sync): its slot stays as it is
                    else:
                        value = self.keep_value((tensor, index), value)
                    block.install(value, dict(state), version, step)   # readers of the old copy keep it
            self.cond.notify_all()

    def hold_copies(self, copies: list) -> None:
        """Copies their primary stepped ahead of the step's commits (``(tensor, index, version,
        step, value, state)``, private): held apart until ``carry_copies`` names them."""
        for tensor, index, _version, _step, value, _state in copies:
            if value.numel() != self.expected_numel(tensor, index):
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"copy of block {tensor}[{index}] has {value.numel()} elements")
        with self.cond:
            for tensor, index, version, step, value, state in copies:
                block = self.blocks.get((tensor, index))
                if block is not None and not block.primary and step > block.step:
                    block.role = block.role.holding(Held(version, step, value, dict(state)))

    def replay_steps(self, items: list, *, ahead: bool = False, verify=None) -> None:
        """Step copies the way their primary stepped its blocks (replicate_gradients): each item is
        ``(tensor, index, version, step, base_version, lr, grad, checksum)`` (grad None: a zero
        gradient; checksum 0: not checked).
        A copy held at ``base_version`` is stepped out of place (private copies of value and state:
        readers of the old copy keep it) with its group's optimizer, as the primary steps, and
        becomes ``version`` at ``step``; with ``ahead`` (the primary stepped it before the step's
        commits) the result is held apart as a copy sent ahead is (``hold_copies``), until a later
        frame names it. A copy already at ``step`` or past it is left alone (a repeat). Raises
        StoreError UNAVAILABLE, after the rest, if a copy is missing or at another version (its
        primary drops this node from the in-sync holders and it syncs a full copy); ahead, such a
        copy is only not held (the frame that names it finds it lacking).

        The divergence check: an item with a checksum is installed (or held) only if
        ``verify(key, step, value, state, checksum)`` says the result is its primary's; one that
        is not counts in ``replica_divergences`` and is left at the version it was stepped from
        (so a sync brings a full copy) and answered like a missing one."""
        self._check_replays(items)
        if not ahead:
            with self.cond:
                self._follow_copies(step for _t, _i, _v, step, _b, _lr, _g, _c in items)
        missing, diverged = [], []
        for batch in self._replay_batches(items):
            batch_missing, batch_diverged = self._replay_batch(batch, ahead, verify)
            missing += batch_missing
            diverged += batch_diverged
        if (missing or diverged) and not ahead:
            why = []
            if diverged:
                why.append(f"blocks {diverged[:4]} of job {self.name!r} replayed here differ from their primary's "
                           f"(divergence check)")
            if missing:
                why.append(f"blocks {missing[:4]} of job {self.name!r} are not at the version their primary "
                           f"stepped them from (a step this node did not get)")
            raise lacking(missing + diverged, "; ".join(why))

    def _replay_batches(self, items: list):
        """``items`` in payload order, in batches of at most REPLAY_BATCH_ELEMENTS elements (a
        larger block alone)."""
        batch, elements = [], 0
        for item in items:
            numel = self.expected_numel(item[0], item[1])
            if batch and elements + numel > REPLAY_BATCH_ELEMENTS:
                yield batch
                batch, elements = [], 0
            batch.append(item)
            elements += numel
        if batch:
            yield batch

    def _replay_batch(self, items: list, ahead: bool, verify) -> tuple[list, list]:
        """Step and install (or hold) one batch of replay_steps; returns (missing, diverged) keys."""
        with self.cond:
            taken, missing = self._replays_due(items)
        # Stepped outside the lock (the clones are private) as the primary steps: one multi-tensor
        # call per group and lr (BlockOptimizer.step_many).
        batches: dict[tuple, list] = {}
        for *_head, group, lr, grad, value, state, _checksum in taken:
            batches.setdefault((group, lr), []).append((value, grad, state))
        for (group, lr), batch in batches.items():
            values, grads, states = (list(column) for column in zip(*batch))
            self.group_optimizers[group].step_many(values, grads, states, lr=lr)
        _diverge_for_tests(taken)
        diverged = [item[0] for item in taken if item[-1] and verify is not None
                    and not verify(item[0], item[4], item[8], item[9], item[-1])]
        if diverged:   # a result whose checksum differs from its primary's is not installed
            taken = [item for item in taken if item[0] not in diverged]
        with self.cond:
            self.replica_divergences += len(diverged)
            self._install_replayed(taken, ahead)
        return missing, diverged

    def _check_replays(self, items: list) -> None:
        for tensor, index, _version, _step, _base, lr, grad, _checksum in items:
            numel = self.expected_numel(tensor, index)
            if grad is not None and grad.numel() != numel:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"gradient of block {tensor}[{index}] must have {numel} elements")
            self.group_lrs(lr)   # a finite number >= 0, as a push's or commit's lr

    def _replays_due(self, items: list) -> tuple[list, list]:
        """The copies to step (with private clones of their value and state), and the keys of
        those missing or at another version. Lock held."""
        taken, missing = [], []
        for tensor, index, version, step, base, lr, grad, checksum in items:
            key = (tensor, index)
            block = self.blocks.get(key)
            if block is not None and (block.primary or step <= block.step):
                continue  # this node applies it now, or holds this step already
            if block is None or block.version != base:
                missing.append(key)
                continue
            taken.append((key, block, base, version, step, self.tensors[tensor].group, lr, grad,
                          block.value.clone(), clone_state(block.state), checksum))
        return taken, missing

    def _install_replayed(self, taken: list, ahead: bool) -> None:
        """Install (or, ``ahead``, hold apart) the stepped copies. Lock held."""
        for key, block, base, version, step, _group, _lr, _grad, value, state, _checksum in taken:
            if self.blocks.get(key) is not block or block.primary or block.version != base or step <= block.step:
                continue  # taken over, re-synced or dropped meanwhile: what it holds now stands
            self.steps_replayed += 1
            if ahead:
                block.role = block.role.holding(Held(version, step, value, state))
            else:
                block.install(value, state, version, step)
        self.cond.notify_all()

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
                held = block.role.held
                if held is not None and (held.version, held.step) == (version, step):
                    block.install(held.value, held.state, version, step)
                    self.copies_ahead += 1
                elif block.version == version:
                    block.install(block.value, block.state, version, step)
                else:
                    block.role = block.role.installed()
                    missing.append(key)
            self.cond.notify_all()
        if missing:
            raise lacking(missing, f"blocks {missing[:4]} of job {self.name!r} lack the version their primary "
                                   f"carried them through (a copy of a step this node did not get)")

    def _follow_copies(self, steps) -> None:
        """A node that applies none of the job's blocks (it only keeps copies, or is about to take
        some over) collects the step its primaries are at, so that it is current when it starts
        applying. Call with the lock held."""
        if not any(b.primary for b in self.blocks.values()):
            self.step = max(self.step, max(steps, default=self.step))


def _diverge_for_tests(taken: list) -> None:
    """Failpoint ``ps.replay_diverge`` (armed with ``raise``): instead of raising, the first block
    replayed in a call at the armed step moves its first element by one ulp, as a node of another
    build might step it; the divergence check then finds it."""
    if not taken or not failpoints.armed(REPLAY_DIVERGE, taken[0][4]):
        return
    try:
        failpoints.hit(REPLAY_DIVERGE, taken[0][4])
    except failpoints.FailpointError:
        flat = taken[0][8].view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
