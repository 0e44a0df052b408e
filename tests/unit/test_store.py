"""PS store sync semantics against torch.optim run on the equivalent single-process gradients."""

import threading

import pytest
import torch

from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import JobStore, PushItem, StoreError
from shardline.services.blocks import block_slices
from shardline.services.pb import common_pb2

BLOCK = 7
# A step's blocks go through fused multi-tensor kernels: torch.optim's result within float32 round-off.
ROUND_OFF = dict(rtol=1e-6, atol=1e-6)


def make_job(sync="bsp", world_size=2, kind="adamw", **hp):
    spec = common_pb2.JobSpec(name="j", sync=sync, world_size=world_size, block_elements=BLOCK,
                              optimizer=OptimizerConfig.from_kwargs(kind, **hp).to_proto())
    spec.tensors.add(name="a", shape=[4, 5], dtype="float32", trainable=True)
    spec.tensors.add(name="b", shape=[3], dtype="float32", trainable=True)
    spec.tensors.add(name="frozen", shape=[2], dtype="float32", trainable=False)
    return spec


def collections(store):
    """What each primary block collects (a copy collects nothing)."""
    return [b.role.collecting for b in store.blocks.values() if b.primary]


def init_store(store, values):
    items = []
    for name, t in values.items():
        flat = t.reshape(-1)
        for s in block_slices(flat.numel(), BLOCK):
            items.append((name, s.index, flat[s.start:s.stop]))
    store.init_blocks(items)


def items_for(name, grad):
    flat = grad.reshape(-1)
    out = []
    for s in block_slices(flat.numel(), BLOCK):
        part = flat[s.start:s.stop]
        out.append(PushItem(name, s.index, part.clone() if bool(part.any()) else None))
    return out


def values(store, name, shape):
    n = torch.Size(shape).numel()
    flat = torch.empty(n)
    for s in block_slices(n, BLOCK):
        flat[s.start:s.stop] = store.blocks[(name, s.index)].value
    return flat.view(shape)


def test_bsp_weighted_mean_matches_torch_and_skips_untouched():
    torch.manual_seed(0)
    a0, b0, f0 = torch.randn(4, 5), torch.randn(3), torch.randn(2)
    store = JobStore(make_job(lr=0.01, weight_decay=0.1))
    init_store(store, {"a": a0, "b": b0, "frozen": f0})
    ref_a, ref_b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref_a, ref_b], lr=0.01, weight_decay=0.1, foreach=False)
    for step in range(4):
        g1, g2 = torch.randn(4, 5), torch.randn(4, 5)
        g1[0] = 0  # a whole zero block from rank 0 goes as a flag
        w1, w2 = 3.0, 1.0
        store.push(0, step, w1, items_for("a", g1))
        store.push(1, step, w2, items_for("a", g2))
        assert store.commit(0, step, w1) == step  # not applied until every rank committed
        assert store.commit(1, step, w2) == step + 1
        # "b" got no gradient from anyone: torch skips params whose grad is None
        ref_a.grad = (w1 * g1 + w2 * g2) / (w1 + w2)
        ref_b.grad = None
        opt.step()
        torch.testing.assert_close(values(store, "a", (4, 5)), ref_a.detach(), rtol=0, atol=1e-6)
        assert torch.equal(values(store, "b", (3,)), b0)
        assert all(store.blocks[("a", i)].version == step + 1 for i in range(3))
        assert store.blocks[("b", 0)].version == 0


def test_zero_gradient_block_is_still_stepped():
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(world_size=1, lr=0.1, weight_decay=0.5))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    store.push(0, 0, 1.0, items_for("a", torch.zeros(4, 5)))
    store.commit(0, 0, 1.0)
    ref = a0.clone().requires_grad_()
    ref.grad = torch.zeros(4, 5)
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.5, foreach=False).step()
    torch.testing.assert_close(values(store, "a", (4, 5)), ref.detach(), **ROUND_OFF)


