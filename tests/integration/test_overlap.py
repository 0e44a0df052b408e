"""Push during backward and priority pull against real daemons: BSP with both on (buckets of a
few tensors, gradient accumulation under ``no_sync``, token weights declared before backward)
equals single-process torch.optim.AdamW, and so do flat groups pushed block by block
(``flatten=True``); an error of a background push is raised by ``step()`` without a commit; a PS
killed in the middle of a backward changes nothing in the result."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from shardline import PSOptimizer, connect
from shardline.services.errors import ShardlineConfigError
from shardline.local_cluster import LocalCluster
from test_torch_optimizer import HYPER, Net, batch, groups_of, schedule

pytestmark = pytest.mark.timeout(180)

STEPS = 6
WORLD = 2
MICRO = 2
CAP_MB = 0.0005  # ~500 bytes: a bucket is one or two of Net's tensors, so several go out during backward


def sizes(rank: int) -> list[int]:
    return [3 + rank + m for m in range(MICRO)]  # the ranks' batches differ in size: token weights matter


def micro_batch(step: int, rank: int, m: int):
    return batch(step, 10 * rank + m, n=sizes(rank)[m])


def reference(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, torch.optim.AdamW: each step the mean loss over every rank's microbatches."""
    model = Net()
    opt = torch.optim.AdamW(groups_of(model, named=False), **HYPER)
    sched = schedule(opt)
    for step in range(steps):
        parts = [micro_batch(step, r, m) for r in range(WORLD) for m in range(MICRO)]
        tokens, targets = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens), targets).backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_rank(address, job, rank, model, results, errors, *, steps=STEPS, mid_backward=None, **extra):
    """Rank ``rank``: each step two microbatches, the first under no_sync, weight = its examples.
    ``mid_backward(step)`` runs inside the last backward of each step (after the last layers'
    buckets went out, before the first layers' gradients exist)."""
    try:
        opt = PSOptimizer(groups_of(model, named=True), cluster=address, job=job, optimizer="adamw",
                          world_size=WORLD, rank=rank, block_elements=32, connect_timeout=30, pull_timeout=60,
                          bucket_cap_mb=CAP_MB, overlap=True, **HYPER, **extra)
        sched = schedule(opt)
        n = sum(sizes(rank))
        for step in range(opt.version, steps):
            opt.zero_grad()
            opt.set_step_weight(n)
            for m in range(MICRO):
                tokens, targets = micro_batch(step, rank, m)
                hidden = model.norm(model.embed(tokens).mean(1))
                if mid_backward is not None and m == MICRO - 1:
                    hidden.register_hook(lambda g, step=step: (mid_backward(rank, step), g)[1])
                loss = nn.functional.cross_entropy(model.out(torch.tanh(model.hidden(hidden))), targets,
                                                   reduction="sum") / n
                if m < MICRO - 1:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step(weight=n)
            sched.step()
        opt.wait()
        results[rank] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt.close()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
        errors.append(exc)


