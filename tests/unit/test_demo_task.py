"""The demo job: tokenizer and task data, TinyGPT and LoRA, the job-file schema, the training loop
and the progress display. Everything here runs in one process with torch.optim."""

from __future__ import annotations

import dataclasses
import io
import os
import threading

import pytest
import torch

from shardline.services.errors import ShardlineConfigError
from shardline.jobs.data.batch import IGNORE
from shardline.jobs.data.synthetic import (
    BOS, EOS, PAD, TOKENIZER, SFTTask, evaluate, generate, is_heldout, make_batch, masked_lm_loss,
    sample_answers,
)
from shardline.jobs.models.tinygpt import LoRALinear, TinyGPT, mark_only_lora_trainable
from shardline.jobs.runner import LocalOptimizer, make_local_optimizer, run_local, run_training
from shardline.jobs.spec import TrainSpec, load_job, parse_job
from shardline.jobs.workloads import build_model
from shardline.worker.progress import Progress, format_rate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASK = SFTTask("reverse", 1, 6, seed=3)

TINY = {
    "job": {"name": "tiny"},
    "model": {"d_model": 32, "n_layers": 1, "n_heads": 2},
    "task": {"kind": "reverse", "min_digits": 1, "max_digits": 4, "seed": 5},
    "train": {"steps": 40, "batch_size": 8, "optimizer": "adamw", "lr": 0.01, "eval_examples": 8,
              "sample_prompts": 2, "log_every": 10},
}


def tiny(**train) -> dict:
    d = {k: dict(v) for k, v in TINY.items()}
    d["train"].update(train)
    return d


# -- tokenizer and task ---------------------------------------------------------------------------

def test_tokenizer_round_trip_and_specials():
    text = "rev 0123456789=9876543210"
    ids = TOKENIZER.encode(text, bos=True, eos=True)
    assert ids[0] == BOS and ids[-1] == EOS and PAD not in ids
    assert TOKENIZER.decode(ids) == text
    assert TOKENIZER.decode(TOKENIZER.encode("12+345=357")) == "12+345=357"
    assert TOKENIZER.decode(ids[:3] + [EOS] + ids[3:]) == text[:2]  # stops at EOS
    assert len({PAD, BOS, EOS}) == 3 and TOKENIZER.vocab_size == 3 + len(TOKENIZER.CHARS)
    with pytest.raises(ValueError, match="'#'"):
        TOKENIZER.encode("rev #=")


@pytest.mark.parametrize("kind", ["reverse", "add"])
def test_task_answers_are_correct(kind):
    task = SFTTask(kind, 1, 5, seed=1)
    for i in range(50):
        prompt, answer = task.train_example(i)
        assert task.solve(prompt) == answer
        if kind == "reverse":
            assert answer == prompt[4:-1][::-1] and 1 <= len(answer) <= 5
        else:
            a, b = prompt[:-1].split("+")
            assert int(answer) == int(a) + int(b)


def test_loss_mask_counts_only_answer_tokens():
    batch = make_batch(TASK.seed, 0, 0, 1, 24, TASK)
    examples = [TASK.train_example(i) for i in range(24)]
    assert batch.input_ids.shape == batch.targets.shape == batch.loss_mask.shape
    assert batch.n_target_tokens == int(batch.loss_mask.sum()) == sum(len(a) + 1 for _, a in examples)
    for row, (prompt, answer) in enumerate(examples):
        p = TOKENIZER.encode(prompt, bos=True)
        seq = p + TOKENIZER.encode(answer, eos=True)
        n = len(seq) - 1
        assert batch.input_ids[row, :n].tolist() == seq[:-1]
        # Targets are the next token's label: IGNORE on prompt tokens and padding.
        assert batch.targets[row, :n].tolist() == [IGNORE] * (len(p) - 1) + seq[len(p):]
        assert (batch.input_ids[row, n:] == PAD).all() and (batch.targets[row, n:] == IGNORE).all()
        masked = batch.targets[row][batch.loss_mask[row]].tolist()
        assert masked == TOKENIZER.encode(answer, eos=True)  # the answer and EOS, nothing else
    # Lengths vary: the batch is padded to its longest sequence, shorter rows are padded.
    assert len({len(a) for _, a in examples}) > 3


