"""Data-plane frame codec: an 8-byte prefix, a protobuf ``FrameHeader``, then raw tensor bytes.

Prefix (big-endian): magic ``b"SL"``, format version (1), flags (0), uint32 header length.
The payload is the concatenation of the listed blocks' bytes, in header order; a block flagged
``zero`` carries no bytes. Everything a receiver needs to size its buffers is in the header, and
``validate_header`` checks it against ``FrameLimits`` *before* any payload is read or allocated:
dtype whitelist, ``numel * itemsize == nbytes`` (a compressed push block: ``nbytes`` is what its
``numel`` packed signs take, services/compression.py), ``sum(nbytes) == payload_bytes``, bounded
header, payload and block count.

Helpers here work on any object with ``recv_into``/``sendall`` (a socket), so the codec is tested
without a network. Nothing is pickled: headers are protobuf, payloads are raw little-endian
tensor bytes.
"""

from __future__ import annotations

import math
import socket
import struct
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from shardline.services import compression, delta
from shardline.services.errors import FrameError, FrameTooLargeError
from shardline.services.tensor_checks import recv_f32, value_finite_at
from shardline.services.transport.base import capabilities_of
from shardline.services.pb import dataplane_pb2 as dp

PREFIX = struct.Struct(">2sBBI")
MAGIC = b"SL"
FORMAT_VERSION = 1

Op = dp.Op
ErrorCode = dp.ErrorCode
FrameHeader = dp.FrameHeader
BlockRef = dp.BlockRef

ITEMSIZE = {dp.FLOAT32: 4, dp.FLOAT16: 2, dp.BFLOAT16: 2}
TORCH_DTYPE = {dp.FLOAT32: torch.float32, dp.FLOAT16: torch.float16, dp.BFLOAT16: torch.bfloat16}
WIRE_DTYPE = {v: k for k, v in TORCH_DTYPE.items()}
# What a pull may ask its blocks in (BlockRef.want_dtype; unset means FLOAT32). Nodes keep fp32
# masters and convert a reply's copy on the fly with torch's ``.to()`` (round to nearest even), so a
# bf16 puller holds exactly ``master.to(torch.bfloat16)``.
PULL_DTYPES = {dp.DTYPE_UNSPECIFIED: torch.float32, dp.FLOAT32: torch.float32, dp.BFLOAT16: torch.bfloat16}
KNOWN_OPS = frozenset(dp.Op.values()) - {dp.OP_UNSPECIFIED}
# What an OP_REPLICATE frame may carry (one kind each), and the kinds that answer the receiver's
# own OP_SYNC (accepted from a sender at an older epoch: the receiver asked).
REPLICATE_KINDS = frozenset(dp.ReplicateKind.values()) - {dp.REPLICATE_KIND_UNSPECIFIED}
SYNC_ANSWER_KINDS = frozenset({dp.REPLICATE_SYNC, dp.REPLICATE_SYNC_LAST})


@dataclass(frozen=True)
class FrameLimits:
    """Bounds a receiver enforces before allocating anything for a frame."""

    max_header_bytes: int = 4 * 1024 * 1024
    max_payload_bytes: int = 1024 * 1024 * 1024
    max_blocks: int = 65_536


DEFAULT_LIMITS = FrameLimits()


def encode_prefix_and_header(header: FrameHeader) -> bytes:
    body = header.SerializeToString()
    return PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(body)) + body


def decode_prefix(prefix: bytes | memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> int:
    """Validate the 8-byte prefix and return the header length."""
    if len(prefix) != PREFIX.size:
        raise FrameError(f"frame prefix must be {PREFIX.size} bytes, got {len(prefix)}")
    magic, version, flags, header_len = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): not a Shardline data-plane peer")
    if version != FORMAT_VERSION:
        raise FrameError(f"unsupported frame format version {version} (this node speaks {FORMAT_VERSION})")
    if flags != 0:
        raise FrameError(f"unknown frame flags {flags:#x}")
    if header_len == 0:
        raise FrameError("frame header length is 0")
    if header_len > limits.max_header_bytes:
        raise FrameTooLargeError(f"frame header of {header_len} bytes exceeds the limit of {limits.max_header_bytes}")
    return header_len


def parse_header(body: bytes | memoryview) -> FrameHeader:
    header = FrameHeader()
    try:
        header.ParseFromString(bytes(body))
    except Exception as exc:  # protobuf raises DecodeError; any failure means garbage
        raise FrameError(f"frame header is not a valid FrameHeader: {exc}") from None
    return header


