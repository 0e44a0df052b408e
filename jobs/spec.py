"""Job files: the YAML schema a worker runs.

A job file has up to six sections; every key is optional except ``job.name`` (and ``data.path``
when there is a data section), unknown keys are errors that name the key, and bad values are
quoted in the error (``ShardlineConfigError``). The built-in model and task::

    job:   {name: demo-reverse}
    model: {d_model: 128, n_layers: 2, n_heads: 4, max_seq_len: null, dropout: 0.0,
            tie_weights: true, vocab_size: null, lora_rank: 0, lora_alpha: 16,
            lora_also_train: []}            # with lora_rank > 0: embeddings | norms | biases | head
    task:  {kind: reverse, min_digits: 1, max_digits: 10, seed: 0}
    train: {steps: 300, batch_size: 16, optimizer: adamw, lr: 0.003, weight_decay: 0.0,
            betas: [0.9, 0.98], eps: 1.0e-8, momentum: 0.0, sync: bsp, staleness: 0,
            weight_by_tokens: true, eval_examples: 200, eval_every: 0, sample_prompts: 6,
            log_every: 10, seed: 0, lr_schedule: constant, warmup_steps: 0, min_lr_ratio: 0.1,
            replication: 0, on_worker_failure: wait, worker_lease_timeout: 30, compression: none,
            exact_restarts: true, replicate_gradients: null, flatten: false, balance: none, balance_method: kk,
            micro_batch_tokens: null, cost: null, global_batch_size: null}   # the last four only with balance: tokens

A Hugging Face model (a local ``save_pretrained`` directory; needs ``shardline[hf]``) trains on a
JSONL file instead, optionally through LoRA adapters (peft)::

    model: {hf_path: DIR, dtype: float32}   # or bfloat16; no other model key applies
    lora:  {r: 8, alpha: 16, dropout: 0.0, target_modules: null}   # null: peft's default for the model
    data:  {path: FILE.jsonl, format: prompt_completion, max_length: 512, seed: 0}   # or messages

Relative ``hf_path`` and ``data.path`` resolve against the job file's directory. ``train.batch_size``
is per worker. ``train.seed`` seeds the model init (the same on every rank), ``task.seed`` /
``data.seed`` the data order.

``train.balance: tokens`` balances each step's global minibatch (``global_batch_size`` sequences,
default ``batch_size`` x world size: the same sequences as without balancing) over the ranks by
the cost ``c0 + c1*L + c2*L**2`` of a sequence of ``L`` tokens (``cost: {c0, c1, c2}`` or
``[c0, c1, c2]``; default the token count), with ``balance_method`` (``kk`` Karmarkar-Karp or
``lpt``), and runs each rank's part in microbatches of at most ``micro_batch_tokens`` padded
tokens (null: one microbatch); see :mod:`shardline.worker.balance` and docs/jobs.md.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import yaml

from shardline.jobs.data.jsonl import FORMATS as DATA_FORMATS
from shardline.jobs.data.synthetic import TASK_KINDS, TOKENIZER, SFTTask
from shardline.jobs.models.tinygpt import LORA_EXTRA_GROUPS
from shardline.services.compression import COMPRESSIONS
from shardline.services.errors import ShardlineConfigError
from shardline.worker.balance import CostModel

__all__ = [
    "JobSection", "ModelSpec", "LoraSpec", "TaskSpec", "DataSpec", "TrainSpec", "JobSpec", "load_job",
    "parse_job", "OPTIMIZERS", "SYNC_MODES", "LR_SCHEDULES", "MODEL_DTYPES", "BALANCE_MODES", "BALANCE_METHODS",
]

OPTIMIZERS = ("sgd", "adam", "adamw")
SYNC_MODES = ("bsp", "asp", "ssp")
LR_SCHEDULES = ("constant", "cosine", "linear")
MODEL_DTYPES = ("float32", "bfloat16")
BALANCE_MODES = ("none", "tokens")
BALANCE_METHODS = ("kk", "lpt")
# The train keys that only apply with balance: tokens.
BALANCE_KEYS = ("balance_method", "micro_batch_tokens", "cost", "global_batch_size")
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
    hf_path: str | None = None         # a local Hugging Face directory instead of the built-in model
    dtype: str = "float32"             # the Hugging Face model's compute dtype

    @property
    def is_hf(self) -> bool:
        return self.hf_path is not None


# The keys of ModelSpec that describe the built-in TinyGPT (none applies with hf_path).
TINY_MODEL_KEYS = ("d_model", "n_layers", "n_heads", "max_seq_len", "dropout", "tie_weights", "vocab_size",
                   "lora_rank", "lora_alpha", "lora_also_train")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters (peft) on a Hugging Face model: only they train."""
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str | None = None   # None: peft's default for the architecture