def test_batches_are_deterministic_and_ranks_are_disjoint_shards():
    a = make_batch(7, 3, 1, 2, 8, TASK)
    b = make_batch(7, 3, 1, 2, 8, TASK)
    assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and a.n_target_tokens == b.n_target_tokens
    rows = lambda bt: {tuple(x[x != PAD].tolist()) for x in bt.input_ids}  # noqa: E731
    assert rows(make_batch(7, 4, 1, 2, 8, TASK)) != rows(a)  # another step
    assert rows(make_batch(8, 3, 1, 2, 8, TASK)) != rows(a)  # another seed
    r0, r1 = make_batch(7, 3, 0, 2, 8, TASK), make_batch(7, 3, 1, 2, 8, TASK)
    assert len(rows(r0) & rows(r1)) <= 1  # independent draws; short strings may collide by chance
    # The ranks' batches together are the global batch of one process with world_size * batch_size.
    whole = make_batch(7, 3, 0, 1, 16, TASK)
    assert [tuple(x[x != PAD].tolist()) for x in whole.input_ids] == \
        [tuple(x[x != PAD].tolist()) for x in torch.cat([
            torch.nn.functional.pad(r.input_ids, (0, whole.input_ids.shape[1] - r.input_ids.shape[1]))
            for r in (r0, r1)])]
    assert whole.n_target_tokens == r0.n_target_tokens + r1.n_target_tokens


def test_eval_prompts_are_held_out_of_training():
    train = {TASK.train_example(i)[0] for i in range(3000)}
    evals = [TASK.eval_example(i, 11)[0] for i in range(300)]
    long_evals = [p for p in evals if sum(c.isdigit() for c in p) >= 4]
    assert long_evals and all(is_heldout(p) for p in long_evals)
    assert not any(is_heldout(p) for p in train)
    assert not (set(long_evals) & train)


# -- model and LoRA -------------------------------------------------------------------------------

def make_model(**kw) -> TinyGPT:
    args = dict(vocab_size=TOKENIZER.vocab_size, d_model=32, n_layers=2, n_heads=4, max_seq_len=24, seed=3)
    args.update(kw)
    return TinyGPT(**args)


def test_model_init_is_deterministic_and_names_are_stable():
    a, b, c = make_model(), make_model(), make_model(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])
    names = [n for n, _ in a.named_parameters()]
    assert names[:2] == ["tok_emb.weight", "pos_emb.weight"]
    assert {"blocks.1.attn.qkv.weight", "blocks.1.mlp.proj.bias", "blocks.0.ln2.weight", "ln_f.bias"} <= set(names)
    assert "lm_head.weight" not in names  # tied by default
    assert "lm_head.weight" in dict(make_model(tie_weights=False).named_parameters())


def test_model_is_causal():
    model = make_model()
    x = torch.randint(3, TOKENIZER.vocab_size, (2, 12))
    y = x.clone()
    y[:, 8:] = (y[:, 8:] + 1) % TOKENIZER.vocab_size
    with torch.no_grad():
        assert torch.allclose(model(x)[:, :8], model(y)[:, :8], atol=1e-6)
        assert not torch.allclose(model(x)[:, 8:], model(y)[:, 8:])


def test_lora_freezes_base_and_starts_at_the_base_output():
    base, lora = make_model(), make_model(lora_rank=4, lora_alpha=8)
    x = make_batch(1, 0, 0, 1, 6, TASK).input_ids
    with torch.no_grad():
        torch.testing.assert_close(lora(x), base(x), rtol=0, atol=0)  # B = 0: the delta is exactly zero
    wrapped = [m for m in lora.modules() if isinstance(m, LoRALinear)]
    assert len(wrapped) == 2 * 4  # qkv, proj, fc, proj per block
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert all(m.lora_A.detach().abs().sum() > 0 and not m.lora_B.detach().any() for m in wrapped)
    # Base parameter names and values match the full model's: a full checkpoint loads into LoRA.
    full_state = base.state_dict()
    for name, value in lora.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(value, full_state[name]), name
    # Training moves the adapters only.
    frozen_before = {n: p.detach().clone() for n, p in lora.named_parameters() if not p.requires_grad}
    opt = LocalOptimizer(lora.named_parameters(), TrainSpec(lr=0.05))
    b = make_batch(1, 0, 0, 1, 6, TASK)
    for _ in range(2):
        opt.zero_grad()
        masked_lm_loss(lora(b.input_ids), b.targets, b.loss_mask).backward()
        opt.step(weight=b.n_target_tokens)
    assert all(torch.equal(p, frozen_before[n]) for n, p in lora.named_parameters() if not p.requires_grad)
    with torch.no_grad():
        assert not torch.allclose(lora(x), base(x))


