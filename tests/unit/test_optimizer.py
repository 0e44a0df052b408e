"""ps_server.optimizer against torch.optim: the reference is always torch, never this module.

The block optimizer is applied to a tensor split into blocks of uneven size with per-block state
and compared with torch.optim (foreach=False) on the whole tensor: bitwise equal (torch.equal).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from shardline.ps_server.optimizer import (
    AdamBlockOptimizer,
    OptimizerConfig,
    SGDBlockOptimizer,
    make_optimizer,
)
from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2

NUMEL = 1000
SPLITS = {
    "300s": [300, 300, 300, 100],
    "ragged": [1, 7, 13, 333, 646],
}
STEPS = 6
LR = 0.01
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def _sgd_cases():
    cases = []
    for momentum in (0.0, 0.9):
        for dampening in (0.0, 0.25):
            for nesterov in (False, True):
                if nesterov and (momentum == 0 or dampening != 0):
                    continue
                for weight_decay in (0.0, 0.05):
                    for maximize in (False, True):
                        cases.append(
                            dict(
                                momentum=momentum,
                                dampening=dampening,
                                nesterov=nesterov,
                                weight_decay=weight_decay,
                                maximize=maximize,
                            )
                        )
    return [("sgd", kw) for kw in cases]


def _adam_cases():
    cases = []
    for kind in ("adam", "adamw"):
        for amsgrad in (False, True):
            for weight_decay in (0.0, 0.1):
                for maximize in (False, True):
                    cases.append(
                        (kind, dict(amsgrad=amsgrad, weight_decay=weight_decay, maximize=maximize))
                    )
        cases.append((kind, dict(betas=(0.8, 0.95), eps=1e-6, weight_decay=0.2, amsgrad=True)))
        cases.append((kind, {}))  # every default, including AdamW's weight_decay=1e-2
    return cases


CASES = _sgd_cases() + _adam_cases()


def _case_id(case):
    kind, kw = case
    return kind + "-" + ("-".join(f"{k}={v}" for k, v in kw.items()) or "defaults")


def _blocks(flat: torch.Tensor, sizes: list[int], mode: str) -> list[torch.Tensor]:
    """Views into ``flat`` (unaligned offsets) or separate clones (own storage, as a PS may keep)."""
    out, off = [], 0
    for s in sizes:
        view = flat[off : off + s]
        out.append(view if mode == "view" else view.clone())
        off += s
    assert off == flat.numel()
    return out


def _gather(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in blocks])


def _run(kind, kw, sizes, mode, *, torch_opts, steps=STEPS, zero_block_at=(2, 1), lr_change_at=4):
    """Step torch (on the whole tensor) and the block optimizer side by side.

    At step ``zero_block_at[0]`` block ``zero_block_at[1]`` gets grad=None on our side and zeros in
    torch's gradient; at step ``lr_change_at`` the lr is halved (torch: param_groups; ours: the
    mutable ``lr`` on even-indexed blocks' calls via ``opt.lr``, the ``lr=`` override on others).
    Yields (step index, ours, torch's) after every step.
    """
    gen = torch.Generator().manual_seed(zlib.crc32(repr((kind, sorted(kw.items()))).encode()))
    init = torch.randn(NUMEL, generator=gen)
    p = torch.nn.Parameter(init.clone())
    cfg = OptimizerConfig.from_kwargs(kind, lr=LR, **kw)
    ref = TORCH[kind]([p], lr=LR, **kw, **torch_opts)
    opt = make_optimizer(cfg)
    blocks = _blocks(init.clone(), sizes, mode)
    states = [opt.init_state(b.numel()) for b in blocks]
    for t in range(steps):
        grad = torch.randn(NUMEL, generator=gen)
        ours = _blocks(grad, sizes, "view")
        if t == zero_block_at[0]:
            j = zero_block_at[1]
            ours[j] = None
            off = sum(sizes[:j])
            grad[off : off + sizes[j]] = 0.0
        if t >= lr_change_at:
            ref.param_groups[0]["lr"] = LR / 2
            opt.lr = LR / 2
        p.grad = grad.clone()
        ref.step()
        for i, (b, g, s) in enumerate(zip(blocks, ours, states)):
            if t >= lr_change_at and i % 2:
                # same lr through the per-call override while opt.lr says something else
                opt.lr = 123.0
                opt.step(b, g, s, lr=LR / 2)
                opt.lr = LR / 2
            else:
                opt.step(b, g, s)
        yield t, _gather(blocks), p.detach()


@pytest.mark.parametrize("mode", ["view", "clone"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_bitwise_equal_to_torch_single_tensor(case, split, mode):
    kind, kw = case
    for t, ours, theirs in _run(kind, kw, SPLITS[split], mode, torch_opts={"foreach": False}):
        if not torch.equal(ours, theirs):
            diff = (ours - theirs).abs().max().item()
            pytest.fail(f"step {t}: not bitwise equal to torch.optim (max abs diff {diff:g})")


@pytest.mark.parametrize("foreach", [None, True], ids=["default", "foreach"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_close_to_torch_default_and_foreach(case, foreach):
    kind, kw = case
    for t, ours, theirs in _run(kind, kw, SPLITS["300s"], "clone", torch_opts={"foreach": foreach}):
        diff = (ours - theirs).abs().max().item()
        assert diff <= 1e-6, f"step {t}: max abs diff {diff:g} vs torch (foreach={foreach})"


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("sgd", dict(momentum=0.9)),
        ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True)),
        ("sgd", dict(weight_decay=0.1)),
        ("adam", dict(weight_decay=0.1)),
        ("adam", dict(amsgrad=True, maximize=True)),
        ("adamw", dict(weight_decay=0.1, amsgrad=True)),
    ],
)
def test_grad_none_is_a_zero_gradient_step(kind, kw):
    """grad=None steps exactly like torch with p.grad = zeros, including as the very first step."""
    gen = torch.Generator().manual_seed(7)
    init = torch.randn(257, generator=gen)
    p = torch.nn.Parameter(init.clone())
    ref = TORCH[kind]([p], lr=LR, foreach=False, **kw)
    opt = make_optimizer(OptimizerConfig.from_kwargs(kind, lr=LR, **kw))
    block = init.clone()
    state = opt.init_state(block.numel())
    grads = [None, torch.randn(257, generator=gen), None, None, torch.randn(257, generator=gen)]
    for t, g in enumerate(grads):
        p.grad = torch.zeros(257) if g is None else g.clone()
        ref.step()
        opt.step(block, g, state)
        assert torch.equal(block, p.detach()), f"step {t}"
    tstate = ref.state[p]
    if kind == "sgd":
        assert state["step"] == len(grads)
        if "momentum_buffer" in tstate:
            assert torch.equal(state["momentum_buffer"], tstate["momentum_buffer"])
    else:
        assert torch.equal(state["step"], tstate["step"])  # float32, counted zero steps too
        assert state["step"].item() == len(grads)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in tstate:
                assert torch.equal(state[key], tstate[key]), key


def test_grad_is_not_modified_and_zero_grad_still_decays():
    opt = make_optimizer(OptimizerConfig.from_kwargs("adamw", lr=0.1, weight_decay=0.5))
    block = torch.ones(10)
    state = opt.init_state(10)
    opt.step(block, None, state)
    assert torch.allclose(block, torch.full((10,), 1 - 0.1 * 0.5))
    g = torch.randn(10)
    g0 = g.clone()
    for kind, kw in [
        ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True)),
        ("adam", dict(weight_decay=0.1, maximize=True, amsgrad=True)),
    ]:
        o = make_optimizer(OptimizerConfig.from_kwargs(kind, **kw))
        s = o.init_state(10)
        for _ in range(3):
            o.step(torch.randn(10), g, s)
        assert torch.equal(g, g0)


def test_step_argument_checks():
    opt = make_optimizer(OptimizerConfig.from_kwargs("sgd", lr=0.1))
    with pytest.raises(ShardlineConfigError, match="shape"):
        opt.step(torch.zeros(4), torch.zeros(5), opt.init_state(4))
    with pytest.raises(ShardlineConfigError, match="dtype"):
        opt.step(torch.zeros(4), torch.zeros(4, dtype=torch.float64), opt.init_state(4))
    with pytest.raises(ShardlineConfigError, match="-1.0"):
        opt.step(torch.zeros(4), torch.zeros(4), opt.init_state(4), lr=-1.0)
    with pytest.raises(ShardlineConfigError, match="-0.5"):
        opt.lr = -0.5
    assert opt.lr == 0.1
    opt.lr = 0.05
    assert opt.lr == 0.05 and opt.config.lr == 0.1


def test_make_optimizer_kinds_and_state_layout():
    assert isinstance(make_optimizer(OptimizerConfig.from_kwargs("sgd")), SGDBlockOptimizer)
    adam = make_optimizer(OptimizerConfig.from_kwargs("adam", amsgrad=True))
    assert isinstance(adam, AdamBlockOptimizer) and not adam.decoupled_weight_decay
    adamw = make_optimizer(OptimizerConfig.from_kwargs("adamw").to_proto())
    assert isinstance(adamw, AdamBlockOptimizer) and adamw.decoupled_weight_decay
    st = adam.init_state(5)
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
    assert all(st[k].dtype == torch.float32 and st[k].shape == (5,) for k in st if k != "step")
    assert set(make_optimizer(OptimizerConfig.from_kwargs("sgd")).init_state(5)) == {"step"}
    sgdm = make_optimizer(OptimizerConfig.from_kwargs("sgd", momentum=0.5)).init_state(5)
    assert set(sgdm) == {"step", "momentum_buffer"}
    with pytest.raises(ShardlineConfigError):
        make_optimizer({"kind": "sgd"})


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_from_kwargs_defaults_match_torch(kind):
    defaults = TORCH[kind]([torch.nn.Parameter(torch.zeros(1))]).defaults
    cfg = OptimizerConfig.from_kwargs(kind)
    for key, value in cfg.torch_kwargs().items():
        assert key in defaults, key
        theirs = defaults[key]
        if key == "betas":
            assert value == tuple(theirs)
        else:
            assert value == theirs, key
    # every hyperparameter torch has (other than implementation switches) is covered
    switches = {"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"}
    assert set(defaults) - switches == set(cfg.torch_kwargs())


def test_kind_is_normalized_and_config_is_frozen():
    cfg = OptimizerConfig.from_kwargs("AdamW", lr=3)
    assert cfg.kind == "adamw" and cfg.lr == 3.0 and isinstance(cfg.lr, float)
    with pytest.raises(Exception):
        cfg.lr = 1.0  # type: ignore[misc]
    assert cfg.replace(lr=0.5).lr == 0.5
    assert hash(cfg) == hash(OptimizerConfig.from_kwargs("adamw", lr=3.0))


# (kind, kwargs, text the message must contain); torch rejects each of these too unless noted.
INVALID = [
    ("sgd", dict(lr=-0.1), "-0.1"),
    ("sgd", dict(momentum=-0.5), "-0.5"),
    ("sgd", dict(weight_decay=-0.01), "-0.01"),
    ("sgd", dict(nesterov=True), "momentum=0.0"),
    ("sgd", dict(nesterov=True, momentum=0.9, dampening=0.1), "dampening=0.1"),
    ("adam", dict(lr=-1e-3), "-0.001"),
    ("adam", dict(eps=-1e-8), "-1e-08"),
    ("adam", dict(betas=(1.0, 0.999)), "1.0"),
    ("adam", dict(betas=(-0.1, 0.999)), "-0.1"),
    ("adam", dict(betas=(0.9, 1.5)), "1.5"),
    ("adam", dict(weight_decay=-0.2), "-0.2"),
    ("adamw", dict(betas=(0.9, 1.0)), "1.0"),
    ("adamw", dict(eps=-1.0), "-1.0"),
    ("adamw", dict(weight_decay=-1e-2), "-0.01"),
]
# stricter than torch (torch accepts these or fails with a TypeError)
INVALID_STRICTER = [
    ("sgd", dict(lr=float("nan")), "nan"),
    ("adam", dict(lr=float("inf")), "inf"),
    ("adam", dict(betas=(0.9,)), "(0.9,)"),
    ("adam", dict(lr="0.1"), "'0.1'"),
    ("sgd", dict(nesterov="yes", momentum=0.9), "'yes'"),
    ("sgd", dict(betas=(0.9, 0.99)), "betas=(0.9, 0.99)"),
    ("adam", dict(momentum=0.9), "momentum=0.9"),
    ("adamw", dict(foreach=True), "foreach=True"),
    ("adam", dict(lrr=0.1), "lrr=0.1"),
]


@pytest.mark.parametrize("kind,kw,text", INVALID)
def test_invalid_config_rejected_like_torch(kind, kw, text):
    with pytest.raises(ValueError):
        TORCH[kind]([torch.nn.Parameter(torch.zeros(1))], **kw)
    with pytest.raises(ShardlineConfigError) as exc:
        OptimizerConfig.from_kwargs(kind, **kw)
    assert text in str(exc.value)


@pytest.mark.parametrize("kind,kw,text", INVALID_STRICTER)
def test_invalid_config_rejected_stricter_than_torch(kind, kw, text):
    with pytest.raises(ShardlineConfigError) as exc:
        OptimizerConfig.from_kwargs(kind, **kw)
    assert text in str(exc.value)


@pytest.mark.parametrize("kind", ["rmsprop", "", "SGD2"])
def test_unknown_kind_rejected(kind):
    with pytest.raises(ShardlineConfigError) as exc:
        OptimizerConfig.from_kwargs(kind)
    assert repr(kind) in str(exc.value)
    with pytest.raises(ShardlineConfigError):
        OptimizerConfig(kind=kind)
    with pytest.raises(ShardlineConfigError):
        OptimizerConfig.from_proto(common_pb2.OptimizerSpec(kind=kind, lr=0.1))


def test_direct_construction_is_validated():
    with pytest.raises(ShardlineConfigError, match="-1.0"):
        OptimizerConfig("adam", lr=-1.0)
    with pytest.raises(ShardlineConfigError, match="momentum"):
        OptimizerConfig("adamw", momentum=0.9)
    assert OptimizerConfig("sgd", lr=0.1) == OptimizerConfig.from_kwargs("sgd", lr=0.1)
    assert OptimizerConfig("adam") == OptimizerConfig.from_kwargs("adam")
    # AdamW's weight_decay default comes from from_kwargs (torch's), not the dataclass default
    assert OptimizerConfig.from_kwargs("adamw").weight_decay == 1e-2


# ---------------------------------------------------------------------- proto


PROTO_CASES = [
    OptimizerConfig.from_kwargs("sgd"),
    OptimizerConfig.from_kwargs(
        "sgd", lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4, maximize=True
    ),
    OptimizerConfig.from_kwargs("sgd", lr=0.3, momentum=0.5, dampening=0.1),
    OptimizerConfig.from_kwargs("adam"),
    OptimizerConfig.from_kwargs("adam", lr=3e-4, betas=(0.8, 0.95), eps=1e-6, amsgrad=True),
    OptimizerConfig.from_kwargs("adamw"),
    OptimizerConfig.from_kwargs("adamw", lr=1e-4, weight_decay=0.1, maximize=True),
    OptimizerConfig.from_kwargs("adam", lr=0.0, betas=(0.0, 0.0), eps=0.0),
]


@pytest.mark.parametrize("cfg", PROTO_CASES, ids=lambda c: f"{c.kind}-{c.lr}")
def test_proto_round_trip(cfg):
    spec = cfg.to_proto()
    assert isinstance(spec, common_pb2.OptimizerSpec)
    assert spec.kind == cfg.kind and spec.lr == cfg.lr and spec.weight_decay == cfg.weight_decay
    assert spec.maximize == cfg.maximize
    if cfg.kind == "sgd":
        assert (spec.momentum, spec.dampening, spec.nesterov) == (
            cfg.momentum,
            cfg.dampening,
            cfg.nesterov,
        )
    else:
        assert (spec.beta1, spec.beta2, spec.eps, spec.amsgrad) == (*cfg.betas, cfg.eps, cfg.amsgrad)
    wire = common_pb2.OptimizerSpec.FromString(spec.SerializeToString())
    assert OptimizerConfig.from_proto(wire) == cfg


def test_from_proto_ignores_fields_of_other_kinds_and_validates():
    spec = common_pb2.OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9, beta1=0.5, eps=7.0)
    cfg = OptimizerConfig.from_proto(spec)
    assert cfg == OptimizerConfig.from_kwargs("sgd", lr=0.1, momentum=0.9)
    spec = common_pb2.OptimizerSpec(kind="adam", lr=0.1, beta1=0.9, beta2=0.99, momentum=0.9)
    assert OptimizerConfig.from_proto(spec) == OptimizerConfig.from_kwargs(
        "adam", lr=0.1, betas=(0.9, 0.99), eps=0.0
    )
    with pytest.raises(ShardlineConfigError, match="1.5"):
        OptimizerConfig.from_proto(common_pb2.OptimizerSpec(kind="adam", lr=0.1, beta1=1.5))
    with pytest.raises(ShardlineConfigError, match="nan"):
        OptimizerConfig.from_proto(common_pb2.OptimizerSpec(kind="sgd", lr=math.nan))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_step_many_matches_torch_within_round_off(case):
    """The multi-tensor path against torch.optim (foreach=False, one parameter per block): blocks
    of uneven sizes, some skipped at some steps (so their step counts differ within one call),
    zero-flag blocks (grad None), an lr change; gradients are never modified."""
    kind, kw = case
    sizes = SPLITS["ragged"]
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    init = [torch.randn(n, generator=gen) for n in sizes]
    params = [torch.nn.Parameter(b.clone()) for b in init]
    ref = TORCH[kind](params, lr=LR, foreach=False, **kw)
    opt = make_optimizer(OptimizerConfig.from_kwargs(kind, lr=LR, **kw))
    blocks = [b.clone() for b in init]
    states = [opt.init_state(n) for n in sizes]
    for t in range(STEPS):
        stepped = [i for i in range(len(sizes)) if (i + t) % 3 or t == 0]   # the others: nobody pushed
        grads = [None if (i == 1 and t % 2) else torch.randn(sizes[i], generator=gen) for i in stepped]
        kept = [None if g is None else g.clone() for g in grads]
        lr = LR if t < 4 else LR / 2
        ref.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = None
        for i, g in zip(stepped, grads):
            params[i].grad = torch.zeros(sizes[i]) if g is None else g.clone()
        ref.step()
        opt.step_many([blocks[i] for i in stepped], grads, [states[i] for i in stepped], lr=lr)
        for g, g0 in zip(grads, kept):
            assert g is None or torch.equal(g, g0)
        for i, (b, p) in enumerate(zip(blocks, params)):
            torch.testing.assert_close(b, p.detach(), rtol=1e-6, atol=1e-6, msg=f"step {t} block {i}")
    for i, p in enumerate(params):
        tstate = ref.state.get(p, {})
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if tstate.get(key) is not None:
                torch.testing.assert_close(states[i][key], tstate[key], rtol=1e-6, atol=1e-6)
        if kind != "sgd":
            assert states[i]["step"].item() == tstate["step"].item()
        elif tstate:
            assert states[i]["step"] == sum(1 for t in range(STEPS) if (i + t) % 3 or t == 0)
