"""`shardline up` trains a Hugging Face job: a tiny random Llama (built locally by
tests/hf_fixtures.py) on a JSONL file, two BSP workers, full fine-tuning and LoRA. The loss falls,
and with LoRA a step moves adapter bytes only."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_fixtures import build_tiny_llama, messages_records, prompt_completion_records, write_jsonl
from test_demo import processes_mentioning, run_up

pytestmark = pytest.mark.timeout(120)

STEPS = 30


def write_job(root, name: str, *, lora: dict | None = None, fmt: str = "prompt_completion", lr: float = 0.01) -> str:
    """A job file next to its model directory and data, which it names by relative paths."""
    build_tiny_llama(root / "llama")
    records = prompt_completion_records(64) if fmt == "prompt_completion" else messages_records(32)
    write_jsonl(root / "train.jsonl", records)
    job = {"job": {"name": name}, "model": {"hf_path": "llama"},
           "data": {"path": "train.jsonl", "format": fmt, "max_length": 48, "seed": 2},
           "train": {"steps": STEPS, "batch_size": 4, "optimizer": "adamw", "lr": lr, "sync": "bsp",
                     "log_every": 10}}
    if lora:
        job["lora"] = lora
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return str(path)


def train(tmp_path, job_file: str) -> list[dict]:
    workdir = tmp_path / "up"
    res = run_up(workdir, "--ps", "2", "--workers", "2", "--job", job_file, "--timeout", "90", timeout=110)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    results = [json.loads((workdir / f"worker-{r}.result.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in results] == ["completed", "completed"]
    assert [r["version"] for r in results] == [STEPS, STEPS]
    assert processes_mentioning(str(workdir)) == []
    return results


def test_up_fine_tunes_a_hugging_face_model_on_chat_data(tmp_path):
    results = train(tmp_path, write_job(tmp_path, "hf-full", fmt="messages"))
    for r in results:
        losses = r["losses"]
        assert len(losses) == STEPS and losses[-1] < 0.6 * losses[0], losses
        assert r["n_trainable"] == r["n_params"]
        # every step pushes a gradient for every parameter (fp32 on the wire)
        assert r["transfer"]["pushed_bytes"] == STEPS * 4 * r["n_params"]
    print(f"full fine-tune: loss {results[0]['losses'][0]:.3f} -> {results[0]['losses'][-1]:.3f}, "
          f"{results[0]['transfer']['pushed_bytes'] / STEPS:,.0f} B pushed per step and worker")


def test_up_trains_lora_adapters_and_moves_only_adapter_bytes(tmp_path):
    lora = {"r": 4, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    results = train(tmp_path, write_job(tmp_path, "hf-lora", lora=lora, lr=0.03))
    for r in results:
        losses = r["losses"]
        assert losses[-1] < 0.9 * losses[0], losses
        adapter_bytes = 4 * r["n_trainable"]
        assert 0 < r["n_trainable"] < r["n_params"] / 5
        pushed, pulled = r["transfer"]["pushed_bytes"], r["transfer"]["pulled_bytes"]
        # Step 0's lora_A gradients are exactly zero (B starts at zero): those go as flags, no bytes.
        assert (STEPS - 1) * adapter_bytes <= pushed <= STEPS * adapter_bytes, (pushed, adapter_bytes)
        # The frozen base comes over at most once (rank 1 joins by pulling it); steps pull adapters.
        assert pulled <= 4 * r["n_params"] + STEPS * adapter_bytes, (pulled, adapter_bytes)
    print(f"LoRA: loss {results[0]['losses'][0]:.3f} -> {results[0]['losses'][-1]:.3f}, "
          f"{results[0]['transfer']['pushed_bytes'] / STEPS:,.0f} B pushed per step and worker "
          f"(adapters {4 * results[0]['n_trainable']:,} B, whole model {4 * results[0]['n_params']:,} B)")
