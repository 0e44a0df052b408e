"""What a PSOptimizer without options does with a Hugging Face-style model whose parameters do
not all get a gradient every step (an unused pooler, a branch some batches skip): it keeps one
tensor per parameter, so BSP equals single-process torch.optim, which skips a parameter without a
gradient. The first step's hint names the groups ``flatten=True`` would have stepped as one
tensor, and this model shows why that stays a hint: a group every parameter of which had a
gradient at the first step loses one later (docs/architecture.md, "Flat parameters")."""

import logging
import threading

import torch
from torch import nn

from shardline import PSOptimizer

STEPS = 6
WORLD = 2
HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8)


class TinyEncoder(nn.Module):
    """Like a Hugging Face encoder trained for token classification: ``pooler`` is never used,
    ``branch`` only on even steps (a layer some batches skip)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(24, 8)
        self.norm = nn.LayerNorm(8)
        self.branch = nn.Linear(8, 8)
        self.pooler = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens, use_branch: bool):
        h = self.norm(self.embed(tokens).mean(1))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def groups_of(model, named: bool):
    """No weight decay on biases and norms: the decay group holds the never-used pooler's weight,
    the other group only parameters the first step gives a gradient."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        item = (name, p) if named else p
        no_bias_decay = (name.endswith("bias") or name.startswith("norm")) and not name.startswith("pooler")
        (no_decay if no_bias_decay else decay).append(item)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, rank: int, n: int = 5):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 24, (n, 3), generator=g)
    return tokens, tokens[:, 0] % 4


def reference() -> dict[str, torch.Tensor]:
    model = TinyEncoder()
    opt = torch.optim.AdamW(groups_of(model, named=False), **HYPER)
    for step in range(STEPS):
        parts = [batch(step, r) for r in range(WORLD)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat([p[0] for p in parts]), step % 2 == 0),
                                    torch.cat([p[1] for p in parts])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_rank(address, rank, model, results, errors):
    try:
        opt = PSOptimizer(groups_of(model, named=True), cluster=address, job="default-layout", world_size=WORLD,
                          rank=rank, block_elements=32, connect_timeout=30, pull_timeout=60, **HYPER)
        for step in range(STEPS):
            tokens, targets = batch(step, rank)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens, step % 2 == 0), targets).backward()
            opt.step()
        results[rank] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                         {t.name for t in opt.client.spec.tensors})
        opt.close()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
        errors.append(exc)


def test_the_default_steps_each_parameter_and_equals_torch_optim(cluster, caplog):
    caplog.set_level(logging.INFO, logger="shardline.worker")
    models = [TinyEncoder() for _ in range(WORLD)]
    results, errors = {}, []
    threads = [threading.Thread(target=run_rank, args=(cluster.address, r, models[r], results, errors))
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    expected, initial = reference(), TinyEncoder().state_dict()
    for rank, (values, job_tensors) in results.items():
        assert job_tensors == set(initial), "one tensor per parameter, under its own name"
        for name, want in expected.items():
            diff = (values[name] - want).abs().max().item()
            assert diff <= 1e-6, f"rank {rank} {name}: max abs diff {diff}"
        assert torch.equal(values["pooler.weight"], initial["pooler.weight"]), "no gradient ever: never stepped"
        assert not torch.equal(values["branch.bias"], initial["branch.bias"])
    hints = [r.getMessage() for r in caplog.records if "flatten=True" in r.getMessage()]
    assert len(hints) == 1 and "group 1 (" in hints[0] and "group 0" not in hints[0], hints
