"""Shared pieces of the fuzz tests: in-memory sockets that record what the codec asks of them,
and hypothesis strategies for frame headers, tensors and mutations."""

from __future__ import annotations

import struct

import torch
from hypothesis import settings
from hypothesis import strategies as st

from shardline.services import frame
from shardline.services.pb import dataplane_pb2 as dp

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
ITEMSIZE = {dp.FLOAT32: 4, dp.FLOAT16: 2, dp.BFLOAT16: 2}
WIRE_DTYPES = sorted(ITEMSIZE)
ALL_OPS = sorted(dp.Op.values())


def scaled(n: int) -> int:
    """An example count ``n`` relative to the ci profile's 60 (tests/fuzz/conftest.py), for
    properties that ask for fewer examples than the profile's (each costs a round trip)."""
    return max(1, n * settings().max_examples // 60)


class ByteStream:
    """A read-only "socket" over a byte string: ``recv_into`` hands out at most ``chunks[i]`` bytes
    per call (partial reads), records every size asked for and every buffer length it was given,
    and returns 0 (peer closed) at the end."""

    def __init__(self, data: bytes, chunks=(1 << 30,)):
        self.data = memoryview(bytes(data))
        self.pos = 0
        self.chunks = list(chunks) or [1 << 30]
        self.calls = 0
        self.largest_view = 0   # the largest buffer any recv_into was handed
        self.largest_ask = 0

    def recv_into(self, view, nbytes: int = 0) -> int:
        n = nbytes or len(view)
        self.largest_view = max(self.largest_view, len(view))
        self.largest_ask = max(self.largest_ask, n)
        limit = self.chunks[self.calls % len(self.chunks)]
        self.calls += 1
        take = min(n, len(view), limit, len(self.data) - self.pos)
        view[:take] = self.data[self.pos:self.pos + take]
        self.pos += take
        return take

    def settimeout(self, _timeout) -> None:  # recv_exactly_into with a deadline sets it
        pass

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


class ByteSink:
    """A write-only "socket" collecting what ``send_frame`` sends."""

    def __init__(self):
        self.data = bytearray()
        self.sends = 0

    def sendall(self, b) -> None:
        self.data += bytes(b)
        self.sends += 1


def prefix(header_len: int, magic: bytes = frame.MAGIC, version: int = frame.FORMAT_VERSION, flags: int = 0) -> bytes:
    return struct.pack(">2sBBI", magic, version, flags, header_len)


def encode(header: frame.FrameHeader, payload: bytes = b"") -> bytes:
    """A frame's bytes exactly as given: ``header.payload_bytes`` is left as the header says."""
    return frame.encode_prefix_and_header(header) + payload


# --- strategies -------------------------------------------------------------------------------
edge_u32 = st.one_of(st.integers(0, 4), st.sampled_from([2**31, U32_MAX]), st.integers(0, U32_MAX))
edge_u64 = st.one_of(st.integers(0, 4), st.sampled_from([2**32, 2**40, 2**63, U64_MAX]), st.integers(0, U64_MAX))
any_double = st.floats(allow_nan=True, allow_infinity=True)
short_text = st.text(max_size=12)


@st.composite
def block_refs(draw, consistent: bool | None = None):
    """A BlockRef; ``consistent`` True: dtype on the whitelist and nbytes = numel * itemsize."""
    ok = draw(st.booleans()) if consistent is None else consistent
    ref = dp.BlockRef(tensor=draw(short_text), index=draw(edge_u32), version=draw(edge_u64),
                      has=draw(st.booleans()), step=draw(edge_u64))
    if ok:
        zero = draw(st.booleans())
        ref.dtype = draw(st.sampled_from(WIRE_DTYPES))
        ref.numel = draw(st.integers(0, 64))
        ref.nbytes = 0 if zero else ref.numel * ITEMSIZE[ref.dtype]
        ref.zero = zero
    else:
        ref.dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 99]))
        ref.numel = draw(edge_u64)
        ref.nbytes = draw(edge_u64)
        ref.zero = draw(st.booleans())
    ref.ranks.extend(draw(st.lists(edge_u32, max_size=3)))
    return ref


