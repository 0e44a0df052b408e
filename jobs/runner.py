"""The per-rank training loop of a job (:mod:`shardline.jobs.spec`).

:func:`run_training` is the per-rank loop; it takes a ``make_optimizer`` factory so the same loop
drives a local ``torch.optim`` optimizer (:func:`make_local_optimizer`) or a parameter-server
``PSOptimizer``. :func:`run_local` is one process doing what ``world_size`` BSP workers do together:
the reference a cluster must match.

With ``train.balance: tokens`` every rank reads the step's whole global minibatch (the same
sequences on every rank: ``global_batch_size`` of them, default ``batch_size`` x world size, at
offset ``step`` x that in the data stream), splits it with :func:`shardline.worker.balance.plan_rank`
(the same split on every rank, no communication), backpropagates ``loss_scale`` x the summed loss
of each of its microbatches and steps with the plan's weight; a rank whose part is empty still steps
(it only commits). The PS's weighted mean is then the gradient of the whole minibatch's token mean.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from shardline.jobs.data.batch import IGNORE, Batch
from shardline.jobs.data.synthetic import format_samples
from shardline.jobs.models.tinygpt import count_parameters
from shardline.jobs.spec import JobSpec, TrainSpec
from shardline.jobs.workloads import Workload, build_workload
from shardline.services.errors import ShardlineConfigError
from shardline.worker.balance import RankPlan, plan_rank

__all__ = ["TrainResult", "LocalOptimizer", "run_training", "run_local", "make_local_optimizer", "balanced_plans"]

log = logging.getLogger("shardline.jobs")


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
    # Per step, this process's share of the work (what the balancing evens out): forward+backward
    # seconds (not the optimizer step, which includes waiting for the other ranks), input tokens
    # and the number of microbatches.
    compute_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_micro_batches: list[int] = field(default_factory=list)
    balance: str = "none"
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


def run_training(job_spec: JobSpec, make_optimizer: Callable[[NamedParams], StepOptimizer], rank: int,
                 world_size: int, progress: Any = None) -> TrainResult:
    """Train rank ``rank`` of ``world_size`` on its shard of the job's data.

    Each step: ``zero_grad()``, forward/backward of the mean loss over this rank's loss tokens,
    then ``step(weight=n_target_tokens)`` (``weight=None`` unless ``train.weight_by_tokens``), so a
    parameter server's weighted mean of the ranks' gradients is the gradient of the concatenated
    batch; with ``train.balance: tokens`` the rank's part of the balanced global minibatch instead
    (module docstring). The model is built from ``train.seed`` on every rank; rank 0 also measures accuracy and
    sample answers before and after training (the built-in task only). ``progress``: an object with
    ``update(step, loss=, tokens_per_s=, version=, tokens=)`` (``tokens``: the step's input tokens;
    optionally ``close()``), e.g. :class:`shardline.worker.progress.Progress`, or None.
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


