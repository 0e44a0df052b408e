"""Job files: the YAML schema a worker runs, and the training loop that runs it.

A job file has four sections; every key is optional except ``job.name``, unknown keys are errors
that name the key, and bad values are quoted in the error (``ShardlineConfigError``)::

    job:   {name: demo-reverse}
    model: {d_model: 128, n_layers: 2, n_heads: 4, max_seq_len: null, dropout: 0.0,
            tie_weights: true, vocab_size: null, lora_rank: 0, lora_alpha: 16,
            lora_also_train: []}            # with lora_rank > 0: embeddings | norms | biases | head
    task:  {kind: reverse, min_digits: 1, max_digits: 10, seed: 0}
    train: {steps: 300, batch_size: 16, optimizer: adamw, lr: 0.003, weight_decay: 0.0,
            betas: [0.9, 0.98], eps: 1.0e-8, momentum: 0.0, sync: bsp, staleness: 0,
            weight_by_tokens: true, eval_examples: 200, eval_every: 0, sample_prompts: 6,
            log_every: 10, seed: 0, lr_schedule: constant, warmup_steps: 0, min_lr_ratio: 0.1,
            replication: 0, on_worker_failure: wait, worker_lease_timeout: 30}

``train.batch_size`` is per worker. ``train.seed`` seeds the model init (the same on every rank),
``task.seed`` the data. :func:`run_training` is the per-rank loop; it takes a ``make_optimizer``
factory so the same loop drives a local ``torch.optim`` optimizer (:func:`make_local_optimizer`) or
a parameter-server ``PSOptimizer``.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import yaml

from shardline.services.errors import ShardlineConfigError
from shardline.worker.model import LORA_EXTRA_GROUPS, TinyGPT, count_parameters, mark_only_lora_trainable
from shardline.worker.tasks import (
    PAD, TASK_KINDS, TOKENIZER, SFTTask, evaluate, format_samples, make_batch, sample_answers,
    sample_prompts,
)

__all__ = [
    "JobSection", "ModelSpec", "TaskSpec", "TrainSpec", "JobSpec", "TrainResult", "LocalOptimizer",
    "load_job", "parse_job", "run_training", "run_local", "make_local_optimizer", "OPTIMIZERS", "SYNC_MODES",
    "LR_SCHEDULES",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
SYNC_MODES = ("bsp", "asp", "ssp")
LR_SCHEDULES = ("constant", "cosine", "linear")
log = logging.getLogger("shardline.worker")
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


# -- schema ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class JobSection:
    name: str


@dataclass(frozen=True)
class ModelSpec:
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    max_seq_len: int | None = None     # None: the task's longest sequence
    dropout: float = 0.0
    tie_weights: bool = True
    vocab_size: int | None = None      # None: the tokenizer's vocabulary
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_also_train: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaskSpec:
    kind: str = "reverse"
    min_digits: int = 1
    max_digits: int = 10
    seed: int = 0


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 300
    batch_size: int = 16
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    momentum: float = 0.0
    sync: str = "bsp"
    staleness: int = 0
    weight_by_tokens: bool = True
    eval_examples: int = 200
    eval_every: int = 0
    sample_prompts: int = 6
    log_every: int = 10
    seed: int = 0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    replication: int = 0                 # copies of every block; 0: the dispatcher's default
    on_worker_failure: str = "wait"      # or "fail": a lost rank fails the job
    worker_lease_timeout: float = 30.0

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The optimizer's hyperparameters, named as ``PSOptimizer``/``torch.optim`` name them."""
        if self.optimizer == "sgd":
            return {"optimizer": "sgd", "lr": self.lr, "momentum": self.momentum,
                    "weight_decay": self.weight_decay}
        return {"optimizer": self.optimizer, "lr": self.lr, "betas": tuple(self.betas), "eps": self.eps,
                "weight_decay": self.weight_decay}

    def lr_at(self, step: int) -> float:
        """Learning rate for 0-based ``step``: linear warmup, then constant / cosine / linear decay
        to ``lr * min_lr_ratio`` at the last step."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        span = max(self.steps - self.warmup_steps - 1, 1)
        frac = min(max(step - self.warmup_steps, 0) / span, 1.0)
        floor = self.lr * self.min_lr_ratio
        if self.lr_schedule == "cosine":
            return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.lr - (self.lr - floor) * frac

    @property
    def has_schedule(self) -> bool:
        return self.lr_schedule != "constant" or self.warmup_steps > 0


@dataclass(frozen=True)
class JobSpec:
    job: JobSection
    model: ModelSpec = field(default_factory=ModelSpec)
    task: TaskSpec = field(default_factory=TaskSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    source: str = "<job>"

    @property
    def name(self) -> str:
        return self.job.name

    def sft_task(self) -> SFTTask:
        t = self.task
        return SFTTask(t.kind, t.min_digits, t.max_digits, t.seed)

    def model_kwargs(self) -> dict[str, Any]:
        m = self.model
        return {
            "vocab_size": m.vocab_size or TOKENIZER.vocab_size, "d_model": m.d_model,
            "n_layers": m.n_layers, "n_heads": m.n_heads,
            "max_seq_len": m.max_seq_len or self.sft_task().max_seq_len(), "dropout": m.dropout,
            "lora_rank": m.lora_rank, "lora_alpha": m.lora_alpha, "tie_weights": m.tie_weights,
            "seed": self.train.seed,
        }

    def build_model(self) -> TinyGPT:
        """The job's model, initialized from ``train.seed`` (identical on every rank), with LoRA
        trainability applied."""
        model = TinyGPT(**self.model_kwargs())
        if self.model.lora_rank > 0:
            mark_only_lora_trainable(model, self.model.lora_also_train)
        return model

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        d["model"]["lora_also_train"] = list(self.model.lora_also_train)
        d["train"]["betas"] = list(self.train.betas)
        return d


# -- validation helpers ---------------------------------------------------------------------------

_REQUIRED = object()


def _err(source: str, path: str, msg: str) -> ShardlineConfigError:
    return ShardlineConfigError(f"{source}: {path}: {msg}")


def _int(lo: int | None = None, hi: int | None = None):
    def check(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected an integer, got {v!r}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ValueError(f"expected an integer {rng}, got {v!r}")
        return v
    return check


def _opt_int(lo: int):
    inner = _int(lo)
    return lambda v: None if v is None else inner(v)


def _float(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False):
    def check(v: Any) -> float:
        raw = v
        if isinstance(v, str):  # YAML 1.1 reads "3e-3" as a string
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"expected a number, got {raw!r}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"expected a finite number, got {raw!r}")
        bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
        bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
        if bad_lo or bad_hi:
            left = "" if lo is None else ("(" if lo_open else "[") + f"{lo:g}"
            right = "" if hi is None else f"{hi:g}" + (")" if hi_open else "]")
            want = f"in {left}, {right}" if lo is not None and hi is not None else (
                f"{'>' if lo_open else '>='} {lo:g}" if lo is not None else f"{'<' if hi_open else '<='} {hi:g}")
            raise ValueError(f"expected a number {want}, got {raw!r}")
        return float(v)
    return check


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"expected true or false, got {v!r}")
    return v


def _choice(options: Sequence[str]):
    def check(v: Any) -> str:
        if v not in options:
            raise ValueError(f"expected one of {', '.join(options)}; got {v!r}")
        return v
    return check


def _job_name(v: Any) -> str:
    if not isinstance(v, str) or not _JOB_NAME.match(v):
        raise ValueError(f"expected 1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, got {v!r}")
    return v


def _betas(v: Any) -> tuple[float, float]:
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise ValueError(f"expected a list of two numbers in [0, 1), got {v!r}")
    check = _float(0.0, 1.0, hi_open=True)
    try:
        return (check(v[0]), check(v[1]))
    except ValueError:
        raise ValueError(f"expected a list of two numbers in [0, 1), got {v!r}") from None


def _groups(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or any(x not in LORA_EXTRA_GROUPS for x in v):
        raise ValueError(f"expected a list drawn from {', '.join(LORA_EXTRA_GROUPS)}; got {v!r}")
    return tuple(dict.fromkeys(v))


_SCHEMA: dict[str, tuple[type, dict[str, tuple[Callable[[Any], Any], Any]]]] = {
    "job": (JobSection, {"name": (_job_name, _REQUIRED)}),
    "model": (ModelSpec, {
        "d_model": (_int(1, 8192), ModelSpec.d_model),
        "n_layers": (_int(1, 64), ModelSpec.n_layers),
        "n_heads": (_int(1, 256), ModelSpec.n_heads),
        "max_seq_len": (_opt_int(1), None),
        "dropout": (_float(0.0, 1.0, hi_open=True), ModelSpec.dropout),
        "tie_weights": (_bool, ModelSpec.tie_weights),
        "vocab_size": (_opt_int(1), None),
        "lora_rank": (_int(0, 1024), ModelSpec.lora_rank),
        "lora_alpha": (_float(0.0, lo_open=True), ModelSpec.lora_alpha),
        "lora_also_train": (_groups, ()),
    }),
    "task": (TaskSpec, {
        "kind": (_choice(TASK_KINDS), TaskSpec.kind),
        "min_digits": (_int(1, 64), TaskSpec.min_digits),
        "max_digits": (_int(1, 64), TaskSpec.max_digits),
        "seed": (_int(0), TaskSpec.seed),
    }),
    "train": (TrainSpec, {
        "steps": (_int(1), TrainSpec.steps),
        "batch_size": (_int(1, 1 << 20), TrainSpec.batch_size),
        "optimizer": (_choice(OPTIMIZERS), TrainSpec.optimizer),
        "lr": (_float(0.0, lo_open=True), TrainSpec.lr),
        "weight_decay": (_float(0.0), TrainSpec.weight_decay),
        "betas": (_betas, TrainSpec.betas),
        "eps": (_float(0.0, lo_open=True), TrainSpec.eps),
        "momentum": (_float(0.0, 1.0, hi_open=True), TrainSpec.momentum),
        "sync": (_choice(SYNC_MODES), TrainSpec.sync),
        "staleness": (_int(0), TrainSpec.staleness),
        "weight_by_tokens": (_bool, TrainSpec.weight_by_tokens),
        "eval_examples": (_int(0), TrainSpec.eval_examples),
        "eval_every": (_int(0), TrainSpec.eval_every),
        "sample_prompts": (_int(0, 100), TrainSpec.sample_prompts),
        "log_every": (_int(1), TrainSpec.log_every),
        "seed": (_int(0), TrainSpec.seed),
        "lr_schedule": (_choice(LR_SCHEDULES), TrainSpec.lr_schedule),
        "warmup_steps": (_int(0), TrainSpec.warmup_steps),
        "min_lr_ratio": (_float(0.0, 1.0), TrainSpec.min_lr_ratio),
        "replication": (_int(0, 16), TrainSpec.replication),
        "on_worker_failure": (_choice(("wait", "fail")), TrainSpec.on_worker_failure),
        "worker_lease_timeout": (_float(0.0, lo_open=True), TrainSpec.worker_lease_timeout),
    }),
}


def _unknown(source: str, path: str, key: Any, known: Iterable[str]) -> ShardlineConfigError:
    known = list(known)
    hint = difflib.get_close_matches(str(key), known, n=1)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    return _err(source, f"{path}.{key}" if path else str(key),
                f"unknown key {key!r} (known keys: {', '.join(known)}){extra}")


def _parse_section(source: str, name: str, raw: Any):
    cls, fields = _SCHEMA[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _err(source, name, f"expected a mapping, got {raw!r}")
    for key in raw:
        if key not in fields:
            raise _unknown(source, name, key, fields)
    values = {}
    for key, (check, default) in fields.items():
        if key not in raw:
            if default is _REQUIRED:
                raise _err(source, f"{name}.{key}", "required key is missing")
            values[key] = default
            continue
        try:
            values[key] = check(raw[key])
        except ValueError as exc:
            raise _err(source, f"{name}.{key}", str(exc)) from None
    return cls(**values)


def parse_job(data: dict | str, source: str = "<job>") -> JobSpec:
    """Validate a job given as a mapping or YAML text. Raises ShardlineConfigError."""
    if isinstance(data, str):
        try:
            data = yaml.safe_load(data)
        except yaml.YAMLError as exc:
            raise ShardlineConfigError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ShardlineConfigError(f"{source}: expected a mapping with sections {', '.join(_SCHEMA)}, got {data!r}")
    for key in data:
        if key not in _SCHEMA:
            raise _unknown(source, "", key, _SCHEMA)
    if "job" not in data:
        raise _err(source, "job", "required section is missing")
    sections = {name: _parse_section(source, name, data.get(name)) for name in _SCHEMA}
    spec = JobSpec(source=source, **sections)
    _cross_check(spec)
    return spec


def _cross_check(spec: JobSpec) -> None:
    s, m, t, tr = spec.source, spec.model, spec.task, spec.train
    if t.min_digits > t.max_digits:
        raise _err(s, "task.min_digits", f"must be <= task.max_digits ({t.max_digits!r}), got {t.min_digits!r}")
    if m.d_model % m.n_heads:
        raise _err(s, "model.n_heads", f"must divide model.d_model ({m.d_model!r}), got {m.n_heads!r}")
    need = spec.sft_task().max_seq_len()
    if m.max_seq_len is not None and m.max_seq_len < need:
        raise _err(s, "model.max_seq_len",
                   f"must be >= {need} (the longest {t.kind} sequence with {t.max_digits} digits), got {m.max_seq_len!r}")
    if m.vocab_size is not None and m.vocab_size < TOKENIZER.vocab_size:
        raise _err(s, "model.vocab_size", f"must be >= {TOKENIZER.vocab_size} (the tokenizer's), got {m.vocab_size!r}")
    if m.lora_also_train and m.lora_rank == 0:
        raise _err(s, "model.lora_also_train", f"only applies with model.lora_rank > 0, got {list(m.lora_also_train)!r}")
    if tr.warmup_steps > tr.steps:
        raise _err(s, "train.warmup_steps", f"must be <= train.steps ({tr.steps!r}), got {tr.warmup_steps!r}")
    if tr.staleness and tr.sync != "ssp":
        raise _err(s, "train.staleness", f"only applies with train.sync: ssp, got {tr.staleness!r}")


def load_job(path: str | os.PathLike) -> JobSpec:
    """Read and validate a job file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read job file {str(path)!r}: {exc.strerror}") from None
    return parse_job(text, source=os.path.basename(str(path)))


