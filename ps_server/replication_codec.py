"""Replication's payload encoding: a block's value and optimizer state packed into one float32
run (``BlockCodec``), and the BlockRefs of the frames that carry copies, gradients to replay or
handovers.

A copy travels as ``packed_numel(numel)`` float32 elements, or, for a block that keeps no
optimizer state (a frozen tensor's), as its ``numel`` value elements in the dtype it is stored in
(float32 or bfloat16); a gradient to replay as ``numel`` float32 elements (``BlockRef.replay``).
docs/architecture.md, "Replication".
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from types import SimpleNamespace

import torch

from shardline.ps_server.store import Handover, JobStore, StoreError
from shardline.services import frame
from shardline.services.errors import ErrorCode
from shardline.services.pb import dataplane_pb2 as dp


class BlockCodec:
    """Packs a block's value and optimizer state into one float32 run and back.

    Layout: the value, then the state entries in sorted key order: tensors as float32 (a 0-dim
    tensor as one element), ints as the 8 bytes of an int64 (two float32 slots, bit for bit).
    """

    def __init__(self, job: JobStore):
        self.job = job
        self.optimizer = job.optimizer
        template = job.optimizer.init_state(2)
        self.entries = []  # (key, kind, elements per block element or fixed count)
        for key in sorted(template):
            value = template[key]
            if isinstance(value, torch.Tensor):
                self.entries.append((key, "scalar" if value.dim() == 0 else "vector"))
            else:
                self.entries.append((key, "int"))

    def packed_numel(self, numel: int) -> int:
        return numel + sum({"scalar": 1, "vector": numel, "int": 2}[kind] for _k, kind in self.entries)

    def copy_nbytes(self, value: torch.Tensor, state: dict) -> int:
        """The bytes a copy of a block of ``value`` with ``state`` travels as: its value alone where
        it keeps no state (a frozen tensor's block)."""
        return self.packed_numel(value.numel()) * 4 if state else value.nbytes

    def accepts(self, numel: int, ref) -> bool:
        """Whether ``ref`` (its dtype and numel) can be a copy of a block of ``numel``: a packed
        float32 run, or a value alone in float32 or bfloat16."""
        if ref.numel == numel:
            return ref.dtype in (dp.FLOAT32, dp.BFLOAT16)
        return ref.numel == self.packed_numel(numel) and ref.dtype == dp.FLOAT32

    def pack(self, value: torch.Tensor, state: dict) -> list[memoryview]:
        parts = [frame.tensor_bytes(value)]
        if not state:
            return parts
        for key, kind in self.entries:
            item = state[key]
            if kind == "int":
                parts.append(memoryview(int(item).to_bytes(8, "little", signed=True)))
            else:
                parts.append(frame.tensor_bytes(item.reshape(-1) if kind == "vector" else item.reshape(1)))
        return parts

    def checksum(self, value: torch.Tensor, state: dict) -> int:
        """zlib.crc32 of the packed run of (value, state) — what a copy would carry — as a replay
        ref's ``checksum`` (the divergence check). Never 0 (a crc of 0 counts as 1): 0 means no check."""
        crc = 0
        for part in self.pack(value, state):
            crc = zlib.crc32(part.cast("B") if part.format != "B" else part, crc)
        return crc or 1

    def unpack(self, numel: int, flat: torch.Tensor, tensor: str) -> tuple[torch.Tensor, dict]:
        """Private copies of (value, state) from a received run of ``packed_numel(numel)`` floats,
        or of ``numel`` (a value alone, float32 or bfloat16: a block of ``tensor`` that kept no
        state, stored here in the tensor's dtype, with the state a new block of it gets here,
        JobStore.fresh_state: none while frozen, the fresh one once unfrozen, as the sender's
        untouched state was)."""
        if flat.numel() == numel:
            return flat.to(self.job.tensors[tensor].dtype, copy=True), self.job.fresh_state(tensor, numel)
        value = flat[:numel].clone()
        offset = numel
        state = {}
        for key, kind in self.entries:
            if kind == "vector":
                state[key] = flat[offset:offset + numel].clone()
                offset += numel
            elif kind == "scalar":
                state[key] = flat[offset:offset + 1].clone().reshape(())
                offset += 1
            else:
                state[key] = int.from_bytes(flat[offset:offset + 2].numpy().tobytes(), "little", signed=True)
                offset += 2
        return value, state


def copy_refs(codec: BlockCodec, items) -> tuple[list, list]:
    """BlockRefs and payload parts (views of the blocks) for ``items`` of (key, block)."""
    refs, payloads = [], []
    for (tensor, index), block in items:
        numel = block.value.numel()
        if block.state:
            packed = codec.packed_numel(numel)
            refs.append(dp.BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, numel=packed, nbytes=packed * 4,
                                    version=block.version, step=block.step))
        else:   # the value alone, in its own dtype
            refs.append(dp.BlockRef(tensor=tensor, index=index, dtype=frame.WIRE_DTYPE[block.value.dtype],
                                    numel=numel, nbytes=block.value.nbytes, version=block.version, step=block.step))
        payloads.extend(codec.pack(block.value, block.state))
    return refs, payloads


def stepped_refs(codec: BlockCodec, items, *, replay: bool = True, checksums: dict | None = None) -> tuple[list, list]:
    """BlockRefs and payload parts for stepped ``items`` of (key, block): a copy of each
    (copy_refs), or, for a block carrying a ``replay`` (replicate_gradients) when ``replay``
    allows, the gradient its holders step it with (gradient_refs; ``checksums`` given: with the
    divergence check's checksum, computed once per block into that dict)."""
    replayed = [(k, b) for k, b in items if _replayed(b, replay)]
    refs, payloads = copy_refs(codec, [(k, b) for k, b in items if not _replayed(b, replay)])
    replay_refs, replay_payloads = gradient_refs(replayed, codec if checksums is not None else None, checksums)
    return refs + replay_refs, payloads + replay_payloads