def test_rank_without_gradient_counts_in_the_mean():
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    g = torch.randn(4, 5)
    store.push(0, 0, 1.0, items_for("a", g))
    store.commit(0, 0, 1.0)
    store.commit(1, 0, 1.0)  # rank 1's grad for "a" was None: contributes zero
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - g / 2, rtol=0, atol=1e-6)


def test_rejections_leave_no_partial_update():
    store = JobStore(make_job())
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    bad = torch.randn(4, 5)
    bad[3, 4] = float("nan")
    with pytest.raises(StoreError) as e:
        store.push(0, 0, 1.0, items_for("a", bad))
    assert e.value.code == "NONFINITE" and "'a'" in str(e.value)
    assert not any(store.blocks[("a", i)].role.collecting.has_grad for i in range(3))
    with pytest.raises(StoreError) as e:
        store.push(0, 1, 1.0, items_for("a", torch.ones(4, 5)))
    assert e.value.code == "STALE_STEP"
    with pytest.raises(StoreError) as e:
        store.push(0, 0, 1.0, [PushItem("frozen", 0, torch.ones(2))])
    assert e.value.code == "INVALID_ARGUMENT" and "frozen" in str(e.value)
    with pytest.raises(StoreError) as e:
        store.push(0, 0, 1.0, [PushItem("nope", 0, torch.ones(2))])
    assert e.value.code == "UNKNOWN_TENSOR"
    with pytest.raises(StoreError) as e:
        store.push(0, 0, 1.0, [PushItem("a", 0, torch.ones(3))])
    assert e.value.code == "INVALID_ARGUMENT" and "elements" in str(e.value)
    with pytest.raises(StoreError) as e:
        store.push(0, 0, 1.0, [PushItem("a", 9, torch.ones(7))])
    assert e.value.code == "INVALID_ARGUMENT" and "out of range" in str(e.value)
    with pytest.raises(StoreError) as e:
        store.push(5, 0, 1.0, items_for("a", torch.ones(4, 5)))
    assert e.value.code == "INVALID_ARGUMENT"
    store.push(0, 0, 1.0, items_for("a", torch.ones(4, 5)))
    with pytest.raises(StoreError, match="twice in one frame"):
        store.push(0, 0, 1.0, [PushItem("b", 0, torch.ones(3)), PushItem("b", 0, torch.ones(3))])
    with pytest.raises(StoreError) as e:  # a resend must keep the weight of the step
        store.push(0, 0, 2.0, items_for("a", torch.ones(4, 5)))
    assert e.value.code == "INVALID_ARGUMENT"
    store.commit(0, 0, 1.0)
    assert store.commit(0, 0, 1.0) == 0  # a resent commit is acknowledged again
    with pytest.raises(StoreError) as e:
        store.commit(0, 0, 3.0)
    assert e.value.code == "STALE_STEP"
    assert torch.equal(values(store, "a", (4, 5)), torch.zeros(4, 5))  # nothing applied yet


def test_resent_push_and_commit_are_ignored():
    """A client that resends its push and commit of a step (lost reply, node restart) changes
    nothing: the result equals a run without the resend, against torch.optim."""
    torch.manual_seed(1)
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(kind="sgd", lr=0.1, momentum=0.9))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    ref = a0.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, foreach=False)
    for step in range(3):
        g0, g1 = torch.randn(4, 5), torch.randn(4, 5)
        store.push(0, step, 1.0, items_for("a", g0))
        store.push(0, step, 1.0, items_for("a", torch.full((4, 5), 99.0)))  # resend: ignored
        store.commit(0, step, 1.0)
        store.commit(0, step, 1.0)
        store.push(1, step, 1.0, items_for("a", g1))
        assert store.commit(1, step, 1.0) == step + 1
        ref.grad = (g0 + g1) / 2
        opt.step()
    torch.testing.assert_close(values(store, "a", (4, 5)), ref.detach(), **ROUND_OFF)


