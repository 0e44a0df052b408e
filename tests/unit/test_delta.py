"""Element-level bf16 deltas, block checksums and the PS's delta history (no network)."""

from __future__ import annotations

import zlib

import pytest
import torch

from shardline.ps_server.delta_history import DeltaHistory, subscriber_blocks
from shardline.services import delta, frame
from shardline.services.blocks import block_slices
from shardline.services.errors import FrameError, ShardlineChecksumError, ShardlineConnectionError
from shardline.services.pb import dataplane_pb2 as dp
from shardline.worker.subscriber import SubscriberStats, _SubscriberClient
from shardline.worker.client import TransferStats


def _bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(torch.bfloat16)


def test_delta_round_trip_reconstructs_exactly():
    g = torch.Generator().manual_seed(3)
    base = torch.randn(1000, generator=g).to(torch.bfloat16)
    current = base.clone()
    idx = torch.tensor([0, 17, 511, 999])
    current[idx] = torch.randn(4, generator=g).to(torch.bfloat16)
    current[300] = -0.0 if float(base[300]) == 0.0 else 0.0   # a sign-of-zero change is a change too
    k, payload = delta.encode_delta(base, current)
    assert k == 5 and len(payload) == 6 * k
    rebuilt = base.clone()
    delta.apply_delta(rebuilt, k, payload)
    assert torch.equal(rebuilt.view(torch.int16), current.view(torch.int16))
    assert delta.checksum(rebuilt) == delta.checksum(current)


def test_delta_not_chosen_when_dense_is_smaller():
    base = _bf16([1.0] * 30)
    current = _bf16([2.0] * 10 + [1.0] * 20)   # a third changed: 6 bytes each > 2 bytes for every element
    assert delta.encode_delta(base, current) is None
    assert delta.encode_delta(base, base.clone()) == (0, b"")


def test_bad_delta_payload_is_refused_and_block_unchanged():
    block = _bf16([1.0, 2.0, 3.0] + [0.0] * 7)
    before = block.clone()
    k, payload = delta.encode_delta(block, _bf16([1.0, 5.0, 3.0] + [0.0] * 7))
    with pytest.raises(delta.DeltaError):
        delta.apply_delta(block, k, payload[:-1])           # truncated
    out_of_range = (70).to_bytes(4, "little") + payload[4:]
    with pytest.raises(delta.DeltaError):
        delta.apply_delta(block, k, out_of_range)             # index beyond the block
    assert torch.equal(block, before)


def test_checksum_is_crc32_of_the_value_bytes():
    v = _bf16([1.5, -2.0, 0.25])
    assert delta.checksum(v) == zlib.crc32(v.view(torch.int16).numpy().tobytes())
    f = torch.tensor([1.0, 2.0])
    assert delta.checksum(f) == zlib.crc32(f.numpy().tobytes())


def test_frame_validation_of_delta_blocks():
    ref = dp.BlockRef(tensor="w", index=0, dtype=dp.BF16_DELTA, numel=100, nbytes=12, delta_elements=2)
    frame.validate_header(dp.FrameHeader(op=dp.OP_REPLY, blocks=[ref], payload_bytes=12))
    with pytest.raises(FrameError, match="takes 12 bytes"):
        bad = dp.BlockRef(tensor="w", index=0, dtype=dp.BF16_DELTA, numel=100, nbytes=10, delta_elements=2)
        frame.validate_header(dp.FrameHeader(op=dp.OP_REPLY, blocks=[bad], payload_bytes=10))
    with pytest.raises(FrameError, match="pull replies only"):
        frame.validate_header(dp.FrameHeader(op=dp.OP_PUSH, blocks=[ref], payload_bytes=12))
    with pytest.raises(FrameError, match="into a block of"):
        big = dp.BlockRef(tensor="w", index=0, dtype=dp.BF16_DELTA, numel=1, nbytes=12, delta_elements=2)
        frame.validate_header(dp.FrameHeader(op=dp.OP_REPLY, blocks=[big], payload_bytes=12))


def test_history_is_bounded_by_bytes_and_versions():
    h = DeltaHistory(max_bytes=3 * 200, max_versions=2)
    img = lambda: torch.zeros(100, dtype=torch.bfloat16)   # 200 bytes
    h.record(("u", "j", "a", 0), 1, img())
    h.record(("u", "j", "a", 0), 2, img())
    h.record(("u", "j", "a", 0), 3, img())                  # the block's oldest version goes
    assert h.get(("u", "j", "a", 0), 1) is None and h.get(("u", "j", "a", 0), 3) is not None
    h.record(("u", "j", "b", 0), 1, img())
    h.record(("u", "j", "c", 0), 1, img())                  # over 600 bytes: least recently used goes
    assert h.bytes <= 600 and len(h) == 3
    assert h.get(("u", "j", "a", 0), 2) is None
    h.forget_job("u", "j")
    assert len(h) == 0 and h.bytes == 0
    off = DeltaHistory(max_bytes=0)
    off.record(("u", "j", "a", 0), 1, img())
    assert len(off) == 0


