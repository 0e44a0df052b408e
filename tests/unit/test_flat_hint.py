"""The hint a default (per-parameter) PSOptimizer gives at its first step: which param groups
``flatten=True`` would have stepped exactly as one tensor (worker/flat_params.py)."""

import torch

from shardline.worker.flat_params import groups_that_could_be_flat


def group(*params):
    return {"params": list(params)}


def with_grad(*shape, dtype=torch.float32):
    p = torch.nn.Parameter(torch.zeros(*shape, dtype=dtype))
    p.grad = torch.ones_like(p)
    return p


def test_a_group_whose_trainable_parameters_all_have_gradients_could_be_flat():
    frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)   # not a member: frozen stays a tensor
    assert groups_that_could_be_flat([group(with_grad(2, 2), with_grad(4), frozen)]) == [(0, 2)]


def test_a_group_with_a_parameter_without_gradient_stays_per_parameter():
    unused = torch.nn.Parameter(torch.zeros(3))   # torch.optim skips it; a flat step could not
    groups = [group(with_grad(2), unused), group(with_grad(2), with_grad(3))]
    assert groups_that_could_be_flat(groups) == [(1, 2)]


def test_a_single_parameter_and_bf16_parameters_gain_nothing_or_are_not_supported():
    groups = [group(with_grad(5)), group(with_grad(2, dtype=torch.bfloat16), with_grad(2, dtype=torch.bfloat16))]
    assert groups_that_could_be_flat(groups) == []
