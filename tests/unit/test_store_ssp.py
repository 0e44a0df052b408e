"""SSP in the PS store: several steps in flight, each applied with the mean of its own gradients
(checked against torch.optim stepping those means in order), and the bound on how far ahead."""

import threading

import pytest
import torch

from shardline.ps_server.store import COPY, JobStore, PushRef, StoreError
from tests.unit.test_store import init_store, items_for, make_job, values


def ssp_job(staleness, world_size=2, **hp):
    spec = make_job(sync="ssp", world_size=world_size, **hp)
    spec.staleness = staleness
    return JobStore(spec)


def fresh(staleness=2, world_size=2):
    torch.manual_seed(0)
    a0 = torch.randn(4, 5)
    store = ssp_job(staleness, world_size, lr=0.01, weight_decay=0.1)
    init_store(store, {"a": a0, "b": torch.zeros(3), "frozen": torch.zeros(2)})
    ref = a0.clone().requires_grad_()
    return store, ref, torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1, foreach=False)


def test_steps_ahead_collect_apart_and_apply_in_order_with_their_own_means():
    store, ref, opt = fresh(staleness=2)
    grads = {(rank, step): torch.randn(4, 5) for rank in (0, 1) for step in range(3)}
    grads[(0, 1)][0] = 0  # a zero block of a step ahead goes as a flag
    weights = {0: 3.0, 1: 1.0}
    # The fast rank 0 pushes and commits steps 0, 1 and 2 before the slow rank 1 pushes anything.
    for step in range(3):
        store.push(0, step, weights[0], items_for("a", grads[(0, step)]))
        assert store.commit(0, step, weights[0]) == 0
    # Rank 1 pushes step 1 before it commits step 0: both steps collect at once.
    store.push(1, 0, weights[1], items_for("a", grads[(1, 0)]))
    store.push(1, 1, weights[1], items_for("a", grads[(1, 1)]))
    assert store.commit(1, 0, weights[1]) == 1      # step 0 applied; step 1 still waits for rank 1's commit
    expected = []
    for step in range(3):
        ref.grad = (weights[0] * grads[(0, step)] + weights[1] * grads[(1, step)]) / sum(weights.values())
        opt.step()
        expected.append(ref.detach().clone())
    torch.testing.assert_close(values(store, "a", (4, 5)), expected[0], rtol=0, atol=1e-6)
    assert store.commit(1, 1, weights[1]) == 2
    torch.testing.assert_close(values(store, "a", (4, 5)), expected[1], rtol=0, atol=1e-6)
    store.push(1, 2, weights[1], items_for("a", grads[(1, 2)]))
    assert store.commit(1, 2, weights[1]) == 3
    torch.testing.assert_close(values(store, "a", (4, 5)), expected[2], rtol=0, atol=1e-6)
    assert all(store.blocks[("a", i)].version == 3 and not store.blocks[("a", i)].role.ahead for i in range(3))
    assert torch.equal(values(store, "b", (3,)), torch.zeros(3))  # nobody pushed it: never stepped


def test_a_step_complete_before_the_one_before_it_applies_right_after_it():
    store, ref, opt = fresh(staleness=1)
    g = {(r, s): torch.randn(4, 5) for r in (0, 1) for s in (0, 1)}
    store.push(0, 0, 1.0, items_for("a", g[(0, 0)]))
    store.commit(0, 0, 1.0)
    for rank in (0, 1):  # step 1 completes while step 0 still waits for rank 1
        store.push(rank, 1, 1.0, items_for("a", g[(rank, 1)]))
        assert store.commit(rank, 1, 1.0) == 0
    store.push(1, 0, 1.0, items_for("a", g[(1, 0)]))
    assert store.commit(1, 0, 1.0) == 2  # both, in order
    for step in (0, 1):
        ref.grad = (g[(0, step)] + g[(1, step)]) / 2
        opt.step()
    torch.testing.assert_close(values(store, "a", (4, 5)), ref.detach(), rtol=0, atol=1e-6)


def test_pushes_and_commits_beyond_job_step_plus_staleness_are_refused():
    store, _ref, _opt = fresh(staleness=2)
    g = torch.randn(4, 5)
    with pytest.raises(StoreError) as err:
        store.push(0, 3, 1.0, items_for("a", g))
    assert err.value.code == "STALE_STEP" and "staleness 2" in str(err.value) and "up to step 2" in str(err.value)
    with pytest.raises(StoreError) as err:
        store.commit(0, 3, 1.0)
    assert err.value.code == "STALE_STEP" and "staleness 2" in str(err.value)
    assert not any(b.role.ahead for b in store.blocks.values()) and 3 not in store.commits  # nothing kept
    for rank in (0, 1):
        store.commit(rank, 0, 1.0)
    store.push(0, 3, 1.0, items_for("a", g))  # the job is at step 1 now: step 3 is within the bound
    store.commit(0, 3, 1.0)


