"""TinyGPT: a small GPT-style causal language model for the demo job and the tests.

Token + learned position embeddings, pre-LN blocks (causal self-attention through
``scaled_dot_product_attention(is_causal=True)``, then a GELU MLP), a final LayerNorm and an LM
head that is tied to the token embedding by default.

Initialization is deterministic: it draws from a private ``torch.Generator`` seeded with ``seed``,
never from the global RNG, so every rank that builds ``TinyGPT(..., seed=s)`` holds bit-identical
weights. The base weights do not depend on ``lora_rank``: a LoRA model and a full model built with
the same seed share their base weights, and LoRA adapters draw from a second generator.

With ``lora_rank > 0`` the attention and MLP projections are :class:`LoRALinear` modules (frozen
``weight``/``bias`` plus trainable ``lora_A``/``lora_B``; ``B`` starts at zero so the model's output
at init equals the base model's) and every non-LoRA parameter is frozen (``requires_grad=False``);
:func:`mark_only_lora_trainable` re-opens chosen groups (embeddings, norms, biases).

Parameter names are stable strings: ``tok_emb.weight``, ``pos_emb.weight``,
``blocks.{i}.ln1.weight``, ``blocks.{i}.attn.qkv.weight`` (no bias), ``blocks.{i}.attn.proj.*``,
``blocks.{i}.ln2.*``, ``blocks.{i}.mlp.fc.*``, ``blocks.{i}.mlp.proj.*``, ``ln_f.*``, and
``lm_head.weight`` when the head is untied; LoRA adds ``<linear>.lora_A`` / ``<linear>.lora_B``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyGPT", "LoRALinear", "mark_only_lora_trainable", "count_parameters", "LORA_EXTRA_GROUPS"]

# Groups of non-LoRA parameters that mark_only_lora_trainable can leave trainable.
LORA_EXTRA_GROUPS = ("embeddings", "norms", "biases", "head")


class LoRALinear(nn.Linear):
    """``nn.Linear`` with a low-rank adapter: ``y = x W^T + b + (x A^T B^T) * alpha / rank``.

    ``weight`` and ``bias`` keep their ``nn.Linear`` names (a full checkpoint loads into a LoRA model)
    and are frozen; ``lora_A`` (rank x in) starts random, ``lora_B`` (out x rank) starts at zero.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        if rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {rank!r}")
        self.rank = rank
        self.alpha = float(alpha)
        self.scaling = self.alpha / rank
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def reset_lora(self, generator: torch.Generator) -> None:
        # Same distribution as PEFT's kaiming_uniform_(a=sqrt(5)): U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        return out + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank={self.rank}, alpha={self.alpha:g}"


