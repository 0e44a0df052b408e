"""jobs/hf_export.py without a cluster: a job's tensors (by the worker's names) written as a
save_pretrained model or a peft adapter, loaded back with transformers/peft; the refusals.
The tiny Llama (tied embeddings) and tokenizer are built locally by tests/hf_fixtures.py."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from hf_fixtures import build_tiny_llama
from shardline.jobs.hf_export import HFExporter, HFExportError, is_lora
from shardline.jobs.models.hf import load_model
from shardline.jobs.spec import LoraSpec
from shardline.services.errors import ShardlineConfigError

LORA = LoraSpec(r=4, alpha=16.0, dropout=0.0, target_modules=("q_proj", "v_proj"))
IDS = torch.tensor([[2, 7, 8, 12, 13, 9], [2, 20, 21, 22, 3, 0]])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("src") / "llama")


def trained(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """Perturb every trainable parameter (as training would) and return the job's tensors."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def logits(model, ids=IDS) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_a_full_fine_tune_loads_with_transformers_tied_head_and_tokenizer(llama, tmp_path):
    import transformers

    model = load_model(str(llama))
    tensors = trained(model)
    assert "lm_head.weight" not in tensors  # tied: the worker registers the embedding once
    out = tmp_path / "out"
    result = HFExporter(llama, out).write(tensors)
    assert result.kind == "model" and result.dtype == torch.float32
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    assert (logits(back) - logits(model)).abs().max().item() <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tok("color of apple ?")["input_ids"] == transformers.AutoTokenizer.from_pretrained(llama)(
        "color of apple ?")["input_ids"]
    assert tok.chat_template is not None


def test_bf16_export_writes_bf16_weights_and_config(llama, tmp_path):
    import transformers
    from safetensors import safe_open

    model = load_model(str(llama))
    tensors = trained(model)
    out = tmp_path / "bf16"
    HFExporter(llama, out, torch.bfloat16).write(tensors)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert back.dtype == torch.bfloat16
    ref = logits(model.to(torch.bfloat16))
    assert torch.allclose(logits(back), ref, atol=2e-2, rtol=2e-2)


def test_a_lora_job_becomes_a_peft_adapter(llama, tmp_path):
    import peft
    import transformers

    model = load_model(str(llama), lora=LORA)
    tensors = trained(model)
    assert is_lora(tensors) and not is_lora(trained(load_model(str(llama))))
    out = tmp_path / "adapter"
    result = HFExporter(llama, out).write(tensors, lora_alpha=16, lora_dropout=0.05)
    assert result.kind == "lora" and result.dtype == torch.float32
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(result.files)
    assert "config.json" not in result.files and "model.safetensors" not in result.files
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["lora_dropout"], sorted(cfg["target_modules"]), cfg["task_type"],
            cfg["base_model_name_or_path"]) == (4, 16, 0.05, ["q_proj", "v_proj"], "CAUSAL_LM", str(llama.resolve()))
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True)
    back = peft.PeftModel.from_pretrained(base, out)
    assert (logits(back) - logits(model)).abs().max().item() <= 1e-5
    assert (logits(back) - logits(transformers.AutoModelForCausalLM.from_pretrained(llama))).abs().max() > 1e-3


def test_lora_alpha_comes_from_the_job_file_section_or_a_flag(llama, tmp_path):
    tensors = trained(load_model(str(llama), lora=LORA))
    with pytest.raises(ShardlineConfigError, match="--lora-alpha"):
        HFExporter(llama, tmp_path / "a").write(tensors)
    res = HFExporter(llama, tmp_path / "b").write(tensors, lora=LORA)
    assert res.adapter_config["lora_alpha"] == 16 and res.adapter_config["lora_dropout"] == 0.0
    with pytest.raises(HFExportError, match=r"lora section \(r 8.*r 4"):
        HFExporter(llama, tmp_path / "c").write(tensors, lora=LoraSpec(r=8, alpha=16.0))
    with pytest.raises(ShardlineConfigError, match="no LoRA adapters"):
        HFExporter(llama, tmp_path / "d").write(trained(load_model(str(llama))), lora_alpha=16)


