"""bf16 without waste (issue 10): a bf16 model trained through PSOptimizer under BSP with two
workers moves half the bytes of the same model in fp32 (gradients pushed as bf16, pulls answered
in bf16 by the PS), while the PS keeps fp32 masters and runs AdamW in fp32.

Bytes are tensor payload bytes as the workers count them (Client.stats: pushed_bytes and
pulled_bytes; frame headers are not included, they are the same in both dtypes but for the dtype
field values). Exactness: the PS masters equal a single-process reference doing the same bf16
forward/backward per rank, averaging the gradients in fp32 and stepping fp32 masters with
torch.optim.AdamW; every worker's bf16 parameter is exactly ``master.to(torch.bfloat16)``."""

import threading

import torch
from torch import nn

from shardline import PSOptimizer, connect

STEPS = 6
WORLD = 2
BLOCK = 32
HYPER = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(11)
        self.embed = nn.Embedding(24, 16)
        self.norm = nn.LayerNorm(16)
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.norm(self.embed(tokens).mean(1)))))


def batch(step: int, rank: int, n: int = 6):
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, 24, (n, 3), generator=g)
    return tokens, tokens[:, 0] % 4


def loss_of(model, step, rank):
    tokens, targets = batch(step, rank)
    return nn.functional.cross_entropy(model(tokens).float(), targets)


def run_rank(address, job, rank, model, out, errors):
    try:
        opt = PSOptimizer(model, cluster=address, job=job, optimizer="adamw", world_size=WORLD, rank=rank,
                          block_elements=BLOCK, connect_timeout=30, pull_timeout=60, **HYPER)
        try:
            joined = (opt.client.stats.pushed_bytes, opt.client.stats.pulled_bytes)
            for step in range(opt.version, STEPS):
                opt.zero_grad()
                loss_of(model, step, rank).backward()
                opt.step()
            stats = opt.client.stats
            out[rank] = {
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "push_per_step": (stats.pushed_bytes - joined[0]) / STEPS,
                "pull_per_step": (stats.pulled_bytes - joined[1]) / STEPS,
                "copy_back": list(opt._copy_back),
                "cache": {n: (opt.client._values[n].dtype, opt.client._values[n].data_ptr() == p.data_ptr())
                          for n, p in model.named_parameters()},
            }
        finally:
            opt.close()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
        errors.append(exc)


def train(address, job, dtype):
    models = [Net().to(dtype) for _ in range(WORLD)]  # built here: Net() seeds the global RNG
    out, errors = {}, []
    threads = [threading.Thread(target=run_rank, args=(address, job, r, models[r], out, errors)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank did not finish within 120 s"
    assert not errors, errors
    with connect(address, job) as reader:  # an fp32 cache: the masters as the PS holds them
        masters = {n: v.clone() for n, v in reader.pull().items()}
    return out, masters


def reference_bf16() -> dict[str, torch.Tensor]:
    """What the PS does: per rank a bf16 forward/backward at bf16(master), the fp32 mean of the
    ranks' gradients, torch.optim.AdamW on fp32 masters."""
    init = Net().to(torch.bfloat16)
    masters = {n: nn.Parameter(p.detach().float()) for n, p in init.named_parameters()}
    opt = torch.optim.AdamW(list(masters.values()), foreach=False, **HYPER)
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD):
            model = Net().to(torch.bfloat16)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(masters[n].to(torch.bfloat16))
            loss_of(model, step, rank).backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for n, master in masters.items():
            master.grad = (grads[0][n].float() + grads[1][n].float()) / WORLD
        opt.step()
    return {n: m.detach().clone() for n, m in masters.items()}


def test_bf16_wire_traffic_is_half_of_fp32s_and_masters_match_fp32_adamw(cluster):
    fp32, fp32_masters = train(cluster.address, "wire-fp32", torch.float32)
    bf16, bf16_masters = train(cluster.address, "wire-bf16", torch.bfloat16)

    numel = sum(p.numel() for p in Net().parameters())
    for rank in range(WORLD):
        # every parameter changes every step: a step pulls all of them, 4 resp. 2 bytes each
        assert fp32[rank]["pull_per_step"] == 4 * numel
        assert bf16[rank]["pull_per_step"] == 2 * numel
        push_ratio = bf16[rank]["push_per_step"] / fp32[rank]["push_per_step"]
        pull_ratio = bf16[rank]["pull_per_step"] / fp32[rank]["pull_per_step"]
        assert 0.45 <= push_ratio <= 0.55, (rank, bf16[rank]["push_per_step"], fp32[rank]["push_per_step"])
        assert 0.45 <= pull_ratio <= 0.55
        # bf16 parameters are bound directly: the L1 cache is the parameter itself, in bf16
        assert bf16[rank]["copy_back"] == [] and fp32[rank]["copy_back"] == []
        assert all(dtype == torch.bfloat16 and same for dtype, same in bf16[rank]["cache"].values())
        assert all(dtype == torch.float32 and same for dtype, same in fp32[rank]["cache"].values())

    # fp32 masters on the PS, fp32 AdamW: the single-process reference, to float32 round-off
    # (the PS steps a step's blocks with fused multi-tensor kernels)
    expected = reference_bf16()
    initial = {n: p.detach().float() for n, p in Net().to(torch.bfloat16).named_parameters()}
    for name, want in expected.items():
        got = bf16_masters[name]
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
        assert not torch.equal(got, initial[name]), f"{name} never moved"
        # the masters keep what bf16 cannot hold: not all of them are bf16 values
        assert not torch.equal(got, got.to(torch.bfloat16).float())
        for rank in range(WORLD):
            held = bf16[rank]["params"][name]
            assert held.dtype == torch.bfloat16
            assert torch.equal(held.view(torch.int16), got.to(torch.bfloat16).view(torch.int16)), (rank, name)
    # the fp32 job is untouched by all this: its workers hold its masters exactly
    for rank in range(WORLD):
        for name, got in fp32[rank]["params"].items():
            assert got.dtype == torch.float32 and torch.equal(got, fp32_masters[name])
