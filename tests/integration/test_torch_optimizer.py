"""PSOptimizer is a torch.optim.Optimizer: param groups with their own hyperparameters, LR
schedulers, state_dict, zero_grad; under BSP with 2 workers it equals single-process torch.optim
on the concatenated batch (issue: "Drop into real post-training code")."""

import threading
import time

import pytest
import torch
from torch import nn

from shardline import PSOptimizer
from shardline.services.errors import ShardlineConfigError, ShardlineStateError

STEPS = 10
WORLD = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(24, 8)
        self.norm = nn.LayerNorm(8)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.norm(self.embed(tokens).mean(1)))))


def batch(step: int, rank: int, n: int = 5):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 24, (n, 3), generator=g)
    return tokens, tokens[:, 0] % 4


def groups_of(model, named: bool):
    """The usual split: no weight decay on biases and norms, a lower lr for the embedding."""
    decay, no_decay, embed = [], [], []
    for name, p in model.named_parameters():
        item = (name, p) if named else p
        if name.startswith("embed"):
            embed.append(item)
        elif name.endswith("bias") or name.startswith("norm"):
            no_decay.append(item)
        else:
            decay.append(item)
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0},
            {"params": embed, "lr": 0.02, "weight_decay": 0.05}]


HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8)


def schedule(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)