def test_asp_applies_on_arrival():
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(sync="asp", kind="sgd", lr=0.5))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    g = torch.randn(4, 5)
    assert store.push(1, 0, 1.0, items_for("a", g)) == 1
    assert store.push(0, 0, 1.0, items_for("a", g)) == 2
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - g, rtol=0, atol=1e-6)
    with pytest.raises(StoreError):
        store.commit(0, 0, 1.0)


def test_waiting_pull_wakes_on_apply_and_times_out():
    store = JobStore(make_job(world_size=1, kind="sgd", lr=0.1))
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    with pytest.raises(StoreError) as e:
        store.wait_for_step(1, timeout=0.05)
    assert e.value.code == "TIMEOUT"
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("step", store.wait_for_step(1, timeout=10)))
    t.start()
    store.push(0, 0, 1.0, items_for("a", torch.ones(4, 5)))
    store.commit(0, 0, 1.0)
    t.join(10)
    assert result["step"] == 1
    step, changed = store.changed_blocks([("a", 0, 0), ("b", 0, 0), ("frozen", 0, None)], copy=False)
    assert step == 1 and [(c[0], c[1]) for c in changed] == [("a", 0), ("frozen", 0)]


def push_refs(name, grad):
    from shardline.ps_server.store import PushRef

    flat = grad.reshape(-1)
    return [PushRef(name, s.index, False, s.numel, torch.float32) for s in block_slices(flat.numel(), BLOCK)], flat


def receive_all(store, ticket, flat):
    for i, dest in enumerate(ticket.dests):
        s = block_slices(flat.numel(), BLOCK)[i]
        dest.copy_(flat[s.start:s.stop])
        store.check_received(ticket, i)


def test_interleaved_pushes_of_two_ranks_sum_correctly():
    """Rank 0 receives straight into the gradient buffers; rank 1, arriving meanwhile, receives into
    its scratch buffer and, when its push ends (at once), is copied into a parked buffer until rank
    0's gradient is in the sum: then it is added, in rank order."""
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    g0, g1 = torch.randn(4, 5), torch.randn(4, 5)
    refs, flat0 = push_refs("a", g0)
    _, flat1 = push_refs("a", g1)
    t0 = store.begin_push(0, 0, 1.0, refs, bytearray(80))
    t1 = store.begin_push(1, 0, 3.0, refs, bytearray(80))
    assert all(t0.direct) and not any(t1.direct)
    receive_all(store, t1, flat1)
    assert store.finish_push(t1) == 0
    assert all(c.parked.keys() == {1} and not c.received for c in collections(store) if c.pushed_by)
    receive_all(store, t0, flat0)
    store.finish_push(t0)
    assert all(not c.parked and c.received == {0, 1} for c in collections(store) if c.pushed_by)
    store.commit(0, 0, 1.0)
    store.commit(1, 0, 3.0)
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - (g0 + 3 * g1) / 4, rtol=0, atol=1e-6)


def test_a_push_needs_scratch_only_for_the_blocks_not_received_straight_into_their_buffers():
    """The data plane binds the scratch buffer after begin_push (scratch=None), sized to what the
    push needs: nothing for rank 0's push (every block straight into its gradient buffer), the
    blocks packed in payload order for rank 1's (rank 0 is receiving into those buffers); the sum
    is torch's."""
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    g0, g1 = torch.randn(4, 5), torch.randn(4, 5)
    g1[1] = 0   # not a zero flag: a block of zeros still takes its bytes
    refs, flat0 = push_refs("a", g0)
    _, flat1 = push_refs("a", g1)
    t0 = store.begin_push(0, 0, 1.0, refs, None)
    t1 = store.begin_push(1, 0, 3.0, refs, None)
    assert all(t0.direct) and t0.scratch_bytes == 0 and not t0.unbound
    assert not any(t1.direct) and t1.scratch_bytes == 4 * 20 and all(d is None for d in t1.dests)
    t0.bind_scratch(bytearray(0))
    t1.bind_scratch(bytearray(t1.scratch_bytes))
    assert [d.numel() for d in t1.dests] == [7, 7, 6] and not t1.unbound
    receive_all(store, t1, flat1)
    store.finish_push(t1)
    receive_all(store, t0, flat0)
    store.finish_push(t0)
    store.commit(0, 0, 1.0)
    store.commit(1, 0, 3.0)
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - (g0 + 3 * g1) / 4, rtol=0, atol=1e-6)


