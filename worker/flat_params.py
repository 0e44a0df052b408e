"""Flat parameters (``PSOptimizer(flatten=True)``): each param group's trainable parameters are
one float32 tensor on the PS, as DDP's gradient buckets and FSDP's flat parameters are; the
parameters become views of the group's cache.

Contract, checked with errors that say what to change: float32 CPU parameters; every trainable
parameter of a group has a gradient at ``step()`` or none of them has; frozen parameters stay
tensors of their own. BSP still equals torch.optim (SGD, Adam, AdamW are elementwise). Group
names derive from the parameters' names and shapes (:func:`flat_layout`), so a worker whose model
differs is refused when it joins.

Design: docs/architecture.md, "Overlap, priority pull and flat parameters" ("Flat parameters").
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field

import torch

from shardline.services.errors import ShardlineConfigError

FLAT_PREFIX = "flat"
_FLAT_NAME = re.compile(rf"{FLAT_PREFIX}[0-9]+\.[0-9a-f]{{12}}")


def is_flat_name(name: str) -> bool:
    """Whether a job's tensor ``name`` is a flat group's (see :func:`flat_layout`)."""
    return _FLAT_NAME.fullmatch(name) is not None


@dataclass
class FlatGroup:
    """One param group's trainable parameters as one tensor of the job."""

    name: str        # the job's tensor: "flat<group>.<digest of the members' names and shapes>"
    group: int
    members: list[tuple[str, torch.Tensor]]
    offsets: list[int] = field(default_factory=list)   # of each member in the flat tensor
    numel: int = 0

    def values(self) -> torch.Tensor:
        """The members' current values, concatenated (a new tensor)."""
        return torch.cat([p.detach().reshape(-1) for _, p in self.members])

    def view_into(self, storage: torch.Tensor) -> None:
        """Make each member a view of its range of ``storage`` (1-D float32 of ``numel``), which
        must already hold the values the members are to have."""
        with torch.no_grad():
            for (_, p), offset in zip(self.members, self.offsets):
                p.data = storage[offset:offset + p.numel()].view(p.shape)

    def missing_grads_error(self, missing: list[str]) -> ShardlineConfigError:
        """The error for a step where members ``missing`` got no gradient and others did."""
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return ShardlineConfigError(
            f"flatten=True steps param group {self.group} as one tensor, so every trainable parameter in it needs a "
            f"gradient (torch.optim would skip one without): {shown} got none this step. Set requires_grad=False "
            f"on parameters the model does not use before the job is created, or pass flatten=False")

    def gather_grads(self, out: torch.Tensor) -> bool:
        """Copy the members' gradients into ``out`` (1-D float32 of ``numel``). False if no member
        has one (nothing to push for this group); a group where only some have one is an error."""
        grads = [p.grad for _, p in self.members]
        missing = [name for (name, _), g in zip(self.members, grads) if g is None]
        if len(missing) == len(grads):
            return False
        if missing:
            raise self.missing_grads_error(missing)
        torch.cat([g.detach().reshape(-1) for g in grads], out=out)
        return True


def flat_name(group: int, members: list[tuple[str, tuple[int, ...]]]) -> str:
    """The job's tensor name of param group ``group`` whose trainable members are ``members``
    ((name, shape) in order): it changes with any name, shape, order or grouping."""
    digest = hashlib.sha256(";".join(f"{n}:{tuple(shape)}" for n, shape in members).encode()).hexdigest()[:12]
    return f"{FLAT_PREFIX}{group}.{digest}"


def unflatten(name: str, flat: torch.Tensor, members: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The parameters of flat tensor ``name`` (a job's, e.g. from a checkpoint) by their own names,
    given the members it was made of ((name, shape) in order, as the model lists its trainable
    parameters); ValueError if ``name`` is not what those members make or the sizes differ."""
    group = int(name[len(FLAT_PREFIX):name.index(".")]) if is_flat_name(name) else -1
    if group < 0 or flat_name(group, members) != name:
        raise ValueError(f"flat tensor {name!r} was not made from these parameters (their names and shapes, in "
                         f"order, give {flat_name(max(group, 0), members)!r})")
    values = flat.reshape(-1)
    sizes = [math.prod(shape) for _, shape in members]
    if sum(sizes) != values.numel():
        raise ValueError(f"flat tensor {name!r} has {values.numel()} elements, its parameters {sum(sizes)}")
    return {n: part.view(shape) for (n, shape), part in zip(members, values.split(sizes))}


def groups_that_could_be_flat(param_groups: list[dict]) -> list[tuple[int, int]]:
    """(group index, trainable parameters) of each group that ``flatten=True`` would have stepped
    exactly this step: more than one trainable parameter, all float32 on the CPU, and every one
    with a gradient (one without is skipped by torch.optim, which a flat step cannot do).

    Plain jobs stay plain (the layout is fixed when the job is created, before any gradient
    exists, and a later step may leave a parameter without one), so this only feeds a hint."""
    groups = []
    for index, group in enumerate(param_groups):
        trainable = [p for p in group["params"] if p.requires_grad]
        if len(trainable) > 1 and all(p.dtype == torch.float32 and p.device.type == "cpu" and p.grad is not None
                                      for p in trainable):
            groups.append((index, len(trainable)))
    return groups


def flat_layout(param_groups: list[dict]) -> list[FlatGroup]:
    """The flat groups of torch param groups whose ``param_names`` and ``params`` are set: each
    group's parameters that require grad, in order (a group without any has none)."""
    flats = []
    for index, group in enumerate(param_groups):
        members = [(n, p) for n, p in zip(group["param_names"], group["params"]) if p.requires_grad]
        if not members:
            continue
        for name, p in members:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise ShardlineConfigError(f"flatten=True needs float32 CPU parameters; {name!r} is {p.dtype} on "
                                           f"{p.device} (pass flatten=False)")
        flat = FlatGroup(flat_name(index, [(n, tuple(p.shape)) for n, p in members]), index, members)
        for _, p in members:
            flat.offsets.append(flat.numel)
            flat.numel += p.numel()
        flats.append(flat)
    return flats
