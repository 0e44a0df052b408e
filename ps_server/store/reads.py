"""Reads of the block store: pulls (waiting for a step, changed blocks), checkpoint snapshots and
restores, and the end of a job here (``freeze``: a stopping node; ``fail``: a lost worker).

BSP applies no step while the pulls of a step are served, so pulls send the fp32 masters as they
are; ASP and SSP may step a block while it is sent, so they copy under the lock (SSP also waits
until each block's replicas hold its newest step). Checkpoints copy blocks at a step boundary (a
boundary hook, or a stopping node), when no gradient of the next step has arrived yet.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from shardline.ps_server.store.blocks import Block
from shardline.ps_server.store.common import StoreError, clone_state
from shardline.services.errors import ErrorCode

log = logging.getLogger("shardline.ps.store")


class Reads:
    """The read half of JobStore (see the module docstring)."""

    def wait_for_step(self, min_step: int, timeout: float, keys=None,
                      interrupted: Callable[[], bool] | None = None, copies=frozenset(),
                      copies_within: float = 0.0, reader_resends: bool = False) -> int:
        """Block until the job step is >= ``min_step`` and every block of ``keys`` is visible at it
        (SSP: and at its newest step; see changed_blocks) (no busy polling). Raises StoreError:
        TIMEOUT naming the ranks that did not commit; NOT_OWNER when ``interrupted()`` (the
        routing changed under the wait).

        ``copies`` (keys of a BSP read a copy holder may serve, docs/architecture.md, "Reads from
        copy holders"): this node holds a copy of these blocks, which counts once its primary
        carried it to ``min_step`` (``Block.step``: the copy holds that step, and so does its
        primary, which applied it first). After the job step is reached they are waited for at
        most ``copies_within`` more seconds; a copy still behind (its primary dropped this node
        from its in-sync holders, or it is slow), or one this node lacks, is COPY_BEHIND: the
        reader asks the primary instead.

        ``reader_resends`` (a BSP worker that keeps its previous step's gradients until a reply's
        ``durable_step`` passes it, and resends them after a failover): in a job that replays
        gradients a primary's block counts once it applied ``min_step`` and its holders
        acknowledged the step before (``visible >= min_step - 1``), not ``min_step`` itself
        (docs/architecture.md, "Reads before the acknowledgement")."""
        keys = keys or []
        lag = 1 if reader_resends and self.reads_before_acks else 0
        absent = next((key for key in keys if key in copies and key not in self.blocks), None)
        if absent is not None:
            raise StoreError(ErrorCode.COPY_BEHIND, f"node holds no copy of block {absent[0]}[{absent[1]}] "
                                                    f"of job {self.name!r}: read it from its primary")
        blocks = [self._block(t, i) for t, i in keys]
        with self.cond:
            def stopped() -> bool:
                return self.failed is not None or bool(interrupted and interrupted())

            def ready() -> bool:
                return stopped() or (self.step >= min_step and all(not b.primary or (
                    b.visible >= min_step - lag and b.step >= min_step and (
                        not self.staleness or b.visible >= b.step)) for b in blocks))

            if not self.cond.wait_for(ready, timeout=timeout):
                raise StoreError(ErrorCode.TIMEOUT, self._timeout_message(min_step, timeout, keys, blocks, lag))
            read = [(key, b) for key, b in zip(keys, blocks) if key in copies]
            if read and not self.cond.wait_for(
                    lambda: stopped() or all(b.primary or b.step >= min_step for _k, b in read), timeout=copies_within):
                key, behind = next((k, b) for k, b in read if not b.primary and b.step < min_step)
                raise StoreError(ErrorCode.COPY_BEHIND,
                                 f"the copy of block {key[0]}[{key[1]}] of job {self.name!r} here holds step "
                                 f"{behind.step}, not {min_step}, {copies_within:g} s after the job reached it: "
                                 f"read it from its primary")
            if self.failed is not None:
                raise self.failed
            if interrupted is not None and interrupted():
                raise StoreError(ErrorCode.NOT_OWNER, f"the routing changed while the pull of job {self.name!r} waited")
            for block, key in zip(blocks, keys):
                if key not in copies and not block.primary:
                    raise StoreError(ErrorCode.NOT_OWNER, f"block {key[0]}[{key[1]}] is no longer applied by this node")
                if key in copies and self.blocks.get(key) is not block:  # dropped or replaced by a sync meanwhile
                    raise StoreError(ErrorCode.COPY_BEHIND, f"the copy of block {key[0]}[{key[1]}] of job "
                                                            f"{self.name!r} changed under the read: read it again")
            self.copy_reads += len(read)
            if lag:
                self.reads_before_acks_served += sum(1 for b in blocks if b.primary and b.visible < min_step)
            return self.step

    def _timeout_message(self, min_step: int, timeout: float, keys: list, blocks: list, lag: int) -> str:
        """Why a read of ``min_step`` timed out (the lock held): the ranks that did not commit the
        step, or, where it was applied, the blocks not visible yet and who they wait for."""
        unacked = [(key, b) for key, b in zip(keys, blocks) if b.primary and b.step >= min_step
                   and b.visible < min_step - lag]
        if self.step >= min_step and unacked:
            (t, i), _block = unacked[0]
            more = f" and {len(unacked) - 1} more" if len(unacked) > 1 else ""
            who = self.unacked_by(self, [b for _k, b in unacked]) if self.unacked_by is not None else ""
            return (f"job {self.name!r} applied step {min_step} here, but block {t}[{i}]{more} did not become "
                    f"visible within {timeout:g} s: {who or 'its copy holders have not acknowledged it'}")
        missing = self.missing_ranks(self.step)
        waiting = f"; ranks {missing} did not commit step {self.step}" if missing and self.collects else ""
        return f"job {self.name!r} did not reach step {min_step} within {timeout:g} s (at {self.step}{waiting})"

    @property
    def reads_before_acks(self) -> bool:
        """Whether a reader that resends its previous step may read a primary's newest step before
        its copy holders acknowledged it: BSP jobs that replay gradients (a copy of value and
        state in flight would be changed under its frame by the next step's apply)."""
        return self.sync == "bsp" and self.replays_gradients

    def durable_step(self) -> int:
        """The steps before this one are held by every in-sync copy holder of every block this
        node applies (the least ``visible`` of its primaries; the job step if it applies none):
        a worker forgets its records of them (worker/recovery.py)."""
        with self.cond:
            return min((b.visible for b in self.blocks.values() if b.primary), default=self.step)

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
                if at_step is not None and version > at_step and self.keeps_previous:
                    log.warning("job %s: a restarted rank redoes step %d, but block %s[%d] changed twice since "
                                "(version %d) and its value of step %d is not held here: the redo is not exact "
                                "(a PS node and a worker failed within one step; restore a checkpoint for "
                                "exactness)", self.name, at_step, tensor, index, version, at_step)
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
        kept = block.previous
        if block.version > step and kept is not None and kept.after == block.version and kept.before <= step:
            return kept.before, kept.value
        return block.version, block.value

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
                # a frozen value in its file is never written in place: the writer reads the slot itself
                value = block.value if self.in_frozen_file(block.value) else block.value.clone()
                copies.append((tensor, index, block.version, value, clone_state(block.state)))
            return self.step, held, copies

    def restore(self, step: int, blocks: dict) -> None:
        """Load a checkpoint into this (fresh) job: ``blocks`` maps (tensor, index) to (version,
        value, state). Validated like initial values; the job then continues from ``step``."""
        items = [(tensor, index, value) for (tensor, index), (_v, value, _s) in blocks.items()]
        with self.cond:
            if self.blocks:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"job {self.name!r} already holds blocks; restore needs a fresh job")
            self.step = int(step)
            self.init_blocks(items)
            for key, (version, _value, state) in blocks.items():
                block = self.blocks[key]
                template = block.state
                if not self.tensors[key[0]].trainable or not state:
                    # a frozen block keeps no state (one checkpointed with its untouched state drops
                    # it); one checkpointed while frozen and trainable now starts fresh
                    state = template
                if set(state) != set(template):
                    raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                     f"checkpointed optimizer state of {key[0]}[{key[1]}] has {sorted(state)}, "
                                     f"the job's optimizer keeps {sorted(template)}")
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