def test_aborted_push_leaves_nothing_and_frees_the_buffers():
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(kind="sgd", lr=1.0, world_size=1))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    refs, flat = push_refs("a", torch.full((4, 5), 7.0))
    ticket = store.begin_push(0, 0, 2.0, refs, bytearray(80))
    ticket.dests[0].fill_(7.0)  # half-received, then the connection broke
    store.abort_push(ticket)
    assert all(c.receiving is None and not c.pushed_by and not c.has_grad for c in collections(store))
    g = torch.randn(4, 5)
    store.push(0, 0, 1.0, items_for("a", g))  # the rank may push again, with another weight
    store.commit(0, 0, 1.0)
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - g, rtol=0, atol=1e-6)


def test_a_push_whose_block_changed_owner_meanwhile_is_refused_and_keeps_nothing():
    """The node lost a block while the push's bytes were arriving (its handover went out without
    this rank): the push gets NOT_OWNER, so the worker resends it to the new owner, and no block
    of it, also none the node still applies, keeps a part."""
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    refs, flat = push_refs("a", torch.ones(4, 5))
    ticket = store.begin_push(0, 0, 1.0, refs, bytearray(80))
    receive_all(store, ticket, flat)
    kept = {k for k in store.blocks if k != ("a", len(refs) - 1)}
    _gained, handovers = store.set_primary(kept, epoch=2)   # the last block of "a" moved away
    assert [h.ranks for h in handovers] == [()]
    with pytest.raises(StoreError) as e:
        store.finish_push(ticket)
    assert e.value.code == "NOT_OWNER"
    assert all(not c.pushed_by and not c.received and not c.has_grad and c.receiving is None
               for c in collections(store))
    assert not store.push_weights.get(0)


def test_a_push_in_flight_while_its_block_takes_the_step_from_its_previous_primary_is_a_resend():
    """The node took the blocks over (the previous primary's handover timed out), a rank's resend
    of step 0 arrives, and meanwhile the previous primary, which applied step 0 with both ranks'
    pushes (it learnt the new routing late), hands its copy over: the block catches up to step 1.
    The push in flight is then the resend it is, not STALE_STEP; the values are the previous
    primary's (torch's SGD on the mean of both gradients), and the next step takes pushes."""
    import time

    from shardline.ps_server.store import Handover

    a0 = torch.randn(4, 5)
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    store.set_primary(set(), epoch=1)
    keys = {k for k in store.blocks if k[0] == "a"}
    store.set_primary(keys, epoch=2, awaiting={k: ("p1", time.monotonic() - 1) for k in keys})  # wait over
    g0, g1 = torch.randn(4, 5), torch.randn(4, 5)
    refs, flat0 = push_refs("a", g0)
    ticket = store.begin_push(0, 0, 1.0, refs, bytearray(80))
    receive_all(store, ticket, flat0)
    applied = (a0 - (g0 + g1) / 2).reshape(-1)
    items = [Handover(k, 1, None, (), 1, (applied[s.start:s.stop].clone(), dict(store.blocks[k].state)))
             for k, s in zip(sorted(keys), block_slices(20, BLOCK))]
    store.accept_handover("p1", items)
    assert store.finish_push(ticket) >= 0
    assert all(store.blocks[k].step == 1 and store.blocks[k].role.collecting.receiving is None for k in keys)
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - (g0 + g1) / 2, rtol=0, atol=1e-6)
    g2 = torch.randn(4, 5)
    for rank in (0, 1):
        store.push(rank, 1, 1.0, items_for("a", g2))
        store.commit(rank, 1, 1.0, epoch=2)
    torch.testing.assert_close(values(store, "a", (4, 5)), a0 - (g0 + g1) / 2 - g2, rtol=0, atol=1e-6)


