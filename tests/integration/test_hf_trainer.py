"""``transformers.Trainer(model, args, optimizers=(PSOptimizer, scheduler))`` trains a tiny Llama
on 2 processes through the cluster (issue: "Trainer and examples")."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_fixtures import build_tiny_llama, prompt_completion_records, write_jsonl

HERE = Path(__file__).parent
STEPS = 12


def test_trainer_trains_with_a_ps_optimizer_on_two_processes(cluster, tmp_path):
    from safetensors.torch import load_file

    model_dir = build_tiny_llama(tmp_path / "llama")
    data = write_jsonl(tmp_path / "train.jsonl", prompt_completion_records(96))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, str(HERE / "hf_trainer_worker.py"), cluster.address, "trainer",
                               str(rank), "2", str(model_dir), str(data), str(STEPS), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for rank in range(2)]
    try:
        for p in procs:
            output, _ = p.communicate(timeout=180)
            assert p.returncode == 0, output[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["version"] == STEPS
        assert res["wrapped"] in ("AcceleratedOptimizer", "PSOptimizer")
        assert res["lr"] == pytest.approx(0.0, abs=1e-12), "the linear schedule reached its end"
        first, last = sum(res["losses"][:3]) / 3, sum(res["losses"][-3:]) / 3
        assert last < 0.8 * first, f"loss {first:.3f} -> {last:.3f}"
    a, b = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2))
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() == 0.0, f"{name} differs between the ranks"