def reference(max_grad_norm: float | None = None, norms: list | None = None, prepare=None,
              steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Single process: torch.optim.AdamW on the same groups and schedule, each step on the
    concatenation of every rank's batch (and clip_grad_norm_ before the step); ``prepare(model)``
    first (e.g. freezing some parameters); the first ``steps`` steps of the schedule."""
    model = Net()
    if prepare is not None:
        prepare(model)
    opt = torch.optim.AdamW(groups_of(model, named=False), **HYPER)
    sched = schedule(opt)
    for step in range(steps):
        parts = [batch(step, r) for r in range(WORLD)]
        tokens = torch.cat([p[0] for p in parts])
        targets = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens), targets).backward()
        if max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_rank(address, job, rank, model, results, errors, *, steps: int = STEPS, before_step=None, **extra):
    """Rank ``rank`` trains ``steps`` steps; ``before_step(rank, step, opt)`` runs after each
    backward, before ``opt.step()`` (a fault to inject, an observation)."""
    try:
        opt = PSOptimizer(groups_of(model, named=True), cluster=address, job=job, optimizer="adamw",
                          world_size=WORLD, rank=rank, block_elements=32, connect_timeout=30, pull_timeout=60,
                          **HYPER, **extra)
        assert isinstance(opt, torch.optim.Optimizer)
        sched = schedule(opt)
        for step in range(opt.version, steps):
            tokens, targets = batch(step, rank)
            opt.zero_grad()
            # each rank holds half of the global batch: equal weights give the batch mean
            nn.functional.cross_entropy(model(tokens), targets).backward()
            if before_step is not None:
                before_step(rank, step, opt)
            opt.step()
            sched.step()
        opt.wait()  # prefetch_window 1: the last step's pull
        results[rank] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, opt.state_dict())
        opt.close()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
        errors.append(exc)


def run_ranks(address, job, prepare=None, **extra):
    results, errors = {}, []
    models = [Net() for _ in range(WORLD)]  # built here: Net() seeds the global RNG, threads would interleave draws
    for model in models if prepare is not None else ():
        prepare(model)
    threads = [threading.Thread(target=run_rank, args=(address, job, r, models[r], results, errors), kwargs=extra)
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def assert_equal(results, expected, tol=1e-6):
    initial = Net().state_dict()
    for rank, (values, _state) in results.items():
        for name, want in expected.items():
            diff = (values[name] - want).abs().max().item()
            assert diff <= tol, f"rank {rank} {name}: max abs diff {diff}"
            assert not torch.equal(values[name], initial[name]), f"{name} never moved"


def test_param_groups_and_a_scheduler_under_bsp_equal_single_process_adamw(cluster):
    results = run_ranks(cluster.address, "groups")
    assert_equal(results, reference())
    state = results[0][1]
    assert state["shardline"] == {"job": "groups", "version": STEPS, "optimizer": "adamw"}
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0, 0.05]
    assert state["param_groups"][2]["param_names"] == ["embed.weight"]


def test_max_grad_norm_clips_the_mean_gradient_across_nodes_like_clip_grad_norm(cluster):
    """Groups, a schedule and global clipping together: the PS nodes clip the mean gradient by its
    norm over every block of both nodes, as clip_grad_norm_ on the concatenated batch does."""
    max_norm = 0.3
    norms: list[float] = []
    expected = reference(max_grad_norm=max_norm, norms=norms)
    assert sum(n > max_norm for n in norms) >= STEPS // 2, f"the norm should clip most steps: {norms}"
    placement_nodes = len(cluster.nodes)
    assert placement_nodes == 2
    results = run_ranks(cluster.address, "clipped", max_grad_norm=max_norm)
    assert_equal(results, expected)


def test_plain_parameters_get_an_error_that_says_what_to_pass():
    model = Net()
    with pytest.raises(ShardlineConfigError, match="named_parameters"):
        PSOptimizer(model.parameters(), cluster="127.0.0.1:1", job="x")
    with pytest.raises(ShardlineConfigError, match="param group 0 lists unnamed"):
        PSOptimizer([{"params": list(model.parameters())}], cluster="127.0.0.1:1", job="x")
    with pytest.raises(ShardlineConfigError, match="param group 1"):
        PSOptimizer([{"params": [("a", model.out.bias)]}, {"params": [("b", model.out.weight)], "lr": -1.0}],
                    cluster="127.0.0.1:1", job="x")


def test_schedulers_state_dict_zero_grad_and_fixed_hyperparameters(cluster):
    model = Net()
    opt = PSOptimizer(model, cluster=cluster.address, job="optimizer-api", optimizer="sgd", lr=0.1, momentum=0.9,
                      block_elements=32, connect_timeout=30)
    try:
        lambda_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
        tokens, targets = batch(0, 0)
        nn.functional.cross_entropy(model(tokens), targets).backward()
        assert opt.step() == 1
        lambda_sched.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        opt.zero_grad(set_to_none=False)
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())

        saved = opt.state_dict()
        assert saved["state"] == {} and saved["shardline"]["version"] == 1
        opt.param_groups[0]["lr"] = 1.0
        opt.load_state_dict(saved)
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05), "the scheduler's lr is restored"
        other = dict(saved, shardline={**saved["shardline"], "job": "another"})
        with pytest.raises(ShardlineStateError, match="optimizer-api"):
            opt.load_state_dict(other)

        with pytest.raises(ShardlineConfigError, match="already trains in parameter group 0"):
            opt.add_param_group({"params": [("out.bias", model.out.bias)]})  # (new tensors: test_add_param_group.py)
        opt.param_groups[0]["momentum"] = 0.5
        nn.functional.cross_entropy(model(tokens), targets).backward()
        with pytest.raises(ShardlineConfigError, match="only lr can change"):
            opt.step()
        opt.param_groups[0]["momentum"] = 0.9
        closure_calls = []

        def closure():
            closure_calls.append(1)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(tokens), targets)
            loss.backward()
            return loss

        loss = opt.step(closure)
        assert closure_calls and isinstance(loss, torch.Tensor) and opt.version == 2
    finally:
        opt.close()


def test_a_worker_whose_groups_differ_from_the_jobs_is_refused(cluster):
    model = Net()
    creator = PSOptimizer(groups_of(model, named=True), cluster=cluster.address, job="group-mismatch",
                          optimizer="adamw", world_size=2, rank=0, block_elements=32, connect_timeout=30, **HYPER)
    try:
        with pytest.raises(ShardlineConfigError, match="parameter groups"):
            PSOptimizer(Net().named_parameters(), cluster=cluster.address, job="group-mismatch", optimizer="adamw",
                        world_size=2, rank=1, block_elements=32, connect_timeout=30, **HYPER)
    finally:
        creator.close()


def test_every_waiter_blocks_until_the_pull_landed_and_other_models_never_wait(cluster):
    """prefetch_window=1 without the priority pull (flatten=True has none): two threads waiting at
    once (a forward in one, zero_grad in another) both return only once the pull is done, and the
    forward of a model holding none of the optimizer's parameters does not wait at all (its
    forward hook is global: in one process with two ranks, waiting there deadlocked)."""
    from concurrent.futures import Future

    model = Net()
    opt = PSOptimizer(model, cluster=cluster.address, job="concurrent-waits", optimizer="sgd", lr=0.1,
                      block_elements=32, connect_timeout=30, prefetch_window=1, priority_pull=False)
    try:
        tokens, targets = batch(0, 0)
        nn.functional.cross_entropy(model(tokens), targets).backward()
        opt.step()  # installs the forward hook; its pull runs in the background
        opt.wait()
        pull = Future()
        opt._pending = pull   # a pull still in flight
        returned = []
        waiters = [threading.Thread(target=lambda: (opt.zero_grad(), returned.append("zero_grad"))),
                   threading.Thread(target=lambda: (model(tokens), returned.append("forward")))]
        for t in waiters:
            t.start()
        other = Net()
        other(tokens)  # not this optimizer's: no wait
        time.sleep(0.3)
        assert returned == [] and opt.pending
        pull.set_result(None)
        for t in waiters:
            t.join(10)
        assert sorted(returned) == ["forward", "zero_grad"] and not opt.pending
    finally:
        opt.close()


@pytest.mark.parametrize("flatten", [False, True])
def test_a_commit_that_completes_the_step_brings_it_and_no_pull_is_sent(cluster, flatten):
    """One rank: its commit completes every step on both nodes, so each step's new values come in
    the commit's replies (the pull it carries) and ``step()`` sends no pull; still torch.optim.AdamW."""
    model, ref = Net(), Net()
    opt = PSOptimizer(groups_of(model, named=True), cluster=cluster.address, job=f"carried-{flatten}",
                      optimizer="adamw", world_size=1, rank=0, block_elements=32, connect_timeout=30, flatten=flatten,
                      **HYPER)
    ref_opt = torch.optim.AdamW(groups_of(ref, named=False), **HYPER)
    try:
        assert opt.client.pull_on_commit
        for step in range(STEPS):
            tokens, targets = batch(step, 0)
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                nn.functional.cross_entropy(m(tokens), targets).backward()
                o.step()
        assert opt.client.stats.carried_steps == STEPS
        for name, want in ref.state_dict().items():
            diff = (model.state_dict()[name] - want).abs().max().item()
            assert diff <= 1e-6, f"{name}: max abs diff {diff}"
    finally:
        opt.close()
