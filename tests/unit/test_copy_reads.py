"""Reads from copy holders (services/copy_reads.py, ps_server/store/reads.py wait_for_step's copies,
ps_server/node.py precheck): which reads a replica serves, what it serves (its primary's bytes at
the step asked for), and when it refuses (COPY_BEHIND, NOT_OWNER) so the worker reads the primary.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardline.ps_server import node as node_module
from shardline.ps_server.store import StoreError
from shardline.services import copy_reads, frame
from shardline.services.copy_reads import copies_may_serve, nearest_holder
from shardline.services.errors import ErrorCode, NotOwnerError
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.placement import place
from shardline.worker.read_router import ReadRouter
from test_replication import gradients, run_steps, start


@pytest.fixture
def initial():
    gen = torch.Generator().manual_seed(42)
    return {n: torch.randn(shape, generator=gen) for n, shape in {"a": (6, 4), "b": (10,), "frozen": (3,)}.items()}


# --- the rules ------------------------------------------------------------------------------------
def test_only_a_bsp_workers_read_of_a_new_step_may_read_a_copy():
    assert copies_may_serve(dp.OP_PULL, "bsp", min_step=3)
    assert copies_may_serve(dp.OP_COMMIT, "bsp", min_step=0, pull_applied=True)
    assert not copies_may_serve(dp.OP_COMMIT, "bsp", min_step=0)                  # a commit carrying no pull
    assert not copies_may_serve(dp.OP_PULL, "bsp", min_step=0)                    # where to resume: primaries
    assert not copies_may_serve(dp.OP_PULL, "bsp", min_step=3, subscriber=True)   # deltas, checksums
    assert not copies_may_serve(dp.OP_PULL, "bsp", min_step=3, at_step=True)      # an older step's values
    assert not copies_may_serve(dp.OP_PULL, "ssp", min_step=3)
    assert not copies_may_serve(dp.OP_PULL, "asp", min_step=3)
    assert not copies_may_serve(dp.OP_PUSH, "bsp", min_step=3)


def test_the_nearest_holder_is_on_this_host_then_this_rack_then_the_primary():
    owners = ("p", "r1", "r2")
    racks = {"p": "A", "r1": "B", "r2": "C"}.get

    def pick(local=(), rack=None, rank=0, avoid=frozenset()):
        return nearest_holder(owners, is_local=lambda n: n in local, rack_of=racks, rack=rack, rank=rank, avoid=avoid)

    assert pick() == "p"
    assert pick(local={"r2"}) == "r2"
    assert pick(local={"r2"}, rack="B") == "r2"             # own host before own rack
    assert pick(rack="B") == "r1"
    assert pick(rack="Z") == "p"                            # no holder on the rack
    # equally near holders: ranks take turns, the same rank always the same one
    assert [pick(local=set(owners), rank=r) for r in range(4)] == ["p", "r1", "r2", "p"]
    # a holder that answered COPY_BEHIND is passed over; the primary never is
    assert pick(local={"r2"}, avoid={"r2"}) == "p"
    assert pick(local=set(owners), rank=1, avoid={"r1", "p"}) == "r2"


def test_the_router_reads_no_copies_of_a_node_that_answered_copy_behind_for_a_while(initial):
    bus, _cluster = start(nodes=3, replication=2, initial=initial)
    view = bus.nodes["n0"].routing
    now = [0.0]
    router = ReadRouter(None, clock=lambda: now[0])
    everywhere = lambda _n: True  # noqa: E731 - one host
    sources = router.sources(view, bus.spec, 1, everywhere)
    owners = place(view, bus.spec).owners
    assert sources == {key: o[1 % len(o)] for key, o in owners.items()}
    assert router.sources(view, bus.spec, 1, everywhere) is sources   # cached per epoch
    router.copy_behind("n1", RuntimeError("behind"))
    avoided = router.sources(view, bus.spec, 1, everywhere)
    assert all(node != "n1" or owners[key][0] == "n1" for key, node in avoided.items())
    now[0] += copy_reads.COPY_READ_RETRY_SECONDS + 1
    assert router.sources(view, bus.spec, 1, everywhere) == sources


# --- a replica serving a read ---------------------------------------------------------------------
def read(node, keys, *, min_step, op=dp.OP_PULL, **fields):
    """Precheck and run a read of ``keys`` on ``node`` as a worker sends it; (reply, {key: bytes})."""
    header = frame.FrameHeader(op=op, job="job", epoch=node.routing.epoch, min_step=min_step, step=max(0, min_step - 1),
                               wait_timeout_seconds=5.0, **fields)
    for tensor, index in keys:
        header.blocks.add(tensor=tensor, index=index)
    if op == dp.OP_COMMIT:
        header.pull_applied, header.rank = True, 0
    node.precheck(header)
    reply, payloads = node.handle(header, memoryview(b""))
    return reply, {(r.tensor, r.index): bytes(p) for r, p in zip(reply.blocks, payloads)}


def replica_keys(bus, node_id):
    placement = place(bus.nodes[node_id].routing, bus.spec)
    return [key for key, owners in placement.owners.items() if node_id in owners[1:] and key[0] != "frozen"]


@pytest.mark.parametrize("replicate_gradients", [False, True], ids=["copies", "gradients"])
def test_a_replica_serves_its_primarys_bytes_and_versions_at_the_step(initial, replicate_gradients, monkeypatch):
    monkeypatch.setattr("test_replication.REPLICATE_GRADIENTS", replicate_gradients)
    bus, cluster = start(nodes=3, replication=2, initial=initial)
    run_steps(cluster, gradients(3))
    for node_id, node in bus.nodes.items():
        keys = replica_keys(bus, node_id)
        assert keys
        reply, got = read(node, keys, min_step=3)
        assert reply.step == 3 and len(got) == len(keys)
        placement = place(node.routing, bus.spec)
        for ref in reply.blocks:
            key = (ref.tensor, ref.index)
            primary = bus.nodes[placement.primary(key)].job("job").blocks[key]
            assert ref.version == primary.version
            assert got[key] == frame.tensor_bytes(primary.value)   # bit for bit
        assert node.job("job").copy_reads >= len(keys)


def test_a_read_of_a_step_the_copy_lacks_waits_for_it_then_is_served(initial):
    bus, cluster = start(nodes=3, replication=2, initial=initial)
    run_steps(cluster, gradients(1))
    node_id = "n1"
    keys = replica_keys(bus, node_id)
    answers = []
    reader = threading.Thread(target=lambda: answers.append(read(bus.nodes[node_id], keys, min_step=2)))
    reader.start()
    run_steps(cluster, gradients(1, seed=1))
    reader.join(10)
    reply, got = answers[0]
    assert reply.step == 2 and len(got) == len(keys)


def test_a_copy_its_primary_no_longer_sends_is_refused_as_copy_behind(initial, monkeypatch):
    monkeypatch.setattr(node_module, "COPY_READ_TIMEOUT_SECONDS", 0.3)
    bus, cluster = start(nodes=3, replication=3, initial=initial)   # every block keeps another holder
    run_steps(cluster, gradients(1))
    node_id = "n1"
    for primary in bus.nodes.values():   # n1 dropped from every in-sync set: its copies stop at step 1
        primary.replicator.drop_holder("job", node_id, "test")
    run_steps(cluster, gradients(1, seed=1))
    keys = replica_keys(bus, node_id)
    with pytest.raises(StoreError) as caught:
        read(bus.nodes[node_id], keys, min_step=2)
    assert caught.value.code == ErrorCode.COPY_BEHIND and "read it from its primary" in str(caught.value)
    # a commit carrying the same read is answered without blocks (the worker pulls)
    reply, got = read(bus.nodes[node_id], keys, min_step=2, op=dp.OP_COMMIT)
    assert not reply.pull_applied and not got


@pytest.mark.parametrize("fields", [dict(min_step=0), dict(min_step=2, subscriber=True),
                                    dict(min_step=2, at_step=True)],
                         ids=["step-0", "subscriber", "at-step"])
def test_reads_a_copy_may_not_serve_are_not_owner_there(initial, fields):
    bus, cluster = start(nodes=3, replication=2, initial=initial)
    run_steps(cluster, gradients(2))
    keys = replica_keys(bus, "n1")
    min_step = fields.pop("min_step")
    with pytest.raises(NotOwnerError):
        read(bus.nodes["n1"], keys, min_step=min_step, **fields)


def test_a_node_that_holds_no_copy_of_a_block_refuses_its_read(initial):
    bus, cluster = start(nodes=3, replication=2, initial=initial)
    run_steps(cluster, gradients(1))
    placement = place(bus.nodes["n0"].routing, bus.spec)
    key = next(k for k, owners in placement.owners.items() if "n2" not in owners)
    with pytest.raises(NotOwnerError):
        read(bus.nodes["n2"], [key], min_step=1)


def test_a_holder_dropped_for_a_step_it_lacks_syncs_every_copy_of_that_primary_and_serves_reads_again(
        initial, monkeypatch):
    """A holder refuses a step whose gradient builds on a version it lacks (UNAVAILABLE): the frame's
    other blocks, among them a frozen one the step only carries, are not carried either. Its sync
    names every copy it holds of that primary's blocks, so all of them, not only the lacking one,
    reach the primary's step, and reads of them are served there again."""
    monkeypatch.setattr("test_replication.REPLICATE_GRADIENTS", True)
    monkeypatch.setattr(node_module, "COPY_READ_TIMEOUT_SECONDS", 0.3)
    bus, cluster = start(nodes=2, replication=2, initial=initial)
    run_steps(cluster, gradients(2))
    placement = place(bus.nodes["n0"].routing, bus.spec)
    primary = placement.primary(("frozen", 0))
    holder = next(n for n in bus.nodes if n != primary)
    lacking = next(k for k, owners in placement.owners.items() if owners[0] == primary and k[0] != "frozen")
    bus.nodes[holder].job("job").blocks[lacking].version -= 1   # as if it missed a step of this block
    run_steps(cluster, gradients(1, seed=1))
    job, source = bus.nodes[holder].job("job"), bus.nodes[primary].job("job")
    keys = [key for key, owners in placement.owners.items() if owners[0] == primary]

    def behind():
        return [key for key in keys if (job.blocks[key].version, job.blocks[key].step)
                != (source.blocks[key].version, source.blocks[key].step)]

    deadline = time.monotonic() + 10
    while behind():   # dropped, then synced again
        assert time.monotonic() < deadline, f"copies still behind their primary: {behind()}"
        time.sleep(0.01)
    for key in keys:
        assert torch.equal(job.blocks[key].value, source.blocks[key].value), key
    reply, got = read(bus.nodes[holder], [("frozen", 0), lacking], min_step=3)
    assert reply.step == 3 and set(got) == {("frozen", 0), lacking}
