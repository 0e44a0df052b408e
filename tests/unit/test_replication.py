"""Replication, failover and two-phase ring changes between in-process PS nodes.

The nodes are real PSNodes with real Replicators and PeerLinks; only the connection is replaced
by a call into the peer node's frame handling (precheck + handle), so ordering, acks, fencing and
visibility run as in the daemons, without sockets. Results are checked against torch.optim run
on the same gradients in one process.
"""

from __future__ import annotations

import re
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from shardline.ps_server.node import PSNode
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.services.placement import place
from shardline.ps_server.replication import Replicator
from shardline.ps_server.replication_links import PeerLink, PeerLinks, Send
from shardline.ps_server.store import PushItem, StoreError
from shardline.services import failpoints, frame
from shardline.services.blocks import block_slices
from shardline.services.errors import ErrorCode, FrameError, RemoteError, ShardlineConfigError
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp

BLOCK = 4
SHAPES = {"a": (6, 4), "b": (10,), "frozen": (3,)}


class Bus:
    """The nodes of one in-process cluster and the routing table they share."""

    def __init__(self, spec, replication=2):
        self.spec = spec
        self.nodes: dict[str, PSNode] = {}
        self.down: set[str] = set()
        self.epoch = 1
        self.serving: list[str] = []
        self.pending: list[str] | None = None
        self.replication = replication

    def table(self) -> common_pb2.RoutingTable:
        t = common_pb2.RoutingTable(epoch=self.epoch, default_replication=self.replication)
        for n in self.serving:
            t.nodes.add(node_id=n, rack="default", grpc_address="x:1", data_address=f"{n}:1", vnodes=64)
        if self.pending is not None:
            t.pending_epoch = self.epoch
            for n in self.pending:
                t.pending_nodes.add(node_id=n, rack="default", grpc_address="x:1", data_address=f"{n}:1", vnodes=64)
        return t

    def add(self, node_id: str) -> PSNode:
        info = dispatcher_pb2.JobInfo(spec=self.spec, uid="u1", ready=True)
        node = PSNode(node_id, lambda name: info if name == self.spec.name else None, self.table)
        node.replicator = Replicator(node, FakeLinks(self, node_id))
        self.nodes[node_id] = node
        return node

    def publish(self) -> None:
        self.epoch += 1
        for name, node in self.nodes.items():
            if name not in self.down:
                node.update_routing(self.table())

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every node's syncs completed."""
        deadline = time.monotonic() + timeout
        while not all(n.replicator.ready() for k, n in self.nodes.items() if k not in self.down):
            assert time.monotonic() < deadline, "syncs did not complete"
            time.sleep(0.01)


class FakeConnection:
    def __init__(self, bus: Bus, peer: str):
        self.bus, self.peer = bus, peer

    def request(self, header, payloads, *, timeout=None):
        if self.peer in self.bus.down:
            raise ConnectionError(f"node {self.peer} is down")
        node = self.bus.nodes[self.peer]
        payload = bytearray(b"".join(bytes(p) for p in payloads))
        header = frame.parse_header(frame.encode_prefix_and_header(header)[frame.PREFIX.size:])
        frame.validate_header(header)  # what a real receiver checks before anything else
        try:
            node.precheck(header)
            reply, _ = node.handle(header, memoryview(payload))
        except StoreError as exc:
            raise RemoteError(exc.code, str(exc)) from None
        return reply

    def close(self):
        pass


class FakeLink(PeerLink):
    def __init__(self, bus, peer, *args):
        self.bus = bus
        super().__init__(peer, *args)

    def _connection(self):
        return FakeConnection(self.bus, self.peer)


class FakeLinks(PeerLinks):
    def __init__(self, bus: Bus, me: str):
        super().__init__(lambda peer: f"{peer}:1", None, None, timeout=1.0)
        self.bus = bus

    def link(self, peer):
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = FakeLink(self.bus, peer, self._address_of, None, None, self.timeout)
            return link


REPLICATE_GRADIENTS = False   # set per test by the replicate fixture


def make_spec(**hp) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name="job", sync="bsp", world_size=2, block_elements=BLOCK,
                              replicate_gradients=REPLICATE_GRADIENTS, optimizer=OptimizerConfig.from_kwargs("adamw", lr=0.01, weight_decay=0.1).to_proto())
    for name, shape in SHAPES.items():
        spec.tensors.add(name=name, shape=list(shape), dtype="float32", trainable=name != "frozen")
    return spec


@pytest.fixture(autouse=True, params=[None, 0.01], ids=["lr-on-commits", "lr-on-pushes"])
def push_lr(request, monkeypatch):
    """Each test runs as older clients drive a step (the lr only on commits: blocks are stepped at
    the commits) and as clients do now (the lr on pushes too: a block every rank pushed is stepped
    before the commits, pipelined apply); replicas, failover and handovers must not notice."""
    monkeypatch.setattr(Cluster, "lr", request.param)
    return request.param


@pytest.fixture(autouse=True, params=[False, True], ids=["copies", "gradients"])
def replicate(request, monkeypatch):
    """Each test also runs with JobSpec.replicate_gradients: a primary sends the blocks it steps at
    the commits as their mean gradient and lr, and the copy holders step their own copies; they
    must still equal their primaries bit for bit, through failover, handovers and ring changes."""
    monkeypatch.setattr(sys.modules[__name__], "REPLICATE_GRADIENTS", request.param)
    return request.param