def test_mark_only_lora_trainable_groups():
    lora = make_model(lora_rank=2)
    mark_only_lora_trainable(lora, ["embeddings", "norms"])
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert {"tok_emb.weight", "pos_emb.weight", "ln_f.weight", "blocks.0.ln1.bias"} <= trainable
    assert "blocks.0.attn.qkv.weight" not in trainable and "blocks.0.mlp.fc.bias" not in trainable
    assert "blocks.0.attn.qkv.bias" not in dict(lora.named_parameters())  # see CausalSelfAttention
    with pytest.raises(ValueError, match="bogus"):
        mark_only_lora_trainable(lora, ["bogus"])


def test_generate_and_evaluate_run_on_an_untrained_model():
    model = make_model(max_seq_len=TASK.max_seq_len())
    out = generate(model, "rev 123=", 4)
    assert isinstance(out, str) and len(out) <= 4
    acc = evaluate(model, 10, 0, TASK)
    assert 0.0 <= acc <= 1.0
    rows = sample_answers(model, ["rev 12=", "rev 9876="], TASK)
    assert [r["expected"] for r in rows] == ["21", "6789"]


# -- job files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["demo_job.yaml", "lora_job.yaml"])
def test_example_job_files_are_valid(name):
    spec = load_job(os.path.join(ROOT, "examples", name))
    assert spec.train.sync == "bsp" and spec.train.weight_by_tokens
    model = build_model(spec)
    assert model.max_seq_len >= spec.sft_task().max_seq_len()
    if name.startswith("lora"):
        assert spec.model.lora_rank > 0
        assert not model.blocks[0].attn.qkv.weight.requires_grad


def test_ssp_example_job_file_is_valid():
    spec = load_job(os.path.join(ROOT, "examples", "ssp_job.yaml"))
    assert (spec.train.sync, spec.train.staleness) == ("ssp", 1)


@pytest.mark.parametrize("mutate, pattern", [
    (lambda d: d["train"].update(lrr=0.1), r"train\.lrr.*unknown key 'lrr'.*did you mean 'lr'"),
    (lambda d: d.update(trian={}), r"unknown key 'trian'"),
    (lambda d: d["model"].update(flash=True), r"model\.flash"),
    (lambda d: d["train"].update(lr=-1), r"train\.lr: .*got -1"),
    (lambda d: d["train"].update(lr="fast"), r"train\.lr: .*got 'fast'"),
    (lambda d: d["train"].update(optimizer="lion"), r"train\.optimizer: .*'lion'"),
    (lambda d: d["train"].update(steps=2.5), r"train\.steps: .*2\.5"),
    (lambda d: d["train"].update(weight_by_tokens="yes"), r"train\.weight_by_tokens: .*'yes'"),
    (lambda d: d["train"].update(exact_restarts="no"), r"train\.exact_restarts: .*'no'"),
    (lambda d: d["train"].update(flatten=1), r"train\.flatten: .*1"),
    (lambda d: d["train"].update(betas=[0.9]), r"train\.betas: .*\[0\.9\]"),
    (lambda d: d["train"].update(sync="gossip"), r"train\.sync: .*'gossip'"),
    (lambda d: d["train"].update(sync="ssp"), r"train\.staleness: .*ssp needs staleness >= 1.*got 0"),
    (lambda d: d["train"].update(staleness=2), r"train\.staleness: only applies with train\.sync: ssp, got 2"),
    (lambda d: d["task"].update(kind="sort"), r"task\.kind: .*'sort'"),
    (lambda d: d["task"].update(min_digits=5), r"task\.min_digits: .*5"),
    (lambda d: d["model"].update(n_heads=3), r"model\.n_heads: .*3"),
    (lambda d: d["model"].update(max_seq_len=5), r"model\.max_seq_len: .*5"),
    (lambda d: d["model"].update(lora_also_train=["embeddings"]), r"model\.lora_also_train"),
    (lambda d: d["model"].update(lora_rank=4, lora_also_train=["everything"]), r"'everything'"),
    (lambda d: d["job"].update(name="a/b"), r"job\.name: .*'a/b'"),
    (lambda d: d.pop("job"), r"job: required"),
    (lambda d: d["job"].pop("name"), r"job\.name: required"),
])
def test_job_validation_errors_name_the_key(mutate, pattern):
    data = tiny()
    mutate(data)
    with pytest.raises(ShardlineConfigError, match=pattern):
        parse_job(data, source="t.yaml")


