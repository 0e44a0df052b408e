import pytest
import torch

from shardline.services import frame, tensor_checks
from shardline.services.tensor_checks import all_finite, copy_checked, first_nonfinite, is_all_zero, zero_parts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_agrees_with_elementwise_check(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        t = torch.randn(1000, generator=g).to(dtype)
        pos = int(torch.randint(0, 1000, (1,), generator=g))
        choice = int(torch.randint(0, 4, (1,), generator=g))
        if choice == 1:
            t[pos] = float("nan")
        elif choice == 2:
            t[pos] = float("inf")
        elif choice == 3:
            t[pos] = -float("inf")
        assert all_finite(t) == bool(torch.isfinite(t).all())


def test_all_finite_when_the_sum_overflows():
    big = torch.full((10,), 3e38)  # every element finite, the float32 sum is not
    assert all_finite(big)
    assert all_finite(torch.empty(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_is_all_zero(dtype):
    z = torch.zeros(100, dtype=dtype)
    assert is_all_zero(z)
    z[0] = -0.0
    assert is_all_zero(z)
    z[99] = 1e-3
    assert not is_all_zero(z)
    z = torch.zeros(100, dtype=dtype)
    z[50] = float("nan")
    assert not is_all_zero(z)
    assert not is_all_zero(torch.ones(3, dtype=dtype))
    assert is_all_zero(torch.zeros(6, dtype=dtype)[::2])  # non-contiguous


@pytest.mark.parametrize("numel", [1, 1023, 1024, 1025, 4096 + 7, 262_144])
def test_all_finite_float32_anywhere_and_overflow(numel):
    """The float32 check sums squares: a NaN/Inf anywhere is found, and sums of squares that
    overflow (finite elements past ~1.8e19) fall back to the exact check."""
    for pos in {0, numel // 2, numel - 1}:
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = torch.ones(numel)
            t[pos] = bad
            assert not all_finite(t)
        assert all_finite(torch.ones(numel))
    big = torch.full((numel,), 3e38)
    big[::2] = -3e38
    assert all_finite(big)  # finite, though sums of it may overflow
    assert all_finite(torch.arange(float(2 * numel))[::2].contiguous())
    assert all_finite(torch.full((numel,), 2e19))  # one square overflows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_parts_agrees_with_is_all_zero_per_block(dtype):
    flat = torch.randn(40).to(dtype)
    flat[0:10] = 0            # all zero
    flat[10] = 0              # starts with zero, is not all zero
    flat[20:30] = -0.0        # negative zeros count as zero
    bounds = [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert zero_parts(flat, bounds) == [True, False, True, False]
    assert zero_parts(flat, bounds) == [is_all_zero(flat[a:b]) for a, b in bounds]
    assert zero_parts(flat, [(0, 0), (0, 10)]) == [True, True]  # an empty part: the per-block path
    assert zero_parts(flat, []) == []


def test_first_nonfinite_names_the_first_bad_tensor_of_many():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(int(n), generator=g) for n in torch.randint(1, 300, (40,), generator=g)]
    assert first_nonfinite(tensors) is None
    assert first_nonfinite([]) is None
    assert first_nonfinite([tensors[0]]) is None
    tensors[17][0] = float("nan")
    tensors[30][-1] = float("inf")
    assert first_nonfinite(tensors) == 17
    assert first_nonfinite(tensors[18:]) == 12
    assert first_nonfinite([tensors[30]]) == 0
    big = [torch.full((10,), 3e38), torch.full((10,), 3e38)]  # finite, their sum is not
    assert first_nonfinite(big) is None


def test_the_native_copy_check_is_built():
    """make test installs the package, which builds services/_copycheck.c; without it a one-copy
    push takes two passes over its bytes, so its absence is a failure here, not a skip."""
    assert tensor_checks._copycheck is not None, "shardline.services._copycheck is not built: pip install -e ."


@pytest.fixture(params=["native", "fallback"])
def copy_path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(tensor_checks, "_copycheck", None)
    return request.param


# every float32 bit pattern class: zeros, subnormals, normals up to the largest, NaNs (quiet,
# signalling, negative, with payload bits), infinities
_SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1.17e-38, 3.4028235e38, -3.4028235e38, 1.0, -2.5]
_BAD_BITS = [0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F800000, 0xFF800000]


@pytest.mark.parametrize("numel", [1, 7, 8, 15, 16, 17, 63, 64, 1000, 262_144 + 3])
def test_copy_checked_copies_exactly_and_finds_every_nonfinite_pattern(copy_path, numel):
    """Against torch: the copy equals the source bit for bit, and the answer equals
    isfinite(...).all(), for a bad value at the start, the middle or the end (vector bodies and
    scalar tails of every width)."""
    g = torch.Generator().manual_seed(numel)
    src = torch.randn(numel, generator=g) * 1e30
    src[: min(numel, len(_SPECIAL))] = torch.tensor(_SPECIAL[:numel])
    dst = torch.full((numel,), 7.0)
    assert copy_checked(dst, src)
    assert torch.equal(dst.view(torch.int32), src.view(torch.int32))
    for pos in sorted({0, numel // 2, numel - 1}):
        for bits in _BAD_BITS:
            bad = src.clone()
            bad.view(torch.int32)[pos] = torch.tensor(bits, dtype=torch.int64).to(torch.int32)
            dst = torch.zeros(numel)
            assert not copy_checked(dst, bad)
            assert torch.equal(dst.view(torch.int32), bad.view(torch.int32))  # copied in full all the same


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_copy_checked_other_dtypes_take_the_two_pass_path(dtype):
    src = torch.randn(100).to(dtype)
    dst = torch.empty(100, dtype=dtype)
    assert copy_checked(dst, src) and torch.equal(dst, src)
    src[50] = float("inf")
    assert not copy_checked(dst, src) and torch.equal(dst, src)


def test_copy_checked_non_contiguous_views(copy_path):
    src = torch.arange(20.0)[::2]
    dst = torch.empty(10)
    assert copy_checked(dst, src) and torch.equal(dst, src)
    src = torch.arange(20.0)
    src[4] = float("nan")
    assert not copy_checked(dst, src[::2])


def test_the_native_kernel_refuses_mismatched_or_overlapping_buffers():
    kernel = tensor_checks._copycheck
    a = torch.zeros(16).numpy()
    with pytest.raises(ValueError, match="equal lengths"):
        kernel.copy_f32(a[:8], a[8:15])
    with pytest.raises(ValueError, match="overlap"):
        kernel.copy_f32(a[:8], a[4:12])
    with pytest.raises(ValueError, match="start must be >= 0, got -1"):
        kernel.copy_f32(a[:8], a[8:], -1)
    with pytest.raises(TypeError):
        kernel.copy_f32(bytes(8), bytes(8))  # the destination must be writable
    assert kernel.copy_f32(a[:8], a[8:]) is True


def test_the_streaming_copy_keeps_every_byte_at_any_alignment_and_length():
    """copy_stream (a large pull placed in a client's memory, bypassing the node's caches): exact
    bytes whatever the alignment of either end, the length (under, at and past its 64-byte steps),
    and nothing written past the end (its refusals: the test below)."""
    kernel = tensor_checks._copycheck
    src = bytes(torch.randint(0, 256, (1 << 20 | 200,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).numpy())
    for dst_at in (0, 1, 4, 15, 16, 17):
        for src_at in (0, 3, 16):
            for n in (0, 1, 15, 16, 63, 64, 65, 127, 200, (1 << 20) + 7):
                dst = bytearray(n + 64)
                kernel.copy_stream(memoryview(dst)[dst_at:dst_at + n], src[src_at:src_at + n])
                assert dst[dst_at:dst_at + n] == src[src_at:src_at + n], (dst_at, src_at, n)
                assert not any(dst[:dst_at]) and not any(dst[dst_at + n:]), (dst_at, src_at, n)


@pytest.mark.parametrize("name", ["copy", "copy_stream"])
def test_the_byte_copies_refuse_mismatched_or_overlapping_buffers_and_a_readonly_destination(name):
    kernel = getattr(tensor_checks._copycheck, name)
    a = bytearray(64)
    with pytest.raises(ValueError, match=f"{name} needs equal lengths"):
        kernel(memoryview(a)[:8], bytes(7))
    with pytest.raises(ValueError, match=f"{name}: dst and src overlap"):
        kernel(memoryview(a)[:32], memoryview(a)[16:48])
    with pytest.raises(TypeError):
        kernel(bytes(8), bytes(8))  # the destination must be writable


def test_the_plain_copy_keeps_every_byte_below_and_above_its_gil_threshold():
    """copy (ring and region copies of the shm transport): exact bytes whether it keeps the GIL (under
    256 KiB) or lets other threads run (from 256 KiB), from read-only sources too (a peer's ring is
    mapped read-only)."""
    kernel = tensor_checks._copycheck
    src = bytes(torch.randint(0, 256, ((1 << 20) + 9,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7)).numpy())
    for n in (0, 1, 4095, (256 << 10) - 1, 256 << 10, (1 << 20) + 9):
        dst = bytearray(n + 8)
        kernel.copy(memoryview(dst)[3:3 + n], memoryview(src)[:n])
        assert dst[3:3 + n] == src[:n] and not any(dst[:3]) and not any(dst[3 + n:]), n


@pytest.mark.parametrize("start", [0, 1, 2, 3, 5])
def test_copy_span_checked_checks_whole_values_and_leaves_cut_ones(copy_path, start):
    """A span of a float32 array from its byte ``start``: every byte is copied; the answer covers
    exactly the values lying wholly in the span (checked against torch on those values); a value
    cut by either end is copied and left to value_finite_at."""
    from shardline.services.tensor_checks import copy_span_checked, value_finite_at

    values = torch.arange(1.0, 41.0)
    raw = bytearray(frame.tensor_bytes(values))
    end = len(raw) - 3
    for bad_value in (None, 0, 1, 9, 38, 39):   # which value is NaN (None: none)
        src = bytearray(raw)
        if bad_value is not None:
            src[4 * bad_value:4 * bad_value + 4] = frame.tensor_bytes(torch.tensor([float("nan")]))
        dst = bytearray(end - start)
        got = copy_span_checked(dst, memoryview(src)[start:end], start)
        assert dst == src[start:end]
        first_whole, last_whole = -(-start // 4), end // 4 - 1        # values wholly in [start, end)
        expected = bad_value is None or not first_whole <= bad_value <= last_whole
        assert got is expected, (bad_value, first_whole, last_whole)
        if bad_value is not None and start % 4 and bad_value == start // 4:
            assert not value_finite_at(src, 4 * bad_value)          # the cut value, checked by the caller
