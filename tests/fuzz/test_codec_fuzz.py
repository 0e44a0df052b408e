"""Property-based fuzzing of the data-plane frame codec (services/frame.py), without a network.

Any bytes a peer may send either decode to a header that validate_header accepts or raise
FrameError / FrameTooLargeError (ConnectionError when the stream ends first); the codec never
asks for a buffer larger than the limits allow; valid frames round-trip bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from fuzzlib import ByteSink, ByteStream, U32_MAX, encode, headers, mutations, prefix, wire_tensors
from shardline.services import frame
from shardline.services.errors import FrameError, FrameTooLargeError
from shardline.services.pb import dataplane_pb2 as dp

# Small limits make the "too large" edges reachable with small examples.
limits_strategy = st.builds(frame.FrameLimits, max_header_bytes=st.integers(1, 4096),
                            max_payload_bytes=st.integers(0, 1 << 20), max_blocks=st.integers(0, 8))
chunking = st.lists(st.integers(1, 64), min_size=1, max_size=4)
SKIP_CHUNK = getattr(frame, "SKIP_CHUNK_BYTES", 1 << 20)


def assert_valid(header: frame.FrameHeader, limits: frame.FrameLimits) -> None:
    """What a header that passed validate_header guarantees its receiver."""
    assert header.op in frame.KNOWN_OPS
    assert (header.replicate_kind in frame.REPLICATE_KINDS) == (header.op == dp.OP_REPLICATE)
    if header.agg_ranks or header.agg_weights:   # an aggregated push: well formed
        assert header.op == dp.OP_PUSH
        assert frame.aggregate_problem(header.rank, header.weight or 1.0, header.agg_ranks, header.agg_weights) is None
    assert header.payload_bytes <= limits.max_payload_bytes
    assert len(header.blocks) <= limits.max_blocks
    total = 0
    for ref in header.blocks:
        if ref.zero:
            assert ref.nbytes == 0
        elif ref.nbytes:
            assert frame.wire_nbytes(ref.dtype, ref.numel) == ref.nbytes
        total += ref.nbytes
    assert total == header.payload_bytes


def read_frame(stream: ByteStream, limits: frame.FrameLimits):
    """recv_header on ``stream``: the header, or the exception it raised (any other type fails)."""
    try:
        header = frame.recv_header(stream, limits)
    except (FrameError, ConnectionError) as exc:
        return exc
    assert_valid(header, limits)
    return header


@given(data=st.binary(max_size=16), limits=limits_strategy)
@example(data=prefix(0), limits=frame.DEFAULT_LIMITS)
@example(data=prefix(U32_MAX), limits=frame.DEFAULT_LIMITS)
@example(data=b"SL\x01\x00\x00\x40\x00\x01", limits=frame.DEFAULT_LIMITS)
def test_decode_prefix_returns_a_bounded_length_or_raises_frame_error(data, limits):
    try:
        n = frame.decode_prefix(data, limits)
    except FrameError:
        return
    assert len(data) == 8 and data[:2] == frame.MAGIC
    assert 1 <= n <= limits.max_header_bytes


@given(st.binary(max_size=512))
def test_parse_header_of_any_bytes_is_a_header_or_frame_error(body):
    try:
        header = frame.parse_header(body)
    except FrameError:
        return
    assert isinstance(header, frame.FrameHeader)


@given(header=headers(), limits=st.one_of(st.just(frame.DEFAULT_LIMITS), limits_strategy))
def test_validate_header_accepts_only_consistent_bounded_headers(header, limits):
    try:
        frame.validate_header(header, limits)
    except FrameTooLargeError:
        assert header.payload_bytes > limits.max_payload_bytes or len(header.blocks) > limits.max_blocks
        return
    except FrameError:
        return
    assert_valid(header, limits)


@given(data=st.one_of(
    st.binary(max_size=256),
    st.builds(lambda n, body: prefix(n) + body, st.integers(0, U32_MAX), st.binary(max_size=256)),
    st.builds(lambda body, extra: prefix(len(body)) + body + extra, st.binary(max_size=256), st.binary(max_size=32)),
    st.builds(lambda h, extra: encode(h) + extra, headers(), st.binary(max_size=32)),
), limits=limits_strategy, chunks=chunking)
def test_recv_header_of_any_stream_never_allocates_past_the_header_limit(data, limits, chunks):
    stream = ByteStream(data, chunks)
    got = read_frame(stream, limits)
    if isinstance(got, ConnectionError):
        assert stream.left == 0, "recv_header gave up before the stream ended"
    # The prefix buffer, then at most one header buffer: never more than the limit asks for.
    assert stream.largest_view <= max(frame.PREFIX.size, limits.max_header_bytes)
    assert stream.largest_ask <= max(frame.PREFIX.size, limits.max_header_bytes)


@given(n=st.one_of(st.integers(0, 1 << 22), st.sampled_from([1 << 40, 2**64 - 1])), data=st.binary(max_size=4096),
       chunks=chunking)
def test_skip_bytes_reads_through_a_bounded_buffer(n, data, chunks):
    stream = ByteStream(data, chunks)
    try:
        frame.skip_bytes(stream, n)
    except ConnectionError:
        assert len(data) < n
    else:
        assert stream.left == len(data) - n
    assert stream.largest_view <= SKIP_CHUNK


@st.composite
def frames_with_payloads(draw):
    """A valid header of any op plus its blocks: tensors of any wire dtype and size (0 included)
    and zero-flag blocks, in any order."""
    header = draw(headers(consistent=True, max_blocks=0))
    blocks = draw(st.lists(st.one_of(wire_tensors(), st.builds(lambda n: ("zero", n), st.integers(0, 1 << 20))),
                           max_size=6))
    if draw(st.integers(0, 9)) == 0:  # now and then one large block: send_frame's multi-sendall path
        big = torch.frombuffer(bytearray(draw(st.binary(min_size=4, max_size=4)) * 20_000), dtype=torch.float32)
        blocks.insert(draw(st.integers(0, len(blocks))), big)
    return header, blocks


@given(frames_with_payloads(), chunking)
def test_send_frame_then_recv_header_and_payload_views_round_trip(spec, chunks):
    header, blocks = spec
    payloads = []
    for i, b in enumerate(blocks):
        if isinstance(b, tuple):
            header.blocks.append(frame.block_ref(f"t{i}", i, None, zero=True, numel=b[1]))
        else:
            header.blocks.append(frame.block_ref(f"t{i}", i, b, version=i))
            payloads.append(frame.tensor_bytes(b))
    sink = ByteSink()
    frame.send_frame(sink, header, payloads)
    stream = ByteStream(sink.data, chunks)
    got = frame.recv_header(stream)
    assert got == header, "the header did not survive the round trip"
    buf = bytearray(got.payload_bytes)
    frame.recv_exactly_into(stream, memoryview(buf))
    assert stream.left == 0
    views = frame.payload_views(buf, got.blocks)
    assert len(views) == len(blocks)
    for b, (ref, t) in zip(blocks, views):
        if isinstance(b, tuple):
            assert ref.zero and t is None and ref.numel == b[1]
        elif b.numel() == 0:
            assert t is None and ref.nbytes == 0
        else:
            assert t.dtype == b.dtype and t.numel() == b.numel()
            assert bytes(frame.tensor_bytes(t)) == bytes(frame.tensor_bytes(b)), "payload bytes changed"
            torch.testing.assert_close(t, b, rtol=0, atol=0, equal_nan=True)


@st.composite
def mutated_frames(draw):
    header, blocks = draw(frames_with_payloads())
    payloads = []
    for i, b in enumerate(blocks):
        if isinstance(b, tuple):
            header.blocks.append(frame.block_ref(f"t{i}", i, None, zero=True, numel=b[1]))
        else:
            header.blocks.append(frame.block_ref(f"t{i}", i, b))
            payloads.append(frame.tensor_bytes(b))
    sink = ByteSink()
    frame.send_frame(sink, header, payloads)
    return draw(mutations(bytes(sink.data)))


@given(mutated_frames(), st.one_of(st.just(frame.DEFAULT_LIMITS), limits_strategy), chunking)
def test_mutated_frames_are_refused_or_decode_to_a_consistent_header(data, limits, chunks):
    stream = ByteStream(data, chunks)
    got = read_frame(stream, limits)
    assert stream.largest_view <= max(frame.PREFIX.size, limits.max_header_bytes)
    if isinstance(got, Exception):
        return
    # A header that passed: its payload is exactly what its blocks add up to, and splitting a
    # buffer of that size into blocks works for every block (no exception, right sizes).
    buf = bytearray(got.payload_bytes)
    try:
        frame.recv_exactly_into(stream, memoryview(buf))
    except ConnectionError:
        assert stream.left == 0
        return
    for ref, t in frame.payload_views(buf, got.blocks):
        if t is None:
            assert ref.zero or ref.nbytes == 0
        else:
            assert t.numel() * t.element_size() == ref.nbytes
            if ref.dtype != dp.SIGN1:  # compressed blocks come as their packed bytes
                assert t.numel() == ref.numel and t.dtype == frame.TORCH_DTYPE[ref.dtype]


@given(headers(consistent=True))
def test_error_header_is_always_a_valid_frame(h):
    e = frame.error_header(h.request_id, dp.INTERNAL, h.message * 1000, epoch=h.epoch, step=h.step)
    sink = ByteSink()
    frame.send_frame(sink, e)
    got = frame.recv_header(ByteStream(sink.data))
    assert got.op == dp.OP_ERROR and len(got.message) <= 4096


def test_payload_views_refuses_a_buffer_shorter_than_the_header_claims():
    """payload_views trusts the header; a caller that passes a short buffer gets an exception
    (torch's ValueError), not a read past the end."""
    ref = dp.BlockRef(tensor="w", index=0, dtype=dp.FLOAT32, numel=8, nbytes=32)
    with pytest.raises(ValueError):
        frame.payload_views(bytearray(16), [ref])
