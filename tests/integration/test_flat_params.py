"""``PSOptimizer(flatten=True)`` against real daemons: each param group's trainable parameters are
one tensor on the PS (worker/flat_params.py). Under BSP with 2 workers and 2 PS nodes it equals
single-process torch.optim.AdamW (param groups, a scheduler, clipping, frozen parameters, shm and
TCP, the prefetched pull, a PS killed mid-step); what it cannot do is refused with an error that
says what to change."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardline import PSOptimizer, connect
from shardline.services.errors import ShardlineConfigError
from shardline.local_cluster import LocalCluster
from shardline.worker.flat_params import is_flat_name
from test_torch_optimizer import STEPS, Net, assert_equal, batch, reference, run_ranks

pytestmark = pytest.mark.timeout(180)


def job_tensors(address: str, job: str) -> dict[str, bool]:
    """The job's tensors on the cluster: name -> trainable."""
    with connect(address, job=job) as probe:
        return {t.name: t.trainable for t in probe.wait_ready(30).tensors}


@pytest.mark.parametrize("transport,prefetch_window,overlap", [("auto", 0, False), ("tcp", 0, False), ("auto", 1, False),
                                                              ("tcp", 1, True)])
def test_flat_groups_under_bsp_equal_single_process_adamw(cluster, transport, prefetch_window, overlap):
    """Three groups (their own weight decay and lr), a cosine schedule, blocks of 32 elements over
    two nodes; over shm a rank's push is taken from its shared gradient buffer, over TCP it is sent;
    with overlap the blocks go out during backward."""
    job = f"flat-{transport}-{prefetch_window}-{int(overlap)}"
    results = run_ranks(cluster.address, job, flatten=True, transport=transport, prefetch_window=prefetch_window,
                        overlap=overlap)
    assert_equal(results, reference())
    tensors = job_tensors(cluster.address, job)
    assert len(tensors) == 3 and all(map(is_flat_name, tensors)) and all(tensors.values()), tensors


def test_flat_groups_clip_the_mean_gradient_like_clip_grad_norm(cluster):
    norms: list[float] = []
    expected = reference(max_grad_norm=0.3, norms=norms)
    assert sum(n > 0.3 for n in norms) >= STEPS // 2, f"the norm should clip most steps: {norms}"
    assert_equal(run_ranks(cluster.address, "flat-clipped", flatten=True, max_grad_norm=0.3), expected)


def test_frozen_parameters_stay_tensors_of_their_own(cluster):
    def freeze_norm(model):
        model.norm.weight.requires_grad_(False)
        model.norm.bias.requires_grad_(False)

    expected = reference(prepare=freeze_norm)
    results = run_ranks(cluster.address, "flat-frozen", prepare=freeze_norm, flatten=True)
    # a parameter frozen when the job was made cannot start training later: said, not ignored
    model = Net()
    freeze_norm(model)
    opt = PSOptimizer(model, cluster=cluster.address, job="flat-frozen-later", optimizer="sgd", lr=0.1,
                      block_elements=32, connect_timeout=30, flatten=True)
    try:
        model.norm.weight.requires_grad_(True)
        tokens, targets = batch(0, 0)
        nn.functional.cross_entropy(model(tokens), targets).backward()
        with pytest.raises(ShardlineConfigError, match="'norm.weight' has a gradient but was frozen"):
            opt.step()
    finally:
        opt.close()
    initial = Net().state_dict()
    for rank, (values, _state) in results.items():
        for name, want in expected.items():
            diff = (values[name] - want).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} {name}: max abs diff {diff}"
        assert torch.equal(values["norm.weight"], initial["norm.weight"])
    tensors = job_tensors(cluster.address, "flat-frozen")
    assert tensors["norm.weight"] is False and tensors["norm.bias"] is False
    assert sum(map(is_flat_name, tensors)) == 3 and len(tensors) == 5, tensors


def test_a_ps_killed_in_the_middle_of_a_step_changes_nothing(tmp_path):
    """Rank 0 kills one of two PS nodes after its backward of step 2, before its step(): its push
    (taken from the shared gradient buffer) meets the dead node, the client resends the step to
    the node that took the blocks over, and the result still equals torch.optim."""
    steps = 4
    with LocalCluster(tmp_path / "c") as c:
        c.start_dispatcher(heartbeat_timeout=2, heartbeat_interval=0.5)
        nodes = [c.add_node(node_id=f"ps{i}", wait=False) for i in range(2)]
        for h in nodes:
            c.wait_ready(h)
        c.wait_for_nodes(2, timeout=30)
        killed = []

        def kill_once(rank, step, _opt):
            if rank == 0 and step == 2 and not killed:
                killed.append(c.kill(nodes[1]))

        results = run_ranks(c.address, "flat-kill", steps=steps, before_step=kill_once, recovery_timeout=30,
                            flatten=True)
        assert killed
        assert_equal(results, reference(steps=steps))


