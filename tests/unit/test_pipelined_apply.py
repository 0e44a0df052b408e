"""Pipelined apply in the PS store (BSP): a block every rank pushed is stepped before the commits,
and nothing anyone can observe changes until the commits complete the step. The reference is
torch.optim on the weighted mean of the ranks' gradients, and the same store fed by clients that
send no lr with their pushes (the step is then computed at the commits, as before)."""

import pytest
import torch

from shardline.ps_server.store import COPY, JobStore, StoreError
from shardline.services.blocks import block_slices
from shardline.services.pb import common_pb2
from test_store import BLOCK, ROUND_OFF, init_store, items_for, make_job, values

LR = 0.01


def fresh(world_size=2, **hp):
    torch.manual_seed(0)
    initial = {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)}
    store = JobStore(make_job(world_size=world_size, lr=LR, weight_decay=0.1, **hp))
    init_store(store, initial)
    return store, initial


def staged(store, name):
    n = store.tensors[name].blocks
    return [(s := store.blocks[(name, i)].role.collecting.staged) is not None and s.value is not None
            for i in range(n)]


def reference(initial, steps):
    """torch.optim.AdamW on the weighted mean of every rank's gradient of each step."""
    params = {n: initial[n].clone().requires_grad_() for n in ("a", "b")}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.1, foreach=False)
    for grads, weights in steps:
        for n, p in params.items():
            parts = [(w, g[n]) for g, w in zip(grads, weights) if n in g]
            p.grad = None if not parts else sum(w * g for w, g in parts) / sum(weights)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def run(store, steps, lr):
    for step, (grads, weights) in enumerate(steps):
        for rank, (g, w) in enumerate(zip(grads, weights)):
            store.push(rank, step, w, [i for n, t in g.items() for i in items_for(n, t)], lr=lr)
        for rank, w in enumerate(weights):
            store.commit(rank, step, w, lr=lr)


def test_a_block_every_rank_pushed_is_stepped_before_the_commits_and_equals_the_commit_time_apply():
    torch.manual_seed(1)
    steps = [([{"a": torch.randn(4, 5), "b": torch.randn(3)}, {"a": torch.randn(4, 5), "b": torch.randn(3)}],
              [3.0, 1.0]) for _ in range(4)]
    steps[1][0][0]["a"][0] = 0.0     # a zero block from rank 0 goes as a flag and still counts
    early, initial = fresh()
    for step, (grads, weights) in enumerate(steps):
        before = {n: values(early, n, initial[n].shape).clone() for n in ("a", "b")}
        for rank, (g, w) in enumerate(zip(grads, weights)):
            early.push(rank, step, w, items_for("a", g["a"]) + items_for("b", g["b"]), lr=LR)
        assert all(staged(early, "a")) and all(staged(early, "b"))
        for n in ("a", "b"):  # computed, not visible: the blocks still hold (and serve) step `step`
            assert torch.equal(values(early, n, initial[n].shape), before[n])
            assert all(b.version == step and b.step == step for k, b in early.blocks.items() if k[0] == n)
        early.commit(0, step, weights[0], lr=LR)
        assert early.step == step
        early.commit(1, step, weights[1], lr=LR)
        assert early.step == step + 1
        assert not any(b.role.collecting.staged for b in early.blocks.values())
    assert early.applied_early == 4 * (3 + 1)

    at_commit, _ = fresh()
    run(at_commit, steps, lr=None)   # an older client: no lr on its pushes, stepped at the commits
    assert at_commit.applied_early == 0
    want = reference(initial, steps)
    for n in ("a", "b"):
        assert torch.equal(values(early, n, initial[n].shape), values(at_commit, n, initial[n].shape))
        torch.testing.assert_close(values(early, n, initial[n].shape), want[n], **ROUND_OFF)
        for i in range(early.tensors[n].blocks):
            for key, v in early.blocks[(n, i)].state.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(at_commit.blocks[(n, i)].state[key])), key


