"""A primary's apply that crosses a ring switch (found by the fixed-seed fault schedule).

The old primary applied step v (every rank committed it there, at the old epoch) after the new
primary had taken the block over: its copy of step v reached the new primary too late and was
refused, while workers that saw step v+1 never push step v again. The new primary must take
the step from the old primary's handover, and a replica that refused the copy must not let the
old primary count it as held. Two JobStores stand in for the two nodes; the handover goes
through the replicator's real wire format."""

import time
from types import SimpleNamespace

import pytest
import torch

from shardline.ps_server.replication import Replicator
from shardline.ps_server.store import JobStore
from shardline.services import frame
from test_store import init_store, items_for, make_job, values


def grads_of(step):
    g = torch.Generator().manual_seed(100 + step)
    return {rank: {"a": torch.randn(4, 5, generator=g), "b": torch.randn(3, generator=g)} for rank in (0, 1)}


def push_and_commit(node, step, epoch=0):
    for rank, grads in grads_of(step).items():
        node.push(rank, step, 1.0, [*items_for("a", grads["a"]), *items_for("b", grads["b"])])
    for rank in (0, 1):
        node.commit(rank, step, 1.0, epoch=epoch)


def reference(a0, b0, steps):
    ref_a, ref_b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref_a, ref_b], lr=0.01, foreach=False)
    for step in range(steps):
        g = grads_of(step)
        ref_a.grad, ref_b.grad = (g[0]["a"] + g[1]["a"]) / 2, (g[0]["b"] + g[1]["b"]) / 2
        opt.step()
    return ref_a.detach(), ref_b.detach()


class FakeLinks:
    """Peer links that capture frames instead of sending them."""

    def __init__(self):
        self.sent = []
        self.timeout = 1.0

    def link(self, peer):
        return SimpleNamespace(send=lambda item: self.sent.append((peer, item)))


def replicator_for(node_id, job):
    node = SimpleNamespace(node_id=node_id, routing=SimpleNamespace(epoch=3), store=None)
    return Replicator(node, FakeLinks())


def two_nodes(seed):
    """``old`` applies every block; ``new`` holds copies of them (the same initial values)."""
    torch.manual_seed(seed)
    a0, b0 = torch.randn(4, 5), torch.randn(3)
    old, new = JobStore(make_job(lr=0.01)), JobStore(make_job(lr=0.01))
    for node in (old, new):
        init_store(node, {"a": a0, "b": b0, "frozen": torch.zeros(2)})
    keys = set(new.blocks)
    new.set_primary(set(), epoch=2)
    return a0, b0, old, new, keys


def hand_over_on_the_wire(sender_id, sender_store, receiver_id, receiver_store, handovers):
    """``handovers`` through the wire format: OP_REPLICATE handover frame -> _handle_handover ->
    accept_handover."""
    import shardline.ps_server.replication as replication

    sender = replicator_for(sender_id, sender_store)
    real_place = replication.place
    replication.place = lambda routing, spec: SimpleNamespace(primary=lambda key: receiver_id)
    try:
        sender.hand_over(sender_store, handovers)
    finally:
        replication.place = real_place
    (peer, sent), = sender.links.sent
    assert peer == receiver_id
    payload = b"".join(bytes(p) for p in sent.payloads)
    replicator_for(receiver_id, receiver_store).handle_replicate(receiver_store, sent.header, bytearray(payload))