def _token_losses(workload: Workload, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of the model's next-token predictions, flattened (0 where IGNORE)."""
    logits = workload.logits(input_ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")


def _step_loss(workload: Workload, batches: list[Batch], weight_by_tokens: bool) -> torch.Tensor:
    """Σ_r w_r·mean_r / Σ_r w_r over the ranks' batches in one forward pass, where mean_r is the
    mean loss over rank r's loss tokens and w_r their count (or 1)."""
    if len(batches) == 1:
        b = batches[0]
        ids, tgt, mask = b.input_ids, b.targets, b.loss_mask.float() / b.n_target_tokens
    else:
        t = max(b.input_ids.shape[1] for b in batches)
        pad = lambda x, v: F.pad(x, (0, t - x.shape[1]), value=v)  # noqa: E731
        w = [float(b.n_target_tokens) if weight_by_tokens else 1.0 for b in batches]
        ids = torch.cat([pad(b.input_ids, b.pad_id) for b in batches])
        tgt = torch.cat([pad(b.targets, IGNORE) for b in batches])
        mask = torch.cat([pad(b.loss_mask.float(), 0.0) * (wr / sum(w) / b.n_target_tokens)
                          for b, wr in zip(batches, w)])
    return (_token_losses(workload, ids, tgt) * mask.reshape(-1)).sum()


def _loss_tokens(labels: Sequence[int]) -> int:
    """Tokens of an example the loss counts: labels after the first that are not IGNORE."""
    return sum(1 for x in labels[1:] if x != IGNORE)


def balanced_plans(train: TrainSpec, examples: Sequence[tuple[Sequence[int], Sequence[int]]], ranks: Sequence[int],
                   world_size: int) -> dict[int, RankPlan]:
    """The plans of ``ranks`` for one global minibatch (``examples``, the same on every rank):
    :func:`plan_rank` with the job's cost model, method and microbatch bound. A sequence's length is
    its model input (``len(ids) - 1``); microbatches count padded tokens, as :func:`collate` pads."""
    lengths = [len(ids) - 1 for ids, _ in examples]
    loss_tokens = [_loss_tokens(labels) for _, labels in examples]
    return {r: plan_rank(lengths, world_size, r, loss_tokens=loss_tokens, cost=train.cost,
                         method=train.balance_method, micro_batch_tokens=train.micro_batch_tokens, padded=True)
            for r in ranks}


@dataclass
class _StepWork:
    loss: float            # the token-mean loss of what this process computed (nan: no loss tokens)
    weight: float | None   # what to pass to step(weight=...)
    tokens: int            # input tokens
    target_tokens: int     # loss tokens
    micro_batches: int


def _declare_weight(opt, weight: float | None) -> None:
    """A PSOptimizer pushing during backward sends the step's weight with it: declared before."""
    declare = getattr(opt, "set_step_weight", None)
    if weight is not None and callable(declare):
        declare(weight)


def _accumulating(opt, last: bool):
    """``opt.no_sync()`` around every backward of a step but the last (which pushes the sum)."""
    no_sync = getattr(opt, "no_sync", None)
    return contextlib.nullcontext() if last or not callable(no_sync) else no_sync()


def _naive_step(workload: Workload, tr: TrainSpec, step: int, ranks: list[int], world_size: int, opt) -> _StepWork:
    batches = [workload.batch(step, r, world_size, tr.batch_size) for r in ranks]
    n_target = sum(b.n_target_tokens for b in batches)
    weight = float(n_target) if tr.weight_by_tokens else None
    loss = _step_loss(workload, batches, tr.weight_by_tokens)
    _declare_weight(opt, weight)
    loss.backward()
    return _StepWork(float(loss.detach()), weight, sum(b.n_tokens for b in batches), n_target, 1)


def _balanced_step(workload: Workload, tr: TrainSpec, step: int, ranks: list[int], world_size: int,
                   opt) -> _StepWork:
    """Backpropagate this process's parts of the step's balanced global minibatch. One rank of a
    cluster backpropagates ``loss_scale * S_r`` (the PS takes the weighted mean); a process that
    runs every rank (``run_local``) applies the PS's mean itself, ``Σ_r w_r·loss_scale_r·S_r / Σ_r w_r``."""
    size = tr.global_batch(world_size)
    examples = workload.examples_at(step * size, size)
    plans = balanced_plans(tr, examples, ranks, world_size)
    total_weight = sum(p.weight for p in plans.values()) if len(ranks) == world_size else None
    weight = plans[ranks[0]].weight if total_weight is None else total_weight
    _declare_weight(opt, weight)
    loss_sum, tokens, n_mb = 0.0, 0, 0
    left = sum(len(plan.micro_batches) for plan in plans.values())
    for plan in plans.values():
        scale = plan.loss_scale if total_weight is None else plan.weight * plan.loss_scale / total_weight
        for mb in plan.micro_batches:
            b = workload.collate([examples[i] for i in mb])
            summed = (_token_losses(workload, b.input_ids, b.targets) * b.loss_mask.reshape(-1).float()).sum()
            left -= 1
            with _accumulating(opt, last=left == 0):
                (scale * summed).backward()
            loss_sum += float(summed.detach())
            tokens += b.n_tokens
            n_mb += 1
    target = sum(p.loss_tokens for p in plans.values())
    return _StepWork(loss_sum / target if target else float("nan"), weight, tokens, target, n_mb)


def _train(spec: JobSpec, make_optimizer, ranks: list[int], world_size: int, progress: Any) -> TrainResult:
    tr = spec.train
    lead = 0 in ranks
    torch.manual_seed(tr.seed * 1_000_003 + ranks[0])  # dropout masks differ per rank
    workload = build_workload(spec, lead)
    model = workload.model
    n_params = count_parameters(model)
    n_trainable = count_parameters(model, trainable_only=True)

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

    def measure(at_step: int, samples: str | None) -> None:
        t_eval = time.perf_counter()
        if samples is not None:
            setattr(result, samples, workload.samples())
        accuracy = workload.evaluate()
        if accuracy is not None:
            if samples == "before_samples":
                result.before_accuracy = accuracy
            elif samples == "after_samples":
                result.after_accuracy = accuracy
            result.accuracy_curve.append((at_step, accuracy))
        result.eval_seconds += time.perf_counter() - t_eval

    if lead:
        measure(0, "before_samples")
    model.train()
    train_seconds = 0.0
    # A resumed job continues where the cluster stopped: its step is the number of steps applied,
    # and step k trains on the same batches and lr as in an uninterrupted run.
    start = getattr(opt, "version", 0)
    start = start if isinstance(start, int) and start > 0 else 0
    result.start_step = min(start, tr.steps)
    if start:
        log.info("resuming job %s at step %d of %d", spec.name, min(start, tr.steps), tr.steps)
    compute_step = _balanced_step if tr.balanced else _naive_step
    result.balance = tr.balance
    try:
        for step in range(result.start_step, tr.steps):
            t0 = time.perf_counter()
            if tr.has_schedule:
                set_lr(tr.lr_at(step))
            opt.zero_grad()
            t_compute = time.perf_counter()
            work = compute_step(workload, tr, step, ranks, world_size, opt)
            result.compute_seconds.append(time.perf_counter() - t_compute)
            opt.step(weight=work.weight)
            loss_value, n_tokens = work.loss, work.tokens
            train_seconds += time.perf_counter() - t0
            result.losses.append(loss_value)
            result.tokens += n_tokens
            result.target_tokens += work.target_tokens
            result.step_tokens.append(n_tokens)
            result.step_micro_batches.append(work.micro_batches)
            if progress is not None:
                version = getattr(opt, "version", None)
                progress.update(step + 1, loss=loss_value, tokens_per_s=result.tokens / max(train_seconds, 1e-9),
                                version=version if isinstance(version, int) else step + 1, tokens=n_tokens)
            if lead and tr.eval_every and (step + 1) % tr.eval_every == 0 and step + 1 < tr.steps:
                measure(step + 1, None)
    finally:
        close = getattr(progress, "close", None)
        if callable(close):
            close()

    result.train_seconds = train_seconds
    result.tokens_per_s = result.tokens / max(train_seconds, 1e-9)
    result.final_loss = result.losses[-1] if result.losses else float("nan")
    if lead:
        measure(tr.steps, "after_samples")
    return result