def test_a_block_one_rank_did_not_push_waits_for_the_commits():
    torch.manual_seed(2)
    store, initial = fresh()
    g0 = {"a": torch.randn(4, 5), "b": torch.randn(3)}
    g1 = {"a": torch.randn(4, 5)}                     # rank 1 has no gradient for b
    store.push(0, 0, 2.0, items_for("a", g0["a"]) + items_for("b", g0["b"]), lr=LR)
    store.push(1, 0, 1.0, items_for("a", g1["a"]), lr=LR)
    assert all(staged(store, "a")) and not any(staged(store, "b"))
    store.commit(0, 0, 2.0, lr=LR)
    store.commit(1, 0, 1.0, lr=LR)
    assert store.applied_early == 3   # b: stepped at the commits, with rank 1 counting as zero
    want = reference(initial, [([g0, g1], [2.0, 1.0])])
    for n in ("a", "b"):
        torch.testing.assert_close(values(store, n, initial[n].shape), want[n], **ROUND_OFF)


def test_a_commit_naming_another_lr_than_its_pushes_is_refused():
    torch.manual_seed(3)
    store, initial = fresh()
    g = [{"a": torch.randn(4, 5)}, {"a": torch.randn(4, 5)}]
    for rank in range(2):
        store.push(rank, 0, 1.0, items_for("a", g[rank]["a"]), lr=LR)
    assert all(staged(store, "a"))
    store.commit(0, 0, 1.0, lr=LR)
    with pytest.raises(StoreError) as err:
        store.commit(1, 0, 1.0, lr=0.5)
    assert err.value.code == "INVALID_ARGUMENT"
    assert "0.5" in str(err.value) and "0.01" in str(err.value)
    with pytest.raises(StoreError):
        store.commit(1, 0, 1.0)        # no lr at all is another lr too
    assert store.step == 0 and torch.equal(values(store, "a", (4, 5)), initial["a"])
    store.commit(1, 0, 1.0, lr=LR)
    torch.testing.assert_close(values(store, "a", (4, 5)), reference(initial, [(g, [1.0, 1.0])])["a"], **ROUND_OFF)


def test_ranks_whose_pushes_name_different_lrs_are_not_stepped_early():
    store, _ = fresh()
    store.push(0, 0, 1.0, items_for("a", torch.ones(4, 5)), lr=LR)
    store.push(1, 0, 1.0, items_for("a", torch.ones(4, 5)), lr=0.02)
    assert not any(staged(store, "a"))
    store.commit(0, 0, 1.0, lr=LR)
    with pytest.raises(StoreError, match="other ranks"):   # the commits disagree: refused as before
        store.commit(1, 0, 1.0, lr=0.02)


def test_max_grad_norm_disables_early_apply():
    spec = make_job(lr=LR)
    spec.max_grad_norm = 1.0
    store = JobStore(spec)
    init_store(store, {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)})
    for rank in range(2):
        store.push(rank, 0, 1.0, items_for("a", torch.randn(4, 5)), lr=LR)
    assert not any(staged(store, "a"))


def test_a_resent_push_after_the_early_step_is_ignored():
    torch.manual_seed(4)
    store, initial = fresh()
    g = [{"a": torch.randn(4, 5)}, {"a": torch.randn(4, 5)}]
    for rank in range(2):
        store.push(rank, 0, 1.0, items_for("a", g[rank]["a"]), lr=LR)
    first = [store.blocks[("a", i)].role.collecting.staged for i in range(3)]
    store.push(0, 0, 1.0, items_for("a", torch.full((4, 5), 99.0)), lr=LR)   # resent: ignored
    assert [store.blocks[("a", i)].role.collecting.staged for i in range(3)] == first
    for rank in range(2):
        store.commit(rank, 0, 1.0, lr=LR)
    store.push(1, 0, 1.0, items_for("a", torch.full((4, 5), 99.0)), lr=LR)   # after the step: ignored
    store.commit(1, 0, 1.0, lr=LR)
    assert store.step == 1
    torch.testing.assert_close(values(store, "a", (4, 5)), reference(initial, [(g, [1.0, 1.0])])["a"], **ROUND_OFF)