# -- optimizers -----------------------------------------------------------------------------------

class StepOptimizer(Protocol):
    def step(self, weight: float | None = None) -> Any: ...
    def zero_grad(self) -> Any: ...


NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


class LocalOptimizer:
    """A ``torch.optim`` optimizer with the ``step(weight=...)`` signature of ``PSOptimizer``
    (``weight`` is ignored: one process has nothing to average). Frozen parameters are left out."""

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], train: TrainSpec):
        params = [p for _, p in named_parameters if p.requires_grad]
        if not params:
            raise ShardlineConfigError("the model has no trainable parameters")
        if train.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(params, lr=train.lr, momentum=train.momentum,
                                             weight_decay=train.weight_decay)
        else:
            cls = torch.optim.AdamW if train.optimizer == "adamw" else torch.optim.Adam
            self.optimizer = cls(params, lr=train.lr, betas=tuple(train.betas), eps=train.eps,
                                 weight_decay=train.weight_decay)
        self.version = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self, weight: float | None = None) -> None:
        self.optimizer.step()
        self.version += 1

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def make_local_optimizer(train: TrainSpec) -> Callable[[NamedParams], LocalOptimizer]:
    """A ``make_optimizer`` factory for :func:`run_training` that trains in this process."""
    return lambda named_parameters: LocalOptimizer(named_parameters, train)


