"""Reads before the acknowledgement (docs/architecture.md): a BSP primary of a job that replays
gradients serves a worker that resends its previous step the step it applied once its copy
holders acknowledged the step before; the worker keeps that step's record until a reply calls it
durable, and after a failover the new primary recomputes what the old one served from the
resent records, bit for bit.

The PS side runs real PSNodes and Replicators over test_replication's in-process bus, with the
frames of applied steps held back from the copy holders (``Gate``); the worker side drives a
Client's bookkeeping without a network.
"""

from __future__ import annotations

import threading

import pytest
import torch

from shardline.ps_server.store import PushItem, StoreError
from shardline.services import frame
from shardline.services.errors import ErrorCode
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.placement import place
import test_replication
from test_client_ssp import OneNode, bare_client
from test_replication import FakeConnection, blocks_of, finish_and_compare, gradients, run_steps, start


@pytest.fixture
def initial():
    gen = torch.Generator().manual_seed(42)
    return {n: torch.randn(shape, generator=gen) for n, shape in test_replication.SHAPES.items()}


class Gate:
    """Holds the frames of applied steps (REPLICATE_STEP, REPLICATE_STAGED) on their way to the
    copy holders while closed; a frame from a node that died meanwhile never arrives."""

    STEP_KINDS = (dp.REPLICATE_STEP, dp.REPLICATE_STAGED)

    def __init__(self, bus_of):
        self.open_ = threading.Event()
        self.open_.set()
        self.bus_of = bus_of

    def install(self, monkeypatch):
        request = FakeConnection.request
        gate = self

        def held_request(conn, header, payloads, *, timeout=None):
            if header.op == dp.OP_REPLICATE and header.replicate_kind in gate.STEP_KINDS:
                gate.open_.wait(30)
                if header.node in conn.bus.down:
                    raise ConnectionError(f"node {header.node} died before its frame arrived")
            return request(conn, header, payloads, timeout=timeout)

        monkeypatch.setattr(FakeConnection, "request", held_request)


def read(node, keys, *, min_step, **fields):
    header = frame.FrameHeader(op=dp.OP_PULL, job="job", epoch=node.routing.epoch, min_step=min_step,
                               wait_timeout_seconds=fields.pop("wait", 5.0), **fields)
    for tensor, index in keys:
        header.blocks.add(tensor=tensor, index=index)
    frame.validate_header(header)
    node.precheck(header)
    reply, payloads = node.handle(header, memoryview(b""))
    return reply, {(r.tensor, r.index): bytes(p) for r, p in zip(reply.blocks, payloads)}


def primary_keys(node):
    job = node.job("job")
    return sorted(k for k, b in job.blocks.items() if b.primary and k[0] != "frozen")


def push(cluster, node_of, rank, step, grads):
    for name, g in grads.items():
        for t, i, part in blocks_of(name, g):
            node_of((t, i)).job("job").push(rank, step, 1.0, [PushItem(t, i, part.clone())], lr=cluster.lr)


def commit(cluster, rank, step):
    for node in cluster.live().values():
        node.job("job").commit(rank, step, 1.0, lr=cluster.lr, epoch=cluster.bus.epoch)


@pytest.fixture(params=[None, 0.01], ids=["lr-on-commits", "lr-on-pushes"])
def lr(request):
    return request.param


