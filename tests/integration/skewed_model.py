"""A skewed job for the rebalancing test: one hot embedding table (every block stepped and pulled
every step), a rarely used table (stepped every RARE_EVERY steps) and a large frozen table (pulled
once), shared by the worker script and the single-process reference. Run as a script it is one
worker process (``train`` is one rank's loop, for threads of a test too):

    python skewed_model.py CLUSTER JOB RANK WORLD_SIZE STEPS OUT.safetensors STEP_SLEEP_SECONDS
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
from torch import nn

HOT_ROWS, COLD_ROWS, RARE_ROWS, DIM, OUT, BATCH = 96, 256, 32, 32, 3, 8
BLOCK_ELEMENTS = 64          # 2 rows of a table per block: the hot table is 48 blocks
RARE_EVERY = 8
_INIT_LOCK = threading.Lock()
HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


class SkewedModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(4321)
        self.hot = nn.Embedding(HOT_ROWS, DIM)
        self.rare = nn.Embedding(RARE_ROWS, DIM)
        self.cold = nn.Embedding(COLD_ROWS, DIM)
        self.cold.weight.requires_grad_(False)       # frozen: pulled once, then never again
        self.proj = nn.Linear(DIM, OUT)

    def forward(self, tokens, step: int):
        x = self.hot(tokens).mean(1) + self.cold(tokens % COLD_ROWS).mean(1)
        if step % RARE_EVERY == 0:
            x = x + self.rare(tokens % RARE_ROWS).mean(1)
        return self.proj(x)


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(7919 * step + rank)
    tokens = torch.randint(0, HOT_ROWS, (BATCH, 6), generator=g)
    return tokens, tokens[:, 0] % OUT


def loss_fn(model, step, tokens, targets):
    return nn.functional.cross_entropy(model(tokens, step), targets)


def reference(steps: int, world_size: int) -> dict[str, torch.Tensor]:
    """Single process, torch.optim.AdamW, each step on the concatenation of all ranks' batches."""
    model = SkewedModel()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **HYPER)
    for step in range(steps):
        parts = [batch(step, r) for r in range(world_size)]
        opt.zero_grad()
        loss_fn(model, step, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(cluster: str, job: str, rank: int, world: int, steps: int, step_sleep: float,
          stop_at: dict | None = None) -> dict:
    """One rank's training loop against the cluster; returns its parameters and ``_version``.
    ``stop_at``: a dict whose ``"step"``, once set (by a test thread), ends training there instead
    (set it ahead of every rank's step); each rank records its steps done there under its rank."""
    from shardline import PSOptimizer

    with _INIT_LOCK:  # the initial values come from the global RNG: one model at a time (threads)
        model = SkewedModel()
    opt = PSOptimizer(model.named_parameters(), cluster=cluster, job=job, optimizer="adamw", sync="bsp",
                      world_size=world, rank=rank, block_elements=BLOCK_ELEMENTS, connect_timeout=60,
                      pull_timeout=120, **HYPER)
    try:
        for step in range(opt.version, steps):
            if stop_at is not None and stop_at.get("step") is not None and step >= stop_at["step"]:
                break
            tokens, targets = batch(step, rank)
            opt.zero_grad()
            loss_fn(model, step, tokens, targets).backward()
            opt.step()
            if stop_at is not None:
                stop_at[rank] = step + 1
            time.sleep(step_sleep)
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        state["_version"] = torch.tensor([opt.version])
        return state
    finally:
        opt.close()


def main(argv):
    cluster, job, rank, world, steps, out, step_sleep = argv
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    save_file(train(cluster, job, int(rank), int(world), int(steps), float(step_sleep)), out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