def blocks_of(name, tensor):
    flat = tensor.reshape(-1)
    return [(name, s.index, flat[s.start:s.stop]) for s in block_slices(flat.numel(), BLOCK)]


class Cluster:
    """Drives BSP steps like the workers do: pushes to primaries, commits to every node, and a
    resend of the step in flight after an epoch change. ``lr`` goes with pushes and commits."""

    lr = None

    def __init__(self, bus: Bus, initial: dict):
        self.bus = bus
        view = next(iter(bus.nodes.values())).routing
        placement = place(view, bus.spec)
        for name, tensor in initial.items():
            for t, i, value in blocks_of(name, tensor):
                node = bus.nodes[placement.primary((t, i))]
                header = frame.FrameHeader(op=dp.OP_INIT, job="job", epoch=bus.epoch)
                header.blocks.append(frame.block_ref(t, i, value))
                node.precheck(header)
                node.handle(header, memoryview(bytearray(frame.tensor_bytes(value.contiguous()))))
        self.step = 0

    def live(self):
        return {k: n for k, n in self.bus.nodes.items() if k not in self.bus.down}

    def push(self, rank, grads: dict):
        view = next(iter(self.live().values())).routing
        placement = place(view, self.bus.spec)
        for name, g in grads.items():
            for t, i, part in blocks_of(name, g):
                node = self.bus.nodes[placement.primary((t, i))]
                node.job("job").push(rank, self.step, 1.0, [PushItem(t, i, part.clone())], lr=self.lr)

    def commit(self, rank):
        for node in self.live().values():
            node.job("job").commit(rank, self.step, 1.0, lr=self.lr, epoch=self.bus.epoch)

    def wait_visible(self):
        for node in self.live().values():
            job = node.job("job")
            keys = [k for k, b in job.blocks.items() if b.primary]
            job.wait_for_step(self.step + 1, timeout=10, keys=keys)
        self.step += 1

    def values(self, name) -> torch.Tensor:
        view = next(iter(self.live().values())).routing
        placement = place(view, self.bus.spec)
        numel = torch.Size(SHAPES[name]).numel()
        flat = torch.empty(numel)
        for s in block_slices(numel, BLOCK):
            node = self.bus.nodes[placement.primary((name, s.index))]
            flat[s.start:s.stop] = node.job("job").blocks[(name, s.index)].value
        return flat.view(SHAPES[name])

    def assert_copies_equal(self):
        """Every copy of every block, on every live node that holds one, equals the primary's."""
        view = next(iter(self.live().values())).routing
        placement = place(view, self.bus.spec)
        for key, owners in placement.owners.items():
            primary = self.bus.nodes[owners[0]].job("job").blocks[key]
            for other in owners[1:]:
                copy = self.bus.nodes[other].job("job").blocks.get(key)
                assert copy is not None, f"{other} lacks {key}"
                assert torch.equal(copy.value, primary.value), key
                for k, v in primary.state.items():
                    assert torch.equal(torch.as_tensor(copy.state[k]), torch.as_tensor(v)), (key, k)
                assert (copy.version, copy.step) == (primary.version, primary.step), key


# Primaries step with fused multi-tensor kernels: torch.optim's result within float32 round-off
# (replicas still equal their primaries bitwise: they install copies).
ROUND_OFF = dict(rtol=1e-6, atol=1e-6)


def reference(initial, grads_per_step):
    params = {n: initial[n].clone().requires_grad_() for n in ("a", "b")}
    opt = torch.optim.AdamW(list(params.values()), lr=0.01, weight_decay=0.1, foreach=False)
    for g0, g1 in grads_per_step:
        for n, p in params.items():
            p.grad = (g0[n] + g1[n]) / 2
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def gradients(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [tuple({n: torch.randn(SHAPES[n], generator=gen) for n in ("a", "b")} for _ in range(2)) for _ in range(steps)]


@pytest.fixture
def initial():
    gen = torch.Generator().manual_seed(42)
    return {n: torch.randn(shape, generator=gen) for n, shape in SHAPES.items()}


def serving_bus(nodes=3, replication=2) -> Bus:
    """``nodes`` serving nodes holding the job, its blocks not initialized yet."""
    bus = Bus(make_spec(), replication)
    for i in range(nodes):
        bus.add(f"n{i}")
    bus.serving = list(bus.nodes)
    bus.publish()
    for node in bus.nodes.values():
        node.job("job")
    bus.settle()
    return bus


def start(nodes=3, replication=2, initial=None):
    bus = serving_bus(nodes, replication)
    return bus, Cluster(bus, initial)


def run_steps(cluster, grads):
    for g0, g1 in grads:
        cluster.push(0, g0)
        cluster.push(1, g1)
        cluster.commit(0)
        cluster.commit(1)
        cluster.wait_visible()


def finish_and_compare(cluster, initial, grads, done: int) -> None:
    """Run the steps of ``grads`` after the first ``done``; the values equal torch.optim's on all of
    them and every copy its primary's."""
    run_steps(cluster, grads[done:])
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)
    cluster.assert_copies_equal()


