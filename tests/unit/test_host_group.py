"""Host aggregation (worker/host_group.py): the workers of one job on one host sum their gradients
through shared memory and one of them pushes for all.

The group tests run each worker in a process of its own (spawned once per module and reused, each
test under a group key of its own; a killed one is replaced), driven over a pipe: a worker makes
its gradients from (seed, rank, step), and the test computes the reference sum from the same
tensors in ascending rank order and compares bits. Every worker's group is closed after its test
and checked to leave no fd, memfd mapping or thread behind. The state table, argument checks and
HELLO checks run in this process.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest
import torch

from shardline.services.errors import ShardlineConfigError, ShardlineStateError
from shardline.worker import host_group as hg
from shardline.worker.host_group import HostGroup, HostGroupEvent, HostGroupState

LAYOUT = [("w", 96), ("b", 7), ("emb", 1000)]
SHAPES = {"w": (12, 8), "b": (7,), "emb": (10, 100)}   # w goes in transposed: not contiguous
OTHER_LAYOUT = [("w", 96), ("b", 8), ("emb", 1000)]
PULL_BLOCK = 64   # elements per block of the shared pull's tensors
PULL_LAYOUT = hg.PullLayout([("w", 96, "torch.float32"), ("b", 7, "torch.float32"), ("emb", 1000, "torch.float32")],
                            PULL_BLOCK)
BOOT_TIMEOUT = 120.0   # s: a spawned worker imports torch (two cores, shared)
REPLY_TIMEOUT = 20.0


def gradients(seed: int, rank: int, step: int, none=(), layout=LAYOUT) -> dict:
    """Rank ``rank``'s gradients of ``step``: the same tensors in the worker and in the test."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 1009 + step)
    grads = {}
    for name, numel in layout:
        shape = SHAPES[name] if math.prod(SHAPES[name]) == numel else (numel,)
        grad = torch.randn(shape, generator=generator)
        grads[name] = None if name in none else (grad.t() if name == "w" else grad)
    return grads


def reference(seed: int, step: int, ranks, weights, none: dict | None = None) -> dict:
    """The sums the leader must return, folded in ascending rank order."""
    none = none or {}
    sums = {}
    for name, _numel in LAYOUT:
        out = None
        for rank, weight in sorted(zip(ranks, weights)):
            grad = gradients(seed, rank, step, none.get(rank, ()))[name]
            if grad is None:
                continue
            grad = grad.reshape(-1)
            out = weight * grad if out is None else out.add_(grad, alpha=weight)
        sums[name] = None if out is None else out.numpy().tobytes()
    return sums


