"""What every part of the block store shares: its error, a tensor's metadata, small helpers.

The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardline.services.compression import decode_signs
from shardline.services.errors import ErrorCode, RequestError

# A step's learning rates, one per parameter group; None: each group's own lr.
LRs = tuple[float, ...] | None


# A request the store refuses: the one type every data-plane server raises (services/errors.py).
StoreError = RequestError


# JobSpec tensor dtype -> how a block's value is stored (bfloat16: a frozen tensor's, dispatcher/jobs.py)
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    numel: int
    trainable: bool
    blocks: int
    group: int = 0       # the parameter group whose hyperparameters step it
    dtype: torch.dtype = torch.float32   # how its blocks' values are stored (bfloat16: a frozen one's)


def total_weight(weights) -> float:
    """The sum of a step's weights, exactly rounded (math.fsum): the same whatever order the
    pushes or commits that carry them arrived in."""
    return math.fsum(weights)


def as_fp32(ref, payload: torch.Tensor) -> torch.Tensor:
    """A pushed block's gradient in fp32: ``payload`` as ``ref`` (a PushRef) describes it, packed
    signs each worth +-``ref.scale`` if compressed (decoded). One block at most."""
    if ref.scale is None:
        return payload.to(torch.float32)
    return decode_signs(payload, ref.numel, ref.scale)


def clone_state(state: dict) -> dict:
    """A private copy of a block's optimizer state (tensors cloned, counters as they are)."""
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def lacking(keys: list, message: str) -> StoreError:
    """UNAVAILABLE for a copy holder that lacks the versions of ``keys`` a frame builds on; the
    keys travel along (``.keys``) so the holder can ask its primary for them (a sync)."""
    error = StoreError(ErrorCode.UNAVAILABLE, message)
    error.keys = list(keys)
    return error