def test_replicas_equal_their_primaries_bitwise(initial, push_lr, replicate):
    bus, cluster = start(initial=initial)
    grads = gradients(4)
    run_steps(cluster, grads)
    cluster.assert_copies_equal()
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)
    early = sum(node.job("job").applied_early for node in bus.nodes.values())
    trained = sum(1 for n in bus.nodes.values() for k, b in n.job("job").blocks.items() if b.primary and k[0] != "frozen")
    assert early == (0 if push_lr is None else 4 * trained)
    # stepped ahead: their copies went to the replicas before the commits, the step's frames only named them
    ahead = sum(node.job("job").copies_ahead for node in bus.nodes.values())
    assert ahead == (0 if push_lr is None else 4 * trained)
    # with replicate_gradients the one replica of each block replayed every step, at the commits
    # or (stepped ahead) when the gradient arrived, and held it until the step's frame named it
    replayed = sum(node.job("job").steps_replayed for node in bus.nodes.values())
    assert replayed == (4 * trained if replicate else 0)


def test_a_frame_replayed_in_batches_of_a_few_blocks_equals_torch_and_its_primary(initial, monkeypatch):
    """A copy holder steps a large frame's replayed copies in batches (REPLAY_BATCH_ELEMENTS: the
    transient is a batch's clones, not every copy's); forced here to a block or two per batch."""
    from shardline.ps_server.store import copies

    monkeypatch.setattr(copies, "REPLAY_BATCH_ELEMENTS", BLOCK + 1)
    bus, cluster = start(initial=initial)
    finish_and_compare(cluster, initial, gradients(4), 0)
    if REPLICATE_GRADIENTS:
        assert sum(node.job("job").steps_replayed for node in bus.nodes.values()) > 0


def test_a_step_goes_to_each_holder_in_frames_of_a_bounded_size_and_becomes_visible_after_the_last(initial, push_lr,
                                                                                                     monkeypatch):
    """A primary sends a step's blocks to a copy holder in REPLICATE_STEP frames of about
    STEP_FRAME_BYTES (the holder's receive buffer is one frame, not the node's primaries' whole
    step); the step becomes visible once every frame was answered. Forced here to a block or two
    per frame: the run still equals torch.optim and every copy its primary, bit for bit."""
    from shardline.ps_server import replication_primary

    monkeypatch.setattr(replication_primary, "STEP_FRAME_BYTES", 4 * BLOCK)
    frames, counting = {}, [False]
    original = FakeLink.send

    def send(self, item):
        header = item.header
        if counting[0] and header.op == dp.OP_REPLICATE and header.replicate_kind == dp.REPLICATE_STEP:
            frames.setdefault((header.step, header.node, self.peer), []).append(header.payload_bytes)
        return original(self, item)

    monkeypatch.setattr(FakeLink, "send", send)
    bus, cluster = start(initial=initial)
    counting[0] = True
    finish_and_compare(cluster, initial, gradients(3), 0)
    job = bus.nodes["n0"].job("job")
    largest_block = bus.nodes["n0"].replicator.codec(job).packed_numel(BLOCK) * 4
    assert max(p for sizes in frames.values() for p in sizes) <= 4 * BLOCK + largest_block
    if push_lr is None:    # stepped at the commits: a holder of several blocks gets them in several frames
        assert max(len(sizes) for sizes in frames.values()) >= 3, frames
    else:                  # stepped ahead, sent ahead: the step's one frame only names them
        assert all(sizes == [0] for sizes in frames.values()), frames


def test_initial_values_go_to_the_copy_holders_in_sync_sized_frames(initial, monkeypatch):
    """A job's initial values reach each copy holder in frames of about SYNC_BATCH_BYTES, as a
    sync's do (one frame of a large job's values and state ran past replication_timeout: each node
    dropped the other from its copy holders); forced here to a block or two per frame."""
    from shardline.ps_server import replication_primary

    monkeypatch.setattr(replication_primary, "SYNC_BATCH_BYTES", 4 * BLOCK)
    sent, counting = [], [True]
    original = FakeLink.send

    def send(self, item):
        if counting[0] and item.header.op == dp.OP_REPLICATE and item.header.replicate_kind == dp.REPLICATE_STEP:
            sent.append(len(item.header.blocks))
        return original(self, item)

    monkeypatch.setattr(FakeLink, "send", send)
    bus = serving_bus()
    # each primary's blocks in one INIT frame, as a worker sends them
    placement = place(next(iter(bus.nodes.values())).routing, bus.spec)
    frames = {}
    for name, tensor in initial.items():
        for t, i, value in blocks_of(name, tensor):
            frames.setdefault(placement.primary((t, i)), []).append((t, i, value))
    for node_id, blocks in frames.items():
        header = frame.FrameHeader(op=dp.OP_INIT, job="job", epoch=bus.epoch)
        payload = bytearray()
        for t, i, value in blocks:
            header.blocks.append(frame.block_ref(t, i, value))
            payload += bytes(frame.tensor_bytes(value.contiguous()))
        bus.nodes[node_id].precheck(header)
        bus.nodes[node_id].handle(header, memoryview(payload))
    counting[0] = False
    assert sent and max(sent) <= 2 and len(sent) > len(frames), sent
    cluster = Cluster.__new__(Cluster)
    cluster.bus, cluster.step = bus, 0
    finish_and_compare(cluster, initial, gradients(3), 0)


