"""Server-side optimizers: SGD (momentum, Nesterov), Adam and AdamW applied to one block at a time.

A PS node stores each tensor as blocks (contiguous 1-D float32 slices of the flattened tensor) and
keeps optimizer state per block. Every update here is element-wise, so stepping the blocks of a
tensor one by one with per-block state gives the same result as stepping the whole tensor.

Numerics follow ``torch.optim``'s single-tensor implementations (``foreach=False``: the
``_single_tensor_sgd`` / ``_single_tensor_adam`` functions of torch 2.13) operation for operation,
with the same Python-double scalar arithmetic (``1 - dampening``, ``lr / bias_correction1``,
``bias_correction2 ** 0.5``, ``1 - lr * weight_decay``...) and the same tensor kernels in the same
order, so results are bitwise equal to ``torch.optim.<Opt>(..., foreach=False)`` on CPU. On CPU,
torch's default (``foreach=None``) also picks the single-tensor path. The only liberty taken is
where temporaries live (a copy made by torch out of place may be reused in place here); the values
computed are the same.

The hyperparameters (``OptimizerConfig``, ``group_configs``) are services/optimizer_config.py,
shared with the worker; they are re-exported here. Usage::

    cfg = OptimizerConfig.from_kwargs("adamw", lr=1e-4, weight_decay=0.01)
    opt = make_optimizer(cfg)
    state = opt.init_state(block.numel())
    opt.step(block, grad, state)          # grad=None: a zero gradient
    opt.lr = 5e-5                          # schedules: change lr for later steps ...
    opt.step(block, grad, state, lr=5e-5)  # ... or override it for one call

Multi-tensor apply: ``opt.step_many(params, grads, states, lr=...)`` steps many blocks of one group
at once with torch's fused multi-tensor kernels (``torch.optim.sgd.sgd`` / ``torch.optim.adam.adam``
with ``fused=True``, the kernels behind ``torch.optim.<Opt>(..., fused=True)``). It computes the same
update as ``step`` in one pass over each block instead of one pass per operation, equal to
``foreach=False`` within float32 round-off (an ulp here and there: the fused kernel keeps
intermediates in registers and contracts multiply-adds; not bitwise). tests/unit/test_optimizer.py checks both against
``torch.optim`` directly. A store applying a step of many blocks uses it; a replica never steps.

Thread safety: an optimizer object holds no per-step scratch, so one instance may step different
blocks from several threads at once (torch releases the GIL inside its kernels). A given block and
its state must not be stepped concurrently.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.adam import adam as adam_functional
from torch.optim.sgd import sgd as sgd_functional

from shardline.services.errors import ShardlineConfigError
from shardline.services.optimizer_config import KINDS, OptimizerConfig, check_lr, group_configs

__all__ = [
    "KINDS",
    "OptimizerConfig",
    "group_configs",
    "BlockOptimizer",
    "SGDBlockOptimizer",
    "AdamBlockOptimizer",
    "make_optimizer",
]


# ---------------------------------------------------------------------- block optimizers


class BlockOptimizer:
    """Applies one optimizer to blocks: ``init_state(numel)`` then ``step(param, grad, state)``.

    ``lr`` is mutable (``opt.lr = x``, validated) for learning-rate schedules; ``step(..., lr=x)``
    overrides it for a single call without changing it. Both must be finite and >= 0.
    """

    config: OptimizerConfig

    def __init__(self, config: OptimizerConfig) -> None:
        self.config = config
        self._lr = config.lr

    @property
    def lr(self) -> float:
        """Current learning rate (starts at ``config.lr``)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        self._lr = check_lr(value)

    def init_state(self, numel: int) -> dict[str, torch.Tensor | int]:
        """Fresh state for a block of ``numel`` float32 elements (CPU tensors)."""
        raise NotImplementedError

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor | None,
        state: dict[str, torch.Tensor | int],
        *,
        lr: float | None = None,
    ) -> None:
        """One optimizer step on ``param`` (updated in place) with ``grad``; ``state`` is updated.

        ``grad=None`` means an all-zero gradient and behaves exactly like ``torch.zeros_like(param)``
        (the step happens: step counts advance, momentum decays, weight decay applies). ``grad``
        itself is never modified. ``param`` and ``grad`` are float32 tensors of the same shape
        (blocks are 1-D, but any shape works).
        """
        raise NotImplementedError

    def step_many(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        states: list[dict[str, torch.Tensor | int]],
        *,
        lr: float | None = None,
    ) -> None:
        """``step(params[i], grads[i], states[i], lr=lr)`` for every i, with multi-tensor kernels
        (see the module doc: equal to ``step`` within float32 round-off). The blocks must be
        distinct; ``grads`` are never modified."""
        if not params:
            return
        if not len(params) == len(grads) == len(states):
            raise ShardlineConfigError(f"step_many needs one grad and one state per param: got {len(params)} params, "
                                       f"{len(grads)} grads, {len(states)} states")
        step_lr = self._step_lr(lr)   # once for all: a step of many small blocks pays per block
        prepared = [self._checked_grad(p, g) for p, g in zip(params, grads)]
        self._step_many(params, [g for g, _private in prepared], states, step_lr)

    def _step_many(self, params, grads, states, lr: float) -> None:
        for param, grad, state in zip(params, grads, states):
            self.step(param, grad, state, lr=lr)

    # helpers

    def _prepare(
        self, param: torch.Tensor, grad: torch.Tensor | None, lr: float | None
    ) -> tuple[torch.Tensor, bool, float]:
        """(grad, grad_is_private, lr): the gradient to use, whether it may be modified in place."""
        step_lr = self._step_lr(lr)
        return (*self._checked_grad(param, grad), step_lr)

    def _step_lr(self, lr: float | None) -> float:
        return self._lr if lr is None else check_lr(lr)

    @staticmethod
    def _checked_grad(param: torch.Tensor, grad: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
        """(grad, grad_is_private) for ``param``: an all-zero one for None, else ``grad`` checked."""
        if param.dtype != torch.float32:
            raise ShardlineConfigError(f"param dtype must be float32, got {param.dtype}")
        if grad is None:
            return torch.zeros_like(param), True
        if grad.dtype != param.dtype:
            raise ShardlineConfigError(f"grad dtype {grad.dtype} does not match param {param.dtype}")
        if grad.shape != param.shape:
            raise ShardlineConfigError(
                f"grad shape {tuple(grad.shape)} does not match param {tuple(param.shape)}"
            )
        return grad, False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r}, lr={self._lr!r})"


