"""PSOptimizer.add_param_group during training (issue 10): a fine-tuning run that unfreezes layers
and adds a new tensor at step K. Two BSP workers against two PS nodes (replication 2) end with the
parameters of one process running torch.optim.AdamW that does the same (freeze, then
opt.add_param_group at step K); a PS stopped and restarted after the change (it restores a
checkpoint of the extended job) changes nothing."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from shardline import PSOptimizer
from shardline.services.dispatcher_client import DispatcherClient
from shardline.services.errors import ShardlineConfigError
from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

WORLD = 2
STEPS = 8
UNFREEZE_AT = 3
HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
NEW_GROUP = dict(lr=0.02, weight_decay=0.0)


class Net(nn.Module):
    """``embed`` stays frozen, ``hidden`` is frozen until UNFREEZE_AT, ``shift`` is outside the
    optimizer until then (then it is a new tensor of the job)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(24, 8)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.shift = nn.Parameter(0.1 * torch.randn(4))
        for p in (*self.embed.parameters(), *self.hidden.parameters(), self.shift):
            p.requires_grad_(False)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens).mean(1)))) + self.shift


def batch(step: int, rank: int, n: int = 5):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 24, (n, 3), generator=g)
    return tokens, tokens[:, 0] % 4


def unfrozen(model) -> list[tuple[str, nn.Parameter]]:
    items = [("hidden.weight", model.hidden.weight), ("hidden.bias", model.hidden.bias), ("shift", model.shift)]
    for _name, p in items:
        p.requires_grad_(True)
    return items


def reference() -> dict[str, torch.Tensor]:
    model = Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER)
    for step in range(STEPS):
        if step == UNFREEZE_AT:
            opt.add_param_group({"params": [p for _n, p in unfrozen(model)], **NEW_GROUP})
        parts = [batch(step, r) for r in range(WORLD)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()} | {"shift": model.shift.detach().clone()}


def run_rank(address, job, rank, model, results, errors, pause=None):
    try:
        opt = PSOptimizer([(n, p) for n, p in model.named_parameters() if n != "shift"], cluster=address, job=job,
                          optimizer="adamw", world_size=WORLD, rank=rank, block_elements=16, replication=2,
                          connect_timeout=30, pull_timeout=60, recovery_timeout=60, **HYPER)
        for step in range(opt.version, STEPS):
            if step == UNFREEZE_AT:
                opt.add_param_group({"params": unfrozen(model), **NEW_GROUP})
                assert len(opt.param_groups) == 2 and opt.param_groups[1]["param_names"] == [
                    "hidden.weight", "hidden.bias", "shift"]
            if pause is not None and step == pause[0]:
                pause[1].wait()           # both ranks reached the step: the test restarts a PS now
                assert pause[2].wait(120)
            tokens, targets = batch(step, rank)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens), targets).backward()
            opt.step()
        results[rank] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt.close()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
        errors.append(exc)
        if pause is not None:
            pause[1].abort()


def run_ranks(address, job, pause=None, between=None):
    results, errors = {}, []
    models = [Net() for _ in range(WORLD)]
    threads = [threading.Thread(target=run_rank, args=(address, job, r, models[r], results, errors, pause))
               for r in range(WORLD)]
    for t in threads:
        t.start()
    if between is not None:
        between()
    for t in threads:
        t.join(150)
    assert not errors, errors
    return results


def assert_equal(results, expected, tol=1e-6):
    initial = Net().state_dict()
    for rank, values in results.items():
        for name, want in expected.items():
            diff = (values[name] - want).abs().max().item()
            assert diff <= tol, f"rank {rank} {name}: max abs diff {diff}"
        for name in ("hidden.weight", "shift", "out.weight"):
            assert not torch.equal(values[name], initial[name]), f"{name} never moved"
        assert torch.equal(values["embed.weight"], initial["embed.weight"]), "the frozen embedding moved"


def test_unfreezing_and_a_new_tensor_at_step_k_equal_torch_add_param_group(cluster):
    assert_equal(run_ranks(cluster.address, "unfreeze"), reference())
    dispatcher = DispatcherClient(cluster.address, rpc_timeout=5)
    try:
        info = dispatcher.get_job("unfreeze")
    finally:
        dispatcher.close()
    ext, = info.spec.extensions
    assert (ext.revision, ext.step, list(ext.unfreeze), [t.name for t in ext.tensors]) == (
        1, UNFREEZE_AT, ["hidden.weight", "hidden.bias"], ["shift"])
    assert info.ready_revision == 1 and len(info.spec.param_groups) == 2


def test_a_rank_that_asks_for_another_group_is_refused_naming_the_difference(cluster):
    models = [Net() for _ in range(WORLD)]
    opts = []
    try:
        made = threading.Thread(target=lambda: opts.append(PSOptimizer(
            [(n, p) for n, p in models[1].named_parameters() if n != "shift"], cluster=cluster.address,
            job="disagree", optimizer="adamw", world_size=WORLD, rank=1, block_elements=16, connect_timeout=30,
            **HYPER)))
        made.start()
        opts.append(PSOptimizer([(n, p) for n, p in models[0].named_parameters() if n != "shift"],
                                cluster=cluster.address, job="disagree", optimizer="adamw", world_size=WORLD, rank=0,
                                block_elements=16, connect_timeout=30, **HYPER))
        made.join(60)
        rank0, rank1 = sorted(opts, key=lambda o: o.rank)
        with pytest.raises(ShardlineConfigError, match="already trains"):
            rank0.add_param_group({"params": [("out.weight", models[0].out.weight)]})
        # rank 1 adds the group first with one lr; rank 0 asks for another: refused, naming it
        rank1.add_param_group({"params": unfrozen(models[1])[:2], "lr": 0.02})
        with pytest.raises(Exception, match="lr is 0.02, this request's 0.03"):
            rank0.add_param_group({"params": unfrozen(models[0])[:2], "lr": 0.03})
        assert len(rank0.param_groups) == 1, "a refused group changes nothing locally"
    finally:
        for o in opts:
            o.close()


def test_a_ps_restarted_after_the_change_restores_the_extended_job_and_training_stays_exact(tmp_path):
    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_dispatcher(state_dir=str(tmp_path / "dispatcher-state"), heartbeat_timeout=3)
        nodes = [cluster.add_node(node_id=f"ps{i}", checkpoint_dir=str(tmp_path / f"ps{i}-ckpt"),
                                  checkpoint_every_steps=1, wait=False) for i in range(2)]
        for h in nodes:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(2, timeout=30)
        pause = (UNFREEZE_AT + 2, threading.Barrier(WORLD + 1, timeout=120), threading.Event())

        def restart_a_node():
            try:
                pause[1].wait()
            except threading.BrokenBarrierError:
                return  # a rank failed before the restart: run_ranks reports its error
            assert cluster.stop(nodes[1]) == 0
            cluster.restart(nodes[1])
            assert "restored job extended at step" in nodes[1].log_tail(300), nodes[1].log_tail()
            pause[2].set()

        assert_equal(run_ranks(cluster.address, "extended", pause=pause, between=restart_a_node), reference())
