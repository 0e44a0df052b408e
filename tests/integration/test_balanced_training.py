"""Length-balanced minibatches (``train: {balance: tokens, ...}``) with real daemons through
`shardline up`: the balanced run trains to the parameters of the single-process reference on the
naive split, a rank left without sequences still completes every step, and on lognormal-length
JSONL data the per-rank compute the workers report (``step_tokens``, ``compute_seconds`` in their
result JSON) is far more even than with the naive split."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics

import pytest
import yaml

from shardline.jobs.runner import run_local
from shardline.jobs.spec import load_job
from shardline.ps_server.checkpoint import read_job_tensors
from shardline.worker.balance import imbalance
from test_demo import processes_mentioning, run_up

pytestmark = pytest.mark.timeout(90)

DEMO = {"job": {"name": "demo-balanced"}, "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
        "task": {"kind": "reverse", "min_digits": 1, "max_digits": 12, "seed": 0},
        "train": {"steps": 30, "batch_size": 8, "optimizer": "adamw", "lr": 0.003, "sync": "bsp",
                  "eval_examples": 16, "sample_prompts": 3, "log_every": 10, "balance": "tokens",
                  "micro_batch_tokens": 96, "cost": {"c0": 4, "c1": 1, "c2": 0.01}}}


def write_job(path, job: dict) -> str:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return str(path)


def up(tmp_path, job_file: str, workers: int, ps: int = 2, name: str = "up") -> tuple:
    workdir = tmp_path / name
    res = run_up(workdir, "--ps", str(ps), "--workers", str(workers), "--job", job_file, "--timeout", "70", timeout=85)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    results = [json.loads((workdir / f"worker-{r}.result.json").read_text()) for r in range(workers)]
    steps = results[0]["steps_planned"]
    assert [r["status"] for r in results] == ["completed"] * workers
    assert [r["version"] for r in results] == [steps] * workers
    assert processes_mentioning(str(workdir)) == []
    return workdir, results


def assert_checkpoint_equals(workdir, ps: int, job: str, steps: int, reference) -> None:
    step, _spec, tensors = read_job_tensors([workdir / f"ps-{i}-checkpoints" for i in range(ps)], job)
    assert step == steps
    expected = dict(reference.model.named_parameters())
    assert set(tensors) == set(expected)
    for name, value in tensors.items():
        diff = (value - expected[name].detach()).abs().max().item()
        assert diff <= 1e-5, f"{name}: max abs diff {diff}"


def naive(spec, **train):
    return dataclasses.replace(spec, train=dataclasses.replace(
        spec.train, balance="none", micro_batch_tokens=None, cost=None, global_batch_size=None, **train))


def falls(losses: list[float]) -> bool:
    return statistics.mean(losses[-5:]) < 0.8 * statistics.mean(losses[:5])


def test_balanced_daemons_train_to_the_naive_reference(tmp_path):
    job_file = write_job(tmp_path / "job.yaml", DEMO)
    workdir, results = up(tmp_path, job_file, workers=2)
    for r in results:
        assert r["balance"] == "tokens" and falls(r["losses"]), r["losses"]
        assert len(r["compute_seconds"]) == len(r["step_tokens"]) == 30
        assert max(r["step_micro_batches"]) > 1   # micro_batch_tokens splits the parts
    # BSP's weighted mean of the balanced parts = one process on the naive split's whole batches
    spec = load_job(job_file)
    reference = run_local(naive(spec), world_size=2)
    assert_checkpoint_equals(workdir, 2, "demo-balanced", 30, reference)
    per_step = [a + b for a, b in zip(results[0]["step_tokens"], results[1]["step_tokens"])]
    assert per_step == reference.step_tokens


def test_a_rank_with_an_empty_part_completes_every_step(tmp_path):
    """Three workers, two sequences per global minibatch: rank 2 never gets one, commits every step
    with no gradient, and the cluster ends with the parameters of one process on those batches."""
    job = json.loads(json.dumps(DEMO))
    job["job"]["name"] = "demo-empty-rank"
    job["train"].update(steps=20, lr=0.01, global_batch_size=2)
    job_file = write_job(tmp_path / "job.yaml", job)
    workdir, results = up(tmp_path, job_file, workers=3, ps=1)
    empty = results[2]
    assert empty["step_tokens"] == [0] * 20 and empty["step_micro_batches"] == [0] * 20
    assert all(math.isnan(x) for x in empty["losses"])
    assert all(t > 0 for r in results[:2] for t in r["step_tokens"])
    reference = run_local(naive(load_job(job_file), batch_size=2), world_size=1)
    assert_checkpoint_equals(workdir, 1, "demo-empty-rank", 20, reference)
    assert falls(reference.losses), reference.losses


def test_balance_evens_the_per_rank_compute_on_lognormal_lengths(tmp_path, capsys):
    """The same JSONL job with the naive split and with balance: tokens, 2 workers each. The
    token-cost imbalance (max/mean of the ranks' input tokens per step, deterministic) must drop a
    lot; the timed one (compute_seconds) is reported, it is noisy on a shared 2-core machine."""
    from hf_fixtures import build_tiny_llama, lognormal_records, write_jsonl

    build_tiny_llama(tmp_path / "llama", hidden=128)
    write_jsonl(tmp_path / "train.jsonl", lognormal_records(256, seed=1, median_words=24, sigma=1.0))
    steps = 20
    base = {"model": {"hf_path": "llama"}, "data": {"path": "train.jsonl", "max_length": 128, "seed": 0},
            "train": {"steps": steps, "batch_size": 8, "optimizer": "adamw", "lr": 0.01, "log_every": 10}}
    report = {}
    for mode, extra in (("naive", {}), ("balanced", {"balance": "tokens", "micro_batch_tokens": 1024})):
        job = {"job": {"name": f"hf-{mode}"}, **json.loads(json.dumps(base))}
        job["train"].update(extra)
        _, results = up(tmp_path, write_job(tmp_path / f"{mode}.yaml", job), workers=2, name=f"up-{mode}")
        tokens = [imbalance([r["step_tokens"][s] for r in results]) for s in range(steps)]
        seconds = [imbalance([r["compute_seconds"][s] for r in results]) for s in range(1, steps)]  # skip warmup
        report[mode] = {"tokens": statistics.mean(tokens), "seconds": statistics.mean(seconds),
                        "seconds_median": statistics.median(seconds), "losses": results[0]["losses"]}
    with capsys.disabled():
        print(f"\nper-rank imbalance (max/mean, mean over {steps} steps, 2 workers): "
              f"tokens naive {report['naive']['tokens']:.3f} -> balanced {report['balanced']['tokens']:.3f}; "
              f"compute_seconds naive {report['naive']['seconds']:.3f} (median {report['naive']['seconds_median']:.3f})"
              f" -> balanced {report['balanced']['seconds']:.3f} (median {report['balanced']['seconds_median']:.3f})")
    assert report["naive"]["tokens"] > 1.1
    assert report["balanced"]["tokens"] < 1.0 + 0.3 * (report["naive"]["tokens"] - 1.0)
    for mode in report:
        assert falls(report[mode]["losses"]), (mode, report[mode]["losses"])
