"""What a PS node admits: payload budget, remembered name misses, rate-limited complaints, hang-up
notices, frame deadlines, and the connection loop's answers (over a socketpair, no daemon)."""

import logging
import socket
import threading
import time

import pytest
import torch

from shardline.ps_server.admission import NameMisses
from shardline.services.payload_budget import PayloadBudget
from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
from shardline.services.disconnects import DisconnectWatcher
from shardline.ps_server.node import PSNode
from shardline.ps_server.store import StoreError
from shardline.services import frame
from shardline.services.log_limits import RateLimitedLog
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# --- PayloadBudget ------------------------------------------------------------------------------

def test_budget_grants_up_to_its_limit_and_waits_for_releases():
    seen = []
    budget = PayloadBudget(100, on_change=seen.append)
    assert budget.reserve(60, timeout=0)
    assert not budget.reserve(50, timeout=0.05), "over the limit must not be granted"
    threading.Timer(0.1, budget.release, args=(60,)).start()
    started = time.monotonic()
    assert budget.reserve(50, timeout=5)
    assert time.monotonic() - started < 4
    assert budget.in_use == 50
    assert seen == [60, 0, 50]


def test_budget_never_grants_more_than_the_whole_limit():
    budget = PayloadBudget(100)
    started = time.monotonic()
    assert not budget.reserve(101, timeout=10)
    assert time.monotonic() - started < 1, "a request that can never fit is refused at once"
    assert budget.reserve(0, timeout=0)
    with pytest.raises(ValueError, match="0"):
        PayloadBudget(0)


# --- NameMisses ---------------------------------------------------------------------------------

def test_name_misses_expire_and_stay_bounded():
    clock = Clock()
    misses = NameMisses(ttl_seconds=1.0, max_entries=3, clock=clock)
    misses.add("a")
    assert "a" in misses
    clock.now += 1.01
    assert "a" not in misses
    for name in "bcde":
        misses.add(name)
    assert "b" not in misses, "the oldest entry is dropped beyond max_entries"
    assert all(n in misses for n in "cde")
    misses.discard("c")
    assert "c" not in misses


# --- RateLimitedLog -----------------------------------------------------------------------------

def test_rate_limited_log_writes_one_line_per_key_per_interval_with_a_count(caplog):
    clock = Clock()
    limited = RateLimitedLog(logging.getLogger("t.limits"), 10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="t.limits"):
        assert limited.log(logging.WARNING, "10.0.0.1", "bad frame from %s", "10.0.0.1:1")
        for _ in range(50):
            assert not limited.log(logging.WARNING, "10.0.0.1", "bad frame from %s", "10.0.0.1:1")
        assert limited.log(logging.WARNING, "10.0.0.2", "bad frame from %s", "10.0.0.2:1")
        clock.now += 10
        assert limited.log(logging.WARNING, "10.0.0.1", "bad frame from %s", "10.0.0.1:2")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "50 more like this from 10.0.0.1" in lines[2]


# --- DisconnectWatcher --------------------------------------------------------------------------

def test_watcher_reports_a_hangup_at_once_and_not_data():
    watcher = DisconnectWatcher()
    a, b = socket.socketpair()
    try:
        fired = threading.Event()
        handle = watcher.watch(a, fired.set)
        b.sendall(b"next frame")  # data is not a hang-up
        assert not fired.wait(0.3)
        b.close()
        assert fired.wait(2), "a closed peer must be noticed"
        watcher.unwatch(handle)
        c, d = socket.socketpair()
        quiet = threading.Event()
        watcher.unwatch(watcher.watch(c, quiet.set))
        d.close()
        assert not quiet.wait(0.3), "an unwatched socket reports nothing"
        c.close()
    finally:
        a.close()
        watcher.close()


# --- frame deadlines ----------------------------------------------------------------------------

