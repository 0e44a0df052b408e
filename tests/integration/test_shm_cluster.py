"""The shm transport end to end: two workers and three PS nodes on this host, payloads through the
shared rings (blocks larger than what travels inline, PS rings smaller than a frame so they wrap),
BSP equal to single-process torch.optim.AdamW; a PS SIGKILLed and restarted mid-run; no segment
outlives its connection, in the workers' process or the PS nodes'."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

from shardline import PSOptimizer
from shardline.local_cluster import LocalCluster
from shardline.worker.client import Client
from shardline.services.transport.shm import INLINE_MAX_BYTES, ShmConnection

from test_failover import start

pytestmark = pytest.mark.timeout(180)

IN, HIDDEN, OUT, BATCH = 512, 256, 8, 16
BLOCK = 64 * 1024                       # 256 KiB blocks: every push and pull goes through a ring
PS_RING = 256 * 1024                    # smaller than the frames of a step: the PS rings wrap
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
assert BLOCK * 4 > INLINE_MAX_BYTES


_SEEDING = threading.Lock()  # torch's global generator: one model built at a time


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        with _SEEDING:
            torch.manual_seed(7)
            self.hidden = nn.Linear(IN, HIDDEN)   # 512 KiB of weights: two blocks
            self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, (x[:, :OUT].argmax(1))


def reference(steps: int, world: int) -> dict[str, torch.Tensor]:
    """Single process torch.optim.AdamW, each step on the concatenation of every rank's batch."""
    model = Wide()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(steps):
        parts = [batch(step, r) for r in range(world)]
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shm_mappings(pid: int | str = "self", kind: str = "shm") -> int:
    """Mappings of rings (``kind`` "shm") or of shared caches ("region") in process ``pid``."""
    with open(f"/proc/{pid}/maps") as fh:
        return sum(f"memfd:shardline-{kind}" in line for line in fh)


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def dev_shm_mappings(pid: int | str = "self") -> list[str]:
    """Files of /dev/shm that process ``pid`` maps (Shardline's segments are memfds: none)."""
    with open(f"/proc/{pid}/maps") as fh:
        return [line.split()[-1] for line in fh if "/dev/shm/" in line]


def assert_nothing_in_dev_shm(before: set[str], pids: list[int]) -> None:
    """No file of /dev/shm mapped by this process or the daemons ``pids``, and none left behind by
    a name of ours; files other programs on the host create meanwhile are not ours to judge."""
    for pid in ["self", *pids]:
        assert not dev_shm_mappings(pid), (pid, dev_shm_mappings(pid))
    assert not [n for n in dev_shm() - before if "shardline" in n.lower()], dev_shm() - before


def train(cluster: str, job: str, steps: int, world: int = 2, step_sleep: float = 0.0, progress: list | None = None,
          grads_in_buffers: bool = False):
    """``world`` workers (threads of this process, each its own PSOptimizer and connections) train
    ``job`` over transport 'shm'; returns each rank's parameters and connection kinds.
    ``grads_in_buffers``: each parameter's ``.grad`` is its client's ``gradient_buffer`` (backward
    accumulates into it, ``zero_grad(set_to_none=False)`` zeroes it in place)."""
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            model = Wide()
            opt = PSOptimizer(model.named_parameters(), cluster=cluster, job=job, optimizer="adamw", world_size=world,
                              rank=rank, block_elements=BLOCK, transport="shm", pull_timeout=60, connect_timeout=30,
                              recovery_timeout=60, **HYPER)
            if grads_in_buffers:
                for name, p in model.named_parameters():
                    p.grad = opt.client.gradient_buffer(name)
            try:
                for step in range(opt.version, steps):
                    x, y = batch(step, rank)
                    opt.zero_grad(set_to_none=not grads_in_buffers)
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    if progress is not None:
                        progress[rank] = step + 1
                    time.sleep(step_sleep)
                kinds = {type(c.sock) for c in opt.client._conns.values()}
                results[rank] = {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                                 "kinds": kinds, "pulled": opt.client.stats.pulled_bytes, "version": opt.version,
                                 "placed": opt.client.stats.placed_blocks, "taken": opt.client.stats.taken_blocks,
                                 "grads_shared": all(opt.client._shm.grad_regions[0].offset_of(p.grad) is not None
                                                     for p in model.parameters()) if grads_in_buffers else None}
            finally:
                opt.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    return threads, results, errors


def finish(threads, results, errors, timeout: float = 120.0) -> dict:
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "workers did not finish"
    if errors:
        raise errors[0]
    return results