@pytest.mark.parametrize("overlap", [False, True])
def test_ssp_flat_groups_never_compute_on_parameters_more_than_staleness_old(cluster, overlap):
    """SSP with staleness 1: each step's gradients are gathered into a tensor of their own (the
    records of the steps in flight keep them for resending), and a rank computes every step on
    parameters at most one step old; with overlap too (each round's blocks in their own buffer)."""
    gaps: dict[int, list[int]] = {0: [], 1: []}
    run_ranks(cluster.address, f"flat-ssp-{int(overlap)}", sync="ssp", staleness=1, flatten=True, overlap=overlap,
              before_step=lambda rank, _step, opt: gaps[rank].append(opt.version - opt.held_version))
    assert all(len(g) == STEPS for g in gaps.values()), gaps
    assert all(0 <= gap <= 1 for g in gaps.values() for gap in g), gaps


def test_what_flatten_cannot_do_is_refused_with_what_to_change(cluster):
    model = Net()
    half = Net().to(torch.bfloat16)
    with pytest.raises(ShardlineConfigError, match="float32 CPU parameters; 'embed.weight' is torch.bfloat16"):
        PSOptimizer(half, cluster="127.0.0.1:1", job="x", flatten=True)

    opt = PSOptimizer(model, cluster=cluster.address, job="flat-refusals", optimizer="sgd", lr=0.1,
                      block_elements=32, connect_timeout=30, world_size=2, rank=0, flatten=True)
    try:
        tokens, targets = batch(0, 0)
        # out.bias takes no part in this loss: it has no gradient, which a flat step cannot skip
        model.out(torch.tanh(model.hidden(model.norm(model.embed(tokens).mean(1))))).sum().backward()
        model.out.bias.grad = None
        with pytest.raises(ShardlineConfigError, match="'out.bias' got none this step"):
            opt.step()
        assert opt.version == 0, "nothing was pushed or committed"

        with pytest.raises(ShardlineConfigError, match="add_param_group during training is not supported"):
            opt.add_param_group({"params": [("extra", nn.Parameter(torch.zeros(3)))]})

        with pytest.raises(ShardlineConfigError, match="created with flatten=True: pass flatten=True"):
            PSOptimizer(Net(), cluster=cluster.address, job="flat-refusals", optimizer="sgd", lr=0.1,
                        block_elements=32, connect_timeout=30, world_size=2, rank=1)
        other = Net()
        other.out = nn.Linear(16, 5)  # another shape: another layout
        with pytest.raises(ShardlineConfigError, match="stores no flat tensor"):
            PSOptimizer(other, cluster=cluster.address, job="flat-refusals", optimizer="sgd", lr=0.1,
                        block_elements=32, connect_timeout=30, world_size=2, rank=1, flatten=True)
    finally:
        opt.close()

    plain = PSOptimizer(Net(), cluster=cluster.address, job="flat-refusals-plain", optimizer="sgd", lr=0.1,
                        block_elements=32, connect_timeout=30, world_size=2, rank=0)
    try:
        with pytest.raises(ShardlineConfigError, match="stores no flat tensor"):
            PSOptimizer(Net(), cluster=cluster.address, job="flat-refusals-plain", optimizer="sgd", lr=0.1,
                        block_elements=32, connect_timeout=30, world_size=2, rank=1, flatten=True)
    finally:
        plain.close()


def test_a_job_file_with_flatten_trains_to_the_single_process_reference(tmp_path):
    """``train: {flatten: true}`` through `shardline up` (2 PS nodes, 2 worker daemons): the PS
    checkpoints hold one flat tensor, the model's parameters in order, equal to one process's
    torch.optim run of the same job."""
    from shardline.jobs.runner import run_local
    from shardline.jobs.spec import load_job
    from shardline.ps_server.checkpoint import read_job_tensors
    from test_balanced_training import up, write_job

    job = {"job": {"name": "demo-flat"}, "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
           "task": {"kind": "reverse", "min_digits": 1, "max_digits": 8, "seed": 0},
           "train": {"steps": 12, "batch_size": 8, "optimizer": "adamw", "lr": 0.003, "sync": "bsp",
                     "eval_examples": 8, "sample_prompts": 1, "log_every": 4, "flatten": True}}
    job_file = write_job(tmp_path / "job.yaml", job)
    workdir, _results = up(tmp_path, job_file, workers=2)
    step, _spec, tensors = read_job_tensors([workdir / f"ps-{i}-checkpoints" for i in range(2)], "demo-flat")
    assert step == 12 and len(tensors) == 1 and is_flat_name(next(iter(tensors))), list(tensors)
    flat = next(iter(tensors.values())).reshape(-1)
    reference = run_local(load_job(job_file), world_size=2)
    expected = torch.cat([p.detach().reshape(-1) for _, p in reference.model.named_parameters() if p.requires_grad])
    assert flat.shape == expected.shape
    diff = (flat - expected).abs().max().item()
    assert diff <= 1e-5, f"max abs diff {diff}"