def _lr_setter(opt: Any) -> Callable[[float], None] | None:
    if hasattr(opt, "param_groups"):
        def set_groups(lr: float) -> None:
            for g in opt.param_groups:
                g["lr"] = lr
        return set_groups
    if callable(getattr(opt, "set_lr", None)):
        return opt.set_lr
    return None


# -- training -------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    job_name: str
    rank: int
    world_size: int
    steps: int
    losses: list[float]
    final_loss: float
    train_seconds: float
    tokens: int                 # non-padding input tokens this process trained on
    target_tokens: int          # answer tokens (the ones the loss counts)
    tokens_per_s: float
    n_params: int
    n_trainable: int
    before_accuracy: float | None = None   # the lead rank (rank 0) only
    after_accuracy: float | None = None
    before_samples: list[dict] | None = None
    after_samples: list[dict] | None = None
    accuracy_curve: list[tuple[int, float]] = field(default_factory=list)
    eval_seconds: float = 0.0
    start_step: int = 0                    # > 0: a resumed job (the steps before ran earlier)
    model: torch.nn.Module | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (everything but the model)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "model"}
        d["losses"] = list(self.losses)
        d["accuracy_curve"] = [list(x) for x in self.accuracy_curve]
        return d

    def summary(self) -> str:
        lines = [
            f"job {self.job_name}: {self.steps} steps on {self.world_size} worker(s), "
            f"final loss {self.final_loss:.4f}, {self.train_seconds:.1f} s, "
            f"{self.tokens_per_s:,.0f} tok/s (rank {self.rank})",
        ]
        if self.before_accuracy is not None and self.after_accuracy is not None:
            lines.append(f"exact-match accuracy on held-out examples: "
                         f"{100 * self.before_accuracy:.1f}% before -> {100 * self.after_accuracy:.1f}% after")
        table = format_samples(self.before_samples, self.after_samples)
        if table:
            lines.append(table)
        return "\n".join(lines)