def run_ranks(address, job, **extra):
    results, errors = {}, []
    models = [Net() for _ in range(WORLD)]
    threads = [threading.Thread(target=train_rank, args=(address, job, r, models[r], results, errors), kwargs=extra)
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors
    return results


def assert_equal(results, expected, tol=1e-6):
    initial = Net().state_dict()
    assert len(results) == WORLD
    for rank, values in results.items():
        for name, want in expected.items():
            diff = (values[name] - want).abs().max().item()
            assert diff <= tol, f"rank {rank} {name}: max abs diff {diff}"
            assert not torch.equal(values[name], initial[name]), f"{name} never moved"


@pytest.mark.parametrize("flatten", [False, True], ids=["per-tensor", "flat"])
@pytest.mark.parametrize("prefetch_window", [0, 1])
def test_overlap_with_no_sync_accumulation_equals_single_process_adamw(cluster, prefetch_window, flatten):
    """Buckets pushed during the last microbatch's backward (the first one only accumulates), token
    weights, param groups and a scheduler; with prefetch_window 1 the pull is the priority pull
    (forward order, each module waiting only for its own parameters). Flat: the buckets are the
    blocks (32 elements) of each group's flat tensor, the commit goes from step()."""
    results = run_ranks(cluster.address, f"overlap-{prefetch_window}-{int(flatten)}", prefetch_window=prefetch_window,
                        flatten=flatten)
    assert_equal(results, reference())


def refuse_an_lr_changed_after_backward(opt, model, tokens, targets) -> None:
    """A backward pushes with lr 0.1, the lr then changes: step() refuses it (the lr set back after)."""
    opt.zero_grad()
    nn.functional.cross_entropy(model(tokens), targets).backward()
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(ShardlineConfigError, match="learning rates changed"):
        opt.step()
    opt.param_groups[0]["lr"] = 0.1


def refuse_a_nan_gradient(opt, model, tokens, targets, match: str) -> None:
    """A backward whose hidden.weight gradient is NaN: step() raises the background push's error."""
    opt.zero_grad()
    handle = model.hidden.weight.register_hook(lambda g: g * float("nan"))
    nn.functional.cross_entropy(model(tokens), targets).backward()
    handle.remove()
    with pytest.raises(ShardlineConfigError, match=match):
        opt.step()  # raised by the background push, in this thread


def test_errors_of_what_backward_sent_are_raised_by_step(cluster):
    model = Net()
    opt = PSOptimizer(model, cluster=cluster.address, job="overlap-errors", optimizer="sgd", lr=0.1,
                      block_elements=32, connect_timeout=30, pull_timeout=10, bucket_cap_mb=CAP_MB,
                      overlap=True)
    try:
        # backward's commit carries no pull: the parameters must not change before step()
        assert not opt.client.pull_on_commit
        tokens, targets = batch(0, 0)
        nn.functional.cross_entropy(model(tokens), targets).backward()
        with pytest.raises(ShardlineConfigError, match=r"set_step_weight\(3.0\)"):
            opt.step(weight=3.0)  # backward already pushed (and committed) with weight 1

        refuse_an_lr_changed_after_backward(opt, model, tokens, targets)
        applied = opt.version

        refuse_a_nan_gradient(opt, model, tokens, targets, "hidden.weight.*NaN")
        assert opt.version == applied
        with connect(cluster.address, job="overlap-errors") as probe:
            assert probe.join() == applied, "the failed step was committed"
    finally:
        opt.close()


@pytest.mark.parametrize("flatten", [False, True], ids=["per-tensor", "flat"])
def test_a_ps_killed_in_the_middle_of_a_backward_changes_nothing(tmp_path, flatten):
    """Rank 0 kills one of two PS nodes (replication 2) while its backward of step 2 runs, after
    some buckets went out: the pushes still to come meet the dead node, the client resends the
    step to the replicas that took over, and the result is still exact."""
    with LocalCluster(tmp_path / "c") as c:
        c.start_dispatcher(heartbeat_timeout=2, heartbeat_interval=0.5)
        nodes = [c.add_node(node_id=f"ps{i}", wait=False) for i in range(2)]
        for h in nodes:
            c.wait_ready(h)
        c.wait_for_nodes(2, timeout=30)
        killed = []

        def kill_once(rank, step):
            if rank == 0 and step == 2 and not killed:
                killed.append(c.kill(nodes[1]))

        results = run_ranks(c.address, "overlap-kill", steps=4, mid_backward=kill_once, prefetch_window=1,
                            recovery_timeout=30, flatten=flatten)
        assert killed
        assert_equal(results, reference(steps=4))


def test_flat_blocks_pushed_during_backward_keep_the_rules_of_overlap(cluster):
    """flatten=True with overlap=True: step() commits (and its commit brings the pull); a weight
    or lr that differs from what backward pushed, a NaN, and a member without a gradient are
    refused by step() without a commit."""
    model = Net()
    opt = PSOptimizer(model, cluster=cluster.address, job="overlap-flat-errors", optimizer="sgd", lr=0.1,
                      block_elements=32, connect_timeout=30, pull_timeout=10, overlap=True, flatten=True)
    try:
        assert opt.client.pull_on_commit, "the commit goes from step(): it can carry the pull"
        tokens, targets = batch(0, 0)
        nn.functional.cross_entropy(model(tokens), targets).backward()
        with pytest.raises(ShardlineConfigError, match=r"set_step_weight\(3.0\)"):
            opt.step(weight=3.0)
        assert opt.version == 0, "nothing was committed"
        opt.step()  # the blocks backward pushed are still this step's: only the commit was missing
        assert opt.version == 1

        refuse_an_lr_changed_after_backward(opt, model, tokens, targets)
        opt.step()  # nothing was committed: the step goes out now
        applied = opt.version

        refuse_a_nan_gradient(opt, model, tokens, targets, "flat0.*NaN")
        assert opt.version == applied

        opt.zero_grad()
        model.out.bias.requires_grad_(False)   # this backward gives it no gradient; a flat step needs one
        model.out(torch.tanh(model.hidden(model.norm(model.embed(tokens).mean(1))))).sum().backward()
        model.out.bias.requires_grad_(True)
        with pytest.raises(ShardlineConfigError, match="'out.bias' got none this step"):
            opt.step()
        with connect(cluster.address, job="overlap-flat-errors") as probe:
            assert probe.join() == applied, "a refused step was committed"
    finally:
        opt.close()
