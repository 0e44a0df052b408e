"""`shardline export --hf-dir`: a tiny random Llama (tests/hf_fixtures.py) trained a few steps
through a real cluster (two PS nodes with checkpoint directories and a cluster token; PSOptimizer
in this process over the worker's own model loader), exported from the live cluster and offline
from the checkpoints, loaded back with transformers (full fine-tune) and peft (LoRA); the logits
equal the trained model's; a flat job (``flatten=True``) trains like the named one and exports
the same. And the refusals: another source model, a job that does not exist."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import yaml

from hf_fixtures import build_tiny_llama, prompt_completion_records, write_jsonl
from shardline import PSOptimizer, connect
from shardline.jobs.models.hf import load_model, load_tokenizer
from shardline.jobs.spec import LoraSpec
from shardline.cli import main as cli
from shardline.local_cluster import LocalCluster
from test_demo import processes_mentioning

pytestmark = pytest.mark.timeout(120)

TOKEN = b"hf-export-token-0123456789"
STEPS = 4
LORA = LoraSpec(r=4, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
# fp32 exports must reproduce the trained model's logits to this; bf16 ones at bf16 precision
FP32_TOL = 1e-5
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfx")
    token = root / "cluster.token"
    token.write_bytes(TOKEN + b"\n")
    token.chmod(0o600)
    model_dir = build_tiny_llama(root / "llama")
    write_jsonl(root / "train.jsonl", prompt_completion_records(16))
    with LocalCluster(root / "cluster", cluster_token_file=str(token)) as c:
        c.start_dispatcher()
        for i in range(2):
            c.add_node(node_id=f"ps{i}", checkpoint_dir=str(root / f"ps{i}-ckpt"), checkpoint_every_steps=0, wait=False)
        for h in list(c.handles.values()):
            c.wait_ready(h)
        c.wait_for_nodes(2, timeout=30)
        yield {"root": root, "cluster": c, "model": model_dir, "token": str(token),
               "ckpt": [a for i in range(2) for a in ("--checkpoint-dir", str(root / f"ps{i}-ckpt"))]}
    assert processes_mentioning(str(root)) == []


def fixed_input(model_dir) -> torch.Tensor:
    tok = load_tokenizer(str(model_dir))
    texts = ["color of apple ? red", "color of sky ? blue", "what is the color of snow ?"]
    return tok(texts, padding=True, return_tensors="pt")["input_ids"]


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def train(env, job: str, lora: LoraSpec | None = None, **options) -> tuple[torch.nn.Module, torch.Tensor]:
    """STEPS AdamW steps of the worker's model (jobs/models/hf.py) through the cluster; returns the
    model (holding the cluster's values of the last step) and its logits on the fixed input."""
    model = load_model(str(env["model"]), lora=lora)
    ids = fixed_input(env["model"])
    opt = PSOptimizer(model.named_parameters(), cluster=env["cluster"].address, job=job, optimizer="adamw",
                      lr=0.05 if lora else 0.01, world_size=1, rank=0, cluster_token=TOKEN, connect_timeout=30,
                      pull_timeout=30, **options)
    try:
        model.train()
        for _ in range(STEPS):
            opt.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        assert opt.version == STEPS
    finally:
        opt.close()
    return model, logits(model, ids)


@pytest.fixture(scope="module")
def full_job(env):
    return train(env, "hf-full")


@pytest.fixture(scope="module")
def lora_job(env):
    return train(env, "hf-lora", LORA)


def export(env, capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli(["export", "--cluster-token-file", env["token"], "--timeout", "15", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def live(env) -> list[str]:
    return ["--cluster", env["cluster"].address]


def checkpoint(env, capsys, job: str) -> None:
    capsys.readouterr()
    code = cli(["checkpoint", "--cluster", env["cluster"].address, "--cluster-token-file", env["token"],
                "--job", job, "--wait", "60"])
    out = capsys.readouterr().out
    assert code == 0 and f"step {STEPS} durable" in out, out


def test_a_flat_full_fine_tune_trains_and_exports_like_the_named_one(env, full_job, capsys):
    """flatten=True on the Llama (its head tied to the embedding): the job holds one flat tensor,
    the trained model equals the per-tensor job's, and export splits the flat tensor back into a
    transformers directory with the same logits."""
    import transformers

    from shardline.worker.flat_params import is_flat_name

    model, want = train(env, "hf-flat", flatten=True)
    assert (want - full_job[1]).abs().max().item() <= FP32_TOL
    with connect(env["cluster"].address, job="hf-flat", cluster_token=TOKEN) as probe:
        assert [is_flat_name(t.name) for t in probe.wait_ready(30).tensors] == [True]
    code, out, err = export(env, capsys, *live(env), "--job", "hf-flat", "--hf-dir", str(env["root"] / "flat-live"),
                            "--from-model", str(env["model"]))
    assert code == 0, err
    back = transformers.AutoModelForCausalLM.from_pretrained(env["root"] / "flat-live", local_files_only=True)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert (logits(back, fixed_input(env["model"])) - want).abs().max().item() <= FP32_TOL


def test_a_full_fine_tune_exports_to_a_transformers_directory(env, full_job, capsys):
    import transformers

    model, want = full_job
    ids = fixed_input(env["model"])
    root, src = env["root"], str(env["model"])
    code, out, err = export(env, capsys, *live(env), "--job", "hf-full", "--hf-dir", str(root / "full-live"),
                            "--from-model", src)
    assert code == 0, err
    assert f"at step {STEPS}" in out and "model, 20 tensors" in out and "(float32)" in out, out
    checkpoint(env, capsys, "hf-full")
    for name in ("full-live", "full-ckpt"):
        if name == "full-ckpt":
            code, out, err = export(env, capsys, *env["ckpt"], "--job", "hf-full", "--hf-dir", str(root / name),
                                    "--from-model", src)
            assert code == 0 and "from 2 checkpoint dir(s)" in out, err
        back = transformers.AutoModelForCausalLM.from_pretrained(root / name, local_files_only=True)
        assert back.lm_head.weight is back.model.embed_tokens.weight  # tied, as the source
        tok = transformers.AutoTokenizer.from_pretrained(root / name, local_files_only=True)
        assert torch.equal(tok(["color of apple ? red"], return_tensors="pt")["input_ids"][0],
                           ids[0][ids[0] != tok.pad_token_id])
        MEASURED[name] = (logits(back, ids) - want).abs().max().item()
        assert MEASURED[name] <= FP32_TOL, MEASURED
    # it trained: the export is not the source model
    assert (logits(transformers.AutoModelForCausalLM.from_pretrained(src), ids) - want).abs().max() > 1e-2

    # bf16 through the console script, offline
    res = subprocess.run([sys.executable, "-m", "shardline.cli", "export", *env["ckpt"], "--job", "hf-full",
                          "--hf-dir", str(root / "full-bf16"), "--from-model", src, "--dtype", "bf16"],
                         capture_output=True, text=True, timeout=90)
    assert res.returncode == 0, res.stderr
    back = transformers.AutoModelForCausalLM.from_pretrained(root / "full-bf16", local_files_only=True)
    assert back.dtype == torch.bfloat16
    ref = logits(copy.deepcopy(model).to(torch.bfloat16), ids)
    MEASURED["full-bf16 (vs the model in bf16)"] = (logits(back, ids) - ref).abs().max().item()
    assert torch.allclose(logits(back, ids), ref, atol=1e-2, rtol=1e-2)
    print(f"max |logit difference|: {MEASURED}")


def test_a_lora_job_exports_to_a_peft_adapter(env, lora_job, capsys):
    import peft
    import transformers

    model, want = lora_job
    ids = fixed_input(env["model"])
    root, src = env["root"], str(env["model"])
    code, out, err = export(env, capsys, *live(env), "--job", "hf-lora", "--hf-dir", str(root / "lora-live"),
                            "--from-model", src, "--lora-alpha", "16")
    assert code == 0, err
    assert "LoRA adapter (r 4, alpha 16, target_modules q_proj,v_proj), 8 tensors" in out, out
    checkpoint(env, capsys, "hf-lora")
    # offline, with the worker's job file giving the job name, the model and the lora section
    job_file = root / "lora.yaml"
    job_file.write_text(yaml.safe_dump({
        "job": {"name": "hf-lora"}, "model": {"hf_path": "llama"}, "data": {"path": "train.jsonl"},
        "lora": {"r": LORA.r, "alpha": LORA.alpha, "dropout": 0.05, "target_modules": list(LORA.target_modules)}}))
    code, out, err = export(env, capsys, *env["ckpt"], "--job-file", str(job_file), "--hf-dir", str(root / "lora-ckpt"))
    assert code == 0, err
    for name in ("lora-live", "lora-ckpt"):
        cfg = json.loads((root / name / "adapter_config.json").read_text())
        assert cfg["r"] == 4 and cfg["lora_alpha"] == 16 and cfg["task_type"] == "CAUSAL_LM"
        assert cfg["lora_dropout"] == (0.05 if name == "lora-ckpt" else 0.0)
        assert cfg["base_model_name_or_path"] == str(env["model"].resolve())
        assert not (root / name / "config.json").exists()
        base = transformers.AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
        back = peft.PeftModel.from_pretrained(base, root / name)
        MEASURED[name] = (logits(back, ids) - want).abs().max().item()
        assert MEASURED[name] <= FP32_TOL, MEASURED
        transformers.AutoTokenizer.from_pretrained(root / name, local_files_only=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    assert (logits(base, ids) - want).abs().max() > 1e-2  # the adapters changed the model
    print(f"max |logit difference|: {MEASURED}")


def test_refusals_name_the_problem(env, full_job, lora_job, capsys):
    root, src = env["root"], str(env["model"])
    wide = build_tiny_llama(root / "wide", hidden=32)
    code, _, err = export(env, capsys, *live(env), "--job", "hf-full", "--hf-dir", str(root / "x1"),
                          "--from-model", str(wide))
    assert code == 1 and "'model.embed_tokens.weight' is [45, 48], the model in" in err and "[45, 32]" in err, err
    code, _, err = export(env, capsys, *live(env), "--job", "no-such-job", "--hf-dir", str(root / "x2"),
                          "--from-model", src)
    assert code == 1 and "no job named 'no-such-job' on the cluster" in err, err
    code, _, err = export(env, capsys, *env["ckpt"], "--job", "no-such-job", "--hf-dir", str(root / "x3"),
                          "--from-model", src)
    assert code == 1 and "holds a checkpoint of job 'no-such-job'" in err, err
    code, _, err = export(env, capsys, *live(env), "--job", "hf-lora", "--hf-dir", str(root / "x4"), "--from-model", src)
    assert code == 1 and "--lora-alpha" in err, err
    code, _, err = export(env, capsys, *live(env), "--job", "hf-full", "--hf-dir", str(root / "x5"))
    assert code == 2 and "--from-model" in err, err
    code, _, err = export(env, capsys, *live(env), "--job", "hf-full", "--out", str(root / "x.safetensors"),
                          "--hf-dir", str(root / "x6"), "--from-model", src)
    assert code == 2 and "one of --out" in err, err
    assert not [p.name for p in root.iterdir() if p.name.startswith(("x", ".x"))]