def beating(bus: Bus):
    """A thread doing each live node's periodic replication work, as the PS daemon's heartbeat
    loop does (ps_server/main.py): failed sync asks asked again, dropped holders invited."""
    import threading

    stop = threading.Event()

    def beat():
        while not stop.wait(0.05):
            for name, node in list(bus.nodes.items()):
                if name not in bus.down:
                    node.replicator.retry_failed()
                    node.replicator.invite_dropped()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return stop


def test_a_holder_the_initial_values_did_not_reach_is_invited_to_sync_and_no_step_waits_forever(initial,
                                                                                               monkeypatch):
    """Issue 41's hang: a job's initial values did not reach a copy holder within
    replication_timeout (one frame of a large job), so its primary dropped it; the holder never
    learnt that and asked for nothing, and every later step of that primary waited for a holder's
    sync (no holder in sync) while every node said it applied the step: a pull that waited
    forever. A primary now invites a dropped holder still in the routing to sync (REPLICATE_RESYNC,
    from its heartbeat loop); the holder asks for a sync of the copies it holds of it, and the
    step becomes visible."""
    from shardline.ps_server import replication_primary

    monkeypatch.setattr(replication_primary, "INVITE_AFTER_SECONDS", 0.2)
    failing = {"on": True}
    original = FakeConnection.request

    def request(self, header, payloads, *, timeout=None):
        if failing["on"] and header.op == dp.OP_REPLICATE and header.replicate_kind == dp.REPLICATE_STEP \
                and header.node == "n0":
            # lost on the way, the holder never saw it (failed at once here, not after replication_timeout)
            raise RemoteError(ErrorCode.TIMEOUT, "initial values lost")
        return original(self, header, payloads, timeout=timeout)

    monkeypatch.setattr(FakeConnection, "request", request)
    bus, cluster = start(nodes=2, initial=initial)
    failing["on"] = False
    assert "n1" not in bus.nodes["n0"].replicator.in_sync("job")   # dropped: its initial values failed
    grads = gradients(3)
    g0, g1 = grads[0]
    cluster.push(0, g0)
    cluster.push(1, g1)
    cluster.commit(0)
    cluster.commit(1)
    job = bus.nodes["n0"].job("job")
    with pytest.raises(StoreError) as err:       # what a pull met: a timeout that names who it waits for
        job.wait_for_step(1, timeout=0.3, keys=[k for k, b in job.blocks.items() if b.primary])
    assert err.value.code == "TIMEOUT"
    assert "applied step 1 here" in str(err.value) and "waits for a sync of node n1" in str(err.value), err.value
    stop = beating(bus)
    try:
        cluster.wait_visible()
        finish_and_compare(cluster, initial, grads, 1)
    finally:
        stop.set()
    assert "n1" in bus.nodes["n0"].replicator.in_sync("job")


def test_failover_to_the_replica_loses_no_step(initial):
    bus, cluster = start(initial=initial)
    grads = gradients(6)
    run_steps(cluster, grads[:3])
    # n0 dies mid-step: the workers had pushed their gradients of step 3 (some to n0) and
    # committed on the others only.
    g0, g1 = grads[3]
    cluster.push(0, g0)
    cluster.push(1, g1)
    for node_id in ("n1", "n2"):  # both ranks committed on the survivors before n0 died
        for rank in (0, 1):
            bus.nodes[node_id].job("job").commit(rank, cluster.step, 1.0, lr=cluster.lr, epoch=bus.epoch)
    bus.down.add("n0")
    bus.serving.remove("n0")
    bus.publish()                                   # the dispatcher declared n0 dead: epoch + 1
    bus.settle()
    cluster.push(0, g0)                             # the workers resend the step in flight ...
    cluster.push(1, g1)
    cluster.commit(0)                               # ... and commit it at the new epoch
    cluster.commit(1)
    cluster.wait_visible()
    run_steps(cluster, grads[4:])
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)
    cluster.assert_copies_equal()                   # re-replicated: two copies of everything again


def test_join_through_a_pending_ring_switches_with_every_block_in_sync(initial):
    bus, cluster = start(nodes=2, initial=initial)
    grads = gradients(5)
    run_steps(cluster, grads[:2])
    new = bus.add("n9")
    bus.pending = [*bus.serving, "n9"]
    bus.publish()                                   # pending ring: n9 learns what it will own
    # n9 holds no job yet: it must not report the pending ring ready before a heartbeat listed the
    # jobs (it did, and the ring switched with nothing of n9's synced: a handover found no block)
    assert [n.ready_epoch() for n in bus.nodes.values()] == [0, 0, 0]
    # the heartbeat's reply lists the jobs (the deleted one is unknown): now ready to report, once
    assert [node.hold_jobs(["job", "a-deleted-job"]) for node in bus.nodes.values()] == [True] * 3
    assert not any(node.hold_jobs(["job"]) for node in bus.nodes.values())
    bus.settle()
    run_steps(cluster, grads[2:3])                  # training goes on meanwhile; n9 gets the steps
    assert all(n.ready_epoch() == bus.epoch for n in bus.nodes.values())
    bus.serving, bus.pending = bus.pending, None
    bus.publish()                                   # switch
    bus.settle()
    run_steps(cluster, grads[3:])
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)
    placement = place(new.routing, bus.spec)
    assert any(owners[0] == "n9" for owners in placement.owners.values()), "n9 applies blocks after the switch"
    cluster.assert_copies_equal()