def test_pulls_snapshots_and_handovers_see_the_step_in_flight_until_the_commits():
    torch.manual_seed(5)
    store, initial = fresh()
    g = [{"a": torch.randn(4, 5)}, {"a": torch.randn(4, 5)}]
    for rank in range(2):
        store.push(rank, 0, 1.0, items_for("a", g[rank]["a"]), lr=LR)
    assert all(staged(store, "a"))
    keys = [("a", i) for i in range(3)]
    with pytest.raises(StoreError) as err:
        store.wait_for_step(1, timeout=0.2, keys=keys)
    assert err.value.code == "TIMEOUT"
    step, changed = store.changed_blocks([("a", i, None) for i in range(3)], copy=False)
    assert step == 0 and all(version == 0 for _t, _i, version, _v in changed)
    assert torch.equal(torch.cat([v for *_x, v in changed]), initial["a"].reshape(-1))
    snap_step, held, copies = store.snapshot()
    assert snap_step == 0 and all(version == 0 for _t, _i, version, _v, _s in copies)
    assert torch.equal(torch.cat([v for t, _i, _ver, v, _s in copies if t == "a"]), initial["a"].reshape(-1))

    # The block moves to another primary mid-step: what goes along is the gradient sum of both
    # ranks (the new primary steps it), not the early step; the early step is dropped here.
    other_keys = {k for k in store.blocks if k != ("a", 0)}
    _gained, lost = store.set_primary(other_keys, epoch=2)
    (handover,) = lost
    assert handover.key == ("a", 0) and handover.step == 0 and handover.ranks == (0, 1)
    flat = [g[r]["a"].reshape(-1)[:BLOCK] for r in range(2)]
    torch.testing.assert_close(handover.grad, flat[0] + flat[1], rtol=0, atol=1e-7)
    assert store.blocks[("a", 0)].role is COPY   # a copy: the early step went with its collection
    for rank in range(2):
        store.commit(rank, 0, 1.0, lr=LR, epoch=2)
    assert store.step == 1 and store.applied_early == 2   # blocks 1 and 2; block 0 left
    store.wait_for_step(1, timeout=1, keys=keys[1:])
    want = reference(initial, [(g, [1.0, 1.0])])["a"].reshape(-1)
    for i in (1, 2):
        sl = block_slices(20, BLOCK)[i]
        torch.testing.assert_close(store.blocks[("a", i)].value, want[sl.start:sl.stop], **ROUND_OFF)


def test_param_groups_are_stepped_early_with_their_own_lrs():
    groups = [dict(lr=0.05, weight_decay=0.1), dict(lr=0.01, weight_decay=0.0)]
    spec = make_job(world_size=1)
    spec.param_groups.extend(common_pb2.OptimizerSpec(kind="adamw", lr=g["lr"], weight_decay=g["weight_decay"],
                                                      beta1=0.9, beta2=0.999, eps=1e-8) for g in groups)
    spec.optimizer.CopyFrom(spec.param_groups[0])
    spec.tensors[1].group = 1
    torch.manual_seed(6)
    initial = {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)}
    store = JobStore(spec)
    init_store(store, initial)
    ref = {k: initial[k].clone().requires_grad_() for k in ("a", "b")}
    opt = torch.optim.AdamW([{"params": [ref["a"]], **groups[0]}, {"params": [ref["b"]], **groups[1]}])
    for step, lrs in enumerate([(0.05, 0.01), (0.02, 0.005)]):
        grads = {"a": torch.randn(4, 5), "b": torch.randn(3)}
        store.push(0, step, 1.0, items_for("a", grads["a"]) + items_for("b", grads["b"]), lr=lrs)
        assert all(staged(store, "a")) and all(staged(store, "b"))
        store.commit(0, step, 1.0, lr=lrs)
        for group, lr in zip(opt.param_groups, lrs):
            group["lr"] = lr
        ref["a"].grad, ref["b"].grad = grads["a"], grads["b"]
        opt.step()
    assert store.applied_early == 2 * 4
    for n in ("a", "b"):
        torch.testing.assert_close(values(store, n, initial[n].shape), ref[n].detach(), **ROUND_OFF)