def validate_header(header: FrameHeader, limits: FrameLimits = DEFAULT_LIMITS) -> None:
    """Check the header's internal consistency and bounds. Raises FrameError / FrameTooLargeError.

    Content checks that need server state (known job/tensor, ownership, expected block size) are
    the receiver's; this function guarantees that ``payload_bytes`` is what the blocks add up to
    and that it is within ``limits``.
    """
    if header.op not in KNOWN_OPS:
        raise FrameError(f"unknown frame op {header.op}")
    if header.payload_bytes > limits.max_payload_bytes:
        raise FrameTooLargeError(
            f"frame payload of {header.payload_bytes} bytes exceeds the limit of {limits.max_payload_bytes}"
        )
    if len(header.blocks) > limits.max_blocks:
        raise FrameTooLargeError(f"frame lists {len(header.blocks)} blocks, limit is {limits.max_blocks}")
    total = sourced = 0
    for ref in header.blocks:
        if (ref.replay or ref.lr) and header.op != dp.OP_REPLICATE:
            raise FrameError(f"block {ref.tensor}[{ref.index}] carries a gradient to replay in a "
                             f"{dp.Op.Name(header.op)} frame (only replication does)")
        if ref.dest_region and not asks_blocks(header):
            raise FrameError(f"block {ref.tensor}[{ref.index}] names a destination region in a "
                             f"{dp.Op.Name(header.op)} frame (only pulls do)")
        if ref.src_region or ref.src_offset:
            problem = _sourced_block_problem(header, ref)
            if problem:
                raise FrameError(problem)
            sourced += ref.nbytes
            continue  # its bytes are in the sender's region, not in the payload
        if ref.placed:
            if header.op != dp.OP_REPLY or ref.zero or wire_nbytes(ref.dtype, ref.numel) != ref.nbytes \
                    or ref.dtype in (dp.SIGN1, dp.BF16_DELTA):
                raise FrameError(f"block {ref.tensor}[{ref.index}] is flagged placed in a {dp.Op.Name(header.op)} "
                                 f"frame, or with inconsistent numel/nbytes/dtype")
            continue  # its bytes are in the requester's region, not in the payload
        if ref.zero:
            if ref.nbytes != 0:
                raise FrameError(f"block {ref.tensor}[{ref.index}] is flagged zero but claims {ref.nbytes} bytes")
            continue
        if (header.op == dp.OP_SYNC or asks_blocks(header)) and ref.nbytes == 0 and ref.numel == 0:
            continue  # a pull or sync request names blocks without carrying them
        if ref.dtype == dp.SIGN1 or ref.scale:
            problem = _sign_block_problem(header, ref)
            if problem:
                raise FrameError(problem)
        if ref.dtype == dp.BF16_DELTA:  # a subscriber's element-level delta (services/delta.py)
            problem = delta.delta_ref_problem(header, ref)
            if problem:
                raise FrameError(problem)
            total += ref.nbytes
            continue
        nbytes = wire_nbytes(ref.dtype, ref.numel)
        if nbytes is None:
            raise FrameError(f"block {ref.tensor}[{ref.index}] has unsupported dtype {ref.dtype}")
        if nbytes != ref.nbytes:
            what = (f"{ref.numel} packed signs take {nbytes} bytes" if ref.dtype == dp.SIGN1
                    else f"numel {ref.numel} * itemsize {ITEMSIZE[ref.dtype]} = {nbytes}")
            raise FrameError(f"block {ref.tensor}[{ref.index}]: {what} != nbytes {ref.nbytes}")
        total += ref.nbytes
    if total != header.payload_bytes:
        raise FrameError(f"blocks add up to {total} bytes but the header claims payload_bytes={header.payload_bytes}")
    if sourced and total + sourced > limits.max_payload_bytes:
        raise FrameTooLargeError(f"frame moves {total + sourced} bytes ({sourced} of them from a shared region), "
                                 f"more than the limit of {limits.max_payload_bytes}")
    if header.op == dp.OP_REPLICATE:
        if header.replicate_kind not in REPLICATE_KINDS:
            raise FrameError(f"replicate frame of unknown kind {header.replicate_kind}")
    elif header.replicate_kind:
        raise FrameError(f"{dp.Op.Name(header.op)} frame names replicate kind {header.replicate_kind} "
                         f"(only replication does)")
    if header.agg_ranks or header.agg_weights:
        if header.op != dp.OP_PUSH:
            raise FrameError(f"{dp.Op.Name(header.op)} frame names aggregated ranks (only pushes do)")
        problem = aggregate_problem(header.rank, header.weight or 1.0, header.agg_ranks, header.agg_weights)
        if problem:
            raise FrameError(problem)
    if header.resends_previous_step and header.op not in (dp.OP_PULL, dp.OP_COMMIT, dp.OP_REPLY):
        raise FrameError(f"{dp.Op.Name(header.op)} frame says resends_previous_step (only pulls, commits and "
                         f"their replies do)")
    if header.durable_step and header.op != dp.OP_REPLY:
        raise FrameError(f"{dp.Op.Name(header.op)} frame names a durable_step (only replies do)")