def test_a_node_back_from_a_partition_reports_the_pending_ring_ready_only_after_its_roles_are_assigned(initial):
    """n2 is cut off from the dispatcher, declared dead and left behind; back, its registration
    starts a pending ring, and a thread that met the new epoch first (a peer's frame, an ack)
    is still assigning its roles when the heartbeat thread, finding the epoch unchanged, asks
    for its readiness. It is not ready until the syncs that thread asks for completed (it was,
    and the ring switched with n2 the primary of stale blocks: a push of the current step was
    refused STALE_STEP against a block still at the step of the partition)."""
    import threading

    bus, cluster = start(initial=initial)
    grads = gradients(6)
    run_steps(cluster, grads[:2])
    stale = bus.nodes["n2"]
    bus.down.add("n2")                              # cut off: it never learns it was declared dead
    bus.serving.remove("n2")
    bus.publish()
    bus.settle()
    run_steps(cluster, grads[2:4])
    bus.down.discard("n2")
    bus.serving.append("n2")
    bus.pending, bus.serving = list(bus.serving), [n for n in bus.serving if n != "n2"]
    bus.epoch += 1
    entered, release = threading.Event(), threading.Event()
    resync = stale.replicator.resync

    def stalled_resync(*args, **kwargs):
        entered.set()
        release.wait(10)
        return resync(*args, **kwargs)

    stale.replicator.resync = stalled_resync
    learner = threading.Thread(target=stale.update_routing, args=(bus.table(),))
    learner.start()
    try:
        assert entered.wait(10)
        for name in ("n0", "n1"):
            bus.nodes[name].update_routing(bus.table())
            assert bus.nodes[name].hold_jobs(["job"])
        stale.update_routing(bus.table())           # the heartbeat thread: the epoch it holds already
        assert stale.hold_jobs(["job"])
        assert stale.ready_epoch() == 0, "ready before its roles were assigned and its syncs asked for"
    finally:
        release.set()
        learner.join(10)
    bus.settle()
    assert all(n.ready_epoch() == bus.epoch for n in bus.nodes.values())
    bus.serving, bus.pending = bus.pending, None
    bus.publish()                                   # switch: n2 applies blocks again
    bus.settle()
    finish_and_compare(cluster, initial, grads, 4)


def test_a_deposed_primary_is_fenced(initial):
    bus, cluster = start(initial=initial)
    run_steps(cluster, gradients(1))
    job0 = bus.nodes["n0"].job("job")
    key = next(k for k, b in job0.blocks.items() if b.primary)
    owners = place(bus.nodes["n0"].routing, bus.spec).owners[key]
    replica = bus.nodes[owners[1]]
    # the rest of the cluster moved on without n0 (paused, then woken): its copies are refused
    bus.serving.remove("n0")
    bus.epoch += 1
    for name, node in bus.nodes.items():
        if name != "n0":
            node.update_routing(bus.table())
    header = frame.FrameHeader(op=dp.OP_REPLICATE, job="job", epoch=bus.epoch - 1, node="n0", step=1,
                               replicate_kind=dp.REPLICATE_STEP)
    with pytest.raises(StoreError) as err:
        replica.precheck(header)
    assert err.value.code == "NOT_OWNER"


def wait_handed_over(bus, timeout=5.0):
    deadline = time.monotonic() + timeout
    while any(b.awaiting for n in bus.nodes.values() for b in n.job("job").blocks.values()):
        assert time.monotonic() < deadline, "handovers did not arrive"
        time.sleep(0.01)


def test_a_drain_hands_the_step_in_flight_over_so_a_dead_rank_loses_nothing(initial):
    """Rank 1 pushes step 2 everywhere, commits on n0 only and dies; n0 applies step 2. n2 drains
    before rank 1 is back: its blocks move with the gradients they collected (rank 1's among
    them). The restarted rank 1 redoes step 2 from partly stepped parameters — other gradients,
    which every node must ignore — and the result equals torch.optim bitwise."""
    bus, cluster = start(initial=initial)
    grads = gradients(4)
    run_steps(cluster, grads[:2])
    g0, g1 = grads[2]
    cluster.push(0, g0)
    cluster.push(1, g1)
    bus.nodes["n0"].job("job").commit(1, cluster.step, 1.0, lr=cluster.lr, epoch=bus.epoch)   # rank 1 dies here
    cluster.commit(0)
    assert bus.nodes["n0"].job("job").step == cluster.step + 1
    bus.pending = ["n0", "n1"]                       # n2 drains
    bus.publish()
    bus.settle()
    bus.serving, bus.pending = ["n0", "n1"], None
    bus.publish()                                    # switch: n2's blocks change primary mid-step
    wait_handed_over(bus)
    bus.settle()
    n1 = bus.nodes["n1"].job("job")
    commits, lr = bus.nodes["n0"].job("job").commits_of(cluster.step)
    n1.adopt_commits(cluster.step, {1: commits[1]}, lr)           # the commit relay
    cluster.push(0, g0)                              # rank 0 resends the step in flight at the new epoch
    cluster.commit(0)
    wrong = {n: torch.full(SHAPES[n], 100.0) for n in ("a", "b")}
    cluster.push(1, wrong)                           # restarted rank 1 redoes the step: ignored everywhere
    cluster.commit(1)
    cluster.wait_visible()
    finish_and_compare(cluster, initial, grads, 3)