def test_commits_that_complete_the_step_while_the_early_step_runs_step_the_gradient_sum(monkeypatch):
    """The early step's copies are installed only if its block still waits for that step: commits
    that completed it meanwhile (another node's relayed record) stepped the kept gradient sum."""
    torch.manual_seed(7)
    store, initial = fresh()
    g = [{"a": torch.randn(4, 5)}, {"a": torch.randn(4, 5)}]
    original = JobStore._step_early

    def commits_arrive_first(self, items):
        self.adopt_commits(0, {0: (1.0, 0), 1: (1.0, 0)}, LR)
        original(self, items)

    store.push(0, 0, 1.0, items_for("a", g[0]["a"]), lr=LR)
    monkeypatch.setattr(JobStore, "_step_early", commits_arrive_first)
    store.push(1, 0, 1.0, items_for("a", g[1]["a"]), lr=LR)
    assert store.step == 1 and store.applied_early == 0 and not any(b.role.collecting.staged for b in store.blocks.values())
    assert store.early_unused == sum(1 for t, _ in store.blocks if t == "a")   # each stepped twice: counted
    torch.testing.assert_close(values(store, "a", (4, 5)), reference(initial, [(g, [1.0, 1.0])])["a"], **ROUND_OFF)


def _push_deferred(store, rank, step, weight, grads):
    """A push as the data plane runs it: received, finished with the early steps left on the
    ticket (they run after the reply went out)."""
    from shardline.ps_server.store import PushRef

    items = [i for n, t in grads.items() for i in items_for(n, t)]
    refs = [PushRef(i.tensor, i.index, i.grad is None, store.expected_numel(i.tensor, i.index), torch.float32)
            for i in items]
    ticket = store.begin_push(rank, step, weight, refs, bytearray(4 * sum(r.numel for r in refs)), lr=LR)
    for n, item in enumerate(items):
        if item.grad is not None:
            ticket.dests[n].copy_(item.grad)
            store.check_received(ticket, n)
    store.finish_push(ticket, defer_early=True)
    return ticket


@pytest.mark.parametrize("commits_first", [False, True])
def test_an_early_step_left_for_after_the_reply_equals_torch_whenever_it_runs(commits_first):
    """finish_push(defer_early=True) stages the blocks the push completed and steps nothing; the
    step runs with step_early (after the reply). If the commits come first they step the blocks
    themselves and the late early step is discarded: the same result either way."""
    torch.manual_seed(8)
    store, initial = fresh()
    steps = [([{"a": torch.randn(4, 5), "b": torch.randn(3)}, {"a": torch.randn(4, 5), "b": torch.randn(3)}],
              [2.0, 1.0]) for _ in range(3)]
    for step, (grads, weights) in enumerate(steps):
        _push_deferred(store, 0, step, weights[0], grads[0])
        last = _push_deferred(store, 1, step, weights[1], grads[1])
        assert last.early and not any(staged(store, "a"))   # staged, not computed yet
        if not commits_first:
            store.step_early(last)
            assert all(staged(store, "a")) and all(staged(store, "b")) and not last.early
        for rank, w in enumerate(weights):
            store.commit(rank, step, w, lr=LR)
        if commits_first:
            store.step_early(last)
        assert store.step == step + 1 and not any(b.role.collecting.staged for b in store.blocks.values())
    assert store.applied_early == (0 if commits_first else 3 * (3 + 1))
    assert store.early_unused == (3 * (3 + 1) if commits_first else 0)
    want = reference(initial, steps)
    for n in ("a", "b"):
        torch.testing.assert_close(values(store, n, initial[n].shape), want[n], **ROUND_OFF)


