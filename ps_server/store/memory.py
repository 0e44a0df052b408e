"""Where a job's bytes on this node go: every tensor the block store holds, by what it is for.

``job_memory(job)`` walks the job's blocks under its lock and sums the bytes of each tensor's
storage once (a buffer that moved between roles, say a collection's gradient buffer that became
the replay gradient, counts where it is now, under the first kind that names it). The kinds, in
that order:

===================  ===========================================================================
values               the fp32 master copy of every block held (primaries and copies; a frozen
                     bf16 tensor's in bf16)
optimizer_state      the optimizer's state of every trainable block (AdamW: two moments)
gradients            a primary's buffer summing the pushes of the step it collects (SSP: and of
                     the steps ahead); allocated on a block's first push, kept for the job's life
parked_gradients     pushes that arrived before a lower rank's (folded in rank order) and the
                     pool of their freed buffers
replay_spares        replicate_gradients: the previous step's mean gradient, kept until every
                     copy holder acknowledged it (it is the next step's gradient buffer)
kept_values          exact restarts (BSP): a primary's value from before its last step
staging              pipelined apply: blocks stepped ahead of their step's commits
held_copies          a copy holder: copies their primary stepped ahead of the commits, held apart
frozen_files         frozen tensors' values kept in the job's file (frozen_file.py): the page cache,
                     not the process heap
===================  ===========================================================================

Node-wide memory (data-plane receive buffers, the subscribers' delta history) is not a job's:
ps_server/memory_report.py adds it. docs/operations.md, "Memory", gives bytes per parameter.
"""

from __future__ import annotations

import torch

MEMORY_KINDS = ("values", "optimizer_state", "gradients", "parked_gradients", "replay_spares", "kept_values",
                "staging", "held_copies", "frozen_files")


class _Tally:
    """Bytes by kind, each storage counted once."""

    def __init__(self):
        self.bytes = dict.fromkeys(MEMORY_KINDS, 0)
        self._seen: set[int] = set()

    def add(self, kind: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._seen or not storage.nbytes():
            return
        self._seen.add(ptr)
        self.bytes[kind] += storage.nbytes()

    def add_state(self, kind: str, state: dict | None) -> None:
        for value in (state or {}).values():
            self.add(kind, value)


def job_memory(job) -> dict[str, int]:
    """Bytes of ``job``'s tensors on this node by kind (MEMORY_KINDS, every kind present)."""
    tally = _Tally()
    with job.cond:
        blocks = list(job.blocks.values())
        # what the job is for first: a buffer shared with a transient record counts as its owner
        frozen = job.frozen_file
        for block in blocks:
            if frozen is not None and frozen.holds(block.value):
                tally.bytes["frozen_files"] += block.value.nbytes   # a slot of one mapping: its own bytes
            else:
                tally.add("values", block.value)
        for block in blocks:
            tally.add_state("optimizer_state", block.state)
        for block in blocks:
            role = block.role
            if not role.primary:
                held = role.held
                if held is not None:
                    tally.add("held_copies", held.value)
                    tally.add_state("held_copies", held.state)
                continue
            for collection in (role.collecting, *role.ahead.values()):
                tally.add("gradients", collection.grad_buf)
                for parked in (collection.parked or {}).values():
                    tally.add("parked_gradients", parked.grad)
                staged = collection.staged
                if staged is not None:
                    tally.add("staging", staged.value)
                    tally.add_state("staging", staged.state)
                    if staged.replay is not None:
                        tally.add("staging", staged.replay.grad)
            if role.replay is not None:
                tally.add("replay_spares", role.replay.grad)
            tally.add("replay_spares", role.spare)
            if role.kept is not None:
                tally.add("kept_values", role.kept.value)
        for buffers in job.grad_pool.values():
            for buffer in buffers:
                tally.add("parked_gradients", buffer)
    return tally.bytes


def held_parameters(job) -> int:
    """Parameters of the blocks ``job`` holds on this node (primaries and copies): what the
    bytes per parameter of a node are counted against."""
    with job.cond:
        return sum(block.value.numel() for block in job.blocks.values())
