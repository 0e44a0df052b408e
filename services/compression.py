"""Gradient compression on the wire: the job option (``none``, ``bf16``, ``sign``) and the codec
of compressed push blocks (wire dtype ``SIGN1``) that the worker and the PS share.

Contract: a ``SIGN1`` block is one bit per element, the sign of ``v`` (>= 0 is a set bit), least
significant bit first, ``ceil(numel / 8)`` bytes with the unused bits of the last byte zero, plus
one fp32 ``scale = mean(|v|)``; it decodes to ``scale * (+1 | -1)``. ``check_compression`` raises
ShardlineConfigError for an unknown option; ``padding_problem`` names a block whose padding bits
are set (its caller refuses it). Plain tensor arithmetic; nothing is pickled. The error-feedback
residual is the worker's (worker/compressor.py).

Design: docs/architecture.md, "BSP step" ("Gradient compression").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import dataplane_pb2 as dp

if TYPE_CHECKING:  # the codecs import torch when called: the dispatcher validates the option without it
    import torch

COMPRESSIONS = ("none", "bf16", "sign")


def check_compression(value: object) -> str:
    """``value`` if it names a compression (ShardlineConfigError quoting it otherwise)."""
    if value not in COMPRESSIONS:
        raise ShardlineConfigError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {value!r}")
    return value


def compression_of(spec) -> str:
    """A JobSpec's compression; a spec that predates the option (empty) compresses nothing."""
    return spec.compression or "none"


def sign_nbytes(numel: int) -> int:
    """Bytes of ``numel`` packed signs."""
    return (numel + 7) // 8


@dataclass(frozen=True, eq=False)
class SignBlock:
    """A gradient block as it travels under ``sign`` compression: ``packed`` (uint8, see the
    module docstring) signs of ``numel`` elements, each worth ``scale``."""

    numel: int
    scale: float
    packed: torch.Tensor

    def block_ref(self, tensor: str, index: int) -> dp.BlockRef:
        return dp.BlockRef(tensor=tensor, index=index, dtype=dp.SIGN1, numel=self.numel, nbytes=self.packed.numel(),
                           scale=self.scale)

    def payload(self) -> memoryview:
        return memoryview(self.packed.numpy()).cast("B")


def encode_signs(v: torch.Tensor) -> SignBlock:
    """Compress a 1-D float block: its signs and ``scale = mean(|v|)``, rounded to fp32 (the
    value the receiver decodes with, so ``decode_signs`` of the result is exactly what it adds)."""
    import torch

    v = v.detach().reshape(-1)
    n = v.numel()
    scale = float(torch.linalg.vector_norm(v.to(torch.float32), 1) / n) if n else 0.0
    bits = (v >= 0).numpy()
    packed = torch.from_numpy(np.packbits(bits, bitorder="little"))
    return SignBlock(n, scale, packed)


def decode_signs(packed: torch.Tensor, numel: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 block ``packed`` encodes (into ``out`` if given, a 1-D fp32 tensor of ``numel``)."""
    import torch

    bits = torch.from_numpy(np.unpackbits(packed.numpy(), count=numel, bitorder="little"))
    out = torch.empty(numel, dtype=torch.float32) if out is None else out
    out.copy_(bits)
    # 1 -> 2s - s = s, 0 -> -s: both exact in fp32
    return out.mul_(2.0 * scale).sub_(scale)


def padding_problem(packed: torch.Tensor, numel: int) -> str | None:
    """What is wrong with received packed signs (None: nothing): set bits past ``numel``."""
    used = numel % 8
    if used and int(packed[-1]) >> used:
        return f"the unused bits of the last byte of {numel} packed signs are not zero"
    return None
