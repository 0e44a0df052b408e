"""Frame codec: round trips and every malformed case, driven through a socketpair (no daemon)."""

import socket
import struct

import pytest
import torch

from shardline.services import frame
from shardline.services.errors import FrameError, FrameTooLargeError
from shardline.services.pb import dataplane_pb2 as dp


def _push_header(blocks):
    h = frame.FrameHeader(op=dp.OP_PUSH, request_id=7, job="j", epoch=3, step=2, rank=1, weight=2.5)
    for name, index, t in blocks:
        h.blocks.append(frame.block_ref(name, index, t))
    return h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_many_blocks(pair, dtype):
    a, b = pair
    tensors = [("w", 0, torch.randn(1000).to(dtype)), ("w", 1, torch.randn(17).to(dtype)), ("emb.weight", 5, torch.randn(3).to(dtype))]
    header = _push_header(tensors)
    header.blocks.append(frame.block_ref("z", 0, None, zero=True, numel=64))
    frame.send_frame(a, header, [frame.tensor_bytes(t) for _, _, t in tensors])
    got = frame.recv_header(b)
    assert got.op == dp.OP_PUSH and got.job == "j" and got.step == 2 and got.weight == 2.5
    buf = bytearray(got.payload_bytes)
    frame.recv_exactly_into(b, memoryview(buf))
    views = frame.payload_views(buf, got.blocks)
    for (name, index, t), (ref, v) in zip(tensors, views):
        assert (ref.tensor, ref.index) == (name, index)
        assert torch.equal(v, t)
    assert views[-1][1] is None and views[-1][0].zero


def test_large_payload_round_trip(pair):
    a, b = pair
    t = torch.randn(1 << 20)  # 4 MiB: exercises the multi-sendall path
    import threading

    sender = threading.Thread(target=frame.send_frame, args=(a, _push_header([("w", 0, t)]), [frame.tensor_bytes(t)]))
    sender.start()
    header = frame.recv_header(b)
    assert header.payload_bytes == t.numel() * 4
    dest = torch.empty_like(t)
    frame.recv_exactly_into(b, frame.tensor_bytes(dest))
    sender.join(10)
    assert torch.equal(dest, t)


def _raw(a, prefix_fields=None, body=b""):
    magic, version, flags, length = prefix_fields or (frame.MAGIC, frame.FORMAT_VERSION, 0, len(body))
    a.sendall(struct.pack(">2sBBI", magic, version, flags, length) + body)


def test_garbage_bytes_rejected(pair):
    a, b = pair
    a.sendall(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(FrameError, match="magic"):
        frame.recv_header(b)


def test_bad_version_and_flags(pair):
    a, b = pair
    _raw(a, (frame.MAGIC, 9, 0, 4), b"abcd")
    with pytest.raises(FrameError, match="version"):
        frame.recv_header(b)
    a2, b2 = socket.socketpair()
    _raw(a2, (frame.MAGIC, frame.FORMAT_VERSION, 1, 4), b"abcd")
    with pytest.raises(FrameError, match="flags"):
        frame.recv_header(b2)
    a2.close(), b2.close()


def test_header_too_large_rejected_before_allocation(pair):
    a, b = pair
    _raw(a, (frame.MAGIC, frame.FORMAT_VERSION, 0, 0xFFFFFFFF))
    with pytest.raises(FrameTooLargeError):
        frame.recv_header(b, frame.FrameLimits(max_header_bytes=1024))


def test_unparsable_header(pair):
    a, b = pair
    _raw(a, body=b"\xff\xff\xff\xff\xff")
    with pytest.raises(FrameError, match="not a valid FrameHeader"):
        frame.recv_header(b)


def test_truncated_frame(pair):
    a, b = pair
    body = frame.FrameHeader(op=dp.OP_PING).SerializeToString()
    a.sendall(struct.pack(">2sBBI", frame.MAGIC, 1, 0, len(body) + 10) + body)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        frame.recv_header(b)


def test_claimed_100gb_payload_is_refused():
    h = frame.FrameHeader(op=dp.OP_PUSH, payload_bytes=100 << 30)
    h.blocks.add(tensor="w", index=0, dtype=dp.FLOAT32, numel=25 << 30, nbytes=100 << 30)
    with pytest.raises(FrameTooLargeError, match="exceeds"):
        frame.validate_header(h, frame.FrameLimits(max_payload_bytes=1 << 30))


@pytest.mark.parametrize("mutate, match", [
    (lambda r: setattr(r, "dtype", 99), "dtype"),
    (lambda r: setattr(r, "dtype", dp.DTYPE_UNSPECIFIED), "dtype"),
    (lambda r: setattr(r, "nbytes", r.nbytes + 1), "itemsize"),
    (lambda r: setattr(r, "numel", r.numel * 2), "itemsize"),
])
def test_inconsistent_block_refs(mutate, match):
    t = torch.randn(8)
    h = _push_header([("w", 0, t)])
    h.payload_bytes = 32
    mutate(h.blocks[0])
    with pytest.raises(FrameError, match=match):
        frame.validate_header(h)


def test_payload_bytes_must_match_blocks():
    h = _push_header([("w", 0, torch.randn(8))])
    h.payload_bytes = 33
    with pytest.raises(FrameError, match="add up"):
        frame.validate_header(h)


def test_zero_flag_with_bytes_rejected():
    h = frame.FrameHeader(op=dp.OP_PUSH)
    h.blocks.add(tensor="w", index=0, dtype=dp.FLOAT32, numel=8, nbytes=32, zero=True)
    h.payload_bytes = 32
    with pytest.raises(FrameError, match="zero"):
        frame.validate_header(h)


def test_unknown_op_and_block_count_limit():
    with pytest.raises(FrameError, match="op"):
        frame.validate_header(frame.FrameHeader(op=77))
    h = frame.FrameHeader(op=dp.OP_PULL)
    for i in range(11):
        h.blocks.add(tensor="w", index=i)
    with pytest.raises(FrameTooLargeError, match="blocks"):
        frame.validate_header(h, frame.FrameLimits(max_blocks=10))


def test_skip_bytes_keeps_stream_aligned(pair):
    a, b = pair
    t = torch.randn(5000)
    frame.send_frame(a, _push_header([("w", 0, t)]), [frame.tensor_bytes(t)])
    frame.send_frame(a, frame.FrameHeader(op=dp.OP_PING, request_id=99))
    h = frame.recv_header(b)
    frame.skip_bytes(b, h.payload_bytes, bytearray(1000))
    assert frame.recv_header(b).request_id == 99


def test_a_gradient_to_replay_travels_only_in_replication_frames():
    for op in (dp.OP_PUSH, dp.OP_PULL, dp.OP_REPLY, dp.OP_COMMIT):
        h = frame.FrameHeader(op=op, request_id=1, job="j")
        h.blocks.append(dp.BlockRef(tensor="w", index=0, replay=True, zero=True))
        with pytest.raises(FrameError, match="replay"):
            frame.validate_header(h)
        h.blocks[0].replay = False
        h.blocks[0].lr = 0.1
        with pytest.raises(FrameError, match="replay"):
            frame.validate_header(h)
    h = frame.FrameHeader(op=dp.OP_REPLICATE, request_id=1, job="j", payload_bytes=16, replicate_kind=dp.REPLICATE_STEP)
    h.blocks.append(dp.BlockRef(tensor="w", index=0, dtype=dp.FLOAT32, numel=4, nbytes=16, replay=True, lr=0.1))
    frame.validate_header(h)