def _linear(d_in: int, d_out: int, lora_rank: int, lora_alpha: float, bias: bool = True) -> nn.Linear:
    if lora_rank > 0:
        return LoRALinear(d_in, d_out, lora_rank, lora_alpha, bias=bias)
    return nn.Linear(d_in, d_out, bias=bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, lora_rank: int, lora_alpha: float):
        super().__init__()
        self.n_heads = n_heads
        # No qkv bias: a key bias cannot change the softmax, so its gradient is zero up to float
        # round-off, and Adam would turn that noise into full-size steps (runs that sum gradients in
        # a different order, e.g. a parameter server's weighted mean, would then diverge there).
        self.qkv = _linear(d_model, 3 * d_model, lora_rank, lora_alpha, bias=False)
        self.proj = _linear(d_model, d_model, lora_rank, lora_alpha)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        h = self.n_heads
        q = q.view(b, t, h, c // h).transpose(1, 2)
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float, lora_rank: int, lora_alpha: float):
        super().__init__()
        self.fc = _linear(d_model, 4 * d_model, lora_rank, lora_alpha)
        self.proj = _linear(4 * d_model, d_model, lora_rank, lora_alpha)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float, lora_rank: int, lora_alpha: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout, lora_rank, lora_alpha)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout, lora_rank, lora_alpha)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small decoder-only transformer. ``forward(input_ids [B, T]) -> logits [B, T, vocab]``."""

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        max_seq_len: int,
        dropout: float = 0.0,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        *,
        tie_weights: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("n_layers", n_layers),
                            ("n_heads", n_heads), ("max_seq_len", max_seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"TinyGPT {name} must be a positive integer, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"TinyGPT d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"TinyGPT dropout must be in [0, 1), got {dropout!r}")
        if lora_rank < 0:
            raise ValueError(f"TinyGPT lora_rank must be >= 0, got {lora_rank!r}")
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.n_layers = n_layers
        self.n_heads = n_heads
        self.max_seq_len = max_seq_len
        self.lora_rank = lora_rank
        self.lora_alpha = float(lora_alpha)
        self.tie_weights = tie_weights
        self.seed = seed

        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, dropout, lora_rank, self.lora_alpha) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model)
        if tie_weights:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.reset_parameters(seed)
        if lora_rank > 0:
            mark_only_lora_trainable(self)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style init from ``seed``: N(0, 0.02) weights, residual projections scaled by
        1/sqrt(2 * n_layers), zero biases, unit LayerNorms. LoRA A/B come from a second stream."""
        g = torch.Generator().manual_seed(int(seed))
        std = 0.02
        resid_std = std / math.sqrt(2 * self.n_layers)
        self.tok_emb.weight.normal_(0.0, std, generator=g)
        self.pos_emb.weight.normal_(0.0, std, generator=g)
        for block in self.blocks:
            for ln in (block.ln1, block.ln2):
                ln.weight.fill_(1.0)
                ln.bias.zero_()
            for lin, s in ((block.attn.qkv, std), (block.attn.proj, resid_std),
                           (block.mlp.fc, std), (block.mlp.proj, resid_std)):
                lin.weight.normal_(0.0, s, generator=g)
                if lin.bias is not None:
                    lin.bias.zero_()
        self.ln_f.weight.fill_(1.0)
        self.ln_f.bias.zero_()
        if self.lm_head is not None:
            self.lm_head.weight.normal_(0.0, std, generator=g)
        lora_g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 7919)
        for module in self.modules():
            if isinstance(module, LoRALinear):
                module.reset_lora(lora_g)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.max_seq_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head)

    def config(self) -> dict:
        """The constructor arguments (without dropout), e.g. for logs and manifests."""
        return {
            "vocab_size": self.vocab_size, "d_model": self.d_model, "n_layers": self.n_layers,
            "n_heads": self.n_heads, "max_seq_len": self.max_seq_len, "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha, "tie_weights": self.tie_weights, "seed": self.seed,
        }


def _group_of(name: str) -> str:
    """Which LORA_EXTRA_GROUPS group a non-LoRA parameter belongs to ('' for LoRA-wrapped weights)."""
    if name.startswith(("tok_emb.", "pos_emb.")):
        return "embeddings"
    if name.startswith("lm_head."):
        return "head"
    leaf_module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf_module.startswith("ln") or name.startswith("ln_f."):
        return "norms"
    if name.endswith(".bias"):
        return "biases"
    return ""


def mark_only_lora_trainable(model: nn.Module, also_train: Iterable[str] = ()) -> int:
    """Freeze every parameter except LoRA adapters (``lora_A``/``lora_B``) and the groups named in
    ``also_train`` (any of ``embeddings``, ``norms``, ``biases``, ``head``; with tied weights the
    head is the token embedding). Returns the number of trainable elements."""
    extra = set(also_train)
    unknown = extra - set(LORA_EXTRA_GROUPS)
    if unknown:
        raise ValueError(f"unknown parameter group(s) {sorted(unknown)!r}; choose from {LORA_EXTRA_GROUPS}")
    trainable = 0
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        train = leaf in ("lora_A", "lora_B") or (_group_of(name) in extra and _group_of(name) != "")
        if name == "tok_emb.weight" and "head" in extra and getattr(model, "lm_head", 1) is None:
            train = True
        p.requires_grad_(train)
        if train:
            trainable += p.numel()
    return trainable


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