@dataclass(frozen=True)
class DataSpec:
    """SFT examples from a JSONL file, tokenized with the model directory's tokenizer."""
    path: str
    format: str = "prompt_completion"
    max_length: int = 512
    seed: int = 0


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
    compression: str = "none"            # gradients on the wire: none | bf16 | sign (services/compression.py)
    exact_restarts: bool = True          # PSOptimizer(exact_restarts=): PS nodes keep each step's previous values
    # PSOptimizer(replicate_gradients=): replicas replay each step's gradient; None: the cluster
    # decides (replay for BSP/SSP on PS nodes of one build fingerprint), false: copies
    replicate_gradients: bool | None = None
    flatten: bool = False                # PSOptimizer(flatten=): each param group one tensor on the PS
    balance: str = "none"                # "tokens": length-balanced global minibatches
    balance_method: str = "kk"
    micro_batch_tokens: int | None = None   # None: a rank's whole part is one microbatch
    cost: CostModel | None = None        # None: the token count (CostModel.tokens())
    global_batch_size: int | None = None  # None: batch_size x world size

    @property
    def balanced(self) -> bool:
        return self.balance == "tokens"

    def global_batch(self, world_size: int) -> int:
        """Sequences in one step's global minibatch with balance: tokens."""
        return self.global_batch_size or self.batch_size * world_size

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
    lora: LoraSpec | None = None
    data: DataSpec | None = None
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        d["model"]["lora_also_train"] = list(self.model.lora_also_train)
        if self.lora is not None and isinstance(self.lora.target_modules, tuple):
            d["lora"]["target_modules"] = list(self.lora.target_modules)
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


def _path(v: Any) -> str:
    if not isinstance(v, str) or not v.strip() or "\0" in v:
        raise ValueError(f"expected a path, got {v!r}")
    return v


def _opt_path(v: Any) -> str | None:
    return None if v is None else _path(v)


def _target_modules(v: Any) -> tuple[str, ...] | str | None:
    if v is None or v == "all-linear":
        return v
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"expected a list of module names, all-linear or null, got {v!r}")
    return tuple(dict.fromkeys(v))