def test_two_ranks_pushing_at_once_in_interleaved_frames_equal_torch():
    """Threads push frames of a sparse gradient (mostly zero flags) concurrently, as connections
    do: a block is stepped early only once every rank's gradient is in its sum (a push that waits
    for another rank's direct receive releases the lock meanwhile)."""
    import random
    import threading

    from shardline.ps_server.optimizer import OptimizerConfig

    steps, rows, cols, block = 30, 64, 8, 16
    spec = common_pb2.JobSpec(name="j", sync="bsp", world_size=2, block_elements=block,
                              optimizer=OptimizerConfig.from_kwargs("sgd", lr=0.1, momentum=0.9,
                                                                    weight_decay=0.01).to_proto())
    spec.tensors.add(name="e", shape=[rows, cols], dtype="float32", trainable=True)
    gen = torch.Generator().manual_seed(8)
    e0 = torch.randn(rows, cols, generator=gen)
    store = JobStore(spec)
    slices = block_slices(rows * cols, block)
    store.init_blocks([("e", s.index, e0.reshape(-1)[s.start:s.stop]) for s in slices])
    grads = []
    for _ in range(steps):
        per_rank = []
        for _rank in range(2):
            g = torch.zeros(rows, cols)
            g[torch.randint(0, 16, (6,), generator=gen)] = torch.randn(6, cols, generator=gen)
            per_rank.append(g)
        grads.append(per_rank)
    errors = []

    def worker(rank):
        try:
            order = random.Random(rank)
            for step in range(steps):
                items = items_for_blocks(grads[step][rank], block)
                order.shuffle(items)
                for k in range(0, len(items), 8):
                    store.push(rank, step, 1.0, items[k:k + 8], lr=0.1)
                store.commit(rank, step, 1.0, lr=0.1)
                store.wait_for_step(step + 1, timeout=10)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    ref = e0.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)
    for g0, g1 in grads:
        ref.grad = (g0 + g1) / 2
        opt.step()
    got = torch.cat([store.blocks[("e", s.index)].value for s in slices]).view(rows, cols)
    torch.testing.assert_close(got, ref.detach(), **ROUND_OFF)
    assert store.applied_early == steps * len(slices)


def items_for_blocks(grad, block):
    from shardline.ps_server.store import PushItem

    flat = grad.reshape(-1)
    return [PushItem("e", s.index, flat[s.start:s.stop].clone() if bool(flat[s.start:s.stop].any()) else None)
            for s in block_slices(flat.numel(), block)]


def test_a_push_followed_by_its_commit_leaves_its_blocks_for_the_commit():
    """A rank that pushes after its backward commits right after (FrameHeader.commit_follows):
    the blocks its push completes are stepped by the commit, without the early step's copies."""
    torch.manual_seed(9)
    store, initial = fresh()
    g = [{"a": torch.randn(4, 5)}, {"a": torch.randn(4, 5)}]
    store.push(0, 0, 1.0, items_for("a", g[0]["a"]), lr=LR)
    store.push(1, 0, 1.0, items_for("a", g[1]["a"]), lr=LR, commit_follows=True)
    assert not any(staged(store, "a"))
    for rank in range(2):
        store.commit(rank, 0, 1.0, lr=LR)
    assert store.step == 1 and store.applied_early == 0
    torch.testing.assert_close(values(store, "a", (4, 5)), reference(initial, [(g, [1.0, 1.0])])["a"], **ROUND_OFF)