def pulled_caches(seed: int, step: int) -> tuple[dict, dict]:
    """The leader's caches once it pulled ``step`` (values by name, versions by block): a block
    changes at step 0 and at each step ``s`` with ``(index + s) % 2 == 0``, taking values drawn
    from (seed, name, index, s) and version ``s + 1``; the others keep theirs."""
    values, versions = {}, {}
    for name, numel, _dtype in zip(PULL_LAYOUT.names, PULL_LAYOUT.numels, PULL_LAYOUT.dtypes):
        flat = torch.empty(numel)
        for index in range(-(-numel // PULL_BLOCK)):
            changed = max(s for s in range(step + 1) if s == 0 or (index + s) % 2 == 0)
            generator = torch.Generator().manual_seed(seed * 7919 + PULL_LAYOUT.names.index(name) * 131_071 + index * 17 + changed)
            block = flat[index * PULL_BLOCK:(index + 1) * PULL_BLOCK]
            block.copy_(torch.randn(block.numel(), generator=generator))
            versions[(name, index)] = changed + 1
        values[name] = flat
    return values, versions


# -- the worker processes --------------------------------------------------------------------------

def _resources() -> dict:
    """This process's open fds (fd -> target), memfd mappings and threads."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:   # the listing's own fd
            pass
    with open("/proc/self/maps") as maps:
        memfd_maps = [line.split(None, 5)[-1].strip() for line in maps if "memfd:" in line]
    return {"fds": fds, "memfd_maps": memfd_maps, "threads": threading.active_count()}


def _leaks(before: dict, after: dict) -> list[str]:
    leaks = [f"fd {fd} -> {target}" for fd, target in after["fds"].items() if before["fds"].get(fd) != target]
    leaks += [f"mapping of {name}" for name in after["memfd_maps"] if name not in before["memfd_maps"]]
    if after["threads"] > before["threads"]:
        leaks.append(f"{after['threads'] - before['threads']} thread(s)")
    return leaks


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _worker_main(conn) -> None:
    """A worker process: runs the commands the test sends and answers (status, result, seconds)."""
    from shardline.services import failpoints

    torch.set_num_threads(1)
    records = _Records()
    logger = logging.getLogger("shardline")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    group = pending = before = layout = None
    caches, versions = {}, {}   # a member's, as the shared pull leaves them
    conn.send(("ready", os.getpid(), 0.0))
    while True:
        try:
            command, args = conn.recv()
        except EOFError:
            break
        if command == "exit":
            break
        started = time.monotonic()
        try:
            if command == "open":
                before = _resources()
                key, rank, layout, options = args
                group = HostGroup(key, rank, layout, **options)   # the layout its gradients follow
                caches = {n: torch.zeros(numel) for n, numel in zip(PULL_LAYOUT.names, PULL_LAYOUT.numels)}
                versions = {}
                result = group.state.value
            elif command == "begin":
                step, weight, seed, none, *share = args
                pending = group.begin_step(step, weight, gradients(seed, group.rank, step, none, layout),
                                           share_pull=bool(share and share[0]))
                if isinstance(pending, hg.LeaderStep):
                    result = ("leader", pending.step, pending.ranks, pending.weights,
                              {n: None if s is None else s.numpy().tobytes() for n, s in pending.sums.items()})
                elif isinstance(pending, hg.MemberStep):
                    result = ("member", pending.step, pending.leader)
                else:
                    result = ("alone", group.state.value)
            elif command == "finish":
                pending.finish(args[0])
                result = None
            elif command == "wait":
                result = (pending.wait(), group.state.value)
            elif command == "share":
                seed, step = args
                values, leader_versions = pulled_caches(seed, step)
                result = (group.share_pull(step + 1000, leader_versions, values, durable_step=step + 500),
                          group.state.value)
            elif command == "take":
                taken = group.take_pull(versions, caches)
                assert taken is None or taken.durable_step == taken.held_step - 500, taken
                held = None if taken is None else taken.held_step
                result = (held, {n: t.numpy().tobytes() for n, t in caches.items()}, dict(versions),
                          group.state.value)
            elif command == "state":
                result = group.state.value
            elif command == "logs":
                result, records.lines = records.lines, []
            elif command == "failpoints":
                failpoints.configure(args[0])
                result = None
            elif command == "close":
                failpoints.configure("")
                if group is not None:
                    group.close()
                group = pending = None
                result = [] if before is None else _leaks(before, _resources())
                before = None
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", result, time.monotonic() - started))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}", time.monotonic() - started))


class WorkerError(AssertionError):
    pass


class Worker:
    """A spawned worker process and its pipe."""

    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.booted = False
        self.seconds = 0.0   # how long the last command ran in the worker

    @property
    def pid(self) -> int:
        return self.proc.pid

    def boot(self) -> None:
        if not self.booted:
            assert self.reply(BOOT_TIMEOUT) == self.pid
            self.booted = True

    def send(self, command: str, *args) -> None:
        self.conn.send((command, args))

    def reply(self, timeout: float = REPLY_TIMEOUT):
        if not self.conn.poll(timeout):
            raise AssertionError(f"worker {self.pid} gave no answer within {timeout} s")
        status, result, self.seconds = self.conn.recv()
        if status == "error":
            raise WorkerError(result)
        return result

    def call(self, command: str, *args, timeout: float = REPLY_TIMEOUT):
        self.send(command, *args)
        return self.reply(timeout)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def end(self) -> None:
        if not self.booted:   # a replacement nobody used: no group to close, no need to wait for its imports
            self.proc.kill()
        try:
            if self.alive():
                self.resume()
                self.send("exit")
        except (OSError, BrokenPipeError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


class Pool:
    """Spawned workers reused across this module's tests; one that died is replaced (the new one
    boots while other tests run)."""

    def __init__(self, size: int):
        self.ctx = multiprocessing.get_context("spawn")
        self.idle = [Worker(self.ctx) for _ in range(size)]
        self.everyone = list(self.idle)

    def take(self, n: int) -> list[Worker]:
        while len(self.idle) < n:
            self._spawn()
        taken, self.idle = self.idle[:n], self.idle[n:]
        for worker in taken:
            worker.boot()
        return taken

    def give_back(self, worker: Worker) -> list[str]:
        """Close its group and return it to the pool: what it leaked (or replace it, dead)."""
        if worker.alive():
            worker.resume()
            try:
                leaks = worker.call("close")
                worker.call("logs")
            except AssertionError as exc:
                worker.end()
                self.everyone.remove(worker)
                self._spawn()
                return [f"worker {worker.pid} could not close its group: {exc}"]
            self.idle.append(worker)
            return [f"worker {worker.pid}: {leak}" for leak in leaks]
        worker.end()
        self.everyone.remove(worker)
        self._spawn()
        return []

    def _spawn(self) -> None:
        worker = Worker(self.ctx)
        self.idle.append(worker)
        self.everyone.append(worker)

    def shutdown(self) -> None:
        for worker in self.everyone:
            worker.end()


@pytest.fixture(scope="module")
def pool():
    workers = Pool(4)
    yield workers
    workers.shutdown()


@pytest.fixture
def take(pool):
    """``take(n)``: n workers of the pool; after the test each closes its group, leaking nothing."""
    taken: list[Worker] = []

    def take_workers(n: int) -> list[Worker]:
        workers = pool.take(n)
        taken.extend(workers)
        return workers

    yield take_workers
    leaks = [leak for worker in taken for leak in pool.give_back(worker)]
    assert not leaks


def group_key(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:8]}@127.0.0.1:7000"


def open_group(workers: list[Worker], key: str, ranks, layout=LAYOUT, **options) -> list[str]:
    """Open ``key`` on each worker in turn (the first leads); their states."""
    options.setdefault("incarnation", "")
    states = []
    for worker, rank in zip(workers, ranks):
        states.append(worker.call("open", key, rank, layout, {**options, "incarnation": f"inc-{rank}"}))
    return states


def logs(worker: Worker, level: str = "WARNING") -> list[str]:
    return [message for levelname, message in worker.call("logs") if levelname == level]


def run_step(by_rank: dict[int, Worker], leader: int, step: int, weights: dict[int, float], seed: int, order,
             none: dict | None = None, pushed: bool = True):
    """One step: ``begin`` in ``order`` (each member's READY is out before the next rank begins; the
    leader blocks until it has them), the leader's sums checked against the reference, ``finish``,
    and each member's ``wait``: (the leader's answer, {rank: wait()})."""
    none = none or {}
    for rank in order:
        by_rank[rank].send("begin", step, weights[rank], seed, none.get(rank, ()))
        if rank != leader:
            assert by_rank[rank].reply() == ("member", step, leader)
    kind, got_step, ranks, got_weights, sums = by_rank[leader].reply()
    assert (kind, got_step) == ("leader", step)
    assert list(ranks) == sorted(by_rank) and list(got_weights) == [weights[r] for r in ranks]
    assert sums == reference(seed, step, ranks, got_weights, none)
    by_rank[leader].call("finish", pushed)
    waits = {rank: worker.call("wait") for rank, worker in by_rank.items() if rank != leader}
    return (ranks, got_weights, sums), waits


# -- the state table ---------------------------------------------------------------------------------

S, E = HostGroupState, HostGroupEvent
EXPECTED = {
    (S.JOINING, E.BOUND): S.LEADING,
    (S.JOINING, E.JOINED): S.MEMBER,
    (S.JOINING, E.UNREACHED): S.JOINING,
    (S.JOINING, E.REFUSED): S.SOLO,
    (S.LEADING, E.BEGIN): S.COLLECTING,
    (S.COLLECTING, E.ALONE): S.LEADING,
    (S.COLLECTING, E.SUMMED): S.AGGREGATED,
    (S.AGGREGATED, E.FINISHED): S.LEADING,
    (S.MEMBER, E.READY_SENT): S.WAITING,
    (S.WAITING, E.ANSWERED): S.MEMBER,
    (S.MEMBER, E.LEADER_LOST): S.JOINING,
    (S.WAITING, E.LEADER_LOST): S.JOINING,
    (S.AGGREGATED, E.PULL_OWED): S.SHARING,
    (S.SHARING, E.PULL_SENT): S.LEADING,
    (S.WAITING, E.PULL_DUE): S.PULL_AWAITED,
    (S.PULL_AWAITED, E.PULL_TAKEN): S.MEMBER,
    (S.PULL_AWAITED, E.LEADER_LOST): S.JOINING,
    **{(state, E.CLOSE): S.CLOSED for state in S if state is not S.CLOSED},
}


@pytest.mark.parametrize("state", list(S))
@pytest.mark.parametrize("event", list(E))
def test_every_transition_of_the_table_and_no_other(state, event):
    if (state, event) in EXPECTED:
        assert state.after(event) is EXPECTED[(state, event)]
    else:
        with pytest.raises(ShardlineStateError, match=f"no transition from {state.value} on {event.name}"):
            state.after(event)


def test_the_module_table_is_the_expected_one():
    assert hg._TRANSITIONS == EXPECTED


# -- in this process: arguments, HELLO checks, joins that fail --------------------------------------

@pytest.fixture
def no_leaks():
    """Fails the test if it leaves an fd, a memfd mapping or a thread behind."""
    before = _resources()
    yield
    deadline = time.monotonic() + 5
    while (leaks := _leaks(before, _resources())) and time.monotonic() < deadline:
        time.sleep(0.05)   # a closed group's thread ends just after close() returned
    assert not leaks


def test_a_bad_weight_or_gradient_is_refused_quoting_it(no_leaks):
    with HostGroup(group_key("weights"), 0, LAYOUT, incarnation="a", join_timeout=2) as group:
        assert group.state is S.LEADING
        grads = gradients(1, 0, 1)
        for weight in (float("nan"), float("inf"), -float("inf"), 0, 0.0, -1.5, True, "2", None):
            with pytest.raises(ShardlineConfigError, match=f"weight must be finite and > 0, got {weight!r}"):
                group.begin_step(1, weight, grads)
        for name, bad, why in [("b", torch.ones(7, dtype=torch.float64), "got torch.float64 on cpu with 7 elements"),
                               ("b", torch.ones(8), "got torch.float32 on cpu with 8 elements"),
                               ("emb", [0.0] * 1000, "got list")]:
            with pytest.raises(ShardlineConfigError, match=f"gradient '{name}' must be a float32 CPU tensor of .*{why}"):
                group.begin_step(1, 1.0, {**grads, name: bad})
        with pytest.raises(ShardlineConfigError, match=r"not in the layout: \['extra'\]"):
            group.begin_step(1, 1.0, {**grads, "extra": torch.ones(1)})
        with pytest.raises(ShardlineConfigError, match="step must be an integer"):
            group.begin_step(-1, 1.0, grads)
        assert group.state is S.LEADING                                   # nothing began
        assert group.begin_step(1, 2.5, grads) is None                    # alone: pushes alone
        assert group.begin_step(1, 2.5, grads) is None                    # a retried step too
        assert group.state is S.LEADING
    assert group.state is S.CLOSED
    group.close()   # again: nothing
    with pytest.raises(ShardlineStateError, match="after close"):
        group.begin_step(2, 1.0, grads)


@pytest.mark.parametrize("layout, why", [
    ([], "must name 1 to"),
    ([("w", 4), ("w", 5)], "names 'w' twice"),
    ([("w", 0)], "numel > 0"),
    ([("w", True)], "numel > 0"),
    ([("", 4)], "non-empty name"),
    ([("w",)], r"must be \(name, numel\)"),
])
def test_a_bad_layout_is_refused(layout, why):
    with pytest.raises(ShardlineConfigError, match=why):
        HostGroup(group_key("layout"), 0, layout, incarnation="a")


@pytest.mark.parametrize("option, value", [("member_timeout", 0), ("leader_timeout", float("nan")),
                                           ("join_timeout", -1), ("incarnation", ""), ("incarnation", "x" * 65)])
def test_bad_options_are_refused_quoting_them(option, value):
    options = {"incarnation": "a", option: value}
    with pytest.raises(ShardlineConfigError, match=f"{option} must be .*got {value!r}"):
        HostGroup(group_key("options"), 0, LAYOUT, **options)


def _raw_hello(group: HostGroup, fds: list[int], *, rank=5, version=hg._VERSION, group_digest=None, layout_digest=None,
               incarnation=b"raw"):
    """Connect to ``group``'s socket like a member would, with the HELLO's fields as given and ``fds``
    on it: the socket and the first message back (None if the leader closed without answering)."""
    layout = group._layout
    hello = hg._HELLO.pack(hg._MAGIC, version, rank, len(layout.names), layout.region_bytes,
                           group_digest or group._group_digest, layout_digest or layout.digest, incarnation)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(group._name)
    socket.send_fds(sock, [hello], fds)
    inbox = bytearray()
    while not (messages := hg._take_messages(inbox)):
        data = sock.recv(4096)
        if not data:
            return sock, None
        inbox += data
    return sock, messages[0]


def _unsealed_memfd(size: int) -> int:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def test_a_hello_of_another_group_layout_version_or_region_is_refused(caplog, no_leaks):
    caplog.set_level(logging.INFO, logger="shardline.worker")
    with HostGroup(group_key("hello"), 0, LAYOUT, incarnation="leader", join_timeout=2) as group:
        other_digest = hg._Layout(OTHER_LAYOUT).digest
        unsealed = _unsealed_memfd(group._layout.region_bytes)
        wrong_size = hg.SharedRegion(group._layout.region_bytes + 64)
        region = hg.SharedRegion(group._layout.region_bytes)
        cases = [
            ([region.fd], dict(version=hg._VERSION + 1), hg.Refusal.VERSION),
            ([region.fd], dict(group_digest=b"\1" * 32), hg.Refusal.GROUP),
            ([region.fd], dict(layout_digest=other_digest), hg.Refusal.LAYOUT),
            ([region.fd], dict(rank=0), hg.Refusal.RANK_TAKEN),                 # the leader's own rank
            ([unsealed], {}, hg.Refusal.REGION),
            ([wrong_size.fd], {}, hg.Refusal.REGION),
        ]
        try:
            for fds, fields, reason in cases:
                sock, answer = _raw_hello(group, fds, **fields)
                sock.close()
                assert answer is not None and (answer.kind, answer.argument) == (hg.REFUSED, reason), fields
                assert answer.tail == group._layout.digest   # the leader's layout digest, for the warning
            sock, answer = _raw_hello(group, [])              # no region: closed without an answer
            sock.close()
            assert answer is None
            # a well-formed HELLO is welcomed, and the roster follows
            sock, answer = _raw_hello(group, [region.fd], rank=3)
            assert (answer.kind, answer.argument) == (hg.WELCOME, 0)
            # ... and a second process claiming rank 3 while the first is connected is refused
            second, refused = _raw_hello(group, [region.fd], rank=3, incarnation=b"another")
            second.close()
            assert (refused.kind, refused.argument) == (hg.REFUSED, hg.Refusal.RANK_TAKEN)
            # a member that sends garbage is dropped; the group serves on
            sock.sendall(hg._MESSAGE.pack(99, 0, 0, 0, 0.0))
            sock.settimeout(5)
            data = b""
            while chunk := sock.recv(4096):   # the roster(s), then the end
                data += chunk
            sock.close()
            assert group.begin_step(1, 1.0, gradients(1, 0, 1)) is None
        finally:
            os.close(unsealed)
            for r in (wrong_size, region):
                r.close()
                r.memory.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    digest = group._layout.digest.hex()[:16]
    assert any(f"has layout digest {other_digest.hex()[:16]}, this group {digest}" in w for w in warnings)
    assert any("is held by incarnation 'raw'" in w and "RANK_TAKEN" in w for w in warnings)
    assert any("broke the protocol (unknown message kind 99)" in w for w in warnings)


def test_no_answer_to_hello_is_unreached_and_tried_again_next_step(caplog, no_leaks):
    key = group_key("unreached")
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(hg.socket_name(key))
    squatter.listen(4)   # holds the name, never answers
    group = HostGroup(key, 1, LAYOUT, incarnation="a", join_timeout=0.3)
    try:
        assert group.state is S.JOINING
        assert any("could not lead or join within join_timeout 0.3 s" in r.getMessage() for r in caplog.records)
        squatter.close()
        assert group.begin_step(1, 1.0, gradients(1, 1, 1)) is None   # binds now: leads, alone
        assert group.state is S.LEADING
    finally:
        group.close()
        squatter.close()


UID_SCRIPT = """
import os, socket, sys, time
os.setgid(65534); os.setuid(65534)
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
name = bytes.fromhex(sys.argv[1])
if sys.argv[2] == "bind":
    sock.bind(name); sock.listen(4); print("bound", flush=True)
    conn, _ = sock.accept(); time.sleep(5)