class SGDBlockOptimizer(BlockOptimizer):
    """torch.optim.SGD (``_single_tensor_sgd``).

    State: ``step`` (int, steps taken) and, when ``momentum != 0``, ``momentum_buffer`` (float32,
    preallocated; torch's "buffer is None" on the first step is ``step == 0`` here, and the first
    step copies the gradient into it exactly like torch's ``grad.clone()``).
    """

    def init_state(self, numel: int) -> dict[str, torch.Tensor | int]:
        state: dict[str, torch.Tensor | int] = {"step": 0}
        if self.config.momentum != 0:
            state["momentum_buffer"] = torch.zeros(int(numel), dtype=torch.float32)
        return state

    def step(self, param, grad, state, *, lr=None):
        grad, private, lr = self._prepare(param, grad, lr)
        c = self.config
        momentum = c.momentum

        if c.maximize:
            grad = torch.neg(grad)  # torch: -grads[i]
            private = True
        if c.weight_decay != 0:
            if private:
                grad = grad.add_(param, alpha=c.weight_decay)
            else:
                grad = grad.add(param, alpha=c.weight_decay)
                private = True

        if momentum != 0:
            buf = state["momentum_buffer"]
            if state["step"] == 0:
                buf.copy_(grad)  # torch: buf = grad.detach().clone()
            else:
                buf.mul_(momentum).add_(grad, alpha=1 - c.dampening)
            if c.nesterov:
                if private:
                    grad = grad.add_(buf, alpha=momentum)
                else:
                    grad = grad.add(buf, alpha=momentum)
            else:
                grad = buf

        param.add_(grad, alpha=-lr)
        state["step"] = int(state["step"]) + 1

    def _step_many(self, params, grads, states, lr):
        c = self.config
        kw = dict(weight_decay=c.weight_decay, momentum=c.momentum, lr=lr, dampening=c.dampening,
                  nesterov=c.nesterov, maximize=c.maximize, fused=True, foreach=False)
        if c.momentum == 0:
            sgd_functional(params, grads, [None] * len(params), **kw)
        else:
            # torch's fused kernel initializes buffers for a whole call or none: first steps apart
            for first in (True, False):
                idx = [i for i, st in enumerate(states) if (st["step"] == 0) == first]
                if not idx:
                    continue
                buffers = [None if first else states[i]["momentum_buffer"] for i in idx]
                sgd_functional([params[i] for i in idx], [grads[i] for i in idx], buffers, **kw)
                if first:
                    for i, buf in zip(idx, buffers):
                        states[i]["momentum_buffer"] = buf
        for st in states:
            st["step"] = int(st["step"]) + 1