def aggregate_problem(rank: int, weight: float, ranks: Sequence[int], weights: Sequence[float]) -> str | None:
    """What is wrong with an aggregated push (``FrameHeader.agg_ranks``/``agg_weights``) that
    ``rank`` sends with its own ``weight``, whatever the job (None: nothing): the ranks ascending,
    distinct, at least two, the sender among them; one weight each, finite and > 0, the sender's
    equal to ``weight``. The node checks what depends on the job (world size, sync, compression)."""
    if len(ranks) != len(weights):
        return f"aggregated push names {len(ranks)} ranks and {len(weights)} weights"
    if len(ranks) < 2:
        return f"aggregated push names {len(ranks)} rank(s): an aggregate sums at least 2"
    if any(a >= b for a, b in zip(ranks, ranks[1:])):
        return f"aggregated push names ranks {list(ranks)}: they must be ascending and distinct"
    if rank not in ranks:
        return f"aggregated push of ranks {list(ranks)} is sent by rank {rank}, which is not among them"
    for r, w in zip(ranks, weights):
        if not (math.isfinite(w) and w > 0):
            return f"aggregated push gives rank {r} weight {w!r}: weights must be finite numbers > 0"
    own = weights[list(ranks).index(rank)]
    if own != weight:
        return f"aggregated push gives its sender, rank {rank}, weight {own!r}, the frame's weight is {weight!r}"
    return None


def asks_blocks(header: FrameHeader) -> bool:
    """Whether the frame's blocks are a pull's: a PULL, or a BSP commit carrying the pull of the
    step it may complete (``FrameHeader.pull_applied``)."""
    return header.op == dp.OP_PULL or (header.op == dp.OP_COMMIT and header.pull_applied)


def sourced_bytes(header: FrameHeader) -> int:
    """The bytes a (validated) push's blocks take from the sender's shared regions (``src_region``):
    the receiver copies them out itself, so they are not in ``payload_bytes``."""
    return sum(ref.nbytes for ref in header.blocks if ref.src_region)


def _sourced_block_problem(header: FrameHeader, ref: BlockRef) -> str | None:
    """A block taken from the sender's region is a push's plain (fp32/fp16/bf16) block."""
    where = f"block {ref.tensor}[{ref.index}] names a source region"
    if header.op != dp.OP_PUSH:
        return f"{where} in a {dp.Op.Name(header.op)} frame (only pushes do)"
    if not ref.src_region:
        return f"{where} offset ({ref.src_offset}) but no region"
    if ref.zero or ref.scale or ref.dtype not in ITEMSIZE:
        return f"{where}: only plain float32/float16/bfloat16 blocks can (not a zero-flagged or compressed one)"
    if ref.nbytes != ref.numel * ITEMSIZE[ref.dtype]:
        return f"{where}: numel {ref.numel} * itemsize {ITEMSIZE[ref.dtype]} != nbytes {ref.nbytes}"
    return None


def wire_nbytes(dtype: int, numel: int) -> int | None:
    """The payload bytes of a block of ``numel`` elements in wire ``dtype`` (None: not a wire dtype)."""
    if dtype == dp.SIGN1:
        return compression.sign_nbytes(numel)
    itemsize = ITEMSIZE.get(dtype)
    return None if itemsize is None else numel * itemsize


def _sign_block_problem(header: FrameHeader, ref: BlockRef) -> str | None:
    """A compressed (SIGN1) block is a push's, with a valid scale; only it has a scale."""
    if ref.dtype != dp.SIGN1:
        return f"block {ref.tensor}[{ref.index}] of dtype {ref.dtype} has a sign scale ({ref.scale!r})"
    if header.op != dp.OP_PUSH:
        return f"block {ref.tensor}[{ref.index}]: {dp.Op.Name(header.op)} cannot carry compressed (SIGN1) blocks"
    if not (math.isfinite(ref.scale) and ref.scale >= 0):
        return f"block {ref.tensor}[{ref.index}]: sign scale must be a finite number >= 0, got {ref.scale!r}"
    return None


