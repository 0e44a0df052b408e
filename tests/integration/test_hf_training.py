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


def write_job(root, name: str, *, lora: dict | None = None, fmt: str = "prompt_completion", lr: float = 0.01,
              dtype: str = "float32", init_std: float = 0.02) -> str:
    """A job file next to its model directory and data, which it names by relative paths."""
    build_tiny_llama(root / "llama", init_std=init_std)
    records = prompt_completion_records(64) if fmt == "prompt_completion" else messages_records(32)
    write_jsonl(root / "train.jsonl", records)
    job = {"job": {"name": name}, "model": {"hf_path": "llama", "dtype": dtype},
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


def test_up_trains_lora_adapters_in_bf16_and_moves_only_adapter_bytes(tmp_path):
    """bf16 base (the adapters and the wire stay fp32): pushes carry adapter gradients only."""
    lora = {"r": 4, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    results = train(tmp_path, write_job(tmp_path, "hf-lora", lora=lora, lr=0.05, dtype="bfloat16",
                                         init_std=0.2))  # a base whose frozen head can express the task
    for r in results:
        losses = r["losses"]
        assert losses[-1] < 0.6 * losses[0], losses
        adapter_bytes = 4 * r["n_trainable"]
        assert 0 < r["n_trainable"] < r["n_params"] / 5
        pushed, pulled = r["transfer"]["pushed_bytes"], r["transfer"]["pulled_bytes"]
        # A block whose gradient is exactly zero goes as a flag, no bytes: step 0's lora_A (B starts
        # at zero), and in bf16 a saturated attention's q/k adapters. Every adapter tensor is one
        # block of at most r x hidden = 4 x 48 fp32.
        zero = r["transfer"]["pushed_zero_blocks"]
        assert STEPS * adapter_bytes - zero * 4 * 4 * 48 <= pushed <= STEPS * adapter_bytes, (pushed, zero)
        assert zero < 4 * STEPS, zero
        # The frozen base comes over at most once (rank 1 joins by pulling it); steps pull adapters.
        assert pulled <= 4 * r["n_params"] + STEPS * adapter_bytes, (pulled, adapter_bytes)
    print(f"LoRA: loss {results[0]['losses'][0]:.3f} -> {results[0]['losses'][-1]:.3f}, "
          f"{results[0]['transfer']['pushed_bytes'] / STEPS:,.0f} B pushed per step and worker "
          f"(adapters {4 * results[0]['n_trainable']:,} B, whole model {4 * results[0]['n_params']:,} B)")