def _cost(v: Any) -> CostModel | None:
    if v is None:
        return None
    if v == "measure":
        raise ValueError("measure is not available to the worker daemon (every rank must use the same "
                         "coefficients): fit them once with `shardline fit-cost JOB_FILE` on a machine like the "
                         "workers' and give the {c0: .., c1: .., c2: ..} it prints, got 'measure'")
    try:
        return CostModel.from_config(v)
    except ShardlineConfigError as exc:
        raise ValueError(str(exc)) from None


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
        "hf_path": (_opt_path, None),
        "dtype": (_choice(MODEL_DTYPES), ModelSpec.dtype),
    }),
    "lora": (LoraSpec, {
        "r": (_int(1, 4096), LoraSpec.r),
        "alpha": (_float(0.0, lo_open=True), LoraSpec.alpha),
        "dropout": (_float(0.0, 1.0, hi_open=True), LoraSpec.dropout),
        "target_modules": (_target_modules, None),
    }),
    "data": (DataSpec, {
        "path": (_path, _REQUIRED),
        "format": (_choice(DATA_FORMATS), DataSpec.format),
        "max_length": (_int(2, 1 << 20), DataSpec.max_length),
        "seed": (_int(0), DataSpec.seed),
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
        "compression": (_choice(COMPRESSIONS), TrainSpec.compression),
        "exact_restarts": (_bool, TrainSpec.exact_restarts),
        "replicate_gradients": (lambda v: None if v is None else _bool(v), TrainSpec.replicate_gradients),
        "flatten": (_bool, TrainSpec.flatten),
        "balance": (_choice(BALANCE_MODES), TrainSpec.balance),
        "balance_method": (_choice(BALANCE_METHODS), TrainSpec.balance_method),
        "micro_batch_tokens": (_opt_int(1), None),
        "cost": (_cost, None),
        "global_batch_size": (_opt_int(1), None),
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


# Sections that may be absent altogether (JobSpec holds None for them).
_OPTIONAL_SECTIONS = ("lora", "data")


def parse_job(data: dict | str, source: str = "<job>", base_dir: str | os.PathLike | None = None) -> JobSpec:
    """Validate a job given as a mapping or YAML text. Relative paths resolve against ``base_dir``
    (the job file's directory; default: the working directory). Raises ShardlineConfigError."""
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
    sections = {name: _parse_section(source, name, data.get(name)) for name in _SCHEMA
                if name not in _OPTIONAL_SECTIONS or name in data}
    spec = JobSpec(source=source, **sections)
    _cross_check(spec, data)
    return _resolve_paths(spec, base_dir)


def _raw_keys(data: dict, section: str) -> list[str]:
    raw = data.get(section)
    return list(raw) if isinstance(raw, dict) else []


def _cross_check(spec: JobSpec, data: dict) -> None:
    s, m, t, tr = spec.source, spec.model, spec.task, spec.train
    if tr.warmup_steps > tr.steps:
        raise _err(s, "train.warmup_steps", f"must be <= train.steps ({tr.steps!r}), got {tr.warmup_steps!r}")
    if tr.staleness and tr.sync != "ssp":
        raise _err(s, "train.staleness", f"only applies with train.sync: ssp, got {tr.staleness!r}")
    if tr.sync == "ssp" and tr.staleness < 1:
        raise _err(s, "train.staleness", f"train.sync: ssp needs staleness >= 1 (0 is BSP: use sync: bsp), "
                                         f"got {tr.staleness!r}")
    if not tr.balanced:
        for key in _raw_keys(data, "train"):
            if key in BALANCE_KEYS:
                raise _err(s, f"train.{key}", f"only applies with train.balance: tokens, got {data['train'][key]!r}")
    elif not tr.weight_by_tokens:
        raise _err(s, "train.weight_by_tokens", "train.balance: tokens pushes with weight = each rank's loss tokens "
                                                "(so the mean is the whole minibatch's gradient), got False")
    if m.is_hf:
        for key in _raw_keys(data, "model"):
            if key in TINY_MODEL_KEYS:
                raise _err(s, f"model.{key}", f"describes the built-in model and does not apply with model.hf_path "
                                               f"({m.hf_path!r}), got {data['model'][key]!r}")
        if "task" in data:
            raise _err(s, "task", f"the built-in task does not apply with model.hf_path ({m.hf_path!r}); "
                                  f"give a data section, got {data['task']!r}")
        if spec.data is None:
            raise _err(s, "data", f"required with model.hf_path ({m.hf_path!r}): "
                                  f"{{path: FILE.jsonl, format: prompt_completion|messages}}")
        return
    if "dtype" in _raw_keys(data, "model"):
        raise _err(s, "model.dtype", f"only applies with model.hf_path, got {m.dtype!r}")
    if spec.lora is not None:
        raise _err(s, "lora", f"only applies with model.hf_path (the built-in model takes model.lora_rank), "
                              f"got {data['lora']!r}")
    if spec.data is not None:
        raise _err(s, "data", f"only applies with model.hf_path (whose tokenizer reads it), got {data['data']!r}")
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


def _resolve_paths(spec: JobSpec, base_dir: str | os.PathLike | None) -> JobSpec:
    """Absolute hf_path and data.path, checked to exist (a missing one is named before any import)."""
    if not spec.model.is_hf:
        return spec
    base = os.path.abspath(base_dir if base_dir is not None else os.getcwd())
    resolve = lambda p: os.path.normpath(os.path.join(base, os.path.expanduser(p)))  # noqa: E731
    hf_path, data_path = resolve(spec.model.hf_path), resolve(spec.data.path)
    if not os.path.isfile(os.path.join(hf_path, "config.json")):
        what = "is not a directory" if not os.path.isdir(hf_path) else "has no config.json (not a save_pretrained directory)"
        raise _err(spec.source, "model.hf_path", f"{hf_path} {what}, got {spec.model.hf_path!r}")
    if not os.path.isfile(data_path):
        raise _err(spec.source, "data.path", f"{data_path} is not a file, got {spec.data.path!r}")
    return replace(spec, model=replace(spec.model, hf_path=hf_path), data=replace(spec.data, path=data_path))


def load_job(path: str | os.PathLike) -> JobSpec:
    """Read and validate a job file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read job file {str(path)!r}: {exc.strerror}") from None
    return parse_job(text, source=os.path.basename(str(path)), base_dir=os.path.dirname(os.path.abspath(path)))


