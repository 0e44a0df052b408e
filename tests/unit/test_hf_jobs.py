"""Hugging Face jobs in one process: the job-file schema of model.hf_path / lora / data, the JSONL
data pipeline (labels, truncation, chat template, order, shards) and the models (full, LoRA, bf16).
The model and tokenizer are built locally by tests/hf_fixtures.py; nothing is downloaded."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from hf_fixtures import build_tiny_llama, messages_records, prompt_completion_records, write_jsonl
from shardline.jobs.data.batch import IGNORE
from shardline.jobs.data.jsonl import JsonlSFT, tokenize_messages, tokenize_prompt_completion
from shardline.jobs.models.hf import load_tokenizer, require_hf
from shardline.jobs.runner import run_local
from shardline.jobs.spec import load_job, parse_job
from shardline.jobs.workloads import HFWorkload
from shardline.services.errors import ShardlineConfigError


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    build_tiny_llama(root / "llama")
    write_jsonl(root / "pc.jsonl", prompt_completion_records(40))
    write_jsonl(root / "chat.jsonl", messages_records(24))
    return root


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    return load_tokenizer(str(hf_dir / "llama"))


def job(**sections) -> dict:
    d = {"job": {"name": "hf-unit"}, "model": {"hf_path": "llama"},
         "data": {"path": "pc.jsonl", "max_length": 32},
         "train": {"steps": 4, "batch_size": 4, "lr": 0.01}}
    for name, value in sections.items():
        if value is None:
            d.pop(name, None)
        else:
            d[name] = value
    return d


def rows(batch) -> list[tuple[int, ...]]:
    return [tuple(x[:n].tolist()) for x, n in zip(batch.input_ids, (batch.input_ids != batch.pad_id).sum(1))]


# -- data -----------------------------------------------------------------------------------------

def test_prompt_completion_labels_only_the_completion_and_eos(tokenizer):
    ids, labels = tokenize_prompt_completion(tokenizer, "color of apple ?", "red")
    words = tokenizer.convert_ids_to_tokens(ids)
    assert words == ["color", "of", "apple", "?", "red", "</s>"]
    assert labels == [IGNORE] * 4 + ids[4:]


def test_batches_mask_prompt_and_padding_and_shift_by_one(hf_dir, tokenizer):
    data = JsonlSFT(str(hf_dir / "pc.jsonl"), "prompt_completion", 32, 0, tokenizer)
    b = data.batch(0, 0, 1, 6)
    assert b.n_target_tokens == int(b.loss_mask.sum()) == 6 * 2     # completion word + EOS per example
    assert ((b.targets == IGNORE) == ~b.loss_mask).all()
    for i in range(6):
        ids, labels = data.examples[data.index(i)]
        n = len(ids) - 1
        assert b.input_ids[i, :n].tolist() == ids[:-1] and b.targets[i, :n].tolist() == labels[1:]
        assert (b.input_ids[i, n:] == tokenizer.pad_token_id).all() and (b.targets[i, n:] == IGNORE).all()
    assert b.n_tokens == sum(len(data.examples[data.index(i)][0]) - 1 for i in range(6))


def test_truncation_to_max_length_and_examples_left_without_loss_are_dropped(tmp_path, tokenizer, caplog):
    long_prompt = " ".join(["color"] * 10) + " of apple ?"
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": long_prompt, "completion": "red red red"},
                                              {"prompt": "color of sky ?", "completion": "blue"}])
    data = JsonlSFT(str(path), "prompt_completion", 14, 0, tokenizer)
    assert len(data) == 2 and max(len(ids) for ids, _ in data.examples) == 14
    ids, labels = data.examples[0]
    assert labels[-1] != IGNORE and labels[:13] == [IGNORE] * 13     # truncated inside the completion
    with caplog.at_level("WARNING"):
        short = JsonlSFT(str(path), "prompt_completion", 8, 0, tokenizer)
    assert len(short) == 1 and "1 example(s) dropped" in caplog.text   # its completion was cut away
    with pytest.raises(ShardlineConfigError, match="no example keeps a completion token"):
        JsonlSFT(str(path), "prompt_completion", 3, 0, tokenizer)


def test_messages_use_the_chat_template_and_label_every_assistant_turn(tokenizer):
    msgs = messages_records(1, seed=4)[0]["messages"]
    ids, labels = tokenize_messages(tokenizer, msgs)
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert text.startswith("<|system|> you are a helpful model <|user|> color of")
    labeled = [tokenizer.convert_ids_to_tokens(t) for t, lab in zip(ids, labels) if lab != IGNORE]
    assert labeled == [msgs[2]["content"], "</s>", msgs[4]["content"], "</s>"]
    assert all(lab in (IGNORE, t) for t, lab in zip(ids, labels))


def test_a_template_that_does_not_render_turn_by_turn_is_refused(tokenizer):
    import copy

    odd = copy.copy(tokenizer)
    odd.chat_template = "{% for m in messages|reverse %}{{ m['content'] + ' ' }}{% endfor %}"
    with pytest.raises(ShardlineConfigError, match="turn by turn"):
        tokenize_messages(odd, messages_records(1)[0]["messages"])


def test_bad_lines_are_named_with_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "color of sky ?", "completion": "blue"}\n\n{"prompt": 3}\n')
    with pytest.raises(ShardlineConfigError, match=r"bad\.jsonl:3: format prompt_completion needs .*\{\"prompt\": 3\}"):
        JsonlSFT(str(path), "prompt_completion", 32, 0, tokenizer)
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ShardlineConfigError, match=r"bad\.jsonl:1: no assistant message"):
        JsonlSFT(str(path), "messages", 32, 0, tokenizer)
    path.write_text('not json\n')
    with pytest.raises(ShardlineConfigError, match=r"bad\.jsonl:1: not valid JSON"):
        JsonlSFT(str(path), "messages", 32, 0, tokenizer)


def test_order_is_a_seeded_shuffle_per_epoch(hf_dir, tokenizer):
    a = JsonlSFT(str(hf_dir / "pc.jsonl"), "prompt_completion", 32, 3, tokenizer)
    b = JsonlSFT(str(hf_dir / "pc.jsonl"), "prompt_completion", 32, 3, tokenizer)
    c = JsonlSFT(str(hf_dir / "pc.jsonl"), "prompt_completion", 32, 4, tokenizer)
    n = len(a)
    order = [a.index(g) for g in range(3 * n)]
    assert order == [b.index(g) for g in range(3 * n)]
    assert order[:n] != [c.index(g) for g in range(n)] and order[:n] != list(range(n))
    for e in range(3):  # every epoch is a permutation, and epochs differ
        assert sorted(order[e * n:(e + 1) * n]) == list(range(n))
    assert order[:n] != order[n:2 * n]
    assert all(torch.equal(x, y) for x, y in zip(a.batch(5, 1, 2, 4)[:3], b.batch(5, 1, 2, 4)[:3]))


@pytest.mark.parametrize("world_size,batch_size", [(2, 4), (3, 5)])
def test_rank_shares_are_exactly_the_global_batch(hf_dir, tokenizer, world_size, batch_size):
    data = JsonlSFT(str(hf_dir / "chat.jsonl"), "messages", 64, 1, tokenizer)
    for step in (0, 3):  # step 3 crosses an epoch boundary (24 examples)
        whole = data.batch(step, 0, 1, world_size * batch_size)
        shares = [data.batch(step, r, world_size, batch_size) for r in range(world_size)]
        assert [row for s in shares for row in rows(s)] == rows(whole)
        assert sum(s.n_target_tokens for s in shares) == whole.n_target_tokens


# -- schema ---------------------------------------------------------------------------------------

def test_relative_paths_resolve_against_the_job_file(hf_dir, tmp_path, monkeypatch):
    import yaml

    path = hf_dir / "job.yaml"
    path.write_text(yaml.safe_dump(job()))
    monkeypatch.chdir(tmp_path)
    spec = load_job(path)
    assert spec.model.hf_path == str(hf_dir / "llama") and spec.data.path == str(hf_dir / "pc.jsonl")
    assert spec.lora is None and spec.model.dtype == "float32" and spec.data.format == "prompt_completion"
    assert spec.to_dict()["data"]["path"] == str(hf_dir / "pc.jsonl")


@pytest.mark.parametrize("change,where,quoted", [
    ({"model": {"hf_path": "llama", "d_model": 64}}, "model.d_model", "64"),
    ({"model": {"hf_path": "llama", "lora_rank": 8}}, "model.lora_rank", "8"),
    ({"model": {"hf_path": "llama", "dtype": "float16"}}, "model.dtype", "'float16'"),
    ({"model": {"hf_path": "nowhere"}}, "model.hf_path", "'nowhere'"),
    ({"model": {"hf_path": "pc.jsonl"}}, "model.hf_path", "'pc.jsonl'"),
    ({"model": {"hf_path": 7}}, "model.hf_path", "7"),
    ({"task": {"kind": "reverse"}}, "task", "'kind': 'reverse'"),
    ({"data": None}, "data", "required with model.hf_path"),
    ({"data": {"format": "messages"}}, "data.path", "required key is missing"),
    ({"data": {"path": "missing.jsonl"}}, "data.path", "'missing.jsonl'"),
    ({"data": {"path": "pc.jsonl", "format": "chat"}}, "data.format", "'chat'"),
    ({"data": {"path": "pc.jsonl", "max_length": 1}}, "data.max_length", "1"),
    ({"lora": {"r": 0}}, "lora.r", "0"),
    ({"lora": {"rank": 4}}, "lora.rank", "unknown key 'rank'"),
    ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules", "'q_proj'"),
    ({"lora": {"dropout": 1.0}}, "lora.dropout", "1.0"),
    ({"model": {"d_model": 32, "n_heads": 2}, "data": None, "lora": {"r": 4}}, "lora", "{'r': 4}"),
    ({"model": {"d_model": 32, "n_heads": 2}, "data": {"path": "pc.jsonl"}}, "data", "only applies with model.hf_path"),
    ({"model": {"dtype": "bfloat16"}, "data": None}, "model.dtype", "'bfloat16'"),
])
def test_schema_errors_name_the_key_and_quote_the_value(hf_dir, change, where, quoted):
    with pytest.raises(ShardlineConfigError) as info:
        parse_job(job(**change), source="j.yaml", base_dir=hf_dir)
    msg = str(info.value)
    assert msg.startswith(f"j.yaml: {where}"), msg
    assert quoted in msg, msg


def test_a_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError
    with pytest.raises(ShardlineConfigError, match=r"needs peft.*pip install 'shardline\[hf\]'"):
        require_hf()


# -- models ---------------------------------------------------------------------------------------

def test_full_fine_tune_trains_every_parameter_and_the_loss_falls(hf_dir):
    spec = parse_job(job(train={"steps": 25, "batch_size": 4, "lr": 0.01}), base_dir=hf_dir)
    res = run_local(spec, world_size=2)
    assert res.n_trainable == res.n_params
    assert res.losses[-1] < 0.6 * res.losses[0], res.losses
    assert res.before_accuracy is None and res.summary()


def test_lora_trains_only_the_adapters_and_leaves_the_base_alone(hf_dir):
    spec = parse_job(job(lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
                         train={"steps": 6, "batch_size": 4, "lr": 0.03}), base_dir=hf_dir)
    base = {n: p.detach().clone() for n, p in HFWorkload(spec).model.named_parameters()}
    res = run_local(spec)
    named = dict(res.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all("q_proj" in n or "v_proj" in n for n in trainable)
    # r x in + out x r per adapted projection: 2 layers x (q: 4*48 + 48*4, v: 4*48 + 24*4)
    assert res.n_trainable == sum(named[n].numel() for n in trainable) == 2 * (384 + 288)
    for n, p in named.items():   # the same adapter init on every build (seeded), the base unchanged
        assert torch.equal(p, base[n]) != (n in trainable), n


def test_bfloat16_runs_the_model_in_bf16(hf_dir):
    spec = parse_job(job(model={"hf_path": "llama", "dtype": "bfloat16"}, train={"steps": 3, "batch_size": 2}),
                     base_dir=hf_dir)
    res = run_local(spec)
    assert {p.dtype for p in res.model.parameters()} == {torch.bfloat16}
    assert all(math.isfinite(x) for x in res.losses), res.losses


def test_the_example_job_file_is_valid_next_to_a_model(hf_dir, tmp_path):
    import shutil

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shutil.copy(os.path.join(root, "examples", "hf_sft_job.yaml"), tmp_path / "job.yaml")
    os.symlink(hf_dir / "llama", tmp_path / "hf-model")
    shutil.copy(hf_dir / "chat.jsonl", tmp_path / "sft.jsonl")
    spec = load_job(tmp_path / "job.yaml")
    assert spec.model.dtype == "bfloat16" and spec.data.format == "messages" and spec.lora.r == 16
    workload = HFWorkload(spec)
    trainable = [n for n, p in workload.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 4 * 2  # 2 layers x 4 projections x (A, B)
    assert workload.batch(0, 1, 2, 4).n_target_tokens > 0
