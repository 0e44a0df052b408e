"""Property-based fuzzing of a live PS connection loop (services/dataplane_server.py).

A real dispatcher and PS (subprocesses on 127.0.0.1) hold a BSP job with known values whose
world_size (64) the fuzzer cannot complete: it only ever speaks as ranks 0-3 (or out of range), so
no step is applied and every value must stay exactly as initialized. Hypothesis builds connections
out of random bytes, valid-looking frames of every op (wrong, duplicate or huge block references,
wrong dtypes, payload lengths that lie, truncated payloads, unknown jobs and tensors) and
mutations of valid frames; each connection is sent, half-closed, and read to its end under a
timeout. After every example the PS must be alive, within an RSS and a thread bound, answer a
valid pull from a real client on a new connection, and hold the initial values.

What a reply stream must look like (``check_replies``): every reply parses, is a REPLY/ERROR/HELLO
of step 0 answering a request id that was sent (or 0 for a malformed frame), a pull's blocks carry
the initial values, and the PS closes the connection once it reached the end of the stream
(unless a pull may still be waiting). With ``STRICT_REPLIES`` (the PS answers every frame, in
order), each complete frame gets its reply, with its request id.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzzlib import ALL_OPS, ByteStream, U32_MAX, U64_MAX, WIRE_DTYPES, edge_u32, edge_u64, encode, mutations, scaled
from shardline import connect
from shardline.services import frame
from shardline.services.errors import FrameError, FrameTooLargeError
from shardline.services.pb import dataplane_pb2 as dp
from test_bad_input import open_socket
from test_dataplane_limits import rss_bytes, threads

# The PS answers every frame, in order (services/dataplane_server.py); set SHARDLINE_FUZZ_LENIENT_REPLIES=1
# to check only what held before that (an error reply *or* a close).
STRICT_REPLIES = os.environ.get("SHARDLINE_FUZZ_LENIENT_REPLIES") != "1"

JOB = "fuzz-job"
WORLD_SIZE = 64                        # the fuzzer's ranks (0-3) never complete a step
BLOCK = 16
INITIAL = {"w": torch.arange(40, dtype=torch.float32) * 0.5 - 3.0, "b": torch.tensor([1.5, -2.0, 0.25, 8.0, -0.125])}
BLOCKS = {(name, i): t[i * BLOCK:(i + 1) * BLOCK].clone() for name, t in INITIAL.items()
          for i in range((t.numel() + BLOCK - 1) // BLOCK)}
RSS_SLACK = 64 << 20
THREAD_SLACK = 32
REPLY_TIMEOUT = 5.0                    # a PS that neither answers nor closes this long is hung
REPLY_LIMITS = frame.FrameLimits(max_payload_bytes=1 << 30)
MAX_PAYLOAD_SENT = 64 << 10            # never send more than this in one frame (claims may be larger)


@dataclass
class Live:
    cluster: object
    ps: object
    epoch: int
    baseline_rss: int
    baseline_threads: int
    examples: int = 0
    connections: int = 0


@pytest.fixture(scope="module")
def live(live_ps):
    c, ps = live_ps
    client = connect(c.address, job=JOB)
    try:
        client.init({k: v.clone() for k, v in INITIAL.items()}, optimizer="sgd", lr=1.0, momentum=0.9,
                     sync="bsp", world_size=WORLD_SIZE, block_elements=BLOCK)
        epoch = client.routing.epoch
    finally:
        client.close()
    state = Live(c, ps, epoch, 0, 0)
    assert_healthy(state, what="before fuzzing")  # warms the job up on the node (first pull)
    state.baseline_rss, state.baseline_threads = rss_bytes(ps.pid), threads(ps.pid)
    yield state
    assert_healthy(state, what=f"after {state.examples} examples")
    assert "Traceback" not in ps.log_tail(2000), "the PS logged a traceback:\n" + ps.log_tail(60)


# --- checks -----------------------------------------------------------------------------------
def pull_values(address: str) -> dict[str, torch.Tensor]:
    client = connect(address, job=JOB)
    try:
        return client.pull(list(INITIAL), min_step=0, timeout=REPLY_TIMEOUT)
    finally:
        client.close()


def assert_healthy(state: Live, what: str) -> None:
    ps = state.ps
    assert ps.alive(), f"the PS died {what} (exit {ps.returncode}):\n{ps.log_tail(60)}"
    if state.baseline_rss:
        rss = rss_bytes(ps.pid)
        assert rss < state.baseline_rss + RSS_SLACK, \
            f"PS RSS grew from {state.baseline_rss >> 20} MiB to {rss >> 20} MiB {what}"
        deadline = time.monotonic() + 3.0  # connection threads end once their peer is gone
        while threads(ps.pid) > state.baseline_threads + THREAD_SLACK and time.monotonic() < deadline:
            time.sleep(0.05)
        n = threads(ps.pid)
        assert n <= state.baseline_threads + THREAD_SLACK, \
            f"PS holds {n} threads {what} (baseline {state.baseline_threads}): connections are not let go"
    started = time.monotonic()
    try:
        got = pull_values(state.cluster.address)
    except Exception as exc:  # noqa: BLE001 - any failure of a valid pull is the finding
        raise AssertionError(f"a valid pull on a new connection failed {what}: {type(exc).__name__}: {exc}") from exc
    assert time.monotonic() - started < 2 * REPLY_TIMEOUT, f"a valid pull took {time.monotonic() - started:.1f} s {what}"
    for name, t in INITIAL.items():
        assert torch.equal(got[name], t), f"values of {name!r} changed {what}: {got[name]} != {t}"


# --- strategies: what a hostile or confused peer sends -----------------------------------------
known_keys = sorted(BLOCKS)
ops = st.one_of(st.sampled_from(ALL_OPS), st.sampled_from([dp.OP_PUSH, dp.OP_PULL, dp.OP_INIT, dp.OP_COMMIT]),
                st.sampled_from([11, 99, 2**31 - 1]))
jobs = st.one_of(st.just(JOB), st.just(JOB), st.sampled_from(["", "nope", "x" * 129, "bad job!", "fuzz-job\x00", "ünï"]),
                 st.text(max_size=10))
ranks = st.sampled_from([0, 0, 1, 2, 3, WORLD_SIZE, U32_MAX])
weights = st.sampled_from([0.0, 1.0, 1.0, 0.5, -1.0, float("nan"), float("inf"), 1e308])
steps = st.sampled_from([0, 0, 0, 1, 2**63, U64_MAX])
waits = st.sampled_from([0.05, 0.2, -1.0, float("inf"), float("nan"), 1e300, 0.0])


@st.composite
def live_refs(draw):
    if draw(st.integers(0, 4)):
        tensor, index = draw(st.sampled_from(known_keys))
        true_numel = BLOCKS[(tensor, index)].numel()
    else:
        tensor = draw(st.sampled_from(["w", "b", "ghost", "", "w\x00"]))
        index = draw(edge_u32)
        true_numel = draw(st.integers(0, 64))
    dtype = draw(st.sampled_from([dp.FLOAT32] * 3 + WIRE_DTYPES + [0, 4, 99]))
    numel = true_numel if draw(st.integers(0, 3)) else draw(st.one_of(edge_u64, st.integers(0, 64)))
    itemsize = {dp.FLOAT32: 4, dp.FLOAT16: 2, dp.BFLOAT16: 2}.get(dtype, 4)
    zero = draw(st.integers(0, 5)) == 0
    nbytes = 0 if zero else (numel * itemsize) % 2**64 if draw(st.integers(0, 4)) else draw(edge_u64)
    return dp.BlockRef(tensor=tensor, index=index, dtype=dtype, numel=numel, nbytes=nbytes, zero=zero,
                       version=draw(steps), has=draw(st.booleans()), step=draw(steps),
                       ranks=draw(st.lists(ranks, max_size=2)))


@st.composite
def live_frames(draw, epoch: int):
    """One frame's bytes, valid-looking, and whether it asks for a pull that may wait."""
    h = frame.FrameHeader(op=draw(ops), request_id=draw(st.integers(1, U64_MAX)), job=draw(jobs),
                          epoch=draw(st.sampled_from([epoch, epoch, epoch, 0, epoch + 1, U64_MAX])),
                          step=draw(steps), rank=draw(ranks), weight=draw(weights),
                          min_step=draw(st.sampled_from([0, 0, 0, 1, U64_MAX])), wait_timeout_seconds=draw(waits),
                          has_lr=draw(st.booleans()), lr=draw(st.sampled_from([0.1, 0.0, -1.0, float("nan")])),
                          node=draw(st.sampled_from(["", "", "ps1", "ghost", "x" * 300])),
                          replicate_kind=draw(st.sampled_from(sorted(dp.ReplicateKind.values()))),
                          incarnation=draw(st.sampled_from(["", "i1", "i2"])))
    aggregated = draw(st.integers(0, 7))
    if aggregated == 0:   # an aggregated push's ranks and weights, mostly ill formed
        h.agg_ranks.extend(draw(st.lists(ranks, max_size=3)))
        h.agg_weights.extend(draw(st.lists(weights, max_size=3)))
    elif aggregated == 1:   # well formed (a rank out of range among them too), sent by its first rank
        agg_ranks, agg_weights = draw(st.sampled_from([([0, 1], [1.0, 1.0]), ([1, 3], [0.5, 2.0]),
                                                       ([2, WORLD_SIZE], [1.0, 1.0])]))
        h.rank, h.weight = agg_ranks[0], agg_weights[0]
        h.agg_ranks.extend(agg_ranks)
        h.agg_weights.extend(agg_weights)
    refs = draw(st.lists(live_refs(), max_size=4))
    if refs and draw(st.integers(0, 4)) == 0:
        refs.insert(draw(st.integers(0, len(refs))), draw(st.sampled_from(refs)))  # a duplicate reference
    h.blocks.extend(refs)
    honest = sum(r.nbytes for r in refs if not r.zero)
    h.payload_bytes = honest % 2**64 if draw(st.integers(0, 5)) else draw(st.one_of(edge_u64, st.integers(0, 256)))
    # The payload actually sent: the blocks' bytes (finite values or any bit patterns), cut short,
    # or followed by extra bytes; never more than MAX_PAYLOAD_SENT.
    payload = bytearray()
    for r in refs:
        if r.zero or not r.nbytes:
            continue
        n = min(r.nbytes, MAX_PAYLOAD_SENT - len(payload))
        if n <= 0:
            break
        if draw(st.booleans()) and r.dtype in (dp.FLOAT32, dp.FLOAT16, dp.BFLOAT16):
            value = draw(st.sampled_from([0.0, 1.0, -0.5, 1e-3]))
            t = torch.full((n // frame.ITEMSIZE[r.dtype],), value, dtype=frame.TORCH_DTYPE[r.dtype])
            chunk = bytes(frame.tensor_bytes(t)).ljust(n, b"\x00")
        else:
            chunk = draw(st.binary(min_size=min(n, 64), max_size=min(n, 64))) * (n // max(1, min(n, 64)) + 1)
        payload += chunk[:n]
    how = draw(st.sampled_from(["exact"] * 4 + ["short", "long"]))
    if how == "short" and payload:
        payload = payload[:draw(st.integers(0, len(payload) - 1))]
    elif how == "long":
        payload += draw(st.binary(min_size=1, max_size=32))
    return encode(h, bytes(payload))


@st.composite
def connections(draw, epoch: int):
    """The bytes of one connection: 1-4 pieces, each a frame, a mutated frame or garbage."""
    pieces = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["frame"] * 4 + ["mutated", "garbage"]))
        if kind == "frame":
            pieces.append(draw(live_frames(epoch)))
        elif kind == "mutated":
            pieces.append(draw(mutations(draw(live_frames(epoch)))))
        else:
            pieces.append(draw(st.one_of(st.binary(max_size=64),
                                         st.builds(lambda b: b"SL\x01\x00" + b, st.binary(max_size=64)))))
    return b"".join(pieces)


# --- what the PS must answer -------------------------------------------------------------------
@dataclass
class Expected:
    due: list = field(default_factory=list)     # (request_id, error code or None) replies owed, in order
    sent_ids: set = field(default_factory=lambda: {0})
    may_wait: bool = False                      # a pull that may wait server-side: no close is owed
    whole: bool = False                         # the stream ends on a frame boundary


def expected_replies(data: bytes, limits: frame.FrameLimits = frame.DEFAULT_LIMITS) -> Expected:
    """Walk the stream as the PS frames it: every complete frame owes a reply; a malformed one owes
    BAD_FRAME/TOO_LARGE and ends the connection; a pull with min_step > 0 may wait (its reply and
    everything after it are not owed within the timeout)."""
    exp = Expected()
    stream = ByteStream(data)
    owed = True      # replies are owed up to a pull that may wait; later frames are only known
    while stream.left:
        try:
            header = frame.recv_header(stream, limits)
        except FrameTooLargeError:
            if owed:
                exp.due.append((0, dp.TOO_LARGE))
            return exp
        except FrameError:
            if owed:
                exp.due.append((0, dp.BAD_FRAME))
            return exp
        except ConnectionError:
            return exp   # a frame cut short: the PS sees the end of the stream mid-frame
        exp.sent_ids.add(header.request_id)
        if header.op == dp.OP_PULL and header.min_step > 0:
            exp.may_wait, owed = True, False   # (or refused at once: then the PS goes on)
        if stream.left < header.payload_bytes:
            return exp   # payload cut short: refused before it (a reply) or dropped at the end (none)
        stream.pos += header.payload_bytes
        if owed:
            exp.due.append((header.request_id, None))
    exp.whole = True
    return exp


@dataclass
class Received:
    data: bytes
    closed: bool    # the PS closed (FIN) or reset the connection
    reset: bool


def exchange(address: str, data: bytes, timeout: float = REPLY_TIMEOUT, close_write: bool = True) -> Received:
    """Send ``data`` on a new connection, half-close, read until the PS closes or ``timeout``."""
    s = open_socket(address)
    got = bytearray()
    closed = reset = False
    try:
        s.settimeout(timeout)
        try:
            s.sendall(data)
            if close_write:
                s.shutdown(socket.SHUT_WR)
        except OSError:  # the PS closed first (a malformed frame): EPIPE, ECONNRESET, ENOTCONN
            reset = True
        deadline = time.monotonic() + timeout
        while not closed and time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(1 << 16)
            except socket.timeout:
                break
            except ConnectionResetError:
                closed = reset = True
                break
            if not chunk:
                closed = True
            got += chunk
        return Received(bytes(got), closed or reset, reset)
    finally:
        s.close()


def check_replies(data: bytes, rx: Received, where: str) -> list[frame.FrameHeader]:
    exp = expected_replies(data)
    stream = ByteStream(rx.data)
    replies = []
    while stream.left:
        try:
            reply = frame.recv_header(stream, REPLY_LIMITS)
        except (FrameError, ConnectionError) as exc:
            if rx.reset:
                break   # a reset may cut the last reply short
            raise AssertionError(f"{where}: the PS sent bytes that are not a frame ({exc}): {rx.data[:200]!r}")
        assert reply.op in (dp.OP_REPLY, dp.OP_ERROR, dp.OP_HELLO), f"{where}: reply op {reply.op}"
        assert reply.request_id in exp.sent_ids, f"{where}: a reply to request {reply.request_id}, never sent"
        assert reply.step == 0, f"{where}: the PS reports job step {reply.step}: a fuzz frame applied a step"
        if reply.op == dp.OP_ERROR:
            assert reply.code in dp.ErrorCode.values() and reply.code != dp.OK, f"{where}: error code {reply.code}"
            assert reply.code != dp.INTERNAL, f"{where}: INTERNAL error (a bug on the PS): {reply.message}"
        payload = bytearray(reply.payload_bytes)
        try:
            frame.recv_exactly_into(stream, memoryview(payload))
        except ConnectionError:
            assert rx.reset, f"{where}: a reply's payload was cut short"
            break
        for ref, t in frame.payload_views(payload, reply.blocks):
            key = (ref.tensor, ref.index)
            assert key in BLOCKS, f"{where}: the PS sent block {key}, not one of the job's"
            if t is not None:
                assert torch.equal(t.to(torch.float32), BLOCKS[key]), f"{where}: block {key} changed: {t}"
        replies.append(reply)
    if not exp.may_wait:
        assert rx.closed, (f"{where}: the PS neither closed the connection nor answered within {REPLY_TIMEOUT:g} s "
                           f"of the end of the stream (got {len(replies)} replies)")
    if STRICT_REPLIES and not rx.reset:
        assert len(replies) >= len(exp.due), \
            f"{where}: {len(exp.due)} complete frames, {len(replies)} replies: {[(r.op, r.code, r.message) for r in replies]}"
        for (request_id, code), reply in zip(exp.due, replies):
            assert reply.request_id == request_id, f"{where}: replies out of order ({reply.request_id} for {request_id})"
            if code is not None:
                assert reply.op == dp.OP_ERROR and reply.code == code, f"{where}: {reply.code} for a malformed frame"
    return replies


# --- the properties ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def epoch(live):
    return live.epoch


def _fuzz(live, data: bytes, what: str) -> None:
    live.examples += 1
    rx = exchange(live.ps.data, data)
    check_replies(data, rx, f"{what} {data[:120]!r}")
    assert_healthy(live, what=f"after {what} {data[:120]!r}")


def test_any_connection_is_answered_or_closed_and_leaves_the_job_intact(live):
    @settings(max_examples=scaled(150))
    @given(connections(live.epoch))
    def run(data):
        _fuzz(live, data, "connection")

    run()


def test_random_bytes_are_refused_and_leave_the_job_intact(live):
    @settings(max_examples=scaled(15))
    @given(st.one_of(st.binary(min_size=1, max_size=256),
                     st.builds(lambda n, b: struct.pack(">2sBBI", b"SL", 1, 0, n) + b,
                               st.sampled_from([1, 7, 1024, 4 << 20, (4 << 20) + 1, U32_MAX]), st.binary(max_size=64))))
    def run(data):
        _fuzz(live, data, "bytes")

    run()


def test_one_connection_answers_a_sequence_of_well_formed_requests_in_order(live):
    """Frames that pass the codec's checks, sent one at a time on one connection, each answered
    before the next (a request error keeps the connection usable); a ping ends it."""
    @settings(max_examples=scaled(15))
    @given(st.lists(live_frames(live.epoch), min_size=1, max_size=8))
    def run(frames):
        live.examples += 1
        s = open_socket(live.ps.data)
        try:
            s.settimeout(REPLY_TIMEOUT)
            for data in frames:
                exp = expected_replies(data)
                if len(exp.due) != 1 or exp.due[0][1] is not None or exp.may_wait or not exp.whole:
                    continue  # malformed, cut short or waiting: the single-frame properties cover those
                s.sendall(data)
                try:
                    reply = frame.recv_header(s, REPLY_LIMITS)
                except (socket.timeout, TimeoutError):
                    raise AssertionError(f"no reply within {REPLY_TIMEOUT:g} s to {data[:200]!r}") from None
                except ConnectionError:
                    if STRICT_REPLIES:
                        raise AssertionError(f"the PS closed the connection instead of answering {data[:200]!r}")
                    return
                assert reply.request_id == exp.due[0][0] and reply.step == 0, (reply, data[:200])
                frame.skip_bytes(s, reply.payload_bytes)
            frame.send_frame(s, frame.FrameHeader(op=dp.OP_PING, request_id=7))
            reply = frame.recv_header(s, REPLY_LIMITS)
            assert reply.op == dp.OP_REPLY and reply.request_id == 7
        finally:
            s.close()
        assert_healthy(live, what=f"after a sequence of {len(frames)} frames")

    run()


# --- examples the fuzzer found, kept as plain tests -----------------------------------------------
def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def waiting_pull(epoch: int, wait: float) -> bytes:
    h = frame.FrameHeader(op=dp.OP_PULL, request_id=5, job=JOB, epoch=epoch, min_step=1, wait_timeout_seconds=wait)
    h.blocks.add(tensor="w", index=0)
    return encode(h)


@pytest.mark.parametrize("wait", [float("nan"), -1.0, 0.3, float("inf")])
def test_a_waiting_pull_costs_no_cpu_whatever_its_wait_timeout(live, wait):
    """A pull that waits for a step that does not come sleeps on the job's condition; it does not
    spin, whatever ``wait_timeout_seconds`` says (NaN included), and ends with its connection."""
    pid = live.ps.pid
    s = open_socket(live.ps.data)
    try:
        s.sendall(waiting_pull(live.epoch, wait))
        before = cpu_seconds(pid)
        time.sleep(1.5)
        used = cpu_seconds(pid) - before
    finally:
        s.close()
    assert used < 0.5, f"the PS burnt {used:.2f} s of CPU in 1.5 s on one pull waiting with timeout {wait}"
    assert_healthy(live, what=f"after a pull waiting with timeout {wait}")


def test_an_abandoned_pull_with_the_default_wait_lets_its_thread_go(live):
    """``wait_timeout_seconds`` 0 means the default wait (60 s); the client hanging up ends it as it
    ends any other waiting pull, rather than holding the connection's thread for the minute."""
    pid = live.ps.pid
    base = threads(pid)
    socks = [open_socket(live.ps.data) for _ in range(8)]
    for s in socks:
        s.sendall(waiting_pull(live.epoch, 0.0))
    time.sleep(0.5)
    for s in socks:
        s.close()
    deadline = time.monotonic() + 3.0
    while threads(pid) > base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads(pid) <= base, f"{threads(pid) - base} connection threads still wait for clients that left"