def test_a_step_read_before_its_holders_had_it_is_recomputed_bit_for_bit_after_its_primary_dies(
        initial, monkeypatch, lr):
    """Steps 0-1 run; the holders then get nothing more. Step 2 is applied by the primaries and
    read at once by a worker that resends (durable_step 2 in the reply), not by one that does not
    or by a subscriber (they wait for the acks). Step 3 is pushed and committed on that read; a
    read of step 4 waits (step 2 is not acknowledged). n0 dies: the holders of its blocks take
    them over at step 2, two behind their job step 4. The workers resend both records at the new
    epoch, rank 0 both steps before rank 1 any (so rank 0's push of step 3 comes ahead of the
    block's step, and the old-epoch commits of step 3 must not count). Step 2 recomputed equals
    the bytes read early from n0 bit for bit; the run equals torch.optim."""
    monkeypatch.setattr(test_replication, "REPLICATE_GRADIENTS", True)
    gate = Gate(None)
    gate.install(monkeypatch)
    bus, cluster = start(nodes=3, replication=2, initial=initial)
    cluster.lr = lr
    grads = gradients(6)
    run_steps(cluster, grads[:2])
    placement = place(bus.nodes["n0"].routing, bus.spec)
    old_primary = lambda key: bus.nodes[placement.primary(key)]  # noqa: E731

    gate.open_.clear()
    for rank in (0, 1):
        push(cluster, old_primary, rank, 2, grads[2][rank])
    for rank in (0, 1):
        commit(cluster, rank, 2)
    early = {}
    for node_id, node in bus.nodes.items():
        keys = primary_keys(node)
        with pytest.raises(StoreError) as waited:
            read(node, keys, min_step=3, wait=0.3)
        assert waited.value.code == ErrorCode.TIMEOUT
        with pytest.raises(StoreError):
            read(node, keys, min_step=3, wait=0.3, subscriber=True)
        reply, got = read(node, keys, min_step=3, resends_previous_step=True)
        assert (reply.step, reply.durable_step, len(got)) == (3, 2, len(keys))
        assert node.job("job").reads_before_acks_served >= len(keys)
        early.update({key: value for key, value in got.items()} if node_id == "n0" else {})
    assert early
    for rank in (0, 1):
        push(cluster, old_primary, rank, 3, grads[3][rank])
    for rank in (0, 1):
        commit(cluster, rank, 3)
    with pytest.raises(StoreError) as waited:
        read(bus.nodes["n1"], primary_keys(bus.nodes["n1"]), min_step=4, wait=0.3, resends_previous_step=True)
    assert waited.value.code == ErrorCode.TIMEOUT

    bus.down.add("n0")
    bus.serving.remove("n0")
    bus.publish()
    gate.open_.set()
    bus.settle()
    placement = place(bus.nodes["n1"].routing, bus.spec)
    new_primary = lambda key: bus.nodes[placement.primary(key)]  # noqa: E731
    taken = {key: new_primary(key).job("job") for key in early}
    assert all(job.blocks[key].step == 2 and job.step == 4 for key, job in taken.items())

    push(cluster, new_primary, 0, 2, grads[2][0])
    commit(cluster, 0, 2)
    push(cluster, new_primary, 0, 3, grads[3][0])   # ahead of the blocks taken over
    commit(cluster, 0, 3)
    push(cluster, new_primary, 1, 2, grads[2][1])
    commit(cluster, 1, 2)
    for key, job in taken.items():   # step 2 recomputed: the bytes the worker read early
        block = job.blocks[key]
        assert (block.step, block.version) == (3, 3), key
        assert frame.tensor_bytes(block.value) == early[key], key
    # rank 1's commit of step 3 at the old epoch went with a push to n0: it does not count here
    assert all(job.blocks[key].step == 3 for key, job in taken.items())
    push(cluster, new_primary, 1, 3, grads[3][1])
    commit(cluster, 1, 3)
    assert all(job.blocks[key].step == 4 for key, job in taken.items())
    cluster.step = 3
    cluster.wait_visible()
    finish_and_compare(cluster, initial, grads, 4)


def test_a_job_that_ships_copies_serves_no_read_before_the_acks(initial, monkeypatch):
    """Copies of value and state go out after the apply, and the next apply would change them
    under their frame: such a job keeps the strict rule, and says the step it served durable."""
    monkeypatch.setattr(test_replication, "REPLICATE_GRADIENTS", False)
    gate = Gate(None)
    gate.install(monkeypatch)
    bus, cluster = start(nodes=3, replication=2, initial=initial)
    run_steps(cluster, gradients(1))
    gate.open_.clear()
    try:
        placement = place(bus.nodes["n0"].routing, bus.spec)
        for rank, g in enumerate(gradients(1, seed=3)[0]):
            push(cluster, lambda key: bus.nodes[placement.primary(key)], rank, 1, g)
        for rank in (0, 1):
            commit(cluster, rank, 1)
        node = bus.nodes["n1"]
        with pytest.raises(StoreError) as waited:
            read(node, primary_keys(node), min_step=2, wait=0.3, resends_previous_step=True)
        assert waited.value.code == ErrorCode.TIMEOUT
    finally:
        gate.open_.set()
    reply, _got = read(node, primary_keys(node), min_step=2, resends_previous_step=True)
    assert reply.durable_step == 2 and node.job("job").reads_before_acks_served == 0


def test_resends_previous_step_is_only_for_pulls_and_commits_and_durable_step_only_for_replies():
    for op in (dp.OP_PUSH, dp.OP_INIT, dp.OP_REPLICATE):
        with pytest.raises(Exception, match="resends_previous_step"):
            frame.validate_header(frame.FrameHeader(op=op, resends_previous_step=True,
                                                    replicate_kind=dp.REPLICATE_STEP if op == dp.OP_REPLICATE else 0))
    with pytest.raises(Exception, match="durable_step"):
        frame.validate_header(frame.FrameHeader(op=dp.OP_PULL, durable_step=3))
    frame.validate_header(frame.FrameHeader(op=dp.OP_REPLY, durable_step=3, resends_previous_step=True))