def test_bsp_still_refuses_any_step_ahead():
    store = JobStore(make_job(lr=0.01))
    init_store(store, {"a": torch.randn(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    with pytest.raises(StoreError) as err:
        store.push(0, 1, 1.0, items_for("a", torch.randn(4, 5)))
    assert err.value.code == "STALE_STEP" and "staleness" not in str(err.value)
    with pytest.raises(StoreError):
        store.commit(0, 1, 1.0)


def test_resent_and_aborted_pushes_of_a_step_ahead_count_once():
    store, ref, opt = fresh(staleness=1)
    g = {(r, s): torch.randn(4, 5) for r in (0, 1) for s in (0, 1)}
    store.push(0, 0, 1.0, items_for("a", g[(0, 0)]))
    store.commit(0, 0, 1.0)
    store.push(0, 1, 1.0, items_for("a", g[(0, 1)]))
    store.push(0, 1, 1.0, items_for("a", g[(0, 1)]))  # resent (lost reply): ignored
    refs = [PushRef("a", 0, False, 7, torch.float32)]
    ticket = store.begin_push(1, 1, 1.0, refs, bytearray(28))  # rank 1's push of step 1 breaks off
    store.abort_push(ticket)
    assert 1 not in store.blocks[("a", 0)].role.ahead[1].pushed_by
    store.push(1, 1, 1.0, items_for("a", g[(1, 1)]))
    store.commit(0, 1, 1.0)
    store.commit(1, 1, 1.0)
    store.push(1, 0, 1.0, items_for("a", g[(1, 0)]))
    assert store.commit(1, 0, 1.0) == 2
    for step in (0, 1):
        ref.grad = (g[(0, step)] + g[(1, step)]) / 2
        opt.step()
    torch.testing.assert_close(values(store, "a", (4, 5)), ref.detach(), rtol=0, atol=1e-6)


def test_a_pull_sees_no_step_its_replicas_do_not_hold_yet():
    store, _ref, _opt = fresh(staleness=1, world_size=1)
    applied = []
    store.apply_hooks.append(lambda job, step, items: applied.append(items) or True)  # copies must be acked
    store.push(0, 0, 1.0, items_for("a", torch.randn(4, 5)))
    store.commit(0, 0, 1.0)
    wanted = [("a", i, 0) for i in range(3)]
    served = []
    puller = threading.Thread(target=lambda: served.append(store.changed_blocks(wanted, copy=True)))
    puller.start()
    puller.join(0.3)
    assert puller.is_alive()  # waits for the replicas' acknowledgement of step 1
    store.mark_visible([b for _k, b in applied[0]], 1)
    puller.join(5)
    step, blocks = served[0]
    assert step == 1 and [version for _t, _i, version, _v in blocks] == [1, 1, 1]


def test_a_lost_block_forgets_its_steps_ahead():
    store, _ref, _opt = fresh(staleness=1)
    store.push(0, 1, 1.0, items_for("a", torch.randn(4, 5)))
    assert store.blocks[("a", 0)].role.ahead
    store.set_primary({key for key in store.blocks if key != ("a", 0)}, epoch=2)
    assert store.blocks[("a", 0)].role is COPY  # nothing ahead: its workers push step 1 again to the new primary


def test_a_pull_waits_for_a_lagging_block_to_reach_min_step():
    """A block taken over mid-step may lag its new node's job step: an SSP pull of min_step waits
    for it as a BSP pull does (it must not pass on the job step alone)."""
    store, _ref, _opt = fresh(staleness=1, world_size=1)
    for step in range(2):
        store.push(0, step, 1.0, items_for("a", torch.randn(4, 5)))
        store.commit(0, step, 1.0)
    lagging = store.blocks[("a", 0)]
    lagging.step = lagging.visible = 1   # as if taken over with step 1 still in flight
    with pytest.raises(StoreError) as err:
        store.wait_for_step(2, 0.2, keys=[("a", 0)])
    assert err.value.code == "TIMEOUT"
    assert store.wait_for_step(2, 0.2, keys=[("a", 1)]) == 2
