"""Element-level bf16 deltas and block checksums of subscriber pulls (docs/architecture.md,
"Weight subscribers").

A block sent to a subscriber is either dense (its value at the reply's version in the asked
dtype) or, where only a few bf16 elements differ from the version the subscriber holds, a
``BF16_DELTA``: ``k`` uint32 indices (ascending, little-endian) followed by ``k`` bfloat16 values,
``6 * k`` bytes instead of ``2 * numel``. Either way the reply names ``checksum``: zlib.crc32 of the
block's full value at the reply's version (its bytes in the reply's element dtype), so the receiver
checks the result it is about to install, not the bytes that travelled: a corrupted payload, a
wrong base or a bug in either side's delta code are all caught the same way.

Pure functions over tensors; no sockets.
"""

from __future__ import annotations

import zlib

import torch

from shardline.services.pb import dataplane_pb2 as dp

INDEX_BYTES = 4
VALUE_BYTES = 2
DELTA_ELEMENT_BYTES = INDEX_BYTES + VALUE_BYTES


class DeltaError(ValueError):
    """A delta block that cannot be applied (bad indices, wrong size); the block is pulled dense again."""


def checksum(value: torch.Tensor) -> int:
    """zlib.crc32 of a contiguous CPU tensor's bytes (bf16 as its 16-bit patterns)."""
    raw = value.view(torch.int16) if value.dtype == torch.bfloat16 else value
    return zlib.crc32(memoryview(raw.contiguous().numpy()).cast("B"))


def changed_indices(base: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """Indices (int64, ascending) of the elements whose bf16 bit patterns differ: exact, so -0.0,
    +0.0 and NaN payloads are told apart as the receiver's bytes would be."""
    return torch.nonzero(base.view(torch.int16) != current.view(torch.int16), as_tuple=True)[0]


def encode_delta(base: torch.Tensor, current: torch.Tensor) -> tuple[int, bytes] | None:
    """``(k, payload)`` of the elements of ``current`` (1-D bf16) that differ from ``base``, or
    None when the delta would not be smaller than the dense block (so the block goes dense)."""
    if base.shape != current.shape or base.dtype != torch.bfloat16 or current.dtype != torch.bfloat16:
        raise ValueError(f"a bf16 delta needs two bf16 blocks of one shape, got {base.dtype}{tuple(base.shape)} "
                         f"and {current.dtype}{tuple(current.shape)}")
    idx = changed_indices(base, current)
    k = int(idx.numel())
    if k * DELTA_ELEMENT_BYTES >= current.numel() * VALUE_BYTES:
        return None
    indices = idx.to(torch.int32).numpy().astype("<u4", copy=False).tobytes()
    values = current[idx].view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    return k, indices + values


def apply_delta(block: torch.Tensor, k: int, payload: memoryview | bytes) -> None:
    """Write a ``BF16_DELTA`` payload of ``k`` elements into ``block`` (1-D bf16) in place.
    Raises DeltaError, leaving ``block`` unchanged, if the payload does not fit it."""
    n = block.numel()
    if len(payload) != k * DELTA_ELEMENT_BYTES or k > n:
        raise DeltaError(f"a delta of {k} elements is {k * DELTA_ELEMENT_BYTES} bytes into a block of {n}, "
                         f"got {len(payload)} bytes")
    if k == 0:
        return
    buf = bytearray(payload) if isinstance(payload, bytes) else payload
    indices = torch.frombuffer(buf, dtype=torch.int32, count=k).to(torch.int64) & 0xFFFFFFFF
    values = torch.frombuffer(buf, dtype=torch.int16, count=k, offset=k * INDEX_BYTES)
    if int(indices.max()) >= n or (k > 1 and not bool((indices[1:] > indices[:-1]).all())):
        raise DeltaError(f"a delta's indices must be ascending and below the block's {n} elements")
    block.view(torch.int16)[indices] = values


def delta_ref_problem(header: dp.FrameHeader, ref: dp.BlockRef) -> str | None:
    """What is wrong with a BF16_DELTA block reference (None: nothing): only pull replies carry
    one, its size is ``6 * delta_elements`` and it replaces at most ``numel`` elements."""
    where = f"block {ref.tensor}[{ref.index}]"
    if header.op != dp.OP_REPLY:
        return f"{where}: {dp.Op.Name(header.op)} cannot carry a BF16_DELTA block (pull replies only)"
    if ref.delta_elements > ref.numel:
        return f"{where}: a delta of {ref.delta_elements} elements into a block of {ref.numel}"
    if ref.nbytes != ref.delta_elements * DELTA_ELEMENT_BYTES:
        return f"{where}: a delta of {ref.delta_elements} elements takes {ref.delta_elements * DELTA_ELEMENT_BYTES} " \
               f"bytes, nbytes is {ref.nbytes}"
    return None