def test_subscriber_blocks_send_deltas_only_against_a_held_base():
    h = DeltaHistory(max_bytes=1 << 20)
    v1 = torch.randn(512).to(torch.bfloat16)
    v2 = v1.clone()
    v2[[3, 400]] = _bf16([7.0, -7.0])
    (ref, payload), = subscriber_blocks(h, ("u", "j"), [("w", 0, 1, v1)], {})
    assert ref.dtype == dp.BFLOAT16 and ref.checksum == delta.checksum(v1) and len(payload) == 1024
    (ref, payload), = subscriber_blocks(h, ("u", "j"), [("w", 0, 2, v2)], {("w", 0): 1})
    assert ref.dtype == dp.BF16_DELTA and ref.delta_elements == 2 and ref.base_version == 1 and len(payload) == 12
    assert ref.nbytes == 12 and ref.checksum == delta.checksum(v2)
    # a base the history does not hold (older, or another node's): dense
    (ref, _), = subscriber_blocks(h, ("u", "j"), [("w", 0, 2, v2)], {("w", 0): 0})
    assert ref.dtype == dp.BFLOAT16
    # fp32 blocks are dense with a checksum, never recorded
    f = torch.randn(8)
    (ref, _), = subscriber_blocks(h, ("u", "j"), [("f", 0, 1, f)], {("f", 0): 0})
    assert ref.dtype == dp.FLOAT32 and ref.checksum == delta.checksum(f)


class _Sock:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def recv_into(self, view, n):
        chunk = self.data[self.pos:self.pos + n]
        view[:len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)

    def settimeout(self, _):
        pass


class _Conn:
    def __init__(self, data: bytes):
        self.sock = _Sock(data)

    def close(self):
        pass


def _receiver(values: dict[str, torch.Tensor], versions: dict) -> _SubscriberClient:
    """A subscriber client holding ``values`` (its back buffer) at ``versions``, without a cluster."""
    c = object.__new__(_SubscriberClient)
    c.job, c._values, c._versions, c._conns = "j", values, dict(versions), {}
    c._slices = {n: block_slices(v.numel(), 64) for n, v in values.items()}
    c.stats, c.sub_stats, c.failed, c.replies = TransferStats(), SubscriberStats(), {}, []
    return c


def _reply(sent):
    reply = dp.FrameHeader(op=dp.OP_REPLY, blocks=[ref for ref, _ in sent])
    return reply, b"".join(bytes(p) for _, p in sent)


def test_receiver_installs_a_good_delta_and_rejects_a_corrupted_payload():
    h = DeltaHistory(max_bytes=1 << 20)
    v1 = torch.randn(128).to(torch.bfloat16)
    v2 = v1.clone()
    v2[[5, 70]] = _bf16([3.0, -3.0])
    blocks = [("w", 0, 1, v1[:64].clone()), ("w", 1, 1, v1[64:].clone())]
    subscriber_blocks(h, ("u", "j"), blocks, {})                       # the node sent version 1 before
    sent = subscriber_blocks(h, ("u", "j"), [("w", 0, 2, v2[:64].clone()), ("w", 1, 2, v2[64:].clone())],
                             {("w", 0): 1, ("w", 1): 1})
    assert all(ref.dtype == dp.BF16_DELTA for ref, _ in sent)
    reply, payload = _reply(sent)

    back = v1.clone()
    c = _receiver({"w": back}, {("w", 0): 1, ("w", 1): 1})
    expected = {("w", i): s for i, s in enumerate(c._slices["w"])}
    c._receive_blocks(_Conn(payload), "ps1", reply, dict(expected))
    assert torch.equal(back.view(torch.int16), v2.view(torch.int16))
    assert c._versions == {("w", 0): 2, ("w", 1): 2} and c.sub_stats.checksum_failures == 0

    corrupted = bytearray(payload)
    corrupted[-1] ^= 0x40                                               # a value byte of block 1
    back = v1.clone()
    c = _receiver({"w": back}, {("w", 0): 1, ("w", 1): 1})
    c._receive_blocks(_Conn(bytes(corrupted)), "ps1", reply, dict(expected))
    assert c.sub_stats.checksum_failures == 1
    assert c._versions == {("w", 0): 2}        # block 1 is forgotten: its next pull is dense
    assert torch.equal(back[:64].view(torch.int16), v2[:64].view(torch.int16))

    dense = subscriber_blocks(DeltaHistory(0), ("u", "j"), [("w", 1, 2, v2[64:].clone())], {})
    reply, payload = _reply(dense)
    corrupted = bytearray(payload)
    corrupted[0] ^= 1
    c._receive_blocks(_Conn(bytes(corrupted)), "ps1", reply, {("w", 1): expected[("w", 1)]})
    assert c.failed[("w", 1)] == 2                                      # failures in a row, delta or dense
    with pytest.raises(ShardlineChecksumError, match="failed its checksum 3 times"):
        c._receive_blocks(_Conn(bytes(corrupted)), "ps1", reply, {("w", 1): expected[("w", 1)]})


def test_receiver_refuses_a_delta_against_another_base():
    h = DeltaHistory(max_bytes=1 << 20)
    v1 = torch.randn(64).to(torch.bfloat16)
    v2 = v1.clone()
    v2[0] = 9.0
    subscriber_blocks(h, ("u", "j"), [("w", 0, 1, v1.clone())], {})
    reply, payload = _reply(subscriber_blocks(h, ("u", "j"), [("w", 0, 2, v2)], {("w", 0): 1}))
    c = _receiver({"w": v1.clone()}, {("w", 0): 0})                     # it holds version 0, not 1
    with pytest.raises(ShardlineConnectionError, match="unexpected block"):
        c._receive_blocks(_Conn(payload), "ps1", reply, {("w", 0): c._slices["w"][0]})
