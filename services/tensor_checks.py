"""Fast whole-tensor checks on the push path (64 MB gradients go through these every step)."""

from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> bool:
    """True if no element is NaN or +-Inf.

    A finite sum proves every element finite (NaN and Inf propagate), and costs a tenth of
    ``isfinite(t).all()``; only when the sum is not finite (NaN/Inf present, or an overflow of
    large finite values) is the exact elementwise check needed.
    """
    if t.numel() == 0:
        return True
    if bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def is_all_zero(t: torch.Tensor) -> bool:
    """True if every element is exactly zero (-0.0 counts as zero)."""
    if t.numel() == 0:
        return True
    if bool(t[0] != 0):  # dense gradients answer here without a scan
        return False
    if t.dtype == torch.float32 and t.is_contiguous():
        return not t.numpy().any()
    return not bool(t.any())