def test_stalled_reservation_times_out(monkeypatch):
    """A push still receiving into a block's buffer after its step was applied holds the buffer:
    the next step's first gradient in rank order waits for it before it is summed, and a stalled
    one times out."""
    import shardline.ps_server.store.pushes as store_module

    monkeypatch.setattr(store_module, "RESERVATION_TIMEOUT_SECONDS", 0.1)
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    refs, flat = push_refs("a", torch.ones(4, 5))
    store.begin_push(0, 0, 1.0, refs, bytearray(80))  # never finished
    store.commit(0, 0, 1.0)
    store.commit(1, 0, 1.0)   # step 0 applied without it: it still holds the buffer
    t1 = store.begin_push(0, 1, 1.0, refs, bytearray(80))
    assert not any(t1.direct)
    receive_all(store, t1, flat)
    with pytest.raises(StoreError) as e:
        store.finish_push(t1)
    assert e.value.code == "TIMEOUT"


def test_commit_lr_overrides_the_job_lr_and_must_agree():
    a0 = torch.randn(4, 5)
    store = JobStore(make_job(lr=0.01))
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    ref = a0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=0.01, foreach=False)
    for step, lr in enumerate([0.001, 0.005, 0.02]):
        g = torch.randn(4, 5)
        store.push(0, step, 1.0, items_for("a", g))
        store.commit(0, step, 1.0, lr=lr)
        with pytest.raises(StoreError) as e:
            store.commit(1, step, 1.0, lr=lr * 2)
        assert e.value.code == "INVALID_ARGUMENT" and "lr" in str(e.value)
        store.commit(1, step, 1.0, lr=lr)
        ref.grad = g / 2
        opt.param_groups[0]["lr"] = lr
        opt.step()
        torch.testing.assert_close(values(store, "a", (4, 5)), ref.detach(), **ROUND_OFF)


def test_param_groups_step_with_their_own_hyperparameters_and_lrs_like_torch():
    """Two groups with different lr and weight decay, and a per-group lr override on the commit,
    equal torch.optim.AdamW on the same groups."""
    groups = [dict(lr=0.05, weight_decay=0.1), dict(lr=0.01, weight_decay=0.0)]
    spec = make_job(world_size=1)
    spec.param_groups.extend(OptimizerConfig.from_kwargs("adamw", **g).to_proto() for g in groups)
    spec.optimizer.CopyFrom(spec.param_groups[0])
    spec.tensors[1].group = 1
    torch.manual_seed(3)
    values = {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)}
    store = JobStore(spec)
    init_store(store, values)
    ref = {k: v.clone().requires_grad_(k != "frozen") for k, v in values.items()}
    opt = torch.optim.AdamW([{"params": [ref["a"]], **groups[0]}, {"params": [ref["b"]], **groups[1]}])
    for step, lrs in enumerate([(0.05, 0.01), (0.02, 0.005), None]):
        grads = {"a": torch.randn(4, 5), "b": torch.randn(3)}
        store.push(0, step, 1.0, items_for("a", grads["a"]) + items_for("b", grads["b"]))
        store.commit(0, step, 1.0, lr=lrs)
        for g, lr in zip(opt.param_groups, lrs or (0.02, 0.005)):  # None: the groups' lrs as last set
            g["lr"] = lr
        if lrs is None:
            for g, base in zip(opt.param_groups, groups):
                g["lr"] = base["lr"]
        ref["a"].grad, ref["b"].grad = grads["a"], grads["b"]
        opt.step()
    for name in ("a", "b"):
        got = torch.cat([store.blocks[(name, s.index)].value for s in block_slices(values[name].numel(), BLOCK)])
        torch.testing.assert_close(got, ref[name].detach().reshape(-1), **ROUND_OFF, msg=name)