def test_job_yaml_text_and_number_strings():
    spec = parse_job("job: {name: x}\ntrain: {lr: 3e-3, steps: 5}\n")  # YAML 1.1 reads 3e-3 as a string
    assert spec.train.lr == pytest.approx(3e-3) and spec.train.steps == 5
    assert spec.model_kwargs()["max_seq_len"] == spec.sft_task().max_seq_len()
    assert spec.train.exact_restarts is True
    assert parse_job("job: {name: x}\ntrain: {exact_restarts: false}\n").train.exact_restarts is False
    assert spec.train.flatten is False and parse_job("job: {name: x}\ntrain: {flatten: true}\n").train.flatten is True
    with pytest.raises(ShardlineConfigError, match="not valid YAML"):
        parse_job("job: [unclosed")
    with pytest.raises(ShardlineConfigError, match="cannot read"):
        load_job("/nonexistent/job.yaml")


def test_lr_schedule():
    tr = TrainSpec(steps=100, lr=1.0, warmup_steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    assert tr.lr_at(0) == pytest.approx(0.1) and tr.lr_at(9) == pytest.approx(1.0)
    assert tr.lr_at(10) == pytest.approx(1.0) and tr.lr_at(99) == pytest.approx(0.1)
    assert TrainSpec(lr=0.5).lr_at(50) == 0.5 and not TrainSpec().has_schedule


# -- training -------------------------------------------------------------------------------------

def test_local_training_reduces_the_loss():
    spec = parse_job(tiny(steps=60))
    out = io.StringIO()
    result = run_training(spec, make_local_optimizer(spec.train), 0, 1, progress=Progress(60, stream=out, every=20))
    assert len(result.losses) == 60 and result.steps == 60
    first, last = sum(result.losses[:5]) / 5, sum(result.losses[-5:]) / 5
    assert last < 0.75 * first, (first, last)
    assert result.tokens > result.target_tokens > 0 and result.tokens_per_s > 0
    assert result.before_accuracy is not None and result.after_accuracy is not None
    assert len(result.before_samples) == len(result.after_samples) == 2
    assert out.getvalue().count("\n") == 3 and "step 60/60" in out.getvalue()
    summary = result.summary()
    assert "exact-match accuracy" in summary and "before  ->  after" in summary
    assert all(r["prompt"] in summary for r in result.after_samples)
    assert result.to_dict()["steps"] == 60


def test_non_lead_rank_skips_evaluation():
    spec = parse_job(tiny(steps=2))
    result = run_training(spec, make_local_optimizer(spec.train), 1, 2)
    assert result.rank == 1 and result.before_accuracy is None and result.after_samples is None
    with pytest.raises(ShardlineConfigError):
        run_training(spec, make_local_optimizer(spec.train), 2, 2)


def test_schedule_needs_an_optimizer_that_can_change_lr():
    spec = parse_job(tiny(steps=2, warmup_steps=1))

    class Fixed:
        def step(self, weight=None):
            pass

        def zero_grad(self):
            pass

    with pytest.raises(ShardlineConfigError, match="lr_schedule"):
        run_training(spec, lambda named: Fixed(), 0, 1)
    assert run_training(spec, make_local_optimizer(spec.train), 0, 1).steps == 2


class BSPGroup:
    """An in-process stand-in for the parameter server under BSP: each worker's step(weight) waits
    for all workers, the token-weighted mean gradient is applied once with torch.optim to a master
    copy, and every worker copies the master back (as a pull of v+1 would)."""

    def __init__(self, world_size: int, train: TrainSpec):
        self.world_size, self.train = world_size, train
        self.barrier = threading.Barrier(world_size, action=self._apply)
        self.lock = threading.Lock()
        self.master = None
        self.opt = None
        self.pending: list[tuple[float, dict]] = []
        self.weights_seen: list[float] = []

    def _apply(self):
        total = sum(w for w, _ in self.pending)
        for name, p in self.master.items():
            grads = [(w, g[name]) for w, g in self.pending if g.get(name) is not None]
            p.grad = sum(w * g for w, g in grads) / total if grads else None
        self.weights_seen.extend(w for w, _ in self.pending)
        self.opt.step()
        self.pending = []

    def factory(self, named):
        named = list(named)
        group = self
        with self.lock:
            if self.master is None:  # "rank 0 initializes the cluster" (all ranks init identically)
                self.master = {n: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                               for n, p in named}
                self.opt = LocalOptimizer(self.master.items(), self.train).optimizer

        class Worker:
            def zero_grad(self):
                for _, p in named:
                    p.grad = None

            def step(self, weight=None):
                grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in named}
                with group.lock:
                    group.pending.append((1.0 if weight is None else float(weight), grads))
                group.barrier.wait()
                with torch.no_grad():
                    for n, p in named:
                        p.copy_(group.master[n])

        return Worker()


