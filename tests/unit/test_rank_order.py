"""A block's gradient sum is folded in ascending rank order, whatever order the pushes arrive in
(docs/architecture.md, "Rank order"): ``w_a g_a`` (copied, then weighted), then ``+ w_b g_b``
for the next rank, and so on; an aggregated push enters at its lowest rank with factor 1. So the
applied step (value and optimizer state) is the same to the bit for every arrival order, and
equal to the fold computed here; a step recomputed from the same pushes by another node (a
handover, the resends) gives the same bits too.

JobStores stand in for the nodes; the references are the fold in rank order and the store's own
optimizer stepped on it."""

import itertools
import math
import time

import pytest
import torch
from test_store import BLOCK, init_store, items_for, make_job

from shardline.ps_server.store import Aggregate, JobStore, PushItem
from shardline.services.blocks import block_slices

pytestmark = pytest.mark.timeout(120)
LR = 0.01
WEIGHTS = (0.75, 1.5, 2.25, 0.375)    # ranks 0..3: none is 1, each weighting changes the bits
SHAPES = {"a": (4, 5), "b": (3,)}


def step_grads(step: int) -> list[dict]:
    """Each rank's gradients of ``step``: rank 1 leaves a[1] at zero (a zero flag), rank 2 has no
    gradient for ``b`` at all (grad None: it pushes nothing of it), rank 0 none for a[2] in step 1."""
    g = torch.Generator().manual_seed(40 + step)
    grads = [{name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()} for _ in WEIGHTS]
    grads[1]["a"].view(-1)[BLOCK:2 * BLOCK] = 0.0
    del grads[2]["b"]
    if step == 1:
        grads[0]["a"].view(-1)[2 * BLOCK:] = 0.0
    return grads


def items(grads: dict) -> list[PushItem]:
    return [item for name in sorted(grads) for item in items_for(name, grads[name])]


def block_parts(grads: dict) -> dict:
    """(tensor, index) -> the block's gradient (None: exactly zero, a flag) of what ``grads`` has."""
    parts = {}
    for name, grad in grads.items():
        flat = grad.reshape(-1)
        for s in block_slices(flat.numel(), BLOCK):
            part = flat[s.start:s.stop]
            parts[(name, s.index)] = part.clone() if bool(part.any()) else None
    return parts


def fold(contributions: list) -> torch.Tensor | None:
    """The fold in rank order of ``(factor, gradient)`` pairs: the first copied then multiplied
    (when its factor is not 1), each later one added times its factor."""
    total = None
    for factor, grad in contributions:
        if grad is None:
            continue
        if total is None:
            total = grad.clone()
            if factor != 1.0:
                total.mul_(factor)
        else:
            total.add_(grad, alpha=factor)
    return total


def reference_sums(grads: list[dict], weights=WEIGHTS) -> dict:
    """Each block's sum folded in rank order over the ranks that pushed it (None: only zeros)."""
    parts = [block_parts(g) for g in grads]
    keys = sorted({k for p in parts for k in p})
    return {k: fold([(w, p[k]) for w, p in zip(weights, parts) if k in p]) for k in keys}


def reference_step(a0: dict, steps: list[dict]) -> dict:
    """The blocks after ``steps`` (each: key -> folded sum), stepped by the job's optimizer on
    sum / fsum(weights)."""
    store = JobStore(make_job(world_size=4, lr=LR))
    init_store(store, a0)
    opt = store.group_optimizers[0]
    values = {k: b.value.clone() for k, b in store.blocks.items() if k[0] != "frozen"}
    states = {k: opt.init_state(v.numel()) for k, v in values.items()}
    total = math.fsum(WEIGHTS)
    for sums in steps:
        keys = sorted(sums)
        opt.step_many([values[k] for k in keys], [None if sums[k] is None else sums[k] / total for k in keys],
                      [states[k] for k in keys], lr=LR)
    return {k: (values[k], states[k]) for k in values}


def initial() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"a": torch.randn(4, 5, generator=g), "b": torch.randn(3, generator=g), "frozen": torch.zeros(2)}


def sums_of(store: JobStore) -> dict:
    """Each primary block's sum as collected (None: no gradient), of the blocks with nothing parked."""
    out = {}
    for key, block in store.blocks.items():
        c = block.role.collecting
        if c.pushed_by and not c.parked:
            out[key] = c.grad_buf.clone() if c.has_grad else None
    return out


def assert_same_sums(got: dict, want: dict, pending=(("b", 0),)) -> None:
    """``got`` holds ``want``'s sums, bit for bit, but those of ``pending``: rank 3's gradient of b
    waits there until rank 2, which pushes none, commits."""
    assert set(got) <= set(want) and set(want) - set(got) <= set(pending), (sorted(got), sorted(want))
    for key in got:
        assert (got[key] is None) == (want[key] is None), key
        if want[key] is not None:
            assert torch.equal(got[key], want[key]), f"{key}: not the fold in rank order"


