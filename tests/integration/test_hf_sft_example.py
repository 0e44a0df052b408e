"""examples/hf_sft.py as a user runs it (one process per rank, RANK/WORLD_SIZE as torchrun sets
them): LoRA on a tiny local Llama, JSONL data, length-balanced global batches; the loss falls."""

import os
import re
import subprocess
import sys
from pathlib import Path

from hf_fixtures import build_tiny_llama, prompt_completion_records, write_jsonl

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_sft.py"


def test_the_sft_example_trains_lora_on_two_ranks(cluster, tmp_path):
    model_dir = build_tiny_llama(tmp_path / "llama", init_std=0.2)  # a frozen random base LoRA can fit
    data = write_jsonl(tmp_path / "train.jsonl", prompt_completion_records(96))
    argv = [sys.executable, str(EXAMPLE), "--cluster", cluster.address, "--job", "sft-example", "--model",
            str(model_dir), "--data", str(data), "--lora-r", "4", "--steps", "24", "--lr", "1e-2",
            "--global-batch", "8", "--warmup", "4"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"}) for rank in range(2)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=240)
            outputs.append(out)
            assert p.returncode == 0, out[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    losses = [float(x) for x in re.findall(r"loss/token (\S+)", outputs[0])]
    assert len(losses) == 24, outputs[0][-2000:]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.75 * first, f"loss {first:.3f} -> {last:.3f}"
