"""Fit a job's token-cost model on this machine: ``shardline fit-cost JOB_FILE``.

Length-balanced minibatches (``train: {balance: tokens, cost: {c0, c1, c2}}``) split each global
batch by ``c0 + c1·L + c2·L²`` seconds per sequence of L tokens. Every rank must use the same
coefficients (different ones give different splits), so the worker daemon takes them from the job
file; this fits them once, on a machine like the workers', by timing one forward and backward pass
of the job's own model per sequence length (``CostModel.measure``: the fastest of a few repeats),
and prints the ``cost:`` line to paste into the job file.
"""

from __future__ import annotations

import torch

from shardline.jobs.spec import JobSpec
from shardline.worker.balance import CostModel

LENGTH_POINTS = 6
MIN_LENGTH = 8


def measured_lengths(longest: int, points: int = LENGTH_POINTS) -> list[int]:
    """``points`` lengths spread evenly from MIN_LENGTH to ``longest`` (distinct, ascending)."""
    longest = max(int(longest), MIN_LENGTH + points)
    step = (longest - MIN_LENGTH) / (points - 1)
    return sorted({round(MIN_LENGTH + i * step) for i in range(points)})


def longest_sequence(spec: JobSpec) -> int:
    """The longest sequence the job trains on: data.max_length (Hugging Face) or the model's window."""
    if spec.model.is_hf:
        return int(spec.data.max_length)
    return int(spec.model_kwargs()["max_seq_len"])


def fit_cost(spec: JobSpec, *, repeats: int = 3, lengths: list[int] | None = None) -> tuple[CostModel, list[int]]:
    """Time the job's model on this machine and fit its cost model. Returns (model, lengths timed)."""
    from shardline.jobs.workloads import build_workload

    workload = build_workload(spec, lead=False)
    model = workload.model
    model.train()
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or getattr(model, "vocab_size"))
    generator = torch.Generator().manual_seed(0)
    lengths = lengths or measured_lengths(longest_sequence(spec))

    def forward_backward(length: int) -> None:
        ids = torch.randint(0, vocab, (1, length), generator=generator)
        workload.logits(ids).float().sum().backward()
        model.zero_grad(set_to_none=True)

    return CostModel.measure(forward_backward, lengths, repeats=repeats), lengths


def cost_line(cost: CostModel) -> str:
    """The job-file line for ``cost`` (``train.cost``)."""
    c = cost.as_dict()
    return f"cost: {{c0: {c['c0']:.6g}, c1: {c['c1']:.6g}, c2: {c['c2']:.6g}}}"