@st.composite
def headers(draw, consistent: bool | None = None, max_blocks: int = 6):
    """A FrameHeader with any field values; ``consistent`` True: one that validate_header accepts."""
    h = frame.FrameHeader(
        op=draw(st.sampled_from([o for o in ALL_OPS if o != dp.OP_UNSPECIFIED]) if consistent
                else st.one_of(st.sampled_from(ALL_OPS), st.integers(0, 2**31 - 1))),
        request_id=draw(edge_u64), job=draw(short_text), epoch=draw(edge_u64), step=draw(edge_u64),
        rank=draw(edge_u32), weight=draw(any_double), min_step=draw(edge_u64),
        wait_timeout_seconds=draw(any_double), has_lr=draw(st.booleans()), lr=draw(any_double),
        node=draw(short_text), replicate_kind=draw(st.integers(0, 7)),
        code=draw(st.sampled_from(sorted(dp.ErrorCode.values()))),
        message=draw(short_text), auth=draw(st.binary(max_size=8)),
    )
    if consistent:  # one kind on a replicate frame, none on any other
        h.replicate_kind = (draw(st.sampled_from(sorted(frame.REPLICATE_KINDS))) if h.op == dp.OP_REPLICATE
                            else dp.REPLICATE_KIND_UNSPECIFIED)
        if h.op == dp.OP_PUSH and draw(st.booleans()):
            aggregate(draw, h)
    elif draw(st.booleans()):   # any ranks and weights, or a well-formed aggregate on any op
        h.agg_ranks.extend(draw(st.lists(edge_u32, max_size=4)))
        h.agg_weights.extend(draw(st.lists(any_double, max_size=4)))
    elif draw(st.booleans()):
        aggregate(draw, h)
    h.blocks.extend(draw(st.lists(block_refs(consistent=consistent), max_size=max_blocks)))
    if consistent or (consistent is None and draw(st.booleans())):
        h.payload_bytes = sum(r.nbytes for r in h.blocks if not r.zero) % 2**64  # a wrapped sum is a lie too
    else:
        h.payload_bytes = draw(edge_u64)
    return h


def aggregate(draw, h: frame.FrameHeader) -> None:
    """Make ``h`` a well-formed aggregated push's header as to its ranks and weights (frame.aggregate_problem)."""
    others = draw(st.lists(edge_u32.filter(lambda r: r != h.rank), min_size=1, max_size=3, unique=True))
    ranks = sorted([h.rank, *others])
    weights = [draw(st.floats(min_value=1e-6, max_value=1e6)) for _ in ranks]
    h.weight = weights[ranks.index(h.rank)]
    h.agg_ranks.extend(ranks)
    h.agg_weights.extend(weights)


@st.composite
def wire_tensors(draw, max_numel: int = 300):
    """A 1-D float32/float16/bfloat16 tensor of any bit patterns (NaN, Inf, subnormals included)."""
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    itemsize = torch.tensor([], dtype=dtype).element_size()
    numel = draw(st.one_of(st.integers(0, max_numel), st.just(0)))
    raw = draw(st.binary(min_size=numel * itemsize, max_size=numel * itemsize))
    return torch.frombuffer(bytearray(raw), dtype=dtype) if numel else torch.empty(0, dtype=dtype)


@st.composite
def mutations(draw, data: bytes) -> bytes:
    """``data`` with bit flips, a cut, bytes inserted or removed, or its header-length field changed."""
    data = bytearray(data)
    kind = draw(st.sampled_from(["flip", "truncate", "length", "insert", "delete", "mix"]))
    rounds = draw(st.integers(1, 4)) if kind == "mix" else 1
    for _ in range(rounds):
        k = kind if kind != "mix" else draw(st.sampled_from(["flip", "truncate", "length", "insert", "delete"]))
        if not data:
            break
        if k == "flip":
            for _ in range(draw(st.integers(1, 8))):
                i = draw(st.integers(0, len(data) - 1))
                data[i] ^= 1 << draw(st.integers(0, 7))
        elif k == "truncate":
            data = data[:draw(st.integers(0, len(data) - 1))]
        elif k == "length" and len(data) >= 8:
            n = draw(st.one_of(st.integers(0, 64), st.sampled_from([0, 1, 2**20, 2**22, 2**22 + 1, U32_MAX]),
                               st.integers(0, U32_MAX)))
            data[4:8] = struct.pack(">I", n)
        elif k == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif k == "delete":
            i = draw(st.integers(0, len(data) - 1))
            del data[i:i + draw(st.integers(1, 16))]
    return bytes(data)
