"""The batch the training loop consumes, and the one collate function that builds it.

An example is ``(token ids, labels)`` of equal length; ``labels[j]`` is ``ids[j]`` where the loss
counts token ``j`` and ``IGNORE`` (-100, as Hugging Face labels) elsewhere (prompt, padding). The
model reads ``ids[:-1]`` and is scored on ``labels[1:]``: the target at position ``j`` is the label
of token ``j + 1``. Sequences are right-padded, which a causal model never attends to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["IGNORE", "Batch", "collate"]

IGNORE = -100


class Batch(NamedTuple):
    input_ids: torch.Tensor      # [B, T] int64, right-padded with pad_id
    targets: torch.Tensor        # [B, T] int64, the next token's label (IGNORE where no loss)
    loss_mask: torch.Tensor      # [B, T] bool, True exactly where the loss counts
    n_target_tokens: int         # loss_mask.sum()
    n_tokens: int = 0            # non-padding input tokens
    pad_id: int = 0


def collate(examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0) -> Batch:
    """Right-pad ``(ids, labels)`` examples (each at least 2 tokens) into a :class:`Batch`."""
    if not examples:
        raise ValueError("collate needs at least one example")
    t = max(len(ids) for ids, _ in examples) - 1
    if t < 1:
        raise ValueError("every example needs at least two tokens")
    input_ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), t), IGNORE, dtype=torch.long)
    n_tokens = 0
    for i, (ids, labels) in enumerate(examples):
        if len(ids) != len(labels):
            raise ValueError(f"example {i}: {len(ids)} tokens but {len(labels)} labels")
        n = len(ids) - 1
        input_ids[i, :n] = torch.tensor(ids[:-1], dtype=torch.long)
        targets[i, :n] = torch.tensor(labels[1:], dtype=torch.long)
        n_tokens += n
    loss_mask = targets != IGNORE
    return Batch(input_ids, targets, loss_mask, int(loss_mask.sum()), n_tokens, pad_id)
