"""Job revisions: a parameter group added to a job while it trains (``PSOptimizer.add_param_group``).

A ``JobExtension`` names the revision it makes, the first step its group trains in, the group's
hyperparameters, tensors new to the job, and frozen tensors of the job that train in the new group
from then on. ``apply_extension`` is the one definition of what an extension does to a spec: the
dispatcher uses it to make the revision (then validates the result like any spec), a PS node to
check that the spec it fetched is its own spec plus the revisions it lacks. Pure.
"""

from __future__ import annotations

from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2


def state_layout(opt: common_pb2.OptimizerSpec) -> tuple:
    """What decides the shape of a block's optimizer state: SGD keeps a momentum buffer only with
    momentum, Adam a max buffer only with amsgrad. The groups of one job must agree on it."""
    return ("momentum", opt.momentum != 0) if opt.kind == "sgd" else ("amsgrad", opt.amsgrad)


def revision_of(spec: common_pb2.JobSpec) -> int:
    """The job's revision: how many extensions it went through since it was created."""
    return len(spec.extensions)


def apply_extension(spec: common_pb2.JobSpec, ext: common_pb2.JobExtension) -> common_pb2.JobSpec:
    """``spec`` at its next revision: a copy with ``ext``'s group appended to the param groups, its
    new tensors added and its unfrozen tensors trainable in that group. Raises ShardlineConfigError
    naming what does not fit (the values of the group's hyperparameters are checked where specs are
    validated, dispatcher/jobs.py)."""
    job, revision = spec.name, revision_of(spec)
    if ext.revision != revision + 1:
        raise ShardlineConfigError(f"job {job!r} is at revision {revision}: the next extension makes revision "
                                   f"{revision + 1}, this one says {ext.revision}")
    if spec.sync != "bsp":
        raise ShardlineConfigError(f"job {job!r} is {spec.sync!r}: parameter groups are added during training only "
                                   f"to BSP jobs (every rank adds it before the same step)")
    if spec.extensions and ext.step < spec.extensions[-1].step:
        raise ShardlineConfigError(f"revision {ext.revision} of job {job!r} starts at step {ext.step}, before revision "
                                   f"{revision}'s step {spec.extensions[-1].step}")
    if not ext.tensors and not ext.unfreeze:
        raise ShardlineConfigError(f"revision {ext.revision} of job {job!r} adds a parameter group without tensors")
    if ext.group.kind != spec.optimizer.kind:
        raise ShardlineConfigError(f"the new parameter group of job {job!r} has optimizer kind {ext.group.kind!r}, "
                                   f"the job's is {spec.optimizer.kind!r}")
    if state_layout(ext.group) != state_layout(spec.optimizer):
        what, _ = state_layout(ext.group)
        raise ShardlineConfigError(
            f"the new parameter group of job {job!r} differs from the job's groups in whether {what} is used "
            f"({what}: {getattr(ext.group, what)!r} vs {getattr(spec.optimizer, what)!r}); it decides the optimizer "
            f"state every block keeps")
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    groups = list(spec.param_groups) or [spec.optimizer]
    index = len(groups)
    del out.param_groups[:]
    out.param_groups.extend(groups + [ext.group])
    existing = {t.name: t for t in out.tensors}
    unfreeze = list(ext.unfreeze)
    for name in unfreeze:
        tensor = existing.get(name)
        if tensor is None:
            raise ShardlineConfigError(f"job {job!r} has no tensor {name!r} to unfreeze (new tensors go in "
                                       f"extension.tensors)")
        if tensor.trainable:
            raise ShardlineConfigError(f"tensor {name!r} of job {job!r} already trains in parameter group "
                                       f"{tensor.group}: only frozen tensors move to a new group")
        if unfreeze.count(name) > 1:
            raise ShardlineConfigError(f"tensor {name!r} is unfrozen more than once")
        tensor.trainable, tensor.group = True, index
        tensor.dtype = "float32"   # a trainable tensor's master copy (a frozen one may be stored as bfloat16)
    added = set()
    for tensor in ext.tensors:
        if tensor.name in existing:
            raise ShardlineConfigError(f"job {job!r} already has a tensor {tensor.name!r}; a new tensor needs a new "
                                       f"name (a frozen one is unfrozen instead)")
        if tensor.name in added:
            raise ShardlineConfigError(f"new tensor name {tensor.name!r} appears more than once")
        added.add(tensor.name)
        if tensor.group not in (0, index):
            raise ShardlineConfigError(f"new tensor {tensor.name!r} names parameter group {tensor.group}; it joins the "
                                       f"new group {index}")
        new = out.tensors.add()
        new.CopyFrom(tensor)
        new.group = index
        new.dtype = new.dtype or "float32"
    out.extensions.add().CopyFrom(ext)
    return out


def replay(spec: common_pb2.JobSpec, target: common_pb2.JobSpec) -> common_pb2.JobSpec:
    """``spec`` brought to ``target``'s revision by applying the extensions ``target`` lists
    after ``spec``'s. Raises ShardlineConfigError if ``target`` is not that (another job, another
    history, an older revision)."""
    if target.name != spec.name or revision_of(target) < revision_of(spec) or any(
            a.SerializeToString(deterministic=True) != b.SerializeToString(deterministic=True)
            for a, b in zip(spec.extensions, target.extensions)):
        raise ShardlineConfigError(f"job {target.name!r} at revision {revision_of(target)} does not continue the "
                                   f"revisions of {spec.name!r} at revision {revision_of(spec)}")
    out = spec
    for ext in target.extensions[revision_of(spec):]:
        out = apply_extension(out, ext)
    for field in ("tensors", "param_groups"):
        mine = [m.SerializeToString(deterministic=True) for m in getattr(out, field)]
        theirs = [m.SerializeToString(deterministic=True) for m in getattr(target, field)]
        if mine != theirs:
            raise ShardlineConfigError(f"job {target.name!r} at revision {revision_of(target)}: its {field} are not "
                                       f"those its revisions make from revision {revision_of(spec)}")
    return out