# --- the worker's records -------------------------------------------------------------------------
class TwoNodes:
    nodes = {"ps0": None, "ps1": None}


def bsp_client(routing=TwoNodes):
    client = bare_client(sync="bsp", staleness=0)
    client.step, client.routing = None, routing()
    return client


def reply(durable, echoed=True):
    return frame.FrameHeader(op=dp.OP_REPLY, durable_step=durable, resends_previous_step=echoed)


def test_a_record_stays_until_every_node_calls_its_step_durable_in_memory_of_its_own():
    client = bsp_client()
    buffer = torch.arange(8, dtype=torch.float32)   # the gradient buffer step 4 was pushed from
    record = client._inflight.record(4, 1.0, 0)
    record.grads.update({("w", 0): buffer[:4], ("w", 1): buffer[4:], ("z", 0): None})
    client.step = 5
    client._note_durable("ps0", 5, reply(5))
    client._note_durable("ps1", 5, reply(4))       # ps1 served step 5 before its holders had step 4
    client._forget_pulled_steps()
    assert list(client._inflight) == [4]
    buffer.fill_(-1.0)                               # the next step writes the buffer again
    kept = client._inflight[4].grads
    assert torch.equal(torch.cat([kept[("w", 0)], kept[("w", 1)]]), torch.arange(8, dtype=torch.float32))
    assert kept[("z", 0)] is None
    own = client._inflight[4].own
    client._note_durable("ps1", 6, reply(5))
    client._forget_pulled_steps()
    assert list(client._inflight) == []
    assert client._inflight._spare == own           # the next detached record reuses the memory


def test_a_node_that_serves_strictly_says_so_by_not_echoing_and_the_read_step_is_durable():
    client = bsp_client()
    client._note_durable("ps0", 7, reply(0, echoed=False))   # a rack cache, or a node of an older build
    client._note_durable("ps1", 7, reply(6))
    assert client.durable_step() == 6
    client._note_durable("ps1", 8, reply(0, echoed=False))
    assert client.durable_step() == 7


def test_a_resend_carries_the_lrs_its_record_was_sent_with():
    """The previous step's record is resent after the lr schedule moved on: its pushes and commit
    carry its own lrs (a node refuses a commit whose lr differs from the step's pushes)."""
    client = bsp_client(OneNode)
    for step, lr in ((4, 0.1), (5, 0.2)):
        record = client._inflight.record(step, 1.0, 0, lr)
        record.grads[("w", 0)] = torch.ones(2)
        record.committed = True
    client.lr = 0.3   # the step after: what a request of this worker carries now
    seen = []

    def exchange(node_id, keys, op, step, weight, grads, min_step, timeout):
        seen.append((dp.Op.Name(op), step, client._resent.lr))
        return step + 1 if op == dp.OP_COMMIT else step

    client._exchange = exchange
    client._resend_inflight("ps0", 4)
    assert seen == [("OP_PUSH", 4, 0.1), ("OP_COMMIT", 4, 0.1), ("OP_PUSH", 5, 0.2), ("OP_COMMIT", 5, 0.2)]
    assert client._resent is None


def test_a_node_whose_taken_over_block_lags_its_job_step_gets_the_steps_from_that_block_on():
    """A node answered a push busy (its block awaited the handover) and its probe says job step 6,
    oldest step a block still collects 4: both records this worker holds go to it again, not
    none (a push refused while the block waited would otherwise count as delivered)."""
    client = bsp_client(OneNode)
    for step in (4, 5):
        record = client._inflight.record(step, 1.0, 0)
        record.grads[("w", 0)] = torch.ones(2)
        record.committed = True
    seen = []

    def exchange(node_id, keys, op, step, weight, grads, min_step, timeout):
        seen.append((dp.Op.Name(op), step))
        return 6

    client._exchange = exchange
    assert client._resend_inflight("ps0", 6) == 6 and seen == []   # what the job step alone says
    client._oldest["ps0"] = 4
    client._resend_inflight("ps0", 6)
    assert seen == [("OP_PUSH", 4), ("OP_COMMIT", 4), ("OP_PUSH", 5), ("OP_COMMIT", 5)]


def test_a_handover_carries_the_copy_of_a_block_changed_by_either_of_its_last_two_steps():
    """The new primary may lack both steps a worker could have read (a planned ring change right
    after a read before the acknowledgement): the previous primary's handover carries its copy
    if either changed the block, so the new one catches up instead of keeping a stale copy."""
    from shardline.ps_server.store.blocks import Block
    from shardline.ps_server.store.handover import handover_of

    for version, carried in ((9, True), (8, True), (7, False)):
        block = Block(torch.zeros(4), {}, step=9, visible=7)
        block.version = version
        assert (handover_of(("w", 0), block).copy is not None) == carried, version