def snapshot(store: JobStore) -> dict:
    return {k: (b.value.clone(), {n: (v.clone() if torch.is_tensor(v) else v) for n, v in b.state.items()})
            for k, b in store.blocks.items() if k[0] != "frozen"}


def assert_bitwise(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, (value, state) in want.items():
        assert torch.equal(got[key][0], value), key
        for name, v in state.items():
            g = got[key][1][name]
            assert (torch.equal(g, v) if torch.is_tensor(v) else g == v), (key, name)


def no_parked(store: JobStore) -> bool:
    return not store.parking_blocks and all(not b.role.collecting.parked for b in store.blocks.values() if b.primary)


def run_orders(order: tuple, mode: str) -> tuple[JobStore, list]:
    """Two steps with every rank pushing in ``order``: ``early`` (pushes carry the lr, the last one
    steps the blocks early; then the commits), ``commit_follows`` (each rank commits right after
    its push: a rank that pushed nothing of a block settles it by its commit). Returns the store
    and each step's sums as collected before the commits completed it."""
    store = JobStore(make_job(world_size=4, lr=LR))
    init_store(store, initial())
    collected = []
    for step in range(2):
        grads = step_grads(step)
        for rank in order:
            if mode == "early":
                store.push(rank, step, WEIGHTS[rank], items(grads[rank]), lr=LR)
            else:
                store.push(rank, step, WEIGHTS[rank], items(grads[rank]), commit_follows=True)
                if rank != order[-1]:
                    store.commit(rank, step, WEIGHTS[rank], lr=LR)
        collected.append(sums_of(store))
        for rank in order if mode == "early" else order[-1:]:
            store.commit(rank, step, WEIGHTS[rank], lr=LR)
        assert store.step == step + 1 and no_parked(store)
    return store, collected


@pytest.mark.parametrize("mode", ["early", "commit_follows"])
def test_every_arrival_order_of_four_weighted_ranks_applies_the_same_bits_as_the_fold_in_rank_order(mode):
    """All 24 orders of 4 ranks with distinct weights, AdamW, two steps; zero flags and a rank
    without a gradient for a tensor: the sums collected are the fold in rank order, and the
    values and optimizer states after each step are the same bits, those of the optimizer
    stepped on that fold."""
    steps = [reference_sums(step_grads(s)) for s in range(2)]
    want = reference_step(initial(), steps)
    for order in itertools.permutations(range(4)):
        store, collected = run_orders(order, mode)
        for got, sums in zip(collected, steps):
            assert_same_sums(got, sums)
        assert_bitwise(snapshot(store), want)
        if mode == "early":
            assert store.applied_early > 0


def test_out_of_order_pushes_park_until_the_lower_ranks_settle_and_free_their_buffers():
    """Rank 3 then rank 1 arrive first: both wait (parked, not received: a handover or an early
    step counts only what is in the sum); rank 0 folds itself and rank 1; rank 2's commit without
    a push of ``b`` lets rank 3's ``b`` in; the freed buffers go back to the pool."""
    store = JobStore(make_job(world_size=4, lr=LR))
    init_store(store, initial())
    grads = step_grads(0)
    store.push(3, 0, WEIGHTS[3], items(grads[3]), commit_follows=True)
    store.push(1, 0, WEIGHTS[1], items(grads[1]), commit_follows=True)
    b = store.blocks[("b", 0)].role.collecting
    assert sorted(b.parked) == [1, 3] and not b.received and not b.has_grad
    assert store.blocks[("a", 1)].role.collecting.received == {1}   # rank 1's zero flag settles it at once
    store.push(0, 0, WEIGHTS[0], items(grads[0]), commit_follows=True)
    assert sorted(b.parked) == [3] and b.received == {0, 1}
    store.push(2, 0, WEIGHTS[2], items(grads[2]), commit_follows=True)   # nothing of b
    assert sorted(b.parked) == [3]
    for rank in (0, 1, 2):
        store.commit(rank, 0, WEIGHTS[rank], lr=LR)
    assert not b.parked and b.received == {0, 1, 3}   # rank 2 settled by its commit
    assert torch.equal(b.grad_buf, reference_sums(grads)[("b", 0)])
    assert no_parked(store) and store.grad_pool_bytes > 0
    store.commit(3, 0, WEIGHTS[3], lr=LR)
    assert store.step == 1


def test_an_aggregate_of_ranks_1_and_2_with_solo_pushes_of_0_and_3_folds_at_its_lowest_rank():
    """An aggregated push of ranks {1, 2} (its payload w1 g1 + w2 g2, factor 1) with the solo
    pushes of ranks 0 and 3, in every order, with and without early steps: the sum is
    w0 g0, then + S12, then + w3 g3, and the step the same bits."""
    grads = step_grads(0)
    grads[2]["b"] = torch.randn(3, generator=torch.Generator().manual_seed(3))
    s12 = {name: WEIGHTS[1] * grads[1][name] + WEIGHTS[2] * grads[2][name] for name in SHAPES}
    parts = [block_parts(grads[0]), block_parts(s12), block_parts(grads[3])]
    want_sums = {k: fold([(WEIGHTS[0], parts[0][k]), (1.0, parts[1][k]), (WEIGHTS[3], parts[2][k])])
                 for k in parts[0]}
    want = reference_step(initial(), [want_sums])
    pushes = {0: lambda s, **kw: s.push(0, 0, WEIGHTS[0], items(grads[0]), **kw),
              1: lambda s, **kw: s.push(1, 0, WEIGHTS[1], items(s12), aggregate=Aggregate((1, 2), WEIGHTS[1:3]), **kw),
              3: lambda s, **kw: s.push(3, 0, WEIGHTS[3], items(grads[3]), **kw)}
    for early in (True, False):
        for order in itertools.permutations(pushes):
            store = JobStore(make_job(world_size=4, lr=LR))
            init_store(store, initial())
            for sender in order:
                pushes[sender](store, lr=LR if early else None)
            assert_same_sums(sums_of(store), want_sums, pending=())
            for rank in range(4):
                store.commit(rank, 0, WEIGHTS[rank], lr=LR)
            assert store.step == 1 and no_parked(store)
            assert_bitwise(snapshot(store), want)
            assert (store.applied_early > 0) == early


def test_a_handover_taken_while_a_contribution_is_parked_hands_over_the_folded_prefix_only():
    """Ranks 0, 2 and 3 pushed to the old primary (2 and 3 parked behind rank 1) when the blocks
    move: the handover carries rank 0's sum and rank 0 alone; the new primary, given the resends
    of ranks 2 and 3 and rank 1's push, folds them in order: the same bits as without the
    handover."""
    old, new = JobStore(make_job(world_size=4, lr=LR)), JobStore(make_job(world_size=4, lr=LR))
    for node in (old, new):
        init_store(node, initial())
    keys = set(new.blocks)
    new.set_primary(set(), epoch=2)
    grads = step_grads(0)
    for rank in (3, 0, 2):
        old.push(rank, 0, WEIGHTS[rank], items(grads[rank]), commit_follows=True)
    assert old.blocks[("a", 0)].role.collecting.parked.keys() == {2, 3}
    new.set_primary(keys, epoch=3, awaiting={k: ("old", time.monotonic() + 60) for k in keys})
    _gained, handovers = old.set_primary(set(), epoch=3)
    prefix = block_parts(grads[0])
    for h in handovers:
        if h.key[0] == "frozen":
            continue
        assert h.ranks == (0,), h   # b: rank 2 pushed none of it, but has not committed: not settled
        want = None if prefix[h.key] is None else prefix[h.key] * WEIGHTS[0]
        assert (h.grad is None) == (want is None) and (want is None or torch.equal(h.grad, want))
    new.accept_handover("old", handovers)
    for rank in (3, 2, 1, 0):   # the resends at the new epoch (rank 0's: handed over, ignored) and rank 1
        new.push(rank, 0, WEIGHTS[rank], items(grads[rank]), commit_follows=True)
    assert_same_sums(sums_of(new), reference_sums(grads))
    for rank in range(4):
        new.commit(rank, 0, WEIGHTS[rank], lr=LR, epoch=3)
    assert new.step == 1 and no_parked(new)
    assert_bitwise(snapshot(new), reference_step(initial(), [reference_sums(grads)]))


def test_ssp_pushes_of_a_step_ahead_fold_in_rank_order_too():
    """SSP: a step's pushes that arrive while the block still collects the step before (its
    collection ahead, parked contributions included) fold in rank order, whatever the order."""
    results = []
    for order in [(3, 1, 0, 2), (0, 1, 2, 3), (2, 3, 1, 0), (1, 0, 3, 2)]:
        spec = make_job(sync="ssp", world_size=4, lr=LR)
        spec.staleness = 1
        store = JobStore(spec)
        init_store(store, initial())
        g0, g1 = step_grads(0), step_grads(1)
        for rank in range(4):
            store.push(rank, 0, WEIGHTS[rank], items(g0[rank]))
        for rank in range(3):
            store.commit(rank, 0, WEIGHTS[rank])
        for rank in order:   # step 1 arrives ahead: block.step is 0
            store.push(rank, 1, WEIGHTS[rank], items(g1[rank]))
        assert store.blocks[("a", 0)].step == 0
        store.commit(3, 0, WEIGHTS[3])
        assert store.blocks[("b", 0)].role.collecting.parked.keys() == {3}   # taken from the collection ahead
        for rank in range(3):
            store.commit(rank, 1, WEIGHTS[rank])
        assert_same_sums(sums_of(store), reference_sums(g1), pending=())   # rank 2's commit let rank 3 in
        store.commit(3, 1, WEIGHTS[3])
        assert store.step == 2 and no_parked(store)
        results.append(snapshot(store))
    for got in results[1:]:
        assert_bitwise(got, results[0])
