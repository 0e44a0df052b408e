"""A node that applies blocks it lacks after a ring change fetches them from their previous
holders, and a fetch always ends (found by the live rebalance test: a pending rebalance that
never switched). The previous holder may lack a block too: the job is being initialized, and
the block's INIT reaches the new primary after the holder's sync answer. The node then waited
forever for an answer that carried the block, so it never reported the pending ring ready."""

from types import SimpleNamespace

import pytest
import torch

from shardline.ps_server import replication
from shardline.ps_server.replication import Replicator
from shardline.ps_server.store import JobStore
from shardline.services import frame
from shardline.services.pb import dataplane_pb2 as dp
from test_handover_catch_up import FakeLinks
from test_store import init_store, make_job


@pytest.fixture
def node(monkeypatch):
    """Node "b" applies every block of job "j" at epoch 5; under the routing before, "a" then
    "c" held them. ``place`` is replaced by those two fixed placements."""
    job = JobStore(make_job())
    keys = {("a", 0), ("b", 0), ("frozen", 0)}
    job.set_primary(keys, epoch=5)
    view = SimpleNamespace(epoch=5, nodes={"a": 1, "b": 1, "c": 1}, pending_nodes={}, ring=object())
    previous = SimpleNamespace(epoch=4, nodes=view.nodes, pending_nodes={}, ring=object())
    placements = {id(view): SimpleNamespace(owners={k: ("b",) for k in keys}, primary=lambda k: "b"),
                  id(previous): SimpleNamespace(owners={k: ("a", "c") for k in keys})}
    monkeypatch.setattr(replication, "place", lambda v, spec: placements[id(v)])
    synced = []
    fake = SimpleNamespace(node_id="b", routing=view, store=SimpleNamespace(get=lambda name: job),
                           on_synced=lambda job, sender: synced.append(sender))
    rep = Replicator(fake, FakeLinks())
    rep.attach(job)
    rep.resync(job, placements[id(view)], keys, set(), previous)
    return SimpleNamespace(job=job, rep=rep, keys=keys, links=rep.links, synced=synced)


def asked_of(links):
    return [(peer, sorted((r.tensor, r.index) for r in item.header.blocks))
            for peer, item in links.sent if item.header.op == dp.OP_SYNC]


def sync_answer(sender, epoch=5):
    return frame.FrameHeader(op=dp.OP_REPLICATE, job="j", node=sender, epoch=epoch,
                             replicate_kind=dp.REPLICATE_SYNC_LAST, sync_epoch=epoch)


def initial_values():
    return {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.zeros(2)}


def test_the_blocks_it_lacks_are_asked_of_the_first_previous_holder(node):
    assert asked_of(node.links) == [("a", sorted(node.keys))]
    assert node.rep.fetching("j") and not node.rep.ready()


def test_an_init_after_the_holders_empty_answer_ends_the_fetch(node):
    # "a" answers first without the blocks; "c" is asked next and answers without them too
    node.rep.handle_replicate(node.job, sync_answer("a"), b"")
    assert asked_of(node.links)[-1] == ("c", sorted(node.keys))
    assert node.rep.fetching("j") and not node.rep.ready()
    node.rep.handle_replicate(node.job, sync_answer("c"), b"")
    assert not node.rep.fetching("j") and node.rep.ready()   # nobody holds them: the INIT brings them
    init_store(node.job, initial_values())
    assert not node.rep.fetching("j") and node.rep.ready()


def test_an_init_before_any_answer_ends_the_fetch(node):
    init_store(node.job, initial_values())   # the worker's INIT reached this node first
    assert not node.rep.fetching("j")
    node.rep.handle_replicate(node.job, sync_answer("a"), b"")  # the holder's answer may still come
    assert node.rep.ready()
    assert len(asked_of(node.links)) == 1  # nothing more asked


def test_a_later_change_asks_a_holder_still_routed_again(node):
    # a new routing before any answer: the fetch is asked again, not forgotten
    node.links.sent.clear()
    node.rep.resync(node.job, replication.place(node.rep.node.routing, None), node.keys, set(),
                    node.rep.node.routing)
    assert asked_of(node.links) == [("a", sorted(node.keys))]
    assert node.rep.fetching("j")