def recv_exactly_into(sock, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``. Raises ConnectionError if the peer closes first and, with a
    ``deadline`` (``time.monotonic()`` value), TimeoutError once it has passed: however slowly the
    bytes trickle in, the read ends then (the socket's timeout is left changed).

    With a ``deadline``, a large read from a TCP socket loops in C (``recv_f32_checked``, its
    check left unused): a payload arriving in many small pieces (a slow or shaped link) costs one
    Python call, not one per piece."""
    n = len(view)
    if deadline is not None and n >= C_RECV_MIN_BYTES and receives_checked(sock):
        recv_f32_checked(sock, view, deadline)
        return
    _fill(sock, n, deadline, lambda got: sock.recv_into(view[got:], n - got))


# recv_exactly_into reads at least this many bytes with a deadline in C (a header, in Python).
C_RECV_MIN_BYTES = 64 * 1024


def recv_checked_into(sock, view: memoryview, deadline: float | None = None) -> bool:
    """``recv_exactly_into`` for the bytes of a float32 block from a connection that checks values
    as it copies them (``sock.recv_checked_into``, the shm transport): True if none is NaN or +-Inf.
    A value one copy cut in two is checked here, in ``view``, once its bytes are all in."""
    n, finite, cuts = len(view), [], []

    def read(got: int) -> int:
        r, whole_finite, cut = sock.recv_checked_into(view[got:], n - got, got)
        finite.append(whole_finite)
        cuts.extend(cut)
        return r

    _fill(sock, n, deadline, read)
    return all(finite) and all(value_finite_at(view, offset - offset % 4) for offset in cuts)


def receives_checked(sock) -> bool:
    """Whether :func:`recv_f32_checked` can read from ``sock``: a TCP socket, and the C helper built."""
    return recv_f32 is not None and isinstance(sock, socket.socket)


def recv_f32_checked(sock: socket.socket, view: memoryview, deadline: float | None = None) -> bool:
    """``recv_exactly_into`` for the bytes of a float32 block from a TCP socket
    (:func:`receives_checked`) that checks each piece for NaN/Inf right after it lands, cache-hot,
    in the same C loop (services/_copycheck.c, ``recv_f32``): True if no value is NaN or +-Inf.
    Without a ``deadline`` the socket's timeout bounds the whole read. Errors as recv_exactly_into's."""
    if deadline is None and sock.gettimeout() is not None:
        deadline = time.monotonic() + sock.gettimeout()
    n = len(view)
    got, finite = recv_f32(sock.fileno(), view, -1.0 if deadline is None else deadline)
    if got < n:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{got} of {n} bytes arrived in time")
        raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
    return finite


def _fill(sock, n: int, deadline: float | None, read) -> None:
    """Call ``read(got)``, which puts bytes from ``got`` on and returns how many, until ``n`` are
    in (see recv_exactly_into for the errors)."""
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes arrived in time")
            sock.settimeout(left)
        r = read(got)
        if r == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += r


def recv_header(sock, limits: FrameLimits = DEFAULT_LIMITS, deadline: float | None = None) -> FrameHeader:
    """Read and validate one frame's prefix and header (not its payload), by ``deadline`` if given."""
    prefix = bytearray(PREFIX.size)
    recv_exactly_into(sock, memoryview(prefix), deadline)
    header_len = decode_prefix(prefix, limits)
    body = bytearray(header_len)
    recv_exactly_into(sock, memoryview(body), deadline)
    header = parse_header(body)
    validate_header(header, limits)
    return header


SKIP_CHUNK_BYTES = 1 << 20


def skip_bytes(sock, n: int, scratch: bytearray | None = None, deadline: float | None = None) -> None:
    """Read and discard ``n`` payload bytes, keeping the stream aligned on frame boundaries
    (through ``scratch`` if it is non-empty, else a buffer of at most SKIP_CHUNK_BYTES)."""
    buf = scratch if scratch is not None and len(scratch) > 0 else bytearray(min(n, SKIP_CHUNK_BYTES) or 1)
    view = memoryview(buf)
    while n > 0:
        chunk = min(n, len(view))
        recv_exactly_into(sock, view[:chunk], deadline)
        n -= chunk


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    if t.dtype == torch.bfloat16:
        return memoryview(t.view(torch.int16).numpy()).cast("B")
    return memoryview(t.numpy()).cast("B")


# A shm connection gets a frame's blocks in groups of about this many bytes (its doorbell size).
SEND_GROUP_BYTES = 4 * 1024 * 1024


def send_frame(sock, header: FrameHeader, payloads: Sequence[memoryview | bytes] = ()) -> None:
    """Send a frame; ``header.payload_bytes`` is set from ``payloads``."""
    header.payload_bytes = sum(len(p) for p in payloads)
    head = encode_prefix_and_header(header)
    if header.payload_bytes < 65536:
        # Small frames: one syscall keeps latency down.
        sock.sendall(b"".join([head, *[bytes(p) for p in payloads]]))
        return
    if isinstance(sock, socket.socket):  # TCP: the header and every block in gathered sends
        send_gathered(sock, [head, *payloads])
        return
    sock.sendall(head)
    if capabilities_of(sock).gathers_sends:  # a shm connection: several blocks per doorbell
        send_many = sock.sendall_many
        group, size = [], 0
        for p in payloads:
            group.append(p)
            size += len(p)
            if size >= SEND_GROUP_BYTES:
                send_many(group)
                group, size = [], 0
        if group:
            send_many(group)
        return
    for p in payloads:
        if len(p):
            sock.sendall(p)


# Buffers one sendmsg takes at most (Linux's IOV_MAX is 1024).
SEND_GATHER_MAX = 512


def send_gathered(sock: socket.socket, buffers: Sequence[memoryview | bytes]) -> None:
    """``sendall`` of the concatenation of ``buffers`` without concatenating them: ``sendmsg``
    hands the kernel as many as the socket buffer takes in one call. Against one ``sendall`` per
    1 MiB block this saves the sender about a tenth of its CPU time per 64 MiB (fewer calls, each
    filling the whole send buffer). With a socket timeout T, the frame must be out within T per
    buffer, the bound one ``sendall`` per buffer had: a peer that reads a byte now and then cannot
    hold the sender longer (each call waits at most T, less once the frame's time runs short)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    timeout = sock.gettimeout()
    deadline = None if timeout is None else time.monotonic() + timeout * max(1, len(views))
    first = 0
    try:
        while first < len(views):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the peer took too long to read a frame of {len(views)} buffers")
                sock.settimeout(min(timeout, left))
            sent = sock.sendmsg(views[first:first + SEND_GATHER_MAX])
            while sent:  # drop what went out; the first buffer left may have gone out in part
                n = len(views[first])
                if sent < n:
                    views[first] = views[first][sent:]
                    break
                sent -= n
                first += 1
    finally:
        if deadline is not None:
            sock.settimeout(timeout)


def error_header(request_id: int, code: int, message: str, *, epoch: int = 0, step: int = 0) -> FrameHeader:
    return FrameHeader(op=dp.OP_ERROR, request_id=request_id, code=code, message=message[:4096], epoch=epoch, step=step)


def block_ref(tensor: str, index: int, t: torch.Tensor | None, *, version: int = 0, zero: bool = False,
              numel: int | None = None) -> BlockRef:
    """A BlockRef describing ``t`` (or a zero/absent block of ``numel`` elements)."""
    if t is None:
        return BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, numel=numel or 0, nbytes=0,
                        version=version, zero=zero)
    dtype = WIRE_DTYPE.get(t.dtype)
    if dtype is None:
        raise ValueError(f"dtype {t.dtype} cannot go on the wire (float32, float16, bfloat16)")
    return BlockRef(tensor=tensor, index=index, dtype=dtype, numel=t.numel(), nbytes=t.numel() * t.element_size(),
                    version=version)


def payload_views(buf: bytearray | memoryview, refs: Iterable[BlockRef]) -> list[tuple[BlockRef, torch.Tensor | None]]:
    """Split a received payload into (ref, tensor view) pairs; zero-flag blocks give None, a
    compressed (SIGN1) block its packed bytes (uint8)."""
    out = []
    offset = 0
    for ref in refs:
        if ref.zero or ref.nbytes == 0:
            out.append((ref, None))
            continue
        if ref.dtype == dp.SIGN1:
            t = torch.frombuffer(buf, dtype=torch.uint8, count=ref.nbytes, offset=offset)
        else:
            t = torch.frombuffer(buf, dtype=TORCH_DTYPE[ref.dtype], count=ref.numel, offset=offset)
        out.append((ref, t))
        offset += ref.nbytes
    return out
