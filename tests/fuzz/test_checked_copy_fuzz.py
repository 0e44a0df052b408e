"""Property-based fuzzing of the one-pass copy and NaN/Inf check (services/_copycheck.c through
tensor_checks) and of a float32 block received over shm with it (frame.recv_checked_into), against
torch: the bytes arrive exactly, and the answer is ``isfinite(...).all()`` of what arrived, however
the sender cut its writes (inline messages, ring chunks, ring wraps cutting values in two)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardline.services import frame, tensor_checks
from shardline.services.transport import shm

# NaNs (quiet, signalling, negative, with payload), infinities, and finite edge values
BIT_PATTERNS = [0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0x7F800000, 0xFF800000,
                0x00000000, 0x80000000, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000]


def poisoned(numel: int, seed: int, poison: list[tuple[int, int]]) -> torch.Tensor:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    bits = t.view(torch.int32)
    for pos, pattern in poison:
        bits[pos % numel] = torch.tensor(pattern, dtype=torch.int64).to(torch.int32)
    return t


poison_strategy = st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(BIT_PATTERNS)), max_size=3)


@pytest.mark.parametrize("path", ["native", "fallback"])
@given(numel=st.integers(1, 3000), seed=st.integers(0, 1000), poison=poison_strategy,
       start=st.integers(0, 40), cut=st.integers(0, 40))
def test_copy_span_checked_answers_for_exactly_the_whole_values(path, numel, seed, poison, start, cut):
    values = poisoned(numel, seed, poison)
    raw = bytes(frame.tensor_bytes(values))
    start, end = min(start, len(raw)), max(min(start, len(raw)), len(raw) - cut)
    dst = bytearray(end - start)
    kernel = tensor_checks._copycheck
    try:
        if path == "fallback":
            tensor_checks._copycheck = None
        got = tensor_checks.copy_span_checked(dst, memoryview(raw)[start:end], start)
    finally:
        tensor_checks._copycheck = kernel
    assert dst == raw[start:end]
    whole = values[-(-start // 4):end // 4]
    assert got == bool(torch.isfinite(whole).all())


@given(numel=st.integers(1, 60_000), seed=st.integers(0, 1000), poison=poison_strategy,
       splits=st.lists(st.integers(1, 200_000), max_size=4), lead=st.integers(0, 7))
def test_a_block_received_over_shm_is_checked_exactly(numel, seed, poison, splits, lead):
    """The sender writes ``lead`` unrelated bytes first (they shift the ring's offset), then the
    block cut at ``splits``: writes of up to 64 KiB go inline, longer ones through the ring."""
    values = poisoned(numel, seed, poison)
    data = bytes(frame.tensor_bytes(values))
    cuts = sorted({min(s, len(data)) for s in splits} | {0, len(data)})
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client, node = shm.ShmConnection(a, ring_bytes=shm.MIN_RING_BYTES), shm.ShmConnection(b, ring_bytes=shm.MIN_RING_BYTES)
    errors: list[BaseException] = []

    def send():
        try:
            if lead:
                client.sendall(b"\x00" * (shm.INLINE_MAX_BYTES + lead))
            for lo, hi in zip(cuts, cuts[1:]):
                client.sendall(data[lo:hi])
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        if lead:
            frame.recv_exactly_into(node, memoryview(bytearray(shm.INLINE_MAX_BYTES + lead)), time.monotonic() + 10)
        got = bytearray(len(data))
        finite = frame.recv_checked_into(node, memoryview(got), time.monotonic() + 10)
        sender.join(10)
        assert not sender.is_alive() and not errors, errors
        assert got == data
        assert finite == bool(torch.isfinite(values).all())
    finally:
        client.close()
        node.close()
