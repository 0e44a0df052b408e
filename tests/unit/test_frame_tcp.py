"""The frame codec's TCP paths: gathered sends (``send_gathered``) and a float32 block received and
checked for NaN/Inf as it lands (``recv_f32_checked``), over real sockets (no daemon)."""

import socket
import threading
import time

import numpy as np
import pytest
import torch

from shardline.services import frame
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services import tensor_checks
from shardline.services.tensor_checks import recv_f32

needs_helper = pytest.mark.skipif(recv_f32 is None, reason="services/_copycheck.c is not built with recv_f32")


def test_a_built_extension_has_the_checked_receive():
    """An extension built before recv_f32 existed would leave TCP pushes checked in a pass of their
    own, unawares (test_tensor_checks fails where the extension is missing altogether)."""
    assert tensor_checks._copycheck is None or recv_f32 is not None, \
        "services/_copycheck.c was built before recv_f32: pip install -e ."


def _sender(fn):
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def _recv_all(sock, n: int) -> bytes:
    buf = bytearray(n)
    frame.recv_exactly_into(sock, memoryview(buf))
    return bytes(buf)


class _Trickle(socket.socket):
    """A socket whose sendmsg takes at most ``limit`` bytes per call, cutting buffers anywhere."""

    limit = 100_003

    def sendmsg(self, buffers, *args):
        out, left = [], self.limit
        for b in buffers:
            if left <= 0:
                break
            out.append(memoryview(b)[:left])
            left -= len(out[-1])
        return super().sendmsg(out, *args)


def test_a_large_frame_goes_out_whole_through_gathered_sends(pair):
    a, b = pair
    blocks = [torch.randn(n) for n in (300_000, 1, 70_000, 5)]
    header = frame.FrameHeader(op=dp.OP_PUSH, request_id=3, job="j")
    for i, t in enumerate(blocks):
        header.blocks.append(frame.block_ref("w", i, t))
    sender = _sender(lambda: frame.send_frame(a, header, [frame.tensor_bytes(t) for t in blocks]))
    got = frame.recv_header(b)
    payload = _recv_all(b, got.payload_bytes)
    sender.join()
    assert got.payload_bytes == sum(t.numel() * 4 for t in blocks)
    assert payload == b"".join(t.numpy().tobytes() for t in blocks)


def test_partial_sendmsg_calls_resume_mid_buffer():
    raw_a, b = socket.socketpair()
    a = _Trickle(raw_a.family, raw_a.type, fileno=raw_a.detach())
    try:
        parts = [bytes([i]) * n for i, n in enumerate((250_001, 3, 0, 99_999, 1 << 20))]
        sender = _sender(lambda: frame.send_gathered(a, parts))
        got = _recv_all(b, sum(map(len, parts)))
        sender.join()
        assert got == b"".join(parts)
    finally:
        a.close()
        b.close()


def test_a_peer_that_reads_a_trickle_cannot_hold_the_sender_past_its_timeouts(pair):
    a, b = pair
    stop = threading.Event()

    def trickle():  # reads a little more often than the timeout: each send goes on, the frame crawls
        while not stop.is_set():
            try:
                b.recv(1 << 20)
            except OSError:
                return
            time.sleep(0.1)

    reader = _sender(trickle)
    a.settimeout(0.2)
    parts = [b"\0" * (4 << 20)] * 3
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            frame.send_gathered(a, parts)
        assert time.monotonic() - started < 0.2 * len(parts) + 1.0  # T per buffer, as a sendall each
        assert a.gettimeout() == 0.2
    finally:
        stop.set()
        a.close()
        reader.join(5)


@needs_helper
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
def test_a_block_is_received_whole_and_checked(pair, bad):
    a, b = pair
    values = np.random.default_rng(0).standard_normal(300_001).astype(np.float32)
    if bad is not None:
        values[123_457] = bad
    data = values.tobytes()
    # cut into pieces at odd offsets, so values straddle the receiver's reads
    sender = _sender(lambda: [a.sendall(data[i:i + 65_537]) or time.sleep(0.001) for i in range(0, len(data), 65_537)])
    dest = torch.empty(300_001)
    finite = frame.recv_f32_checked(b, frame.tensor_bytes(dest), time.monotonic() + 30)
    sender.join()
    assert finite is (bad is None)
    assert dest.numpy().tobytes() == data


@needs_helper
def test_a_value_cut_between_two_reads_is_checked(pair):
    a, b = pair
    data = np.array([1.0, float("nan"), 2.0], dtype=np.float32).tobytes()
    a.sendall(data[:6])  # the NaN's first two bytes
    sender = _sender(lambda: time.sleep(0.05) or a.sendall(data[6:]))
    dest = torch.empty(3)
    assert frame.recv_f32_checked(b, frame.tensor_bytes(dest), time.monotonic() + 10) is False
    sender.join()


@needs_helper
def test_a_peer_that_closes_early_or_stalls_ends_the_read(pair):
    a, b = pair
    a.sendall(b"\0" * 8)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="8 of 16 bytes"):
        frame.recv_f32_checked(b, memoryview(bytearray(16)), time.monotonic() + 0.2)
    assert 0.15 < time.monotonic() - started < 5
    b.settimeout(0.2)  # without a deadline, the socket's timeout bounds the read
    with pytest.raises(TimeoutError):
        frame.recv_f32_checked(b, memoryview(bytearray(16)))
    a.sendall(b"\0" * 4)
    a.close()
    with pytest.raises(ConnectionError, match="after 4 of 16 bytes"):
        frame.recv_f32_checked(b, memoryview(bytearray(16)), time.monotonic() + 10)


def test_only_sockets_receive_checked(pair):
    class NotASocket:
        def recv_into(self, view, n):
            return 0

    assert not frame.receives_checked(NotASocket())
    assert frame.receives_checked(pair[0]) is (recv_f32 is not None)


@needs_helper
def test_a_large_read_with_a_deadline_arrives_whole_in_pieces_or_ends_the_read(pair):
    """recv_exactly_into with a deadline reads a large payload in C (recv_f32): any bytes, whole
    however they are cut, and the same errors as the Python loop for a stall or an early close."""
    a, b = pair
    n = frame.C_RECV_MIN_BYTES * 3 + 5
    data = bytes(np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8))   # NaN patterns included

    def trickle():
        for i in range(0, n, 50_001):
            a.sendall(data[i:i + 50_001])
            time.sleep(0.002)

    sender = _sender(trickle)
    buf = bytearray(n)
    frame.recv_exactly_into(b, memoryview(buf), time.monotonic() + 10)
    sender.join()
    assert bytes(buf) == data
    a.sendall(b"\0" * 8)
    with pytest.raises(TimeoutError, match=f"8 of {n} bytes"):
        frame.recv_exactly_into(b, memoryview(buf), time.monotonic() + 0.2)
    a.sendall(b"\0" * 4)
    a.close()
    with pytest.raises(ConnectionError, match=f"after 4 of {n} bytes"):
        frame.recv_exactly_into(b, memoryview(buf), time.monotonic() + 10)
