"""Two worker processes train through two PS nodes; BSP must equal single-process torch.optim."""

import pytest
import torch

import train_model

STEPS = 8


# shm explicitly (what auto picks for these local nodes, without auto's fallback to TCP), and TCP
@pytest.mark.parametrize("optimizer, schedule, prefetch, transport", [
    ("adamw", False, 0, "shm"), ("sgd", False, 0, "shm"), ("adamw", True, 0, "shm"), ("adamw", True, 1, "shm"),
    ("adamw", False, 0, "tcp")])
def test_bsp_two_workers_equal_single_process(cluster, tmp_path, optimizer, schedule, prefetch, transport):
    job = f"bsp-{optimizer}-{'schedule' if schedule else 'constant'}-prefetch{prefetch}-{transport}"
    results = train_model.run_workers(cluster.address, job, optimizer, "bsp", tmp_path, steps=STEPS, schedule=schedule,
                                      prefetch=prefetch, transport=transport)
    expected = train_model.reference(optimizer, STEPS, world_size=2, schedule=schedule)
    initial = train_model.SmallModel().state_dict()
    for res in results:
        assert int(res["_version"]) == STEPS
        for name, want in expected.items():
            diff = (res[name] - want).abs().max().item()
            assert diff <= 1e-5, f"{name}: max abs diff {diff}"
        # sanity: training moved the trainable tensors, and only them
        assert not torch.equal(res["proj.weight"], initial["proj.weight"])
        assert torch.equal(res["scale"], initial["scale"])
        assert torch.equal(res["unused"], initial["unused"])  # grad None everywhere: never stepped
    assert torch.equal(results[0]["proj.weight"], results[1]["proj.weight"])
    # on one host rank 1 reads each block from its replica (services/copy_reads.py): these runs
    # equal torch.optim with half the reads served by copy holders
    assert sum(copy_reads(node, job) for node in cluster.nodes) > 0


def copy_reads(node, job: str) -> float:
    """Blocks of ``job``'s BSP reads ``node`` served from its copies (its Prometheus metrics)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{node.metrics}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f'shardline_ps_blocks_read_from_copies_total{{job_name="{job}"}}'))


def test_asp_converges(cluster, tmp_path):
    steps = 40
    results = train_model.run_workers(cluster.address, "asp-adam", "adam", "asp", tmp_path, steps=steps)
    tokens, targets = train_model.batch(10_000, 0, n=300)
    with torch.no_grad():
        initial = train_model.loss_fn(train_model.SmallModel(), tokens, targets).item()
    for res in results:
        # (a worker's own first reading may already include the other worker's updates)
        last = res["_eval"][1].item()
        # single-process Adam on the same 80 batches goes 1.077 -> 0.810
        assert last < 0.85 * initial, f"held-out loss {initial:.3f} -> {last:.3f}"


def test_prefetch_lets_a_fast_worker_return_before_the_slow_one_commits(cluster):
    """prefetch_window 1: step() returns after the commit; the parameters are brought up to date
    before the next forward pass. prefetch_window 0: step() waits for the slowest worker."""
    import threading
    import time

    from shardline import PSOptimizer

    fast_model, slow_model = train_model.SmallModel(), train_model.SmallModel()
    kwargs = dict(cluster=cluster.address, job="prefetch", optimizer="adamw", world_size=2, block_elements=16,
                  connect_timeout=30, pull_timeout=60, **train_model.HYPER["adamw"])
    fast = PSOptimizer(fast_model.named_parameters(), rank=0, prefetch_window=1, **kwargs)
    slow = PSOptimizer(slow_model.named_parameters(), rank=1, **kwargs)
    try:
        for opt, model, rank in ((fast, fast_model, 0), (slow, slow_model, 1)):
            tokens, targets = train_model.batch(0, rank)
            opt.zero_grad()
            train_model.loss_fn(model, tokens, targets).backward()
        started = time.monotonic()
        assert fast.step() == 1
        assert time.monotonic() - started < 10 and fast.pending, "fast worker should not wait for rank 1"
        before = fast_model.proj.weight.detach().clone()
        done = threading.Event()
        threading.Thread(target=lambda: (slow.step(), done.set()), daemon=True).start()
        assert done.wait(30)
        tokens, _ = train_model.batch(1, 0)
        fast_model(tokens)  # the forward pre-hook waits for the pull
        assert not fast.pending
        assert not torch.equal(fast_model.proj.weight, before)
        for (name, a), (_, b) in zip(fast_model.named_parameters(), slow_model.named_parameters()):
            assert torch.equal(a, b), name
    finally:
        fast.close()
        slow.close()