@pytest.mark.parametrize("weight_by_tokens", [True, False])
def test_bsp_workers_match_the_single_process_reference(weight_by_tokens):
    spec = parse_job(tiny(steps=6, eval_examples=0, sample_prompts=0, weight_by_tokens=weight_by_tokens))
    group = BSPGroup(2, spec.train)
    results = [None, None]

    def work(rank):
        results[rank] = run_training(spec, group.factory, rank, 2)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(r is not None for r in results)
    reference = run_local(spec, world_size=2)
    ref_state = reference.model.state_dict()
    for rank in range(2):
        for name, value in results[rank].model.state_dict().items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-4, atol=1e-5, msg=name)
    expected_weights = [float(make_batch(5, 0, r, 2, 8, spec.sft_task()).n_target_tokens) if weight_by_tokens
                        else 1.0 for r in range(2)]
    assert sorted(group.weights_seen[:2]) == sorted(expected_weights)
    # With tokens as weights the reference is simply one process on the concatenated batch.
    if weight_by_tokens:
        concat = run_local(dataclasses.replace(spec, train=dataclasses.replace(spec.train, batch_size=16)), 1)
        for name, value in concat.model.state_dict().items():
            torch.testing.assert_close(value, ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


# -- progress display -----------------------------------------------------------------------------

def test_progress_tty_single_updating_line():
    out = io.StringIO()
    p = Progress(300, stream=out, tty=True, width=10, min_interval=0.0)
    p.update(1, loss=2.5, tokens_per_s=900, version=2)
    p.update(120, loss=1.2345, tokens_per_s=5600, version=121)
    assert out.getvalue().endswith("step 120/300 [====>     ] loss 1.234 tok/s 5.6k v121")
    p.update(300, loss=0.5)
    p.close()
    p.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") == 3
    assert "[==========] loss 0.500" in text


def test_progress_plain_lines_every_n_steps():
    out = io.StringIO()
    with Progress(25, stream=out, every=10) as p:
        for s in range(1, 26):
            p.update(s, loss=1.0)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["10/25", "20/25", "25/25"]
    assert out.getvalue().endswith("\n") and "\r" not in out.getvalue()


def test_progress_throttles_tty_redraws_and_formats_rates():
    out = io.StringIO()
    p = Progress(1000, stream=out, tty=True, min_interval=3600)
    for s in range(1, 1001):
        p.update(s)
    p.close()
    assert out.getvalue().count("\r") == 2  # the first draw and the (always drawn) last one
    assert [format_rate(x) for x in (12.34, 1234, 5_600_000, 2e9)] == ["12.3", "1.2k", "5.6M", "2.0G"]