def test_a_step_no_copy_holder_holds_yet_stays_invisible_until_one_synced(initial):
    """A new primary (just switched in) may apply a step before its replicas asked for their
    sync: with no copy holder in sync the step would live on one node only, so pulls must not
    see it until a holder's sync carried it (found by the seeded fault run: the new primary died
    right after applying, and the workers had already seen the step)."""
    bus, cluster = start(nodes=2, initial=initial)
    grads = gradients(3)
    run_steps(cluster, grads[:1])
    for node in bus.nodes.values():                  # as right after a switch: nobody asked yet
        for peer in node.replicator.in_sync("job"):
            node.replicator.drop_holder("job", peer, "not asked yet")
    g0, g1 = grads[1]
    cluster.push(0, g0)
    cluster.push(1, g1)
    cluster.commit(0)
    cluster.commit(1)
    for node in bus.nodes.values():
        job = node.job("job")
        keys = [k for k, b in job.blocks.items() if b.primary]
        with pytest.raises(StoreError) as err:
            job.wait_for_step(cluster.step + 1, timeout=0.3, keys=keys)
        assert err.value.code == "TIMEOUT"
    for node in bus.nodes.values():
        node.assign_roles(node.job("job"))           # the replicas ask for their sync ...
    cluster.wait_visible()                           # ... which carries the step: visible now
    cluster.assert_copies_equal()
    run_steps(cluster, grads[2:])
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)


def test_a_copy_holder_at_another_version_is_dropped_not_stepped_and_syncs_a_full_copy(initial, monkeypatch):
    """replicate_gradients: a copy holder steps its copy from the primary's gradient only if it
    holds the version the primary stepped from. One that does not (here: a copy made to look a
    step behind) steps nothing: stepped at the commits it answers UNAVAILABLE; stepped ahead it
    holds nothing, and the step's frame that names the block finds it lacking. Either way the
    primary drops it from the in-sync holders and makes the step visible with the others, and
    the holder asks its primary at once for a full copy of what it lacks (a sync), so it is an
    in-sync holder again without waiting for a routing change."""
    monkeypatch.setattr(sys.modules[__name__], "REPLICATE_GRADIENTS", True)
    bus, cluster = start(initial=initial)
    grads = gradients(4)
    run_steps(cluster, grads[:2])
    placement = place(next(iter(bus.nodes.values())).routing, bus.spec)
    key = ("a", 0)
    primary, holder = placement.owners[key][0], placement.owners[key][1]
    copy = bus.nodes[holder].job("job").blocks[key]
    copy.version -= 1
    before = copy.value.clone()
    cluster.push(0, grads[2][0])
    cluster.push(1, grads[2][1])
    cluster.commit(0)
    cluster.commit(1)
    cluster.wait_visible()
    # the holder asked its primary for the block at once (a sync, no routing change): in sync again
    primary_block = bus.nodes[primary].job("job").blocks[key]
    deadline = time.monotonic() + 10
    while not (holder in bus.nodes[primary].replicator.in_sync("job")
               and bus.nodes[holder].job("job").blocks[key].version == primary_block.version):
        assert time.monotonic() < deadline, "the holder did not sync the block it lacked"
        time.sleep(0.01)
    assert not torch.equal(before, bus.nodes[holder].job("job").blocks[key].value)   # a full copy came
    bus.settle()
    cluster.assert_copies_equal()
    run_steps(cluster, grads[3:])
    cluster.assert_copies_equal()
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)


def test_a_replayed_copy_that_diverges_is_found_by_its_checksum_resynced_and_survives_a_failover(initial,
                                                                                                 monkeypatch):
    """replicate_gradients with the divergence check every 2 steps: failpoint ps.replay_diverge
    moves one element of one replayed copy by one ulp (as a node of another build might step it).
    At the next checked step the holder's result sums differently from its primary's: it installs
    nothing, counts it (replica_divergences), answers UNAVAILABLE, is dropped and syncs a full copy.
    Every copy then equals its primary bit for bit, and after the primary of half the blocks dies
    the run still equals torch.optim."""
    monkeypatch.setattr(sys.modules[__name__], "REPLICATE_GRADIENTS", True)
    bus, cluster = start(initial=initial)
    for node in bus.nodes.values():
        node.replicator.check_interval = 2
    grads = gradients(9)
    failpoints.configure("ps.replay_diverge@3=1*raise")
    try:
        run_steps(cluster, grads[:2])
        holders = {k: n.replicator.in_sync("job").keys() for k, n in bus.nodes.items()}
        run_steps(cluster, grads[2:3])  # the diverged copy is installed at step 3: not a checked one
        diverged = [n for n in bus.nodes.values() if n.job("job").replica_divergences]
        assert diverged == []
        run_steps(cluster, grads[3:5])  # versions 4 (checked) and 5
    finally:
        failpoints.configure("")
    assert sum(n.job("job").replica_divergences for n in bus.nodes.values()) == 1
    bus.settle()
    deadline = time.monotonic() + 10
    while any(n.replicator.in_sync("job").keys() != holders[k] for k, n in bus.nodes.items()):
        assert time.monotonic() < deadline, "a holder did not sync again"
        time.sleep(0.01)
    cluster.assert_copies_equal()   # the diverged holder got a full copy: bit for bit again
    run_steps(cluster, grads[5:7])
    cluster.assert_copies_equal()
    bus.down.add("n0")               # the primary of some blocks dies between steps
    bus.serving.remove("n0")
    bus.publish()
    bus.settle()
    run_steps(cluster, grads[7:])
    want = reference(initial, grads)
    for name in ("a", "b"):
        torch.testing.assert_close(cluster.values(name), want[name], **ROUND_OFF)
    cluster.assert_copies_equal()
    assert sum(n.job("job").replica_divergences for n in bus.nodes.values()) == 1   # no false alarm since