def test_group_learning_rates_are_validated():
    spec = make_job(world_size=1)
    spec.param_groups.extend([OptimizerConfig.from_kwargs("sgd", lr=0.1).to_proto()] * 2)
    spec.optimizer.CopyFrom(spec.param_groups[0])
    store = JobStore(spec)
    assert store.group_lrs(0.5) == (0.5, 0.5)
    assert store.group_lrs([0.1, 0.2]) == (0.1, 0.2)
    with pytest.raises(StoreError, match="2 parameter groups, the request names 3"):
        store.group_lrs((0.1, 0.2, 0.3))
    with pytest.raises(StoreError, match="finite number"):
        store.group_lrs((0.1, float("nan")))


def test_a_push_of_many_small_blocks_is_checked_in_batches_and_refused_whole():
    """Blocks under CHECK_ALONE_BYTES are checked together; a NaN in one of them (also in the
    last batch, left for finish_push) refuses the whole push, named by its block, and keeps nothing."""
    from shardline.ps_server import store as store_module

    spec = make_job(kind="sgd", lr=1.0, world_size=1)
    del spec.tensors[:]
    for i in range(20):
        spec.tensors.add(name=f"t{i}", shape=[BLOCK], dtype="float32", trainable=True)
    for bad in (3, 19):
        store = JobStore(spec)
        init_store(store, {f"t{i}": torch.zeros(BLOCK) for i in range(20)})
        refs = [store_module.PushRef(f"t{i}", 0, False, BLOCK, torch.float32) for i in range(20)]
        ticket = store.begin_push(0, 0, 1.0, refs, bytearray(4 * BLOCK * 20))
        for i, dest in enumerate(ticket.dests):
            dest.fill_(float("nan") if i == bad else 1.0)
            store.check_received(ticket, i)
        with pytest.raises(StoreError) as e:
            store.finish_push(ticket)
        assert e.value.code == "NONFINITE" and f"'t{bad}'" in str(e.value)
        assert not any(c.has_grad for c in collections(store))
        store.push(0, 0, 1.0, [PushItem(f"t{i}", 0, torch.full((BLOCK,), 2.0)) for i in range(20)])
        store.commit(0, 0, 1.0)
        assert all(torch.equal(values(store, f"t{i}", (BLOCK,)), torch.full((BLOCK,), -2.0)) for i in range(20))


def test_a_large_block_is_checked_as_it_lands(monkeypatch):
    """A block of CHECK_ALONE_BYTES or more is checked alone right away (after the smaller ones
    received before it), so its check overlaps the arrival of the next block."""
    from shardline.ps_server.store import pushes as store_module

    monkeypatch.setattr(store_module, "CHECK_ALONE_BYTES", 4 * BLOCK)   # one full block
    store = JobStore(make_job(kind="sgd", lr=1.0, world_size=1))
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    refs = [store_module.PushRef("b", 0, False, 3, torch.float32)] + push_refs("a", torch.zeros(4, 5))[0]
    ticket = store.begin_push(0, 0, 1.0, refs, bytearray(4 * 23))
    ticket.dests[0].fill_(1.0)
    store.check_received(ticket, 0)
    assert ticket.unchecked == [0]          # 12 bytes: waits for company
    ticket.dests[1].fill_(float("inf"))     # a[0], a whole block: checked now, with b before it
    store.check_received(ticket, 1)
    assert ticket.unchecked == [] and ticket.error is not None and "'a' (block 0)" in str(ticket.error)


def values_at(store, step):
    """Every block as ``changed_blocks(..., at_step=step)`` answers a restarted rank: name -> flat tensor, versions."""
    wanted = [(name, index, None) for name, index in store.blocks]
    _step, blocks = store.changed_blocks(wanted, copy=True, at_step=step)
    return {(t, i): (version, value) for t, i, version, value in blocks}


