"""A worker's gradient compression for its job's pushes (``bf16``, stateless; ``sign``, with the
error-feedback residuals); services/compression.py holds the encodings.

Contract: with ``sign``, what a block sent summed over steps is what it computed minus its
current residual. A zero block (None) stays a zero flag and keeps its residual. A block encoded
again for the same BSP ``step`` gets the encoding it got the first time, residual untouched (the
PS counts a rank's first push of a block per step). Residuals live on the worker only: a
restarted worker starts from zero.

Design: docs/architecture.md, "BSP step" ("Gradient compression").
"""

from __future__ import annotations

import torch

from shardline.services.compression import SignBlock, check_compression, decode_signs, encode_signs

Key = tuple[str, int]


class GradientCompressor:
    """One job's compression on one worker (not thread-safe: the client's push path drives it)."""

    def __init__(self, kind: str):
        self.kind = check_compression(kind)
        self.residuals: dict[Key, torch.Tensor] = {}   # sign: fp32 error feedback per block
        self._sent: dict[Key, tuple[int, SignBlock]] = {}  # sign: the last step encoded and its encoding

    def encode(self, blocks: dict[Key, torch.Tensor | None], step: int | None
               ) -> dict[Key, torch.Tensor | SignBlock | None]:
        """What to push for ``blocks`` (see the module docstring). ``step``: the step they
        belong to (None, ASP: every call is a new update)."""
        if self.kind == "none":
            return dict(blocks)
        if self.kind == "bf16":
            return {k: g.to(torch.bfloat16) if g is not None and g.dtype == torch.float32 else g
                    for k, g in blocks.items()}
        return {k: None if g is None else self._sign(k, g, step) for k, g in blocks.items()}

    def _sign(self, key: Key, g: torch.Tensor, step: int | None) -> SignBlock:
        sent = self._sent.get(key)
        if step is not None and sent is not None and sent[0] == step:
            return sent[1]
        e = self.residuals.get(key)
        if e is None or e.numel() != g.numel():
            e = self.residuals[key] = torch.zeros(g.numel(), dtype=torch.float32)
        v = e.add_(g)                      # v = g + e, in the residual's buffer
        block = encode_signs(v)
        v.sub_(decode_signs(block.packed, block.numel, block.scale))   # e = v - decode(encode(v))
        if step is not None:
            self._sent[key] = (step, block)
        return block