def test_the_new_primary_takes_a_step_its_predecessor_applied_after_the_switch():
    a0, b0, old, new, keys = two_nodes(0)
    push_and_commit(old, 0)                             # old applies step 0 at epoch 2 ...
    # ... while new already routes at epoch 3 and applies the blocks: old's copy of step 0 is refused
    new.set_primary(keys, epoch=3, awaiting={k: ("old", time.monotonic() + 60) for k in keys})
    assert new.oldest_step() == 0
    _gained, handovers = old.set_primary(set(), epoch=3)  # old learns epoch 3: it hands the blocks over
    assert all(h.step == 1 for h in handovers)
    assert all((h.copy is None) == (h.key[0] == "frozen") for h in handovers)  # frozen: unchanged, no copy

    hand_over_on_the_wire("old", old, "new", new, handovers)

    want_a, want_b = reference(a0, b0, 1)
    torch.testing.assert_close(values(new, "a", (4, 5)), want_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(values(new, "b", (3,)), want_b, rtol=0, atol=1e-6)
    assert new.oldest_step() == 1 and all(b.visible == 1 for b in new.blocks.values() if b.primary)
    # training goes on at the new primary, still equal to torch.optim
    push_and_commit(new, 1, epoch=3)
    want_a, want_b = reference(a0, b0, 2)
    torch.testing.assert_close(values(new, "a", (4, 5)), want_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(values(new, "b", (3,)), want_b, rtol=0, atol=1e-6)


def test_a_handover_of_the_step_in_flight_still_carries_the_gradients():
    """Nothing applied across the switch: the handover's gradients count, no copy is taken."""
    a0, b0, old, new, keys = two_nodes(1)
    for rank, grads in grads_of(0).items():
        old.push(rank, 0, 1.0, [*items_for("a", grads["a"]), *items_for("b", grads["b"])])
    new.set_primary(keys, epoch=3, awaiting={k: ("old", time.monotonic() + 60) for k in keys})
    _gained, handovers = old.set_primary(set(), epoch=3)
    assert all(h.step == 0 and h.copy is None for h in handovers)
    new.accept_handover("old", handovers)
    for rank in (0, 1):
        new.commit(rank, 0, 1.0, epoch=3)
    want_a, want_b = reference(a0, b0, 1)
    torch.testing.assert_close(values(new, "a", (4, 5)), want_a, rtol=0, atol=1e-6)
    torch.testing.assert_close(values(new, "b", (3,)), want_b, rtol=0, atol=1e-6)


def test_a_copy_refused_as_not_owner_leaves_the_deposed_primary_invisible():
    """The old primary's step whose copy the new primary refused (NOT_OWNER) is not made visible
    there for the blocks it lost: a pull must not see a step no primary will hold if it dies."""
    from shardline.ps_server.replication_progress import StepAcks
    from shardline.services.errors import RemoteError

    old = JobStore(make_job(lr=0.01))
    init_store(old, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    kept = {k for k in old.blocks if k[0] == "b"}
    rep = replicator_for("old", old)
    rep.node.refresh_routing_quietly = lambda: old.set_primary(kept, epoch=3)  # it learns: "a" moved
    old.apply_hooks.append(lambda job, step, items: True)  # visible once the copy holders acked
    push_and_commit(old, 0)
    assert all(b.visible == 0 for b in old.blocks.values())
    blocks = [b for b in old.blocks.values()]
    pending = StepAcks(old, 0, blocks, {"new": 1})
    rep._acked(pending, "new", 1)(RemoteError("NOT_OWNER", "node 'old' is not the primary"), None)
    assert all(b.visible == 1 for k, b in old.blocks.items() if k in kept)
    assert all(b.visible == 0 for k, b in old.blocks.items() if k not in kept)


def test_the_value_from_before_an_apply_that_crossed_the_switch_moves_with_the_block():
    """The old primary applied step 0 across the switch (a rank's commit reached only it: chaos
    seed 4, a node draining), and the block moves on once more (the old node rejoins). A rank
    redoing step 0 must get the values from before it at whichever node applies the block now
    (value_at), not the stepped ones: the handover carries Block.previous, hop after hop."""
    from test_store import values_at

    a0, b0, old, new, keys = two_nodes(2)
    push_and_commit(old, 0)                              # kept Block.previous at old
    new.set_primary(keys, epoch=3, awaiting={k: ("old", time.monotonic() + 60) for k in keys})
    _gained, handovers = old.set_primary(set(), epoch=3)
    assert all((h.previous is None) == (h.key[0] == "frozen") for h in handovers)
    hand_over_on_the_wire("old", old, "new", new, handovers)
    redo = values_at(new, 0)
    assert all(redo[("a", i)][0] == 0 for i in range(new.tensors["a"].blocks))
    torch.testing.assert_close(torch.cat([redo[("a", i)][1] for i in range(new.tensors["a"].blocks)]).view(4, 5),
                               a0, rtol=0, atol=0)
    torch.testing.assert_close(redo[("b", 0)][1], b0, rtol=0, atol=0)
    assert values_at(new, 1)[("a", 0)][0] == 1         # the current step: the stepped values

    # the second hop: a third node already holding version 1 (its values synced from the copies;
    # its optimizer state is left out: only the values matter here) takes over
    third = JobStore(make_job(lr=0.01))
    init_store(third, {"a": values(new, "a", (4, 5)), "b": values(new, "b", (3,)), "frozen": torch.zeros(2)})
    for block in third.blocks.values():
        block.version = block.step = block.visible = 1 if block is not third.blocks[("frozen", 0)] else 0
    third.step = 1
    third.set_primary(set(), epoch=3)
    third.set_primary(keys, epoch=4, awaiting={k: ("new", time.monotonic() + 60) for k in keys})
    _gained, handovers = new.set_primary(set(), epoch=4)
    assert all(b.previous is None for b in new.blocks.values())   # let go of with the blocks
    hand_over_on_the_wire("new", new, "third", third, handovers)
    redo = values_at(third, 0)
    torch.testing.assert_close(torch.cat([redo[("a", i)][1] for i in range(third.tensors["a"].blocks)]).view(4, 5),
                               a0, rtol=0, atol=0)
    assert values_at(third, 1)[("a", 0)][0] == 1


def test_a_handover_previous_value_that_is_not_older_or_the_wrong_size_is_refused():
    from shardline.ps_server.store import StoreError
    from shardline.services.pb import dataplane_pb2 as dp

    _a0, _b0, old, new, keys = two_nodes(3)
    push_and_commit(old, 0)
    new.set_primary(keys, epoch=3, awaiting={k: ("old", time.monotonic() + 60) for k in keys})
    for bad in ({"base_version": 1}, {"numel": 2, "nbytes": 8}):   # as new as its block; not b's 3 elements
        previous = {"numel": 3, "nbytes": 12, "base_version": 0, **bad}
        header = frame.FrameHeader(op=dp.OP_REPLICATE, job="j", replicate_kind=dp.REPLICATE_HANDOVER, node="old",
                                   blocks=[dp.BlockRef(tensor="b", index=0, step=1, version=1, zero=True),
                                           dp.BlockRef(tensor="b", index=0, previous=True, dtype=dp.FLOAT32,
                                                       **previous)])
        with pytest.raises(StoreError, match="previous value"):
            replicator_for("new", new).handle_replicate(new, header, bytearray(64))
