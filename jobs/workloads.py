"""A job's model paired with its data: what :mod:`shardline.jobs.runner` trains.

A workload holds the built model and answers ``examples_at(start, count)`` (global examples of its
data stream as ``(ids, labels)``, the same in every process; the length-balanced sampler of
:mod:`shardline.jobs.runner` reads a step's whole global batch with it), ``batch(step, rank,
world_size, batch_size)`` (rank ``rank``'s contiguous share of the step's global batch, collated, see
:mod:`shardline.jobs.data.batch`) and ``logits(input_ids)``. The built-in one also measures
exact-match accuracy and sample answers.

* :class:`SyntheticWorkload`: TinyGPT (optional LoRA) on the self-generated task.
* :class:`HFWorkload`: a local Hugging Face model (optional LoRA through peft) on a JSONL file.
"""

from __future__ import annotations

from typing import Any

import torch

from shardline.jobs.data.batch import Batch, collate
from shardline.jobs.data.synthetic import PAD, evaluate, make_batch, sample_answers, sample_prompts, train_examples
from shardline.jobs.models.tinygpt import TinyGPT, mark_only_lora_trainable
from shardline.jobs.spec import JobSpec

__all__ = ["Workload", "SyntheticWorkload", "HFWorkload", "build_workload", "build_model", "EVAL_SEED_OFFSET"]

EVAL_SEED_OFFSET = 7_777  # the eval stream's seed is task.seed + this


Example = tuple[list[int], list[int]]


class Workload:
    model: torch.nn.Module
    pad_id: int = 0

    def examples_at(self, start: int, count: int) -> list[Example]:
        raise NotImplementedError

    def collate(self, examples: list[Example]) -> Batch:
        return collate(examples, pad_id=self.pad_id)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Batch:
        raise NotImplementedError

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def evaluate(self) -> float | None:
        """Held-out accuracy, or None where the workload has no such measure."""
        return None

    def samples(self) -> list[dict] | None:
        return None


def build_model(spec: JobSpec) -> TinyGPT:
    """The built-in model, initialized from ``train.seed`` (identical on every rank), with LoRA
    trainability applied."""
    model = TinyGPT(**spec.model_kwargs())
    if spec.model.lora_rank > 0:
        mark_only_lora_trainable(model, spec.model.lora_also_train)
    return model


class SyntheticWorkload(Workload):
    pad_id = PAD

    def __init__(self, spec: JobSpec, lead: bool):
        self.task = spec.sft_task()
        self.model = build_model(spec)
        self.eval_examples = spec.train.eval_examples
        self.eval_seed = self.task.seed + EVAL_SEED_OFFSET
        self.prompts = sample_prompts(self.task, spec.train.sample_prompts, seed=self.eval_seed) if lead else []

    def examples_at(self, start: int, count: int) -> list[Example]:
        return train_examples(self.task, start, count)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Batch:
        return make_batch(self.task.seed, step, rank, world_size, batch_size, self.task)

    def evaluate(self) -> float:
        return evaluate(self.model, self.eval_examples, self.eval_seed, self.task)

    def samples(self) -> list[dict]:
        return sample_answers(self.model, self.prompts, self.task) if self.prompts else []


class HFWorkload(Workload):
    def __init__(self, spec: JobSpec):
        from shardline.jobs.data.jsonl import JsonlSFT
        from shardline.jobs.models.hf import load_model, load_tokenizer

        m, d = spec.model, spec.data
        self.tokenizer: Any = load_tokenizer(m.hf_path)
        self.data = JsonlSFT(d.path, d.format, d.max_length, d.seed, self.tokenizer)
        self.pad_id = self.data.pad_id
        self.model = load_model(m.hf_path, m.dtype, spec.lora, seed=spec.train.seed)

    def examples_at(self, start: int, count: int) -> list[Example]:
        return self.data.examples_at(start, count)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> Batch:
        return self.data.batch(step, rank, world_size, batch_size)

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Right padding only: a causal model never attends to it, so no attention mask is needed
        # (and none could be built from pad ids where pad is also EOS).
        return self.model(input_ids=input_ids, use_cache=False).logits.float()


def build_workload(spec: JobSpec, lead: bool = True) -> Workload:
    """The job's workload; ``lead``: this process measures accuracy and samples (rank 0)."""
    return HFWorkload(spec) if spec.model.is_hf else SyntheticWorkload(spec, lead)