class AdamBlockOptimizer(BlockOptimizer):
    """torch.optim.Adam / AdamW (``_single_tensor_adam``; AdamW = decoupled weight decay).

    State: ``step`` (0-dim float32 tensor, as torch keeps it: it stops counting at 2**24 exactly
    like torch's), ``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``.
    """

    def __init__(self, config: OptimizerConfig) -> None:
        super().__init__(config)
        self.decoupled_weight_decay = config.kind == "adamw"

    def init_state(self, numel: int) -> dict[str, torch.Tensor | int]:
        numel = int(numel)
        state: dict[str, torch.Tensor | int] = {
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros(numel, dtype=torch.float32),
            "exp_avg_sq": torch.zeros(numel, dtype=torch.float32),
        }
        if self.config.amsgrad:
            state["max_exp_avg_sq"] = torch.zeros(numel, dtype=torch.float32)
        return state

    def step(self, param, grad, state, *, lr=None):
        grad, private, lr = self._prepare(param, grad, lr)
        c = self.config
        beta1, beta2 = c.betas
        weight_decay = c.weight_decay
        exp_avg = state["exp_avg"]
        exp_avg_sq = state["exp_avg_sq"]
        step_t = state["step"]

        if c.maximize:
            grad = torch.neg(grad)  # torch: -grads[i]
            private = True

        step_t += 1

        if weight_decay != 0:
            if self.decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            elif private:
                grad = grad.add_(param, alpha=weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)

        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)

        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5

        if c.amsgrad:
            max_exp_avg_sq = state["max_exp_avg_sq"]
            torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
            denom = torch.sqrt(max_exp_avg_sq)
        else:
            denom = torch.sqrt(exp_avg_sq)
        # torch: (v.sqrt() / bias_correction2_sqrt).add_(eps), with the division done in place here
        denom.div_(bias_correction2_sqrt).add_(c.eps)

        param.addcdiv_(exp_avg, denom, value=-step_size)

    def _step_many(self, params, grads, states, lr):
        c = self.config
        adam_functional(params, grads, [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states],
                        [st["max_exp_avg_sq"] for st in states] if c.amsgrad else [],
                        [st["step"] for st in states], fused=True, foreach=False,
                        decoupled_weight_decay=self.decoupled_weight_decay, amsgrad=c.amsgrad,
                        beta1=c.betas[0], beta2=c.betas[1], lr=lr, weight_decay=c.weight_decay, eps=c.eps,
                        maximize=c.maximize)


def make_optimizer(config: OptimizerConfig | Any) -> BlockOptimizer:
    """The block optimizer for ``config`` (an OptimizerConfig or a ``shardline.v1.OptimizerSpec``)."""
    if not isinstance(config, OptimizerConfig):
        if hasattr(config, "beta1") and hasattr(config, "kind"):
            config = OptimizerConfig.from_proto(config)
        else:
            raise ShardlineConfigError(f"Invalid optimizer config: {config!r}")
    if config.kind == "sgd":
        return SGDBlockOptimizer(config)
    return AdamBlockOptimizer(config)