def test_a_copy_holder_installs_copies_sent_ahead_only_when_their_step_is_named():
    """OP_REPLICATE staged: held apart (not installed, not visible); the step's frame names them
    (a carried ref with their version and step) and installs them; a holder that lacks the copy
    it is told to carry refuses instead of acknowledging a step it does not hold."""
    replica, initial = fresh()
    replica.set_primary(set(), epoch=1)                 # it holds copies only
    a0 = replica.blocks[("a", 0)]
    ahead = torch.full((BLOCK,), 7.0)
    state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a0.state.items()}
    replica.hold_copies([("a", 0, 1, 1, ahead, state)])
    assert torch.equal(a0.value, initial["a"].reshape(-1)[:BLOCK]) and (a0.version, a0.step, a0.visible) == (0, 0, 0)
    replica.carry_copies([(("a", 0), 1, 1), (("a", 1), 0, 1)])   # a0 stepped ahead; a1 carried unchanged
    assert a0.value is ahead and (a0.version, a0.step, a0.visible) == (1, 1, 1) and a0.role.held is None
    assert replica.copies_ahead == 1 and replica.blocks[("a", 1)].step == 1
    with pytest.raises(StoreError) as err:
        replica.carry_copies([(("a", 2), 2, 2)])          # a step of a2 it never got
    assert err.value.code == "UNAVAILABLE" and replica.blocks[("a", 2)].step == 0


def _push_over_shm(served, request_id, grad, blocks):
    from shardline.services import frame
    from shardline.services.pb import dataplane_pb2 as dp

    header = frame.FrameHeader(op=dp.OP_PUSH, request_id=request_id, job="j", epoch=1, step=0, rank=0, weight=1.0,
                               has_lr=True, lr=1.0)
    parts = [grad[i * blocks:(i + 1) * blocks] for i in (0, 1)]
    header.blocks.extend([frame.block_ref("w", i, p) for i, p in enumerate(parts)])
    return served.ask(header, [frame.tensor_bytes(p) for p in parts])[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("early_step_fails", [False, True])
def test_the_data_plane_answers_a_push_before_its_early_step(monkeypatch, early_step_fails):
    """A served push that completes its blocks is answered first, then stepped early (the reply
    does not wait for the optimizer); an early step that fails fails no request: the commit
    steps the blocks itself. SGD on one rank: the result is init - lr * grad either way."""
    import threading

    from shardline.services import frame
    from shardline.services.pb import dataplane_pb2 as dp
    from test_pull_placement import BLOCK as PBLOCK, ServedOverShm

    release, stepping = threading.Event(), threading.Event()
    original = JobStore._step_early

    def held(self, items):
        stepping.set()
        assert release.wait(10)
        if early_step_fails:
            raise RuntimeError("injected early-step failure")
        original(self, items)

    monkeypatch.setattr(JobStore, "_step_early", held)
    served = ServedOverShm()
    try:
        init = torch.randn(2 * PBLOCK, generator=torch.Generator().manual_seed(0))
        grad = torch.randn(2 * PBLOCK, generator=torch.Generator().manual_seed(1))
        assert served.init(init).op == dp.OP_REPLY
        reply = _push_over_shm(served, 2, grad, PBLOCK)
        assert reply.op == dp.OP_REPLY, reply.message
        assert stepping.wait(10) and not release.is_set()   # answered while the early step is held
        release.set()
        commit = frame.FrameHeader(op=dp.OP_COMMIT, request_id=3, job="j", epoch=1, step=0, rank=0, weight=1.0,
                                   has_lr=True, lr=1.0)
        assert served.ask(commit)[0].op == dp.OP_REPLY
        reply, body = served.ask(frame.FrameHeader(op=dp.OP_PULL, request_id=4, job="j", epoch=1, min_step=1,
                                                   blocks=[dp.BlockRef(tensor="w", index=i) for i in (0, 1)]))
        assert reply.op == dp.OP_REPLY and reply.step == 1, reply.message
        job = served.node.store.get("j")
        assert job.applied_early == (0 if early_step_fails else 2)
        torch.testing.assert_close(torch.frombuffer(body, dtype=torch.float32), init - grad, rtol=0, atol=1e-6)
    finally:
        release.set()
        served.close()