def test_a_checked_step_that_agrees_counts_no_divergence(initial, monkeypatch):
    """Checked at every step, replayed copies of a job equal their primaries: no divergence, and
    the holders replayed (not received copies)."""
    monkeypatch.setattr(sys.modules[__name__], "REPLICATE_GRADIENTS", True)
    bus, cluster = start(initial=initial)
    for node in bus.nodes.values():
        node.replicator.check_interval = 1
    run_steps(cluster, gradients(3))
    cluster.assert_copies_equal()
    assert sum(n.job("job").replica_divergences for n in bus.nodes.values()) == 0
    assert sum(n.job("job").steps_replayed for n in bus.nodes.values()) > 0


def test_a_replicator_refuses_a_bad_check_interval():
    for bad in (-1, 1.5, True, "100"):
        with pytest.raises(ShardlineConfigError, match=re.escape(repr(bad))):
            Replicator(SimpleNamespace(node_id="n0"), links=None, check_interval=bad)


def a_stepped_copy(initial):
    """A cluster one step in, and the copy of block a[0] its holder keeps: (bus, the block's
    primary, its holder, the holder's job, the holder's block), for frames sent to the holder."""
    bus, cluster = start(initial=initial)
    run_steps(cluster, gradients(1))
    placement = place(next(iter(bus.nodes.values())).routing, bus.spec)
    primary, holder = placement.owners[("a", 0)][:2]
    job = bus.nodes[holder].job("job")
    return bus, primary, holder, job, job.blocks[("a", 0)]


def test_a_gradient_to_replay_is_refused_where_it_cannot_be_replayed(initial, replicate):
    """A replay ref for a job created without replicate_gradients, or in a sync reply (which
    carries full copies), is INVALID_ARGUMENT, and the copy is left as it was; so is a gradient of
    the wrong size."""
    bus, primary, holder, job, block = a_stepped_copy(initial)
    numel = block.value.numel()
    before = block.value.clone()

    def frame_of(numel_sent, **fields):
        fields.setdefault("replicate_kind", dp.REPLICATE_STEP)
        header = frame.FrameHeader(op=dp.OP_REPLICATE, request_id=1, job="job", epoch=bus.epoch, node=primary,
                                   step=block.step + 1, payload_bytes=4 * numel_sent, **fields)
        header.blocks.append(dp.BlockRef(tensor="a", index=0, dtype=dp.FLOAT32, numel=numel_sent,
                                         nbytes=4 * numel_sent, version=block.version + 1, step=block.step + 1,
                                         base_version=block.version, lr=0.01, replay=True))
        return header, bytearray(4 * numel_sent)

    cases = [frame_of(numel, replicate_kind=dp.REPLICATE_SYNC), frame_of(numel - 1)] + ([] if replicate else [frame_of(numel)])
    for header, payload in cases:
        with pytest.raises(StoreError) as err:
            bus.nodes[holder].replicator.handle_replicate(job, header, payload)
        assert err.value.code == "INVALID_ARGUMENT"
    assert torch.equal(block.value, before)


def test_a_copy_that_is_not_float32_is_refused_and_the_block_left_as_it_was(initial):
    """Copies travel as float32 runs (BlockCodec); a run of another wire dtype (its nbytes then
    disagree with the codec's reading) is INVALID_ARGUMENT naming the block, before any is read."""
    bus, primary, holder, job, block = a_stepped_copy(initial)
    packed = bus.nodes[holder].replicator.codec(job).packed_numel(block.value.numel())
    before = block.value.clone()
    header = frame.FrameHeader(op=dp.OP_REPLICATE, request_id=1, job="job", epoch=bus.epoch, node=primary,
                               step=block.step + 1, payload_bytes=2 * packed, replicate_kind=dp.REPLICATE_STEP)
    header.blocks.append(dp.BlockRef(tensor="a", index=0, dtype=dp.FLOAT16, numel=packed, nbytes=2 * packed,
                                     version=block.version + 1, step=block.step + 1))
    with pytest.raises(StoreError, match=r"copy of a\[0\] is not float32") as err:
        bus.nodes[holder].replicator.handle_replicate(job, header, bytearray(2 * packed))
    assert err.value.code == "INVALID_ARGUMENT"
    assert torch.equal(block.value, before)


