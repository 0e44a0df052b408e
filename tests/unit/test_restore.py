"""A whole-cluster restart from the nodes' checkpoints, between in-process PS nodes (the harness of
test_replication.py: real PSNodes, Replicators, Checkpointers and CheckpointDirs, frames delivered
by calls), checked against torch.optim on the same gradients."""

from __future__ import annotations

import time

import pytest
import torch

from shardline.ps_server import node as node_module
from shardline.ps_server.checkpoint import CheckpointDir
from shardline.ps_server.checkpointer import Checkpointer
from shardline.services.placement import place
from shardline.ps_server.restore import restore_job
from shardline.services.pb import dataplane_pb2 as dp, dispatcher_pb2

from test_replication import Bus, Cluster, FakeConnection, gradients, make_spec, reference, run_steps

STEPS, CRASH_AT = 6, 3


@pytest.fixture
def initial():
    gen = torch.Generator().manual_seed(7)
    return {"a": torch.randn(6, 4, generator=gen), "b": torch.randn(10, generator=gen), "frozen": torch.randn(3, generator=gen)}


@pytest.fixture
def lagging_copies(monkeypatch):
    """While ``bus.lag`` is set, the copies of an applied step reach a node only after that node's
    own boundary of the step (what a loaded machine does to the daemons): its checkpoint of the
    step sees them one step behind."""
    deliver = FakeConnection.request

    def request(self, header, payloads, *, timeout=None):
        if getattr(self.bus, "lag", False) and header.replicate_kind in (dp.REPLICATE_STEP, dp.REPLICATE_STAGED):
            job = self.bus.nodes[self.peer].store.get(header.job)
            deadline = time.monotonic() + 10
            while job is not None and job.step < header.step and time.monotonic() < deadline:
                time.sleep(0.002)
        return deliver(self, header, payloads, timeout=timeout)

    monkeypatch.setattr(FakeConnection, "request", request)


class Resumed(Cluster):
    """Workers resuming at ``step`` on a cluster whose nodes restored their checkpoints."""

    def __init__(self, bus: Bus, step: int):
        self.bus, self.step = bus, step


def add_node(bus: Bus, node_id: str, root):
    node = bus.add(node_id)
    ckdir = CheckpointDir(root / node_id, node_id)
    node.checkpointer = Checkpointer(ckdir, node_id, every_steps=1, full_every=2, keep=3, epoch=lambda: bus.epoch)
    return node, ckdir


def restore(node, ckdir, info, live_step):
    return restore_job(ckdir, "job", node_id=node.node_id, get_job=lambda name: info, restore_job_rpc=None,
                       live_step=lambda name: live_step, add_job=node.add_job)


def test_whole_cluster_restart_with_lagging_replica_copies_equals_torch(tmp_path, initial, lagging_copies, monkeypatch):
    """Both nodes are killed after step 3 and come back one after the other: n1 alone first (it
    applies every block, cold start at the cluster's checkpoint step), then n0 joins through a
    pending ring (warm start) and the ring switches. Every copy either node checkpointed of the
    other's blocks lagged a step; none of them may replace a primary's copy or be served."""
    monkeypatch.setattr(node_module, "HANDOVER_TIMEOUT_SECONDS", 0.2)  # n1 hands over nothing it lacks
    grads = gradients(STEPS, seed=3)
    bus = Bus(make_spec(), replication=2)
    bus.lag = True
    for node_id in ("n0", "n1"):
        add_node(bus, node_id, tmp_path)
    bus.serving = ["n0", "n1"]
    bus.publish()
    for node in bus.nodes.values():
        node.job("job")
    bus.settle()
    cluster = Cluster(bus, initial)
    run_steps(cluster, grads[:CRASH_AT])
    for node in bus.nodes.values():
        assert node.checkpointer.flush(10)
        node.checkpointer.close()
    n0_blocks = [key for key, owners in place(bus.nodes["n0"].routing, bus.spec).owners.items() if owners[0] == "n0"]
    held = bus.nodes["n1"].job("job").blocks
    assert n0_blocks and all(held[k].version == bus.nodes["n0"].job("job").blocks[k].version for k in n0_blocks), \
        "in memory, n1's copies caught up before the crash"

    # kill -9 of everything; the nodes come back with their checkpoint directories
    info = dispatcher_pb2.JobInfo(spec=bus.spec, uid="u1", ready=True, has_checkpoint=True, checkpoint_step=CRASH_AT,
                                  durable_steps={"n0": CRASH_AT, "n1": CRASH_AT})
    after = Bus(make_spec(), replication=2)
    after.epoch = bus.epoch + 1
    n1, ck1 = add_node(after, "n1", tmp_path)
    assert restore(n1, ck1, info, live_step=None).step == CRASH_AT
    after.serving = ["n1"]
    after.publish()                       # n1 alone: it applies every block
    n0, ck0 = add_node(after, "n0", tmp_path)
    assert restore(n0, ck0, info, live_step=n1.job("job").step).step == CRASH_AT
    after.pending = ["n0", "n1"]
    after.publish()                       # n0 joins: it syncs from n1, the primary of everything
    after.settle()
    after.serving, after.pending = ["n0", "n1"], None
    after.publish()                       # the switch: n0 applies its blocks again
    after.settle()
    time.sleep(0.3)
    for node in after.nodes.values():
        node.job("job").release_expired_waits()

    resumed = Resumed(after, CRASH_AT)
    run_steps(resumed, grads[CRASH_AT:])
    expected = reference(initial, grads)
    for name in ("a", "b"):
        assert (resumed.values(name) - expected[name]).abs().max().item() <= 1e-6, name
    resumed.assert_copies_equal()
    for node in after.nodes.values():
        node.checkpointer.close()
