"""Hugging Face causal LMs from a local ``save_pretrained`` directory, with optional LoRA (peft).

``transformers`` and ``peft`` are the optional extra ``shardline[hf]``; they are imported here, on
first use, so daemons and jobs without a Hugging Face model never load them. Nothing is fetched:
model and tokenizer load with ``local_files_only=True``.

With LoRA only the adapters are trainable; the frozen base goes to the cluster once, as
non-trainable tensors (rank 0 creates the job from them, the other ranks pull them once), and a
step then moves adapter gradients and adapter values only.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from shardline.services.errors import ShardlineConfigError

__all__ = ["DTYPES", "require_hf", "load_tokenizer", "load_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INSTALL_HINT = "pip install 'shardline[hf]'"


def require_hf(*modules: str, what: str = "a job with model.hf_path") -> list[Any]:
    """Import ``modules`` (default transformers and peft) or fail naming the extra to install;
    ``what`` names the feature that needs them."""
    out = []
    for name in modules or ("transformers", "peft"):
        try:
            out.append(importlib.import_module(name))
        except ImportError as exc:
            raise ShardlineConfigError(f"{what} needs {name}, which is not installed ({exc}); {INSTALL_HINT}") from None
    return out


def _quiet(transformers: Any) -> None:
    transformers.utils.logging.disable_progress_bar()


def load_tokenizer(path: str) -> Any:
    (transformers,) = require_hf("transformers")
    _quiet(transformers)
    try:
        return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ShardlineConfigError(f"model.hf_path: cannot load a tokenizer from {path!r}: {exc}") from None


def load_model(path: str, dtype: str = "float32", lora: Any = None, seed: int = 0) -> torch.nn.Module:
    """``AutoModelForCausalLM`` from ``path`` in ``dtype``; with ``lora`` (a LoraSpec: r, alpha,
    dropout, target_modules) wrapped by peft so that only the adapters train. Adapter init draws
    from a generator seeded with ``seed``: every rank builds the same adapters."""
    if dtype not in DTYPES:
        raise ShardlineConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    (transformers,) = require_hf("transformers")
    _quiet(transformers)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[dtype])
    except (OSError, ValueError) as exc:
        raise ShardlineConfigError(f"model.hf_path: cannot load a causal LM from {path!r}: {exc}") from None
    if lora is None:
        for p in model.parameters():
            p.requires_grad_(True)
        return model
    (peft,) = require_hf("peft")
    target = lora.target_modules
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             target_modules=list(target) if isinstance(target, tuple) else target,
                             task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = peft.get_peft_model(model, config)
        except ValueError as exc:  # e.g. target modules the model does not have
            raise ShardlineConfigError(f"lora: {exc}") from None
    return model