def test_a_trickling_payload_ends_at_the_deadline():
    a, b = socket.socketpair()
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                b.sendall(b"x")
            except OSError:
                return
            time.sleep(0.05)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        frame.recv_exactly_into(a, memoryview(bytearray(10_000)), deadline=time.monotonic() + 0.5)
    assert time.monotonic() - started < 1.5, "bytes that keep trickling must not extend the deadline"
    stop.set()
    a.close()
    b.close()
    t.join(2)


# --- the connection loop ------------------------------------------------------------------------

def job_spec(name="j", numel=64, block=16):
    spec = common_pb2.JobSpec(name=name, sync="bsp", world_size=2, block_elements=block)
    spec.optimizer.kind = "sgd"
    spec.optimizer.lr = 0.1
    spec.tensors.add(name="w", shape=[numel], dtype="float32", trainable=True)
    return spec


class Served:
    """A node (routing: itself alone) served over a socketpair, counting dispatcher lookups."""

    def __init__(self, policy=None, known=("j",)):
        self.lookups = 0

        def fetch_job(name):
            self.lookups += 1
            return dispatcher_pb2.JobInfo(spec=job_spec(name), uid="u", ready=True) if name in known else None

        table = common_pb2.RoutingTable(epoch=1)
        table.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)
        self.node = PSNode("n1", fetch_job, lambda: table)
        self.node.refresh_routing()
        self.policy = policy or ConnectionPolicy(payload_timeout=1.0)
        self.sock, server = socket.socketpair()
        self.sock.settimeout(5)
        self.thread = threading.Thread(target=serve_connection, args=(server, "peer:1", self.node, self.policy),
                                       daemon=True)
        self.thread.start()

    def ask(self, header, payloads=()):
        frame.send_frame(self.sock, header, list(payloads))
        return frame.recv_header(self.sock, frame.FrameLimits(max_payload_bytes=1 << 30))

    def init(self):
        values = torch.arange(64, dtype=torch.float32)
        h = frame.FrameHeader(op=dp.OP_INIT, request_id=1, job="j", epoch=1)
        payloads = []
        for i in range(4):
            part = values[i * 16:(i + 1) * 16]
            h.blocks.append(frame.block_ref("w", i, part))
            payloads.append(frame.tensor_bytes(part))
        assert self.ask(h, payloads).op == dp.OP_REPLY

    def close(self):
        self.sock.close()
        self.thread.join(5)


def test_unknown_and_invalid_job_names_are_answered_and_the_connection_stays_usable():
    s = Served()
    try:
        for name in ("nope", "bad/name", "x" * 300, ""):
            reply = s.ask(frame.FrameHeader(op=dp.OP_PULL, request_id=7, job=name, epoch=1))
            assert reply.op == dp.OP_ERROR and reply.code == dp.UNKNOWN_JOB and reply.request_id == 7, name
        for _ in range(20):
            s.ask(frame.FrameHeader(op=dp.OP_PULL, request_id=8, job="nope", epoch=1))
        assert s.lookups == 1, "a name the dispatcher does not know is asked about once, then remembered"
        s.init()
        pull = frame.FrameHeader(op=dp.OP_PULL, request_id=9, job="j", epoch=1)
        pull.blocks.extend(dp.BlockRef(tensor="w", index=i) for i in range(4))
        reply = s.ask(pull)
        assert reply.op == dp.OP_REPLY and reply.payload_bytes == 64 * 4
    finally:
        s.close()


def push_of_block_0(rank: int, times: int = 1) -> frame.FrameHeader:
    """A PUSH header naming block 0 of ``w`` ``times`` times (its payload is the caller's)."""
    h = frame.FrameHeader(op=dp.OP_PUSH, request_id=3, job="j", epoch=1, step=0, rank=rank, weight=1.0)
    for _ in range(times):
        h.blocks.append(dp.BlockRef(tensor="w", index=0, dtype=dp.FLOAT32, numel=16, nbytes=64))
    h.payload_bytes = times * 64
    return h


