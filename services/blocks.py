"""Splitting tensors into blocks and naming their ring keys.

A block is a contiguous slice of a tensor's flattened storage. Block ``i`` of a tensor with
``numel`` elements and block size ``B`` covers elements ``[i*B, min((i+1)*B, numel))``; a tensor
with ``numel <= B`` is one block. Block keys on the ring are ``CityHash64("{job}/{tensor}/{i}")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

import cityhash

from shardline.services.errors import ShardlineConfigError

T = TypeVar("T")

DEFAULT_BLOCK_ELEMENTS = 262_144  # 1 MiB of fp32
MAX_BLOCK_ELEMENTS = 64 * 1024 * 1024


@dataclass(frozen=True)
class BlockSlice:
    index: int
    start: int  # first element, in the flattened tensor
    stop: int   # one past the last element

    @property
    def numel(self) -> int:
        return self.stop - self.start


def validate_block_elements(block_elements: int) -> int:
    if not isinstance(block_elements, int) or isinstance(block_elements, bool):
        raise ShardlineConfigError(f"block_elements must be an integer, got {block_elements!r}")
    if not 1 <= block_elements <= MAX_BLOCK_ELEMENTS:
        raise ShardlineConfigError(
            f"block_elements must be in 1..{MAX_BLOCK_ELEMENTS}, got {block_elements!r}"
        )
    return block_elements


def num_blocks(numel: int, block_elements: int) -> int:
    """Number of blocks of a tensor with ``numel`` elements (a 0-element tensor still has one, empty)."""
    if numel < 0:
        raise ShardlineConfigError(f"numel must be >= 0, got {numel!r}")
    return max(1, -(-numel // block_elements))


def block_slices(numel: int, block_elements: int) -> list[BlockSlice]:
    validate_block_elements(block_elements)
    return [
        BlockSlice(i, i * block_elements, min((i + 1) * block_elements, numel))
        for i in range(num_blocks(numel, block_elements))
    ]


def block_slice(numel: int, block_elements: int, index: int) -> BlockSlice:
    n = num_blocks(numel, block_elements)
    if not 0 <= index < n:
        raise IndexError(f"block index {index} out of range for {n} blocks")
    return BlockSlice(index, index * block_elements, min((index + 1) * block_elements, numel))


def block_key(job: str, tensor: str, index: int) -> str:
    return f"{job}/{tensor}/{index}"


def block_hash(job: str, tensor: str, index: int) -> int:
    """The block's 64-bit position on the ring."""
    return cityhash.CityHash64(block_key(job, tensor, index))


def runs_of(items: Sequence[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """``items`` in order, in runs of about ``limit`` (``size(item)`` each): a run ends once it
    reaches ``limit`` (a frame of blocks, a piece of a copy); [] for no items."""
    runs, run, run_size = [], [], 0
    for item in items:
        run.append(item)
        run_size += size(item)
        if run_size >= limit:
            runs.append(run)
            run, run_size = [], 0
    if run:
        runs.append(run)
    return runs