@pytest.mark.parametrize("kind, hp", [
    ("sgd", dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("adam", dict(lr=0.01, weight_decay=0.1, amsgrad=True)),
], ids=["sgd-nesterov-wd", "adam-wd-amsgrad"])
def test_replayed_steps_equal_their_primaries_bitwise_for_every_optimizer(initial, monkeypatch, kind, hp):
    """The holders run the same multi-tensor step as their primaries, momentum buffers and AMSGrad
    maxima included (their first steps too), from the gradient and lr they were sent."""
    monkeypatch.setattr(sys.modules[__name__], "REPLICATE_GRADIENTS", True)
    spec = make_spec()
    spec.optimizer.CopyFrom(OptimizerConfig.from_kwargs(kind, **hp).to_proto())
    monkeypatch.setattr(sys.modules[__name__], "make_spec", lambda **_: spec)
    bus, cluster = start(initial=initial)
    run_steps(cluster, gradients(3))
    cluster.assert_copies_equal()
    assert sum(node.job("job").steps_replayed for node in bus.nodes.values()) > 0


def test_flush_waits_for_every_frame_queued_before_it():
    """PeerLinks.flush: True once every frame queued before it was sent or given up on (a node
    leaving the ring sends its handovers before it exits); False after the timeout otherwise."""
    import threading

    done, release = [], threading.Event()
    links = PeerLinks(lambda peer: None, transport="tcp", token=None, timeout=0.05)  # no address: given up at once
    header = frame.FrameHeader(op=dp.OP_REPLICATE, job="j")
    try:
        for peer in ("ps1", "ps2"):
            for _ in range(3):
                links.link(peer).send(Send(header, [], lambda error, reply, peer=peer: done.append((peer, error))))
        assert links.flush(5.0)
        assert len(done) == 6 and all(error is not None for _peer, error in done)
        links.link("ps1").send(Send(header, [], lambda error, reply: release.wait(5)))  # a send that hangs
        assert not links.flush(0.2)
    finally:
        release.set()
        links.close()


def test_a_replicate_frame_carries_exactly_one_known_kind_and_no_other_frame_carries_one():
    """services/frame.validate_header: OP_REPLICATE names one ReplicateKind; any other op none
    (BAD_FRAME before the receiver reads on); the replicator refuses a kind it has no handler for."""
    for kind in frame.REPLICATE_KINDS:
        frame.validate_header(frame.FrameHeader(op=dp.OP_REPLICATE, job="j", replicate_kind=kind))
    for kind in (dp.REPLICATE_KIND_UNSPECIFIED, max(frame.REPLICATE_KINDS) + 1):
        with pytest.raises(FrameError, match="replicate frame of unknown kind"):
            frame.validate_header(frame.FrameHeader(op=dp.OP_REPLICATE, job="j", replicate_kind=kind))
    for op in (dp.OP_SYNC, dp.OP_PUSH, dp.OP_REPLY):
        with pytest.raises(FrameError, match="only replication does"):
            frame.validate_header(frame.FrameHeader(op=op, job="j", replicate_kind=dp.REPLICATE_STEP))
    replicator = Replicator(SimpleNamespace(node_id="n0"), links=None)
    with pytest.raises(StoreError) as err:
        replicator.handle_replicate(None, frame.FrameHeader(op=dp.OP_REPLICATE, job="j"), b"")
    assert err.value.code == ErrorCode.INVALID_ARGUMENT


def test_each_kind_of_replicate_frame_reaches_its_own_handler(initial):
    """Steps and copies sent ahead are fenced (only the blocks' primary at this epoch); a sync
    answer is not (the receiver asked), and only its last frame ends the receiver's sync; an
    invitation to sync makes the receiver ask the sender for every copy it holds of its blocks."""
    bus, primary, holder, job, block = a_stepped_copy(initial)
    other = next(n for n in bus.nodes if n not in (primary, holder))
    replicator = bus.nodes[holder].replicator
    carried = dp.BlockRef(tensor="a", index=0, zero=True, version=block.version, step=block.step)
    for kind in (dp.REPLICATE_STEP, dp.REPLICATE_STAGED):
        header = frame.FrameHeader(op=dp.OP_REPLICATE, job="job", epoch=bus.epoch, node=other, replicate_kind=kind)
        header.blocks.append(carried)
        with pytest.raises(StoreError) as err:
            replicator.handle_replicate(job, header, b"")
        assert err.value.code == ErrorCode.NOT_OWNER
    answered = []
    replicator.node.on_synced = lambda job_, sender: answered.append(sender)
    for kind in (dp.REPLICATE_SYNC, dp.REPLICATE_SYNC_LAST):
        header = frame.FrameHeader(op=dp.OP_REPLICATE, job="job", epoch=bus.epoch, node=other, replicate_kind=kind)
        header.blocks.append(carried)
        replicator.handle_replicate(job, header, b"")
    assert answered == [other]
    asked = []
    replicator.links.link = lambda peer: SimpleNamespace(send=lambda item: asked.append((peer, item.header)))
    header = frame.FrameHeader(op=dp.OP_REPLICATE, job="job", epoch=bus.epoch, node=primary,
                               replicate_kind=dp.REPLICATE_RESYNC)
    replicator.handle_replicate(job, header, b"")     # an invitation: it asks the sender for a sync
    (peer, sync), = asked
    assert peer == primary and sync.op == dp.OP_SYNC
    placement = place(bus.nodes[holder].routing, bus.spec)
    assert {(r.tensor, r.index) for r in sync.blocks} == {
        key for key, owners in placement.owners.items() if owners[0] == primary and holder in owners[1:]}