def test_duplicate_block_references_are_refused_before_anything_is_reserved():
    budget = PayloadBudget(1 << 30)
    s = Served(ConnectionPolicy(payload_timeout=1.0, budget=budget))
    try:
        s.init()
        h = push_of_block_0(rank=0, times=256)
        s.sock.sendall(frame.encode_prefix_and_header(h))  # the payload never comes
        reply = frame.recv_header(s.sock)
        assert reply.code == dp.INVALID_ARGUMENT and "more than once" in reply.message
        assert budget.in_use <= 4 * 64, "only the init's buffer is held, nothing for the refused push"
    finally:
        s.close()


@pytest.mark.parametrize("op", [dp.OP_COMMIT, dp.OP_PULL, dp.OP_SYNC])
def test_ops_without_payload_refuse_one(op):
    node = Served().node
    h = frame.FrameHeader(op=op, job="j", epoch=1, payload_bytes=4)
    with pytest.raises(StoreError, match="carries no payload"):
        node.precheck(h)


def test_a_stalled_payload_frees_its_reservation_after_the_payload_timeout():
    budget = PayloadBudget(1 << 20)
    s = Served(ConnectionPolicy(payload_timeout=0.5, budget=budget))
    try:
        s.init()
        h = push_of_block_0(rank=1)
        s.sock.sendall(frame.encode_prefix_and_header(h) + b"\0" * 10)
        deadline = time.monotonic() + 0.4
        while budget.in_use == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.thread.join(3)
        assert not s.thread.is_alive(), "the stalled connection must be dropped"
        assert budget.in_use == 0
        assert s.sock.recv(1) == b""
    finally:
        s.close()


def test_a_frame_over_the_budget_is_answered_resource_exhausted():
    budget = PayloadBudget(100)
    s = Served(ConnectionPolicy(payload_timeout=0.3, budget=budget))
    try:
        values = torch.zeros(64)
        h = frame.FrameHeader(op=dp.OP_INIT, request_id=4, job="j", epoch=1)
        payloads = []
        for i in range(4):
            h.blocks.append(frame.block_ref("w", i, values[i * 16:(i + 1) * 16]))
            payloads.append(frame.tensor_bytes(values[i * 16:(i + 1) * 16]))
        reply = s.ask(h, payloads)
        assert reply.code == dp.RESOURCE_EXHAUSTED and "max_inflight_bytes" in reply.message
        assert s.ask(frame.FrameHeader(op=dp.OP_PING, request_id=5)).op == dp.OP_REPLY, "the connection stays usable"
    finally:
        s.close()


def test_a_waiting_pull_ends_when_its_client_hangs_up():
    watcher = DisconnectWatcher()
    s = Served(ConnectionPolicy(payload_timeout=1.0, hangups=watcher))
    try:
        s.init()
        frame.send_frame(s.sock, frame.FrameHeader(op=dp.OP_PULL, request_id=6, job="j", epoch=1, min_step=5,
                                                   wait_timeout_seconds=60))
        time.sleep(0.2)
        assert s.thread.is_alive()
        s.sock.close()
        s.thread.join(2)
        assert not s.thread.is_alive(), "the pull's thread must end when its client is gone"
    finally:
        watcher.close()


def test_connections_beyond_the_handshake_cap_are_turned_away_while_others_authenticate():
    policy = ConnectionPolicy(cluster_token=b"t" * 32, handshakes=threading.BoundedSemaphore(1))
    node = Served().node
    silent, server1 = socket.socketpair()  # never says HELLO: holds the only handshake slot
    t1 = threading.Thread(target=serve_connection, args=(server1, "a:1", node, policy), daemon=True)
    t1.start()
    time.sleep(0.1)
    other, server2 = socket.socketpair()
    other.settimeout(5)
    t2 = threading.Thread(target=serve_connection, args=(server2, "b:1", node, policy), daemon=True)
    t2.start()
    reply = frame.recv_header(other)
    assert reply.code == dp.RESOURCE_EXHAUSTED and "authenticating" in reply.message
    t2.join(2)
    assert not t2.is_alive()
    silent.close()
    t1.join(5)
    assert policy.handshakes.acquire(blocking=False), "the slot is free again"
    other.close()