@pytest.mark.parametrize("push_lr,commit_follows", [(None, False), (0.01, False), (None, True)],
                         ids=["applied-at-commit", "pipelined", "kept-by-the-first-push"])
def test_a_restarted_rank_gets_each_block_as_of_the_step_it_redoes(push_lr, commit_follows):
    """A node keeps each block's value from before its last applied step: a rank that redoes step s
    after the node applied it pulls the parameters after exactly s steps (torch.optim's trajectory),
    on every path that keeps it (copied at the commits; the value the early step replaced, when
    pushes carry the lr; copied by the step's first push its rank's commit follows); older steps
    are not kept (current values come back, at their newer version)."""
    torch.manual_seed(3)
    a0, b0 = torch.randn(4, 5), torch.randn(3)
    store = JobStore(make_job(lr=0.01, weight_decay=0.1))
    init_store(store, {"a": a0, "b": b0, "frozen": torch.zeros(2)})
    ref = a0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1, foreach=False)
    trajectory = [a0.clone()]
    buffers = []
    for step in range(3):
        grads = [torch.randn(4, 5), torch.randn(4, 5)]
        for rank, g in enumerate(grads):
            store.push(rank, step, 1.0, items_for("a", g), lr=push_lr, commit_follows=commit_follows)
        if commit_follows:   # kept by rank 0's push, before any commit
            assert all(store.blocks[("a", i)].previous[:2] == (step, step + 1) for i in range(3))
        for rank in range(2):
            store.commit(rank, step, 1.0, lr=push_lr)
        ref.grad = (grads[0] + grads[1]) / 2
        opt.step()
        trajectory.append(ref.detach().clone())
        buffers.append(store.blocks[("a", 0)].previous[2].data_ptr())
        before = values_at(store, step)   # the step just applied, as a rank redoing it needs it
        flat = torch.cat([before[("a", i)][1] for i in range(store.tensors["a"].blocks)]).view(4, 5)
        torch.testing.assert_close(flat, trajectory[step], **ROUND_OFF)
        assert all(before[("a", i)][0] == step for i in range(store.tensors["a"].blocks))
        assert before[("b", 0)][0] == 0 and torch.equal(before[("b", 0)][1], b0)   # never stepped: as it is
        now = values_at(store, step + 1)
        torch.testing.assert_close(torch.cat([now[("a", i)][1] for i in range(3)]).view(4, 5), trajectory[-1],
                                   **ROUND_OFF)
    if store.step >= 2:   # two steps back is not kept: the current value, at its version
        old = values_at(store, store.step - 2)
        assert all(old[("a", i)][0] == store.step for i in range(3))
    assert store.applied_early == (0 if push_lr is None else 9)
    if push_lr is None:   # copied each step into one buffer per block, allocated once
        assert len(set(buffers)) == 1


def test_a_block_this_node_stops_applying_forgets_its_previous_value():
    store = JobStore(make_job(world_size=1, lr=0.1))
    init_store(store, {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.zeros(2)})
    store.push(0, 0, 1.0, items_for("a", torch.randn(4, 5)))
    store.commit(0, 0, 1.0)
    assert store.blocks[("a", 0)].previous is not None
    store.set_primary({("b", 0)}, epoch=1)
    assert store.blocks[("a", 0)].previous is None
    assert values_at(store, 0)[("a", 0)][0] == 1   # no older value: the current one


def test_a_job_without_exact_restarts_keeps_no_previous_value():
    """exact_restarts=False (JobSpec.inexact_restarts): no copy and no buffer; a restarted rank
    gets the current values (the documented inexact case)."""
    spec = make_job(world_size=1, lr=0.1)
    spec.inexact_restarts = True
    store = JobStore(spec)
    init_store(store, {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.zeros(2)})
    store.push(0, 0, 1.0, items_for("a", torch.randn(4, 5)), commit_follows=True)
    store.commit(0, 0, 1.0)
    assert all(store.blocks[("a", i)].previous is None for i in range(3))
    assert values_at(store, 0)[("a", 0)][0] == 1