EVAL_SEED_OFFSET = 7_777  # the eval stream's seed is task.seed + this


def run_training(job_spec: JobSpec, make_optimizer: Callable[[NamedParams], StepOptimizer], rank: int,
                 world_size: int, progress: Any = None) -> TrainResult:
    """Train rank ``rank`` of ``world_size`` on its shard of the job's data.

    Each step: ``zero_grad()``, forward/backward of the mean loss over this rank's answer tokens,
    then ``step(weight=n_target_tokens)`` (``weight=None`` unless ``train.weight_by_tokens``), so a
    parameter server's weighted mean of the ranks' gradients is the gradient of the concatenated
    batch. The model is built from ``train.seed`` on every rank; rank 0 also measures accuracy and
    sample answers before and after training. ``progress``: an object with
    ``update(step, loss=, tokens_per_s=, version=)`` (and optionally ``close()``), e.g.
    :class:`worker.progress.Progress`, or None.
    """
    if not isinstance(world_size, int) or world_size < 1 or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ShardlineConfigError(f"need 0 <= rank < world_size, got rank={rank!r} world_size={world_size!r}")
    return _train(job_spec, make_optimizer, [rank], world_size, progress)


def run_local(job_spec: JobSpec, world_size: int = 1, progress: Any = None,
              make_optimizer: Callable[[NamedParams], StepOptimizer] | None = None) -> TrainResult:
    """One process doing what ``world_size`` BSP workers do together: every step it trains on all
    ranks' batches with the parameter server's weighting (token-weighted or equal per rank), with
    ``torch.optim``. The reference the cluster must match."""
    if world_size < 1:
        raise ShardlineConfigError(f"world_size must be >= 1, got {world_size!r}")
    return _train(job_spec, make_optimizer or make_local_optimizer(job_spec.train),
                  list(range(world_size)), world_size, progress)


