"""One job's optimizer: torch.optim's hyperparameters (SGD, Adam, AdamW), validated the way torch
validates them, with torch's defaults.

Shared by the PS, whose block optimizers step with them (ps_server/optimizer.py), and the worker,
which checks a PSOptimizer's arguments against them before the job is created.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy
import torch

from shardline.services.errors import ShardlineConfigError

__all__ = ["KINDS", "OptimizerConfig", "check_lr", "group_configs"]

KINDS = ("sgd", "adam", "adamw")

# torch.optim's constructor defaults in torch 2.13 (torch/optim/sgd.py, adam.py, adamw.py).
# tests/unit/test_optimizer.py checks them against torch.optim.<Opt>(params).defaults.
_SGD_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "momentum": 0.0,
    "dampening": 0.0,
    "weight_decay": 0.0,
    "nesterov": False,
    "maximize": False,
}
_ADAM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "amsgrad": False,
    "maximize": False,
}
_ADAMW_DEFAULTS: dict[str, Any] = {**_ADAM_DEFAULTS, "weight_decay": 1e-2}
_DEFAULTS = {"sgd": _SGD_DEFAULTS, "adam": _ADAM_DEFAULTS, "adamw": _ADAMW_DEFAULTS}

# Value an OptimizerConfig holds in the fields a kind does not use ("inert" fields). They are the
# dataclass defaults, so OptimizerConfig("sgd", lr=0.1) is valid and equality is meaningful.
_INERT_FOR_SGD: dict[str, Any] = {"betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False}
_INERT_FOR_ADAM: dict[str, Any] = {"momentum": 0.0, "dampening": 0.0, "nesterov": False}


def _real(name: str, value: Any) -> float:
    """A finite real number as a Python float, else ShardlineConfigError quoting name and value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ShardlineConfigError(f"Invalid {name} value: {value!r} (expected a real number)")
    f = float(value)
    if not math.isfinite(f):
        raise ShardlineConfigError(f"Invalid {name} value: {value!r} (must be finite)")
    return f


def _flag(name: str, value: Any) -> bool:
    if isinstance(value, (bool, numpy.bool_)):
        return bool(value)
    raise ShardlineConfigError(f"Invalid {name} value: {value!r} (expected a bool)")


def check_lr(lr: Any, name: str = "lr") -> float:
    lr = _real(name, lr)
    if lr < 0.0:
        raise ShardlineConfigError(f"Invalid learning rate: {name}={lr!r}")
    return lr


