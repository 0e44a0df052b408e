"""Replication's payload encoding: a block's value and optimizer state packed into one float32
run (``BlockCodec``), and the BlockRefs of the frames that carry copies or gradients to replay.

A copy travels as ``packed_numel(numel)`` float32 elements; a gradient to replay as ``numel``
float32 elements (``BlockRef.replay``). docs/architecture.md, "Replication".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardline.services import frame
from shardline.services.pb import dataplane_pb2 as dp

if TYPE_CHECKING:
    from shardline.ps_server.store import JobStore


class BlockCodec:
    """Packs a block's value and optimizer state into one float32 run and back.

    Layout: the value, then the state entries in sorted key order: tensors as float32 (a 0-dim
    tensor as one element), ints as the 8 bytes of an int64 (two float32 slots, bit for bit).
    """

    def __init__(self, job: JobStore):
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

    def pack(self, value: torch.Tensor, state: dict) -> list[memoryview]:
        parts = [frame.tensor_bytes(value)]
        for key, kind in self.entries:
            item = state[key]
            if kind == "int":
                parts.append(memoryview(int(item).to_bytes(8, "little", signed=True)))
            else:
                parts.append(frame.tensor_bytes(item.reshape(-1) if kind == "vector" else item.reshape(1)))
        return parts

    def unpack(self, numel: int, flat: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Private copies of (value, state) from a received run of ``packed_numel(numel)`` floats."""
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
        packed = codec.packed_numel(numel)
        refs.append(dp.BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, numel=packed, nbytes=packed * 4,
                                version=block.version, step=block.step))
        payloads.extend(codec.pack(block.value, block.state))
    return refs, payloads


def stepped_refs(codec: BlockCodec, items, *, replay: bool = True) -> tuple[list, list]:
    """BlockRefs and payload parts for stepped ``items`` of (key, block): a copy of each
    (copy_refs), or, for a block carrying a ``replay`` (replicate_gradients) when ``replay``
    allows, the gradient its holders step it with (gradient_refs)."""
    replayed = [(k, b) for k, b in items if replay and b.replay is not None]
    refs, payloads = copy_refs(codec, [(k, b) for k, b in items if not (replay and b.replay is not None)])
    replay_refs, replay_payloads = gradient_refs(replayed)
    return refs + replay_refs, payloads + replay_payloads


def gradient_refs(items) -> tuple[list, list]:
    """BlockRefs and payload parts for ``items`` of (key, block) whose step the holders replay
    (Block.replay: the version it was stepped from, its mean gradient, the lr)."""
    refs, payloads = [], []
    for (tensor, index), block in items:
        base, grad, lr = block.replay
        ref = dp.BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, version=block.version, step=block.step,
                          base_version=base, lr=lr, replay=True)
        if grad is None:
            ref.zero = True
        else:
            ref.numel, ref.nbytes = grad.numel(), grad.numel() * 4
            payloads.append(frame.tensor_bytes(grad))
        refs.append(ref)
    return refs, payloads