def _step_loss(model: torch.nn.Module, batches: list, weight_by_tokens: bool) -> torch.Tensor:
    """Σ_r w_r·mean_r / Σ_r w_r over the ranks' batches in one forward pass, where mean_r is the
    mean loss over rank r's answer tokens and w_r its token count (or 1)."""
    if len(batches) == 1:
        b = batches[0]
        ids, tgt, mask = b.input_ids, b.targets, b.loss_mask.float() / b.n_target_tokens
    else:
        t = max(b.input_ids.shape[1] for b in batches)
        pad = lambda x, v: F.pad(x, (0, t - x.shape[1]), value=v)  # noqa: E731
        w = [float(b.n_target_tokens) if weight_by_tokens else 1.0 for b in batches]
        ids = torch.cat([pad(b.input_ids, PAD) for b in batches])
        tgt = torch.cat([pad(b.targets, PAD) for b in batches])
        mask = torch.cat([pad(b.loss_mask.float(), 0.0) * (wr / sum(w) / b.n_target_tokens)
                          for b, wr in zip(batches, w)])
    logits = model(ids)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
    return (per_token * mask.reshape(-1)).sum()


def _train(spec: JobSpec, make_optimizer, ranks: list[int], world_size: int, progress: Any) -> TrainResult:
    tr = spec.train
    task = spec.sft_task()
    lead = 0 in ranks
    if spec.model.dropout > 0:
        torch.manual_seed(tr.seed * 1_000_003 + ranks[0])  # dropout masks differ per rank
    model = spec.build_model()
    n_params = count_parameters(model)
    n_trainable = count_parameters(model, trainable_only=True)
    eval_seed = task.seed + EVAL_SEED_OFFSET
    prompts = sample_prompts(task, tr.sample_prompts, seed=eval_seed) if lead else []

    result = TrainResult(job_name=spec.name, rank=ranks[0], world_size=world_size, steps=tr.steps, losses=[],
                         final_loss=float("nan"), train_seconds=0.0, tokens=0, target_tokens=0,
                         tokens_per_s=0.0, n_params=n_params, n_trainable=n_trainable, model=model)
    # The optimizer may replace the weights (a PSOptimizer of a resumed job pulls what the cluster
    # holds), so "before" is measured after it exists.
    opt = make_optimizer(list(model.named_parameters()))
    set_lr = _lr_setter(opt)
    if tr.has_schedule and set_lr is None:
        raise ShardlineConfigError(
            f"{spec.source}: train.lr_schedule: the optimizer {type(opt).__name__} cannot change its "
            f"learning rate (no param_groups or set_lr), so use lr_schedule: constant and warmup_steps: 0")
    t_eval = time.perf_counter()
    if lead:
        result.before_samples = sample_answers(model, prompts, task) if prompts else []
        result.before_accuracy = evaluate(model, tr.eval_examples, eval_seed, task)
        result.accuracy_curve.append((0, result.before_accuracy))
    result.eval_seconds += time.perf_counter() - t_eval
    model.train()
    train_seconds = 0.0
    # A resumed job continues where the cluster stopped: its step is the number of steps applied,
    # and step k trains on the same batches and lr as in an uninterrupted run.
    start = getattr(opt, "version", 0)
    start = start if isinstance(start, int) and start > 0 else 0
    result.start_step = min(start, tr.steps)
    if start:
        log.info("resuming job %s at step %d of %d", spec.name, min(start, tr.steps), tr.steps)
    try:
        for step in range(result.start_step, tr.steps):
            t0 = time.perf_counter()
            if tr.has_schedule:
                set_lr(tr.lr_at(step))
            batches = [make_batch(task.seed, step, r, world_size, tr.batch_size, task) for r in ranks]
            n_target = sum(b.n_target_tokens for b in batches)
            opt.zero_grad()
            loss = _step_loss(model, batches, tr.weight_by_tokens)
            loss.backward()
            opt.step(weight=float(n_target) if tr.weight_by_tokens else None)
            loss_value = float(loss.detach())
            train_seconds += time.perf_counter() - t0
            result.losses.append(loss_value)
            result.tokens += sum(int((b.input_ids != PAD).sum()) for b in batches)
            result.target_tokens += n_target
            if progress is not None:
                version = getattr(opt, "version", None)
                progress.update(step + 1, loss=loss_value, tokens_per_s=result.tokens / max(train_seconds, 1e-9),
                                version=version if isinstance(version, int) else step + 1)
            if lead and tr.eval_every and (step + 1) % tr.eval_every == 0 and step + 1 < tr.steps:
                t_eval = time.perf_counter()
                result.accuracy_curve.append((step + 1, evaluate(model, tr.eval_examples, eval_seed, task)))
                result.eval_seconds += time.perf_counter() - t_eval
    finally:
        close = getattr(progress, "close", None)
        if callable(close):
            close()

    result.train_seconds = train_seconds
    result.tokens_per_s = result.tokens / max(train_seconds, 1e-9)
    result.final_loss = result.losses[-1] if result.losses else float("nan")
    if lead:
        t_eval = time.perf_counter()
        result.after_samples = sample_answers(model, prompts, task) if prompts else []
        result.after_accuracy = evaluate(model, tr.eval_examples, eval_seed, task)
        result.accuracy_curve.append((tr.steps, result.after_accuracy))
        result.eval_seconds += time.perf_counter() - t_eval
    return result
