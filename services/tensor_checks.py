"""Fast whole-tensor checks on the push path (64 MB gradients go through these every step)."""

from __future__ import annotations

import struct

import numpy as np
import torch

try:  # services/_copycheck.c, built by the install; without it copy_checked takes two passes
    from shardline.services import _copycheck
except ImportError:  # pragma: no cover - tests/unit/test_tensor_checks.py fails where it is missing
    _copycheck = None

# services/_copycheck.c's receive from a socket that checks float32 values as they land (None: the
# extension is missing, or was built before it had one; receivers then check after the receive).
recv_f32 = getattr(_copycheck, "recv_f32", None)

# Tensors smaller than this are concatenated to be checked together (first_nonfinite).
CONCAT_BELOW_BYTES = 64 << 10


def all_finite(t: torch.Tensor) -> bool:
    """True if no element is NaN or +-Inf.

    A finite sum proves every element finite (NaN and Inf propagate), and costs a tenth of
    ``isfinite(t).all()``; only when the sum is not finite (NaN/Inf present, or an overflow of
    large finite values) is the exact elementwise check needed.

    A contiguous float32 CPU tensor (every fp32 gradient and block) sums its squares: numpy's
    ``dot``, one fused multiply-add pass on the calling thread, about 2.5x the speed of a column
    sum on a cache-hot MiB (a block a TCP push is checked in right after it landed). Not
    torch's OpenMP pool: after each parallel region libgomp's workers spin for milliseconds on
    the other cores, which is where the data-plane peer is copying the bytes of this very push
    (measured on 2 cores: a 64 MiB push at ~0.7 of a raw socket with the torch sum, ~0.9 with
    numpy's; bench/README.md).
    """
    if t.numel() == 0:
        return True
    if t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous():
        if _finite_squares(t.detach().reshape(-1).numpy()):
            return True
    elif bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy ``src`` into ``dst`` (equal shapes) and return True if no copied element is NaN or
    +-Inf. What is checked is the copy: a value the source changes meanwhile (another process's
    shared memory) is either kept and checked, or not kept at all.

    Contiguous float32 CPU tensors (every fp32 block a one-copy push takes) go through one pass
    of the C kernel (services/_copycheck.c: each value loaded once, stored and tested in a
    register, the GIL released; :func:`copy_span_checked`); anything else is copied and then
    checked with :func:`all_finite`."""
    if (dst.dtype == src.dtype == torch.float32 and dst.device.type == src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous() and dst.shape == src.shape):
        return copy_span_checked(dst.detach().numpy(), src.detach().numpy())
    dst.copy_(src)
    return all_finite(dst)


def copy_span_checked(dst, src, start: int = 0) -> bool:
    """Copy bytes ``src`` into ``dst`` (writable, the same length): a span of a float32 array that
    begins at its byte ``start``. True if no float32 value lying wholly in the span is NaN or
    +-Inf, checked in the copy as it is made (the C kernel) or after it (the fallback). A value cut
    by either end of the span is copied, not checked: see :func:`value_finite_at`."""
    if _copycheck is not None:
        return _copycheck.copy_f32(dst, src, start)
    dst = memoryview(dst).cast("B")
    dst[:] = memoryview(src).cast("B")
    head = (-start) % 4
    words = max(0, len(dst) - head) // 4
    return not words or all_finite(torch.frombuffer(dst, dtype=torch.float32, count=words, offset=head))


def value_finite_at(buffer, offset: int) -> bool:
    """True if the float32 value in bytes ``offset:offset + 4`` of ``buffer`` is neither NaN nor +-Inf."""
    return struct.unpack_from("=I", buffer, offset)[0] & 0x7F800000 != 0x7F800000


def first_nonfinite(tensors: list[torch.Tensor]) -> int | None:
    """The index of the first of ``tensors`` (1-D) holding NaN or +-Inf; None if all are finite.

    Those under CONCAT_BELOW_BYTES are checked together: one concatenation and one ``all_finite``
    instead of a call each (a push of many small blocks pays the per-call cost, ~10 us, for each
    block otherwise); only if that finds a problem are they checked one by one to name the
    first. Larger ones are checked alone (concatenating them would copy them once more).
    """
    small = [i for i, t in enumerate(tensors) if t.numel() * t.element_size() < CONCAT_BELOW_BYTES]
    together = len(small) > 1 and all_finite(torch.cat([tensors[i] for i in small]))
    skip = set(small) if together else ()
    return next((i for i, t in enumerate(tensors) if i not in skip and not all_finite(t)), None)


def _finite_squares(a: np.ndarray) -> bool:
    """True if the sum of squares of ``a`` (1-D float32) is finite, which proves ``a`` finite
    (a NaN or Inf makes it NaN or Inf; squares cannot cancel); False means NaN/Inf or an overflow
    of large finite values, past about 1.8e19 in one element (the caller checks exactly)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.dot(a, a)))


def is_all_zero(t: torch.Tensor) -> bool:
    """True if every element is exactly zero (-0.0 counts as zero)."""
    if t.numel() == 0:
        return True
    if bool(t[0] != 0):  # dense gradients answer here without a scan
        return False
    if t.dtype == torch.float32 and t.is_contiguous():
        return not t.numpy().any()
    return not bool(t.any())


def zero_parts(flat: torch.Tensor, bounds: list[tuple[int, int]]) -> list[bool]:
    """``is_all_zero(flat[start:stop])`` for each of ``bounds`` (a 1-D tensor's blocks). Dense
    gradients answer with one gather of every block's first element instead of a scan each (by
    numpy for float32: a torch gather's fixed cost is ~10 us, paid for every tensor of every push)."""
    numel = flat.numel()
    if not bounds or any(not 0 <= start < stop <= numel for start, stop in bounds):
        return [is_all_zero(flat[start:stop]) for start, stop in bounds]
    starts = [start for start, _ in bounds]
    if flat.dtype == torch.float32 and flat.is_contiguous():
        values = flat.numpy()
        if len(bounds) == 1:  # a one-block tensor (most of a model's): no gather, no slice if dense
            start, stop = bounds[0]
            return [False if values[start] != 0 else is_all_zero(flat[start:stop])]
        firsts = (values[starts] != 0).tolist()
    else:
        firsts = (flat[torch.tensor(starts)] != 0).tolist()
    return [False if first else is_all_zero(flat[start:stop]) for first, (start, stop) in zip(firsts, bounds)]
