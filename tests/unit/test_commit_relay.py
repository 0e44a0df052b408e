"""The commit relay (ps_server/commit_relay.py): a rank that died between its commits to different
nodes leaves some nodes able to apply the step and others waiting; every node must end up
applying it, bitwise like the node that got every commit. Two JobStores stand in for two nodes."""

import dataclasses
import threading
import time

import torch

from shardline.ps_server.commit_relay import CommitRelay
from shardline.ps_server.store import JobStore, Takeover
from test_store import init_store, items_for, make_job


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def two_nodes_half_committed():
    """Both ranks pushed step 0 to both nodes; rank 0 committed on both, rank 1 on ``a`` only."""
    torch.manual_seed(3)
    values = {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)}
    a, b = JobStore(make_job(lr=0.01)), JobStore(make_job(lr=0.01))
    grads = {rank: {"a": torch.randn(4, 5), "b": torch.randn(3)} for rank in (0, 1)}
    for node in (a, b):
        init_store(node, values)
        for rank in (0, 1):
            node.push(rank, 0, 1.0, [*items_for("a", grads[rank]["a"]), *items_for("b", grads[rank]["b"])])
        node.commit(0, 0, 1.0)
    a.commit(1, 0, 1.0)
    return a, b


def relay_for(node, peers, clock):
    return CommitRelay(lambda: [node], lambda job, step: [p.commits_of(step) for p in peers], threading.Event(),
                       relay_delay=2.0, clock=clock)


def test_a_node_missing_a_commit_adopts_it_after_the_delay_and_equals_its_peer():
    a, b = two_nodes_half_committed()
    assert (a.step, b.step) == (1, 0) and b.missing_ranks() == [1]
    clock = Clock()
    relay = relay_for(b, [a], clock)
    assert relay.check() == []              # just seen partial: wait for the commit in flight
    clock.now += 2.5
    assert relay.check() == [("j", 0)]
    assert b.step == 1
    for key, block in a.blocks.items():
        assert torch.equal(block.value, b.blocks[key].value), key


def test_settle_relays_at_once_before_a_ring_change():
    a, b = two_nodes_half_committed()
    relay = relay_for(b, [a], Clock())
    assert relay.settle() == [("j", 0)] and b.step == 1


def test_a_commit_no_peer_holds_is_not_invented():
    a, b = two_nodes_half_committed()
    c = JobStore(make_job(lr=0.01))  # a peer that knows nothing of rank 1's commit either
    relay = relay_for(b, [c], Clock())
    relay.settle()
    assert b.step == 0 and b.missing_ranks() == [1]


def test_job_step_follows_the_blocks_a_node_takes_over():
    """A node whose job step lags (it applied blocks of an old step) takes over blocks synced at
    step 6 and gives up its others: it collects step 6 and its oldest_step says so."""
    job = JobStore(make_job(lr=0.01))
    init_store(job, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    a_keys = {k for k in job.blocks if k[0] == "a"}
    b_keys = {k for k in job.blocks if k[0] == "b"}
    job.set_primary(b_keys, epoch=2)
    copies = [(t, i, 6, 6, torch.ones_like(job.blocks[(t, i)].value), dict(job.blocks[(t, i)].state))
              for t, i in sorted(a_keys)]
    job.apply_copies(copies)
    assert job.step == 0                    # it still applies b, at step 0
    job.set_primary(a_keys, epoch=3)
    assert job.step == 6 and job.oldest_step() == 6
    job.commit(0, 6, 1.0, epoch=3)
    assert job.commit(1, 6, 1.0, epoch=3) == 7 and job.oldest_step() == 7


def test_a_handover_that_never_comes_stops_blocking_the_step():
    """A block taken over from a primary that died at the switch: once the wait ran out, the
    relay's pass applies it with the commits it has (a rank that pushed nothing to it)."""
    job = JobStore(make_job(lr=0.01))
    init_store(job, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    keys = set(job.blocks)
    job.set_primary(set(), epoch=2)
    clock = Clock()
    job.set_primary(keys, epoch=3, awaiting={k: ("gone", time.monotonic() + 3600) for k in keys})
    job.commit(0, 0, 1.0, epoch=3)
    job.commit(1, 0, 1.0, epoch=3)
    assert job.oldest_step() == 0                    # the job step moved on, the blocks wait
    for block in job.blocks.values():                # the wait ran out
        block.role = dataclasses.replace(block.role, takeover=Takeover("gone", until=1.0))
    relay_for(job, [], clock).check()
    assert job.oldest_step() == 1