@dataclass(frozen=True)
class OptimizerConfig:
    """One job's optimizer: torch.optim's hyperparameters, validated the way torch validates them.

    Fields a kind does not use hold their dataclass default (SGD: ``betas``, ``eps``, ``amsgrad``;
    Adam/AdamW: ``momentum``, ``dampening``, ``nesterov``); setting them to anything else is an
    error. Construct with :meth:`from_kwargs` (fills torch's per-kind defaults) or directly
    (validated in ``__post_init__``; numeric fields are normalized to ``float``).
    """

    kind: str
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        kind = self.kind
        if not isinstance(kind, str) or kind.strip().lower() not in KINDS:
            raise ShardlineConfigError(
                f"Invalid optimizer kind: {kind!r} (expected one of {', '.join(KINDS)})"
            )
        kind = kind.strip().lower()
        setf = object.__setattr__
        setf(self, "kind", kind)

        # Same checks, same order and same wording as torch.optim's constructors.
        lr = check_lr(self.lr)
        momentum = _real("momentum", self.momentum)
        dampening = _real("dampening", self.dampening)
        nesterov = _flag("nesterov", self.nesterov)
        weight_decay = _real("weight_decay", self.weight_decay)
        eps = _real("eps", self.eps)
        amsgrad = _flag("amsgrad", self.amsgrad)
        maximize = _flag("maximize", self.maximize)
        betas = self.betas
        if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
            raise ShardlineConfigError(f"Invalid betas value: {betas!r} (expected a pair)")
        betas = (_real("betas[0]", betas[0]), _real("betas[1]", betas[1]))

        if kind == "sgd":
            if momentum < 0.0:
                raise ShardlineConfigError(f"Invalid momentum value: {momentum!r}")
            if weight_decay < 0.0:
                raise ShardlineConfigError(f"Invalid weight_decay value: {weight_decay!r}")
            if nesterov and (momentum <= 0 or dampening != 0):
                raise ShardlineConfigError(
                    "Nesterov momentum requires a momentum and zero dampening: "
                    f"nesterov=True, momentum={momentum!r}, dampening={dampening!r}"
                )
            inert = _INERT_FOR_SGD
        else:
            if not 0.0 <= eps:
                raise ShardlineConfigError(f"Invalid epsilon value: eps={eps!r}")
            if not 0.0 <= betas[0] < 1.0:
                raise ShardlineConfigError(f"Invalid beta parameter at index 0: {betas[0]!r}")
            if not 0.0 <= betas[1] < 1.0:
                raise ShardlineConfigError(f"Invalid beta parameter at index 1: {betas[1]!r}")
            if not 0.0 <= weight_decay:
                raise ShardlineConfigError(f"Invalid weight_decay value: {weight_decay!r}")
            inert = _INERT_FOR_ADAM

        values = {
            "lr": lr,
            "momentum": momentum,
            "dampening": dampening,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "betas": betas,
            "eps": eps,
            "amsgrad": amsgrad,
            "maximize": maximize,
        }
        for name, expected in inert.items():
            if values[name] != expected:
                raise ShardlineConfigError(
                    f"{name}={values[name]!r} is not a parameter of {kind} "
                    f"(leave it at {expected!r})"
                )
        for name, value in values.items():
            setf(self, name, value)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_kwargs(cls, kind: str, **kwargs: Any) -> "OptimizerConfig":
        """Build from torch.optim-style keyword arguments, filling torch's defaults for ``kind``.

        Accepted keywords: SGD ``lr, momentum, dampening, weight_decay, nesterov, maximize``;
        Adam/AdamW ``lr, betas, eps, weight_decay, amsgrad, maximize``. Anything else (including
        torch's implementation switches ``foreach``, ``fused``, ``capturable``, ``differentiable``)
        raises ShardlineConfigError.
        """
        if not isinstance(kind, str) or kind.strip().lower() not in KINDS:
            raise ShardlineConfigError(
                f"Invalid optimizer kind: {kind!r} (expected one of {', '.join(KINDS)})"
            )
        kind = kind.strip().lower()
        defaults = _DEFAULTS[kind]
        unknown = sorted(set(kwargs) - set(defaults))
        if unknown:
            bad = ", ".join(f"{k}={kwargs[k]!r}" for k in unknown)
            raise ShardlineConfigError(
                f"Unknown {kind} optimizer argument(s): {bad} "
                f"(accepted: {', '.join(sorted(defaults))})"
            )
        return cls(kind=kind, **{**defaults, **kwargs})

    @classmethod
    def from_proto(cls, spec: Any) -> "OptimizerConfig":
        """Build from a ``shardline.v1.OptimizerSpec``.

        proto3 cannot tell an unset field from zero, so every field is taken literally (no
        defaults are filled): producers must set them all, as :meth:`to_proto` does. Fields the
        kind does not use are ignored.
        """
        kind = spec.kind.strip().lower() if isinstance(spec.kind, str) else spec.kind
        values: dict[str, Any] = {
            "lr": spec.lr,
            "weight_decay": spec.weight_decay,
            "maximize": spec.maximize,
        }
        if kind == "sgd":
            values.update(momentum=spec.momentum, dampening=spec.dampening, nesterov=spec.nesterov)
        elif kind in ("adam", "adamw"):
            values.update(betas=(spec.beta1, spec.beta2), eps=spec.eps, amsgrad=spec.amsgrad)
        return cls(kind=kind, **values)

    # ------------------------------------------------------------------ views

    def to_proto(self) -> Any:
        """This config as a ``shardline.v1.OptimizerSpec`` (every field set)."""
        from shardline.services.pb import common_pb2

        return common_pb2.OptimizerSpec(
            kind=self.kind,
            lr=self.lr,
            momentum=self.momentum,
            dampening=self.dampening,
            nesterov=self.nesterov,
            weight_decay=self.weight_decay,
            beta1=self.betas[0],
            beta2=self.betas[1],
            eps=self.eps,
            amsgrad=self.amsgrad,
            maximize=self.maximize,
        )

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the matching torch.optim constructor (see :meth:`torch_class`)."""
        return {name: getattr(self, name) for name in _DEFAULTS[self.kind]}

    def torch_class(self) -> type:
        """``torch.optim.SGD``, ``torch.optim.Adam`` or ``torch.optim.AdamW``."""
        return {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[
            self.kind
        ]

    def replace(self, **changes: Any) -> "OptimizerConfig":
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)


def group_configs(spec: Any) -> list["OptimizerConfig"]:
    """A ``JobSpec``'s parameter groups as configs: its ``param_groups``, or its one ``optimizer``."""
    return [OptimizerConfig.from_proto(g) for g in spec.param_groups] or [OptimizerConfig.from_proto(spec.optimizer)]