def test_tensors_of_another_model_are_refused_naming_the_first_mismatch(llama, tmp_path):
    wide = build_tiny_llama(tmp_path / "wide", hidden=64)
    tensors = trained(load_model(str(llama)))
    with pytest.raises(HFExportError, match=r"'model\.embed_tokens\.weight' is \[45, 48\].*has \[45, 64\]"):
        HFExporter(wide, tmp_path / "out1").write(tensors)
    deep = build_tiny_llama(tmp_path / "deep", layers=3)
    with pytest.raises(HFExportError, match=r"lack tensor 'model\.layers\.2\."):
        HFExporter(deep, tmp_path / "out2").write(tensors)
    with pytest.raises(HFExportError, match=r"have tensor 'extra\.weight'"):
        HFExporter(llama, tmp_path / "out3").write({**tensors, "extra.weight": torch.zeros(2)})
    # LoRA on a base of the same shapes but other weights: the frozen base gives it away
    other = build_tiny_llama(tmp_path / "other", seed=5)
    with pytest.raises(HFExportError, match=r"frozen base tensor 'model\.embed_tokens\.weight' differs"):
        HFExporter(other, tmp_path / "out4").write(trained(load_model(str(llama), lora=LORA)), lora_alpha=16)
    assert not any(p.name.startswith(("out", ".out")) for p in tmp_path.iterdir())  # nothing half-written


def test_a_bf16_lora_job_matches_its_fp32_source_at_bf16_precision(llama, tmp_path):
    tensors = trained(load_model(str(llama), "bfloat16", lora=LORA))
    res = HFExporter(llama, tmp_path / "bf16-lora").write(tensors, lora_alpha=16)
    assert res.kind == "lora"


def test_output_and_source_directories_are_checked_first(llama, tmp_path, monkeypatch):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ShardlineConfigError, match="not an empty directory"):
        HFExporter(llama, tmp_path / "full")
    with pytest.raises(ShardlineConfigError, match="not a directory"):
        HFExporter(tmp_path / "nowhere", tmp_path / "o")
    with pytest.raises(ShardlineConfigError, match="cannot load a model config"):
        HFExporter(tmp_path / "full", tmp_path / "o")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ShardlineConfigError, match=r"export --hf-dir needs transformers.*pip install 'shardline\[hf\]'"):
        HFExporter(llama, tmp_path / "o")


def test_a_flat_job_is_split_back_into_the_models_parameters(llama, tmp_path):
    """A job trained with flatten=True (one param group, as a job file trains) holds one flat tensor
    of every parameter in order: the export splits it back and loads like the named one; a flat
    tensor of another model or of several groups is refused, saying why."""
    import transformers

    from shardline.worker.flat_params import flat_layout

    model = load_model(str(llama))
    tensors = trained(model)
    group = {"param_names": [n for n, _ in model.named_parameters()], "params": [p for _, p in model.named_parameters()]}
    flat, = flat_layout([group])
    flat_tensors = {flat.name: flat.values()}
    HFExporter(llama, tmp_path / "out").write(flat_tensors)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert (logits(back) - logits(model)).abs().max().item() <= 1e-5
    assert torch.equal(back.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])

    deep = build_tiny_llama(tmp_path / "deep", layers=3)
    with pytest.raises(HFExportError, match=r"flat tensor 'flat0\.[0-9a-f]{12}' was not made from these parameters"):
        HFExporter(deep, tmp_path / "out2").write(flat_tensors)
    halves = [dict(group, param_names=group["param_names"][:3], params=group["params"][:3]),
              dict(group, param_names=group["param_names"][3:], params=group["params"][3:])]
    with pytest.raises(HFExportError, match="stores 2 flat parameter groups"):
        HFExporter(llama, tmp_path / "out3").write({f.name: f.values() for f in flat_layout(halves)})