def assert_equal_reference(results: dict, steps: int) -> None:
    expected = reference(steps, world=len(results))
    for rank, res in results.items():
        assert res["version"] == steps
        assert res["kinds"] == {ShmConnection}, f"rank {rank} did not use shm: {res['kinds']}"
        for name, want in expected.items():
            diff = (res["state"][name] - want).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {name}: max abs diff {diff}"


def wait_for_released(pids, timeout: float = 10.0) -> None:
    """Once the workers left, a PS node maps at most the two segments of its link to its peer
    (replication), none of the workers' connections and none of their shared caches."""
    deadline = time.monotonic() + timeout
    while any(shm_mappings(p) > 2 or shm_mappings(p, "region") for p in pids):
        assert time.monotonic() < deadline, {p: (shm_mappings(p), shm_mappings(p, "region")) for p in pids}
        time.sleep(0.05)


def test_bsp_over_shm_equals_torch_and_survives_a_ps_sigkill_and_restart(tmp_path, monkeypatch):
    """Two workers, three PS nodes (rings smaller than a step's frames), every byte through shm:
    kill -9 of a PS mid-run, the workers drop that connection (and its segments) and resend the
    step to the replicas that took over; the node restarts and rejoins (brought in sync, then
    serving over new shm connections); the result equals single-process torch.optim.AdamW.
    The pushes go through the workers' rings here: step() leaves the gradients where backward put
    them instead of copying them into the shared gradient buffers (the test below)."""
    monkeypatch.setattr(Client, "stage_gradients", lambda _client, grads: grads)
    before = dev_shm()
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3, {"shm_ring_bytes": PS_RING})
        steps, progress = 16, [0, 0]
        threads, results, errors = train(cluster.address, "shm-kill", steps, step_sleep=0.1, progress=progress)
        deadline = time.monotonic() + 60
        while min(progress) < 4:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.02)
        # per connection that carried large pushes, its ring (pull replies skip the node's ring:
        # the node copies them into the worker's shared cache)
        during = shm_mappings()
        assert during >= 2, during
        cluster.kill(nodes[1])
        killed_at = min(progress)
        while min(progress) < killed_at + 2:  # the replicas serve the dead node's blocks
            assert time.monotonic() < deadline + 30 and not errors, errors
            time.sleep(0.02)
        cluster.restart(nodes[1])
        cluster.wait_for_nodes(3, timeout=60)
        assert shm_mappings() <= during  # the dead node's segments went with its connections
        finish(threads, results, errors)
        assert_equal_reference(results, steps)
        assert all(res["pulled"] > 0 for res in results.values())
        # the parameters are the clients' shared caches: every pulled block was copied once, by its node
        assert all(res["placed"] > 0 for res in results.values()), results
        assert shm_mappings() == 0
        assert_nothing_in_dev_shm(before, [h.pid for h in nodes])
        wait_for_released([h.pid for h in nodes])
    assert_nothing_in_dev_shm(before, [])


def test_bsp_pushing_from_gradient_buffers_equals_torch(tmp_path):
    """Each parameter's .grad is its client's gradient_buffer: every push over shm is copied by its
    node straight out of the worker's memory (no ring), checked there, and the result equals
    single-process torch.optim.AdamW."""
    with LocalCluster(tmp_path / "c") as cluster:
        start(cluster, 2, {"shm_ring_bytes": PS_RING})
        steps = 4
        results = finish(*train(cluster.address, "shm-grads", steps, grads_in_buffers=True))
        assert_equal_reference(results, steps)
        assert all(res["grads_shared"] for res in results.values()), results   # backward kept them there
        # 4 tensors in 5 blocks, every step: all taken from the buffers
        assert all(res["taken"] == 5 * steps for res in results.values()), results


def test_the_default_step_pushes_from_the_gradient_buffers_and_equals_torch(tmp_path):
    """PSOptimizer's defaults (backward's own .grad tensors, no flat groups): step() copies the
    gradients into the client's shared gradient buffers in one multi-tensor copy and the node
    takes every block from there (nothing through the ring); the result equals single-process
    torch.optim.AdamW."""
    with LocalCluster(tmp_path / "c") as cluster:
        start(cluster, 2, {"shm_ring_bytes": PS_RING})
        steps = 4
        results = finish(*train(cluster.address, "shm-staged", steps))
        assert_equal_reference(results, steps)
        # 4 tensors in 5 blocks, every step: all taken from the buffers
        assert all(res["taken"] == 5 * steps for res in results.values()), results