else:
    sock.connect(name)
    try:
        sock.sendall(b"x" * 200)
        data = sock.recv(1)
    except OSError:   # closed already
        data = b""
    print("ended" if data == b"" else "answered", flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a process of another uid")
def test_a_process_of_another_uid_is_neither_joined_nor_followed(caplog):
    key = group_key("uid")
    name = hg.socket_name(key)
    squatter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(UID_SCRIPT), name.hex(), "bind"],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline().strip() == "bound"
        with HostGroup(key, 1, LAYOUT, incarnation="a", join_timeout=2) as group:
            assert group.state is S.SOLO and group.begin_step(1, 1.0, gradients(1, 1, 1)) is None
    finally:
        squatter.kill()
        squatter.wait(10)
    assert any("of uid 65534, not this user's" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with HostGroup(key, 0, LAYOUT, incarnation="a", join_timeout=2) as group:
        assert group.state is S.LEADING
        intruder = subprocess.run([sys.executable, "-c", textwrap.dedent(UID_SCRIPT), name.hex(), "connect"],
                                  capture_output=True, text=True, timeout=30)
        assert intruder.stdout.strip() == "ended", intruder.stderr
    assert any("refused a connection from pid" in r.getMessage() and "of uid 65534" in r.getMessage()
               for r in caplog.records)


# -- real processes ----------------------------------------------------------------------------------

def test_three_workers_sum_bitwise_equal_to_the_reference_whatever_order_they_come_in(take):
    workers = take(3)
    key = group_key("three")
    for rank, worker in enumerate(workers):   # at once: one binds, the others connect
        worker.send("open", key, rank, LAYOUT, {"incarnation": f"inc-{rank}"})
    states = [worker.reply() for worker in workers]
    assert sorted(states) == ["leading", "member", "member"]
    leader = states.index("leading")
    by_rank = dict(enumerate(workers))
    members = [r for r in by_rank if r != leader]
    weights = {0: 3.0, 1: 1.5, 2: 7.0}
    orders = [members + [leader], [leader] + members, [members[1], leader, members[0]], members[::-1] + [leader]]
    for step, order in enumerate(orders, start=1):
        pushed = step != 3
        _, waits = run_step(by_rank, leader, step, weights, seed=11, order=order, pushed=pushed)
        assert waits == {rank: (pushed, "member") for rank in members}
    # a retried step is pushed alone, by every rank
    assert by_rank[leader].call("begin", 4, 1.0, 11, ()) == ("alone", "leading")
    assert by_rank[members[0]].call("begin", 4, 1.0, 11, ()) == ("alone", "member")
    # begin_step before the last step's wait() / finish() is refused
    by_rank[members[0]].call("begin", 5, 1.0, 11, ())
    with pytest.raises(WorkerError, match=r"begin_step\(6\) before step 5's MemberStep.wait\(\)"):
        by_rank[members[0]].call("begin", 6, 1.0, 11, ())
    by_rank[members[1]].call("begin", 5, 1.0, 11, ())
    assert by_rank[leader].call("begin", 5, 1.0, 11, ())[0] == "leader"
    with pytest.raises(WorkerError, match=r"begin_step\(6\) before step 5's LeaderStep.finish\(\)"):
        by_rank[leader].call("begin", 6, 1.0, 11, ())
    by_rank[leader].call("finish", True)
    with pytest.raises(WorkerError, match="finish\\(\\) of step 5 in state leading"):   # once only
        by_rank[leader].call("finish", True)
    assert [by_rank[r].call("wait") for r in members] == [(True, "member")] * 2


def test_missing_gradients_are_left_out_and_a_tensor_nobody_has_sums_to_none(take):
    workers = take(3)
    open_group(workers, group_key("none"), [0, 1, 2])
    by_rank = dict(enumerate(workers))
    none = {0: ("b", "emb"), 1: ("b",), 2: ("b", "w")}   # b: nobody; emb: ranks 1, 2; w: ranks 0, 1
    (ranks, _, sums), waits = run_step(by_rank, 0, 1, {0: 1.0, 1: 2.0, 2: 0.5}, seed=5, order=[1, 2, 0], none=none)
    assert ranks == (0, 1, 2) and sums["b"] is None and sums["w"] is not None and sums["emb"] is not None
    # the next step's gradients are all there again: nothing of the last step's absence stays
    (_, _, sums), _ = run_step(by_rank, 0, 2, {0: 1.0, 1: 1.0, 2: 1.0}, seed=5, order=[0, 1, 2])
    assert all(s is not None for s in sums.values())


def test_a_member_killed_before_ready_is_dropped_at_once(take):
    workers = take(3)
    open_group(workers, group_key("killed"), [0, 1, 2], member_timeout=10.0)
    by_rank = dict(enumerate(workers))
    run_step(by_rank, 0, 1, {0: 1.0, 1: 1.0, 2: 1.0}, seed=3, order=[1, 2, 0])
    by_rank[0].send("begin", 2, 1.0, 3, ())
    assert by_rank[1].call("begin", 2, 2.0, 3, ()) == ("member", 2, 0)
    time.sleep(0.3)
    by_rank[2].kill()
    kind, _, ranks, weights, sums = by_rank[0].reply()
    assert (kind, ranks) == ("leader", (0, 1)) and by_rank[0].seconds < 3.0   # not member_timeout
    assert sums == reference(3, 2, ranks, weights)
    by_rank[0].call("finish", True)
    assert by_rank[1].call("wait") == (True, "member")
    assert any("rank 2 left (its connection ended)" in m for m in logs(by_rank[0], "INFO"))


def test_a_member_that_dies_right_after_ready_is_summed_whole_or_not_at_all(take):
    workers = take(3)
    open_group(workers, group_key("after-ready"), [0, 1, 2], member_timeout=10.0)
    by_rank = dict(enumerate(workers))
    by_rank[2].call("failpoints", "worker.host_group_ready@2")
    run_step(by_rank, 0, 1, {0: 1.0, 1: 1.0, 2: 1.0}, seed=4, order=[0, 1, 2])
    by_rank[0].send("begin", 2, 1.0, 4, ())
    assert by_rank[1].call("begin", 2, 1.0, 4, ()) == ("member", 2, 0)
    by_rank[2].send("begin", 2, 1.0, 4, ())
    by_rank[2].proc.join(10)
    assert by_rank[2].proc.exitcode == 137
    kind, _, ranks, weights, sums = by_rank[0].reply()
    # its gradients were whole in its region when READY went out; whether the leader returned before
    # it saw the connection end decides whether it is in: either way the sums are those of `ranks`
    assert kind == "leader" and ranks in ((0, 1), (0, 1, 2)) and by_rank[0].seconds < 3.0
    assert sums == reference(4, 2, ranks, weights)
    by_rank[0].call("finish", True)
    assert by_rank[1].call("wait") == (True, "member")
    (ranks, _, _), _ = run_step({0: by_rank[0], 1: by_rank[1]}, 0, 3, {0: 1.0, 1: 1.0}, seed=4, order=[0, 1])
    assert ranks == (0, 1)


def test_a_stopped_member_is_excluded_after_member_timeout_and_included_again_next_step(take):
    workers = take(3)
    open_group(workers, group_key("stopped"), [0, 1, 2], member_timeout=1.0)
    by_rank = dict(enumerate(workers))
    weights = {0: 1.0, 1: 2.0, 2: 3.0}
    run_step(by_rank, 0, 1, weights, seed=6, order=[1, 2, 0])
    by_rank[2].stop()
    try:
        by_rank[0].send("begin", 2, weights[0], 6, ())
        assert by_rank[1].call("begin", 2, weights[1], 6, ()) == ("member", 2, 0)
        kind, _, ranks, got_weights, sums = by_rank[0].reply()
        assert (kind, ranks) == ("leader", (0, 1)) and 1.0 <= by_rank[0].seconds < 3.0
        assert sums == reference(6, 2, ranks, got_weights)
        assert any("rank(s) [2] sent no gradients for step 2 within member_timeout 1 s" in m
                   for m in logs(by_rank[0]))
        by_rank[0].call("finish", True)
        assert by_rank[1].call("wait") == (True, "member")
    finally:
        by_rank[2].resume()
    assert by_rank[2].call("begin", 2, weights[2], 6, ()) == ("member", 2, 0)   # its late READY ...
    assert by_rank[2].call("wait") == (False, "member") and by_rank[2].seconds < 1.0   # ... told EXCLUDED at once
    (ranks, _, _), waits = run_step(by_rank, 0, 3, weights, seed=6, order=[2, 0, 1])
    assert ranks == (0, 1, 2) and waits == {1: (True, "member"), 2: (True, "member")}


def test_a_leader_killed_before_finish_releases_its_members_and_one_of_them_leads_next(take):
    workers = take(3)
    open_group(workers, group_key("leader-killed"), [0, 1, 2], leader_timeout=30.0)
    by_rank = dict(enumerate(workers))
    run_step(by_rank, 0, 1, {0: 1.0, 1: 1.0, 2: 1.0}, seed=8, order=[0, 1, 2])
    by_rank[0].call("failpoints", "worker.host_group_leader_summed@2")   # exits after summing step 2
    assert by_rank[1].call("begin", 2, 1.0, 8, ()) == ("member", 2, 0)
    assert by_rank[2].call("begin", 2, 1.0, 8, ()) == ("member", 2, 0)
    by_rank[0].send("begin", 2, 1.0, 8, ())
    by_rank[0].proc.join(10)
    assert by_rank[0].proc.exitcode == 137
    for rank in (1, 2):
        assert by_rank[rank].call("wait") == (False, "joining") and by_rank[rank].seconds < 3.0
        assert any("lost leader rank 0: its connection ended" in m for m in logs(by_rank[rank]))
    # the next step: one binds, and waits for the other (it knows the group's ranks) though it comes late
    by_rank[1].send("begin", 3, 2.0, 8, ())
    time.sleep(0.3)
    by_rank[2].send("begin", 3, 0.5, 8, ())
    answers = {1: by_rank[1].reply(), 2: by_rank[2].reply()}
    leader = next(rank for rank, answer in answers.items() if answer[0] == "leader")
    member = 3 - leader
    _, step, ranks, weights, sums = answers[leader]
    assert answers[member] == ("member", 3, leader)
    assert (step, ranks, weights) == (3, (1, 2), (2.0, 0.5)) and sums == reference(8, 3, ranks, weights)
    by_rank[leader].call("finish", True)
    assert by_rank[member].call("wait") == (True, "member")
    assert by_rank[leader].call("state") == "leading"


def test_a_leader_stalled_past_leader_timeout_is_left_and_joined_again(take):
    workers = take(3)
    open_group(workers, group_key("leader-stalled"), [0, 1, 2], leader_timeout=1.0)
    by_rank = dict(enumerate(workers))
    run_step(by_rank, 0, 1, {0: 1.0, 1: 1.0, 2: 1.0}, seed=9, order=[0, 1, 2])
    for rank in (1, 2):
        by_rank[rank].call("begin", 2, 1.0, 9, ())
    assert by_rank[0].call("begin", 2, 1.0, 9, ())[2] == (0, 1, 2)
    by_rank[0].stop()
    try:
        for rank in (1, 2):   # no answer within leader_timeout: they hang up and push alone
            assert by_rank[rank].call("wait") == (False, "joining")
    finally:
        by_rank[0].resume()
    by_rank[0].call("finish", True)   # they are gone: nobody to tell
    # next step they join the same leader again (it still holds the socket) and are included
    (ranks, _, _), waits = run_step(by_rank, 0, 3, {0: 1.0, 1: 2.0, 2: 3.0}, seed=9, order=[1, 2, 0])
    assert ranks == (0, 1, 2) and waits == {1: (True, "member"), 2: (True, "member")}


def test_a_late_joiner_is_included_from_its_first_step_and_another_layout_stays_alone(take):
    workers = take(4)
    key = group_key("late")
    by_rank = dict(enumerate(workers))
    open_group(workers[:2], key, [0, 1])
    (ranks, _, _), _ = run_step({0: by_rank[0], 1: by_rank[1]}, 0, 1, {0: 1.0, 1: 1.0}, seed=2, order=[1, 0])
    assert ranks == (0, 1)
    assert open_group([by_rank[2]], key, [2]) == ["member"]
    (ranks, _, _), _ = run_step({r: by_rank[r] for r in (0, 1, 2)}, 0, 2, {0: 1.0, 1: 1.0, 2: 4.0}, seed=2,
                                order=[0, 2, 1])
    assert ranks == (0, 1, 2)
    assert open_group([by_rank[3]], key, [3], layout=OTHER_LAYOUT) == ["solo"]
    mine, theirs = hg._Layout(OTHER_LAYOUT).digest.hex()[:16], hg._Layout(LAYOUT).digest.hex()[:16]
    assert any(f"its layout digest {mine} differs from the leader's {theirs}" in m for m in logs(by_rank[3]))
    assert any(f"has layout digest {mine}, this group {theirs}" in m for m in logs(by_rank[0]))
    # it pushes alone; the group goes on without it
    assert by_rank[3].call("begin", 3, 1.0, 2, ()) == ("alone", "solo")
    (ranks, _, _), _ = run_step({r: by_rank[r] for r in (0, 1, 2)}, 0, 3, {0: 1.0, 1: 1.0, 2: 1.0}, seed=2,
                                order=[2, 1, 0])
    assert ranks == (0, 1, 2)


def test_two_groups_on_one_host_do_not_mix(take):
    workers = take(4)
    groups = {"a": dict(zip((0, 1), workers[:2])), "b": dict(zip((0, 1), workers[2:]))}
    for name, by_rank in groups.items():
        open_group(list(by_rank.values()), group_key(f"job-{name}"), [0, 1])
    for name, by_rank in groups.items():   # both collect at once
        by_rank[0].send("begin", 1, 1.0, ord(name), ())
        assert by_rank[1].call("begin", 1, 2.0, ord(name), ()) == ("member", 1, 0)
    for name, by_rank in groups.items():
        kind, _, ranks, weights, sums = by_rank[0].reply()
        assert (kind, ranks) == ("leader", (0, 1)) and sums == reference(ord(name), 1, ranks, weights)
        by_rank[0].call("finish", True)
        assert by_rank[1].call("wait") == (True, "member")


def test_reference_sum_is_the_documented_fold():
    """The test's reference is the module's rule: w0 * g0, then add_(g, alpha=w), ascending rank."""
    grads = [gradients(1, rank, 1) for rank in (2, 0, 1)]
    contributions = sorted((rank, w, [g[n].reshape(-1) for n, _ in LAYOUT])
                           for rank, w, g in zip((2, 0, 1), (0.3, 1.7, math.pi), grads))
    sums = hg._weighted_sums([n for n, _ in LAYOUT], contributions)
    ranks, weights = zip(*[(r, w) for r, w, _ in contributions])
    assert {n: s.numpy().tobytes() for n, s in sums.items()} == reference(1, 1, ranks, weights)


# -- the host's shared pull ------------------------------------------------------------------------

def as_bytes(caches: dict) -> dict:
    return {name: t.numpy().tobytes() for name, t in caches.items()}


def shared_step(by_rank: dict[int, Worker], leader: int, step: int, seed: int, sharing=None) -> None:
    """A step whose members (those in ``sharing``: all by default) share the pull: begin, finish,
    each member's wait (True, and the sharing ones now await the pull)."""
    sharing = set(by_rank) - {leader} if sharing is None else set(sharing)
    for rank in sorted(by_rank, key=lambda r: r == leader):
        if rank != leader:
            by_rank[rank].send("begin", step, 1.0, seed, (), rank in sharing)
            assert by_rank[rank].reply() == ("member", step, leader)
        else:
            by_rank[rank].send("begin", step, 1.0, seed, ())
    assert by_rank[leader].reply()[0] == "leader"
    by_rank[leader].call("finish", True)
    for rank in set(by_rank) - {leader}:
        assert by_rank[rank].call("wait") == (True, "pull_awaited" if rank in sharing else "member")
    assert by_rank[leader].call("state") == ("sharing" if sharing else "leading")


def test_sharing_members_adopt_the_leaders_pulled_values_and_versions_bitwise(take):
    """Three steps: the leader writes only the blocks that changed into its region, each member
    copies only what differs from its own versions, and ends with the leader's caches bit for bit
    and its versions, a non-sharing member is not told PULLED."""
    workers = take(4)
    by_rank = dict(zip((0, 1, 2, 3), workers))
    open_group(workers, group_key("pull"), [0, 1, 2, 3], pull_layout=PULL_LAYOUT)
    for step in range(3):
        shared_step(by_rank, 0, step, seed=5, sharing={1, 2})
        assert by_rank[0].call("share", 5, step) == (True, "leading")
        values, versions = pulled_caches(5, step)
        for rank in (1, 2):
            held, got, got_versions, state = by_rank[rank].call("take")
            assert (held, state) == (step + 1000, "member")
            assert got == as_bytes(values) and got_versions == versions
        assert by_rank[3].call("state") == "member"


def test_a_member_whose_leader_dies_before_pulled_pulls_itself_at_once(take):
    workers = take(2)
    by_rank = dict(zip((0, 1), workers))
    open_group(workers, group_key("pull-killed"), [0, 1], pull_layout=PULL_LAYOUT, leader_timeout=60)
    shared_step(by_rank, 0, 1, seed=6)
    by_rank[1].send("take")
    time.sleep(0.3)
    by_rank[0].kill()
    held, got, versions, state = by_rank[1].reply()
    assert (held, versions, state) == (None, {}, "joining")
    assert by_rank[1].seconds < 10   # the connection's end, not leader_timeout
    assert any("its connection ended" in line for line in logs(by_rank[1]))


def test_a_member_whose_leader_stalls_pulls_itself_after_leader_timeout(take):
    workers = take(2)
    by_rank = dict(zip((0, 1), workers))
    open_group(workers, group_key("pull-stalled"), [0, 1], pull_layout=PULL_LAYOUT, leader_timeout=2)
    shared_step(by_rank, 0, 1, seed=7)
    by_rank[0].stop()
    held, _, versions, state = by_rank[1].call("take")
    assert (held, versions, state) == (None, {}, "joining")
    assert 1.0 <= by_rank[1].seconds < 10
    assert any("no answer for the pull of step 1 within leader_timeout" in line for line in logs(by_rank[1]))
    by_rank[0].resume()
    # the member hung up: once the leader's connection thread saw it go, nobody is left to share with
    deadline = time.monotonic() + 10
    while not any("rank 1 left" in line for line in logs(by_rank[0], "INFO")):
        assert time.monotonic() < deadline, "the leader did not see the member hang up"
        time.sleep(0.05)
    assert by_rank[0].call("share", 7, 1) == (False, "leading")


def test_the_region_is_not_rewritten_while_a_member_has_not_answered_copied(take):
    """Rank 2 is stopped between PULLED of step 0 and its copy; step 1 goes on without it (excluded
    after member_timeout): the leader tells rank 1 NOT_PULLED instead of rewriting the region, and
    rank 2, resumed, still copies step 0's values whole."""
    workers = take(3)
    by_rank = dict(zip((0, 1, 2), workers))
    open_group(workers, group_key("pull-reuse"), [0, 1, 2], pull_layout=PULL_LAYOUT, member_timeout=1,
               leader_timeout=60)
    shared_step(by_rank, 0, 0, seed=8)
    assert by_rank[0].call("share", 8, 0) == (True, "leading")
    by_rank[2].stop()
    assert by_rank[1].call("take")[0] == 1000
    shared_step({0: by_rank[0], 1: by_rank[1]}, 0, 1, seed=8)
    assert by_rank[0].call("share", 8, 1) == (False, "leading")
    assert any("rank(s) [2] did not answer COPIED" in line for line in logs(by_rank[0], "INFO"))
    held, _, versions, state = by_rank[1].call("take")
    assert (held, state) == (None, "member")
    by_rank[2].resume()
    values, step0_versions = pulled_caches(8, 0)
    held, got, versions, state = by_rank[2].call("take")
    assert (held, state) == (1000, "member")
    assert got == as_bytes(values) and versions == step0_versions
    # COPIED came: the next step is shared again
    shared_step({0: by_rank[0], 1: by_rank[1]}, 0, 2, seed=8)
    assert by_rank[0].call("share", 8, 2) == (True, "leading")
    _, got, versions, _ = by_rank[1].call("take")
    values, step2_versions = pulled_caches(8, 2)
    assert got == as_bytes(values) and versions == step2_versions