def _replayed(block, replay: bool) -> bool:
    """Whether a stepped block goes as the gradient its holders replay (else as a copy)."""
    return replay and block.replay is not None


def stepped_nbytes(codec: BlockCodec, block, *, replay: bool = True) -> int:
    """The payload bytes ``stepped_refs`` gives ``block``: its gradient where it carries a
    ``replay`` and ``replay`` allows (none for a zero gradient), else its copy."""
    if _replayed(block, replay):
        return 0 if block.replay.grad is None else block.replay.grad.numel() * 4
    return codec.copy_nbytes(block.value, block.state)


def gradient_refs(items, codec: BlockCodec | None = None, checksums: dict | None = None) -> tuple[list, list]:
    """BlockRefs and payload parts for ``items`` of (key, block) whose step the holders replay
    (Block.replay: the version it was stepped from, its mean gradient, the lr). With ``codec``,
    each ref carries ``checksum``: BlockCodec.checksum of the block's value and state after the
    step (kept in ``checksums`` by key, so a block sent to several holders is summed once)."""
    refs, payloads = [], []
    for (tensor, index), block in items:
        base, grad, lr = block.replay
        ref = dp.BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, version=block.version, step=block.step,
                          base_version=base, lr=lr, replay=True)
        if codec is not None:
            key = (tensor, index)
            if key not in checksums:
                checksums[key] = codec.checksum(block.value, block.state)
            ref.checksum = checksums[key]
        if grad is None:
            ref.zero = True
        else:
            ref.numel, ref.nbytes = grad.numel(), grad.numel() * 4
            payloads.append(frame.tensor_bytes(grad))
        refs.append(ref)
    return refs, payloads


def handover_refs(codec: BlockCodec, items) -> tuple[list, list]:
    """BlockRefs and payload parts of a REPLICATE_HANDOVER frame for ``items`` (store.Handover):
    each block's ref (step, ranks; the collected gradient sum, or a zero flag), then, where the
    item has them, its copy (``copy``) and its value from before its last step (``previous``)."""
    refs, payloads = [], []
    for item in items:
        ref = dp.BlockRef(tensor=item.key[0], index=item.key[1], step=item.step, ranks=list(item.ranks),
                          version=item.version)
        if item.grad is None:
            ref.zero = True
        else:
            ref.dtype, ref.numel, ref.nbytes = dp.FLOAT32, item.grad.numel(), item.grad.numel() * 4
            payloads.append(frame.tensor_bytes(item.grad))
        refs.append(ref)
        if item.copy is not None:  # right after its block's ref
            value, state = item.copy
            copy_ref, parts = copy_refs(codec, [(item.key, SimpleNamespace(
                value=value, state=state, version=item.version, step=item.step))])
            copy_ref[0].copy = True
            refs.extend(copy_ref)
            payloads.extend(parts)
        if item.previous is not None:  # after those: the value from before its last step
            before, value = item.previous
            previous_ref = frame.block_ref(item.key[0], item.key[1], value)
            previous_ref.previous, previous_ref.base_version = True, before
            refs.append(previous_ref)
            payloads.append(frame.tensor_bytes(value))
    return refs, payloads


def read_handover(codec: BlockCodec, job: JobStore, refs, payload) -> list[Handover]:
    """The store.Handover items of a REPLICATE_HANDOVER frame (``handover_refs``), checked against
    ``job`` (INVALID_ARGUMENT: a part out of place, of the wrong size, or naming unknown ranks)."""
    items, offset = [], 0
    for ref in refs:
        key = (ref.tensor, ref.index)
        numel = job.expected_numel(*key)
        if ref.copy:  # the previous primary's copy of the block named by the ref before it
            if not items or items[-1].key != key or not codec.accepts(numel, ref):
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"handover copy of {ref.tensor}[{ref.index}] must follow its block's ref and hold "
                                 f"{codec.packed_numel(numel)} float32 (or, without state, its {numel} values)")
            flat = torch.frombuffer(payload, dtype=frame.TORCH_DTYPE[ref.dtype], count=ref.numel, offset=offset)
            offset += ref.nbytes
            items[-1] = replace(items[-1], copy=codec.unpack(numel, flat, ref.tensor))
            continue
        if ref.previous:  # the value from before the last step of the block named by the ref before it
            if not items or items[-1].key != key or ref.numel != numel or ref.dtype != dp.FLOAT32 \
                    or ref.base_version >= items[-1].version:
                raise StoreError(ErrorCode.INVALID_ARGUMENT,
                                 f"handover previous value of {ref.tensor}[{ref.index}] must follow its block's ref, "
                                 f"hold {numel} float32 and be older")
            value = torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=offset).clone()
            offset += ref.nbytes
            items[-1] = replace(items[-1], previous=(int(ref.base_version), value))
            continue
        grad = None
        if not ref.zero:
            if ref.numel != numel or ref.dtype != dp.FLOAT32:
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"handover of {ref.tensor}[{ref.index}] has {ref.numel} "
                                                             f"elements, expected {numel} float32")
            grad = torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=offset).clone()
            offset += ref.nbytes
        ranks = tuple(int(r) for r in ref.ranks)
        if any(r >= job.world_size for r in ranks):
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"handover of {ref.tensor}[{ref.index}] names ranks "
                                                         f"{list(ranks)}, the job has {job.world_size}")
        items.append(Handover(key, int(ref.step), grad, ranks, int(ref.version)))
    return items
