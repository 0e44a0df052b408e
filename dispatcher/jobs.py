"""Job registry: validated, normalized job specs and their readiness.

A job is a namespace of tensors with an optimizer, a sync mode and a world size. Every worker of a
job calls ``create`` with the spec it derives from its model; exactly one call creates the job
(``created=True``: that caller initializes the tensors and then calls ``mark_ready``), the others
get the existing job and ``wait_ready`` for it. A spec that differs from the registered one is a
conflict (two different models under one job name), reported with the first differing field.

Specs are normalized before comparison and storage: ``block_elements`` 0 becomes
``DEFAULT_BLOCK_ELEMENTS`` and an empty tensor dtype becomes ``"float32"`` (a frozen tensor may be
``"bfloat16"``: stored so on the PS nodes). Tensors are compared by
name, so the order in which workers list them does not matter. Pure and thread-safe.

Incarnations and checkpoints. Each created job gets a random ``uid``; a job deleted and created
again under its name gets a new one, and the deleted uid is kept as a tombstone, so PS nodes can
tell data of a deleted incarnation from data of the current one. From heartbeats the registry keeps
the job's ``holders``: node id -> its latest durable (checkpointed) step, or None while it has none.
``checkpoint_step`` is the minimum over the holders: the step a whole-cluster restart resumes at.

Revisions. ``extend`` adds a parameter group to a ready BSP job (PSOptimizer.add_param_group
during training): the spec's next revision (services/extension.py), made once; every rank asks
with the same extension, a different one for a made revision is refused naming the difference.
``ready_revision`` is the newest revision whose new tensors their creator initialized.

Durability. Jobs (spec, readiness, uid, holders, ready revision) and tombstones are written to the state store
(``job/<name>``, ``tombstone/<uid>``) before a change becomes visible, and only when something
changed. A registry built over a store with state has them back. A failed write raises
StateStoreError and changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import secrets
import threading
import time
import types
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from google.protobuf import json_format

from shardline.dispatcher import replay_policy
from shardline.dispatcher.membership import validate_name
from shardline.dispatcher.state_memory import MemoryStateStore
from shardline.dispatcher.state_store import JOB_PREFIX, TOMBSTONE_PREFIX, StateStore, StateStoreError, with_prefix
from shardline.dispatcher.leases import DEFAULT_LEASE_TIMEOUT_SECONDS, ON_WORKER_FAILURE
from shardline.services.blocks import DEFAULT_BLOCK_ELEMENTS, validate_block_elements
from shardline.services.compression import check_compression, compression_of
from shardline.services.errors import ShardlineConfigError, ShardlineStateError, ShardlineTimeoutError
from shardline.services.extension import apply_extension, revision_of, state_layout
from shardline.services.names import JOB_NAME_RE, validate_job_name  # noqa: F401 - part of this module's API
from shardline.services.pb import common_pb2

log = logging.getLogger("shardline.dispatcher.jobs")

TENSOR_NAME_RE = re.compile(r"[A-Za-z0-9._/-]{1,256}")
UID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
SYNC_MODES = ("bsp", "asp", "ssp")
OPTIMIZERS = ("sgd", "adam", "adamw")
MAX_REPLICATION = 16
# Every step in flight holds a gradient accumulator per block on the PS nodes: s + 1 of them.
MAX_STALENESS = 16
DTYPES = ("float32", "bfloat16")   # bfloat16: frozen tensors only (a trainable one's master is fp32)
_OPTIMIZER_FIELDS = (
    "kind", "lr", "momentum", "dampening", "nesterov", "weight_decay",
    "beta1", "beta2", "eps", "amsgrad", "maximize",
)


class UnknownJobError(ShardlineStateError, LookupError):
    """No job of that name is registered."""


@dataclass(frozen=True)
class JobRecord:
    """A snapshot of a registered job. ``spec`` is a private copy; mutating it changes nothing.

    ``holders``: node id -> latest durable step (None: no checkpoint yet) of every node whose last
    heartbeat listed this incarnation (read-only).
    """

    spec: common_pb2.JobSpec
    ready: bool
    created_unix_ms: int
    uid: str
    holders: Mapping[str, int | None]
    ready_revision: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def has_checkpoint(self) -> bool:
        """Some node holds the job and every holder has a checkpoint of it."""
        return bool(self.holders) and all(step is not None for step in self.holders.values())

    @property
    def checkpoint_step(self) -> int:
        """The latest step every holder has durable (0 without ``has_checkpoint``)."""
        return min(self.holders.values()) if self.has_checkpoint else 0

    @property
    def durable_steps(self) -> dict[str, int]:
        """Node id -> latest durable step, for the holders that have one."""
        return {node: step for node, step in self.holders.items() if step is not None}


@dataclass
class _Job:
    spec: common_pb2.JobSpec
    ready: bool
    created_ms: int
    uid: str
    holders: dict[str, int | None]
    ready_revision: int = 0      # the newest revision whose new tensors are initialized

    def persisted(self) -> dict:
        """The value of key ``job/<name>``."""
        return {
            "spec": json_format.MessageToDict(self.spec, preserving_proto_field_name=True),
            "ready": self.ready,
            "created_unix_ms": self.created_ms,
            "uid": self.uid,
            "holders": dict(self.holders),
            "ready_revision": self.ready_revision,
        }

    def record(self) -> JobRecord:
        spec = common_pb2.JobSpec()
        spec.CopyFrom(self.spec)
        return JobRecord(spec=spec, ready=self.ready, created_unix_ms=self.created_ms, uid=self.uid,
                         holders=types.MappingProxyType(dict(self.holders)), ready_revision=self.ready_revision)


def validate_uid(uid: object) -> str:
    if not isinstance(uid, str) or not UID_RE.fullmatch(uid):
        raise ShardlineConfigError(f"job uid must be 1..64 characters of [A-Za-z0-9._-], got {uid!r}")
    return uid


def _check_real(value: float, what: str, *, low: float = 0.0, below: float | None = None) -> None:
    """``value`` finite and in ``[low, below)`` (or ``[low, inf)``)."""
    if not math.isfinite(value) or value < low or (below is not None and value >= below):
        bound = f"in [{low:g}, {below:g})" if below is not None else f">= {low:g}"
        raise ShardlineConfigError(f"{what} must be finite and {bound}, got {value!r}")


def _validate_optimizer(opt: common_pb2.OptimizerSpec, what: str = "optimizer") -> None:
    # Ranges are the ones torch.optim enforces, so a job the PS accepts is one torch would run.
    if opt.kind not in OPTIMIZERS:
        raise ShardlineConfigError(f"{what}.kind must be one of {', '.join(OPTIMIZERS)}, got {opt.kind!r}")
    _check_real(opt.lr, f"{what}.lr")
    _check_real(opt.weight_decay, f"{what}.weight_decay")
    if opt.kind == "sgd":
        _check_real(opt.momentum, f"{what}.momentum")
        _check_real(opt.dampening, f"{what}.dampening")
        if opt.nesterov and (opt.momentum <= 0 or opt.dampening != 0):
            raise ShardlineConfigError(
                f"{what}.nesterov needs momentum > 0 and dampening 0, "
                f"got momentum={opt.momentum!r}, dampening={opt.dampening!r}"
            )
    else:
        _check_real(opt.beta1, f"{what}.beta1", below=1.0)
        _check_real(opt.beta2, f"{what}.beta2", below=1.0)
        _check_real(opt.eps, f"{what}.eps")


def _validate_param_groups(spec: common_pb2.JobSpec) -> None:
    groups = spec.param_groups
    for i, group in enumerate(groups):
        _validate_optimizer(group, f"param_groups[{i}]")
        if group.kind != spec.optimizer.kind:
            raise ShardlineConfigError(f"param_groups[{i}].kind is {group.kind!r} but the job's optimizer is "
                                       f"{spec.optimizer.kind!r}: every group uses the job's optimizer")
        if state_layout(group) != state_layout(groups[0]):
            what, _ = state_layout(group)
            raise ShardlineConfigError(
                f"param_groups[{i}] and param_groups[0] differ in whether {what} is used ({what}: "
                f"{getattr(group, what)!r} vs {getattr(groups[0], what)!r}); the groups of one job must agree on it "
                f"(it decides the optimizer state every block keeps)")
    if groups and groups[0] != spec.optimizer:
        raise ShardlineConfigError("optimizer must equal param_groups[0] (the job's defaults are its first group)")
    for tensor in spec.tensors:
        if tensor.group >= max(1, len(groups)):
            raise ShardlineConfigError(f"tensor {tensor.name!r} names parameter group {tensor.group}, the job has "
                                       f"{max(1, len(groups))}")


def _validate_staleness(spec: common_pb2.JobSpec) -> None:
    """SSP needs a staleness >= 1 (0 would be BSP: say sync bsp); the other modes take none."""
    if spec.sync == "ssp" and not 1 <= spec.staleness <= MAX_STALENESS:
        raise ShardlineConfigError(f"sync 'ssp' needs staleness in 1..{MAX_STALENESS} (staleness 0 is BSP: use sync "
                                   f"'bsp'), got {spec.staleness!r}")
    if spec.sync != "ssp" and spec.staleness:
        raise ShardlineConfigError(f"staleness only applies with sync 'ssp'; job sync is {spec.sync!r}, "
                                   f"staleness {spec.staleness!r}")


def normalize_spec(spec: common_pb2.JobSpec) -> common_pb2.JobSpec:
    """Validate ``spec`` and return a normalized copy. Raises ShardlineConfigError quoting the bad value."""
    if not isinstance(spec, common_pb2.JobSpec):
        raise ShardlineConfigError(f"job spec must be a JobSpec message, got {type(spec).__name__}")
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    validate_job_name(out.name)
    if out.sync not in SYNC_MODES:
        raise ShardlineConfigError(f"sync must be one of {', '.join(SYNC_MODES)}, got {out.sync!r}")
    _validate_staleness(out)
    if out.world_size < 1:
        raise ShardlineConfigError(f"world_size must be >= 1, got {out.world_size!r}")
    if out.block_elements == 0:
        out.block_elements = DEFAULT_BLOCK_ELEMENTS
    validate_block_elements(out.block_elements)
    _validate_optimizer(out.optimizer)
    _validate_param_groups(out)
    _check_real(out.max_grad_norm, "max_grad_norm")
    if out.max_grad_norm and out.sync != "bsp":
        raise ShardlineConfigError(f"max_grad_norm clips the mean gradient of a BSP step; job sync is {out.sync!r}")
    out.compression = check_compression(compression_of(out))
    if out.compression == "sign" and out.allow_nonfinite:
        # the residual would turn NaN for good, and a NaN scale cannot go on the wire
        raise ShardlineConfigError("compression 'sign' cannot carry NaN/Inf gradients: allow_nonfinite must be false")
    if out.replication > MAX_REPLICATION:
        raise ShardlineConfigError(f"replication must be in 1..{MAX_REPLICATION} (0: the dispatcher's default), "
                                   f"got {out.replication!r}")
    _check_real(out.worker_lease_timeout_seconds, "worker_lease_timeout_seconds")
    if not out.worker_lease_timeout_seconds:
        out.worker_lease_timeout_seconds = DEFAULT_LEASE_TIMEOUT_SECONDS
    if not out.on_worker_failure:
        out.on_worker_failure = "wait"
    if out.on_worker_failure not in ON_WORKER_FAILURE:
        raise ShardlineConfigError(f"on_worker_failure must be one of {', '.join(ON_WORKER_FAILURE)}, "
                                   f"got {out.on_worker_failure!r}")
    for i, ext in enumerate(out.extensions):
        if ext.revision != i + 1:
            raise ShardlineConfigError(f"extensions[{i}] makes revision {ext.revision}, expected {i + 1}")
    seen: set[str] = set()
    for i, tensor in enumerate(out.tensors):
        if not TENSOR_NAME_RE.fullmatch(tensor.name):
            raise ShardlineConfigError(
                f"tensors[{i}].name must be 1..256 characters of [A-Za-z0-9._/-], got {tensor.name!r}"
            )
        if tensor.name in seen:
            raise ShardlineConfigError(f"tensor name {tensor.name!r} appears more than once")
        seen.add(tensor.name)
        for dim in tensor.shape:
            if dim < 0:
                raise ShardlineConfigError(f"tensor {tensor.name!r} shape dims must be >= 0, got {list(tensor.shape)!r}")
        if not tensor.dtype:
            tensor.dtype = "float32"
        if tensor.dtype not in DTYPES:
            raise ShardlineConfigError(
                f"tensor {tensor.name!r} dtype must be one of {', '.join(DTYPES)}, got {tensor.dtype!r}"
            )
        if tensor.trainable and tensor.dtype != "float32":
            raise ShardlineConfigError(
                f"tensor {tensor.name!r} is trainable and {tensor.dtype!r}: the PS keeps a trainable tensor's "
                f"master copy in float32 (only a frozen tensor is stored in its own dtype)"
            )
    return out


def spec_difference(existing: common_pb2.JobSpec, requested: common_pb2.JobSpec) -> str | None:
    """The first field where two normalized specs differ, described for a person; None if equal."""

    def differs(field: str, a: object, b: object) -> str | None:
        return None if a == b else f"{field} is {a!r} but the request has {b!r}"

    for field in ("sync", "staleness", "world_size", "block_elements", "allow_nonfinite", "replication",
                  "worker_lease_timeout_seconds", "on_worker_failure", "max_grad_norm", "inexact_restarts",
                  "replicate_gradients"):
        found = differs(field, getattr(existing, field), getattr(requested, field))
        if found:
            return found
    found = differs("compression", compression_of(existing), compression_of(requested))  # empty: made before the option
    if found:
        return found
    for field in _OPTIMIZER_FIELDS:
        found = differs(f"optimizer.{field}", getattr(existing.optimizer, field), getattr(requested.optimizer, field))
        if found:
            return found
    if len(existing.param_groups) != len(requested.param_groups):
        return (f"the job has {max(1, len(existing.param_groups))} parameter groups but the request has "
                f"{max(1, len(requested.param_groups))}")
    for i, (a, b) in enumerate(zip(existing.param_groups, requested.param_groups)):
        for field in _OPTIMIZER_FIELDS:
            found = differs(f"param_groups[{i}].{field}", getattr(a, field), getattr(b, field))
            if found:
                return found
    old = {t.name: t for t in existing.tensors}
    new = {t.name: t for t in requested.tensors}
    missing = sorted(old.keys() - new.keys())
    extra = sorted(new.keys() - old.keys())
    if missing or extra:
        return f"tensors differ: the job has {missing!r} that the request lacks, the request has {extra!r} that the job lacks"
    for name, tensor in old.items():
        other = new[name]
        for field, a, b in (
            ("shape", list(tensor.shape), list(other.shape)),
            ("dtype", tensor.dtype, other.dtype),
            ("trainable", tensor.trainable, other.trainable),
            ("group", tensor.group, other.group),
        ):
            found = differs(f"tensor {name!r} {field}", a, b)
            if found:
                return found
    return None


def extension_difference(existing: common_pb2.JobExtension, requested: common_pb2.JobExtension) -> str | None:
    """The first field where two extensions of one revision differ, described for a person; None if equal."""
    if existing.step != requested.step:
        return (f"it starts at step {existing.step}, this request at step {requested.step} (the ranks add the group "
                f"before different steps)")
    for field in _OPTIMIZER_FIELDS:
        a, b = getattr(existing.group, field), getattr(requested.group, field)
        if a != b:
            return f"its group's {field} is {a!r}, this request's {b!r}"
    if list(existing.unfreeze) != list(requested.unfreeze):
        return f"it unfreezes {list(existing.unfreeze)!r}, this request {list(requested.unfreeze)!r}"
    old = [(t.name, list(t.shape), t.trainable) for t in existing.tensors]
    new = [(t.name, list(t.shape), t.trainable) for t in requested.tensors]
    if old != new:
        return f"it adds tensors (name, shape, trainable) {old!r}, this request {new!r}"
    return None


class JobRegistry:
    """Registered jobs by name and tombstones of deleted ones (module docstring: durability).

    ``clock`` gives wall-clock seconds for ``created_unix_ms``; ``store`` keeps the jobs across
    restarts (default: memory, i.e. not kept). Raises StateStoreError naming the store if a stored
    record cannot be read.
    """

    def __init__(self, clock: Callable[[], float] = time.time, store: StateStore | None = None,
                 default_replication: int = 1):
        # copies of every block for jobs created without a replication of their own
        self.default_replication = default_replication
        self._clock = clock
        self.store = store if store is not None else MemoryStateStore()
        self._cond = threading.Condition()
        state = self.store.load()
        self._jobs: dict[str, _Job] = {
            name: self._decode_job(name, value) for name, value in with_prefix(state, JOB_PREFIX).items()
        }
        self._tombstones: dict[str, dict] = with_prefix(state, TOMBSTONE_PREFIX)

    def _decode_job(self, name: str, value: dict) -> _Job:
        try:
            spec = json_format.ParseDict(value["spec"], common_pb2.JobSpec())
            if spec.name != name:
                raise ValueError(f"the spec is named {spec.name!r}")
            holders = {}
            for node, step in dict(value["holders"]).items():
                if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
                    raise ValueError(f"holder {node!r} has step {step!r}")
                holders[validate_name(node, "holder node_id")] = step
            ready, created_ms = value["ready"], value["created_unix_ms"]
            if not isinstance(ready, bool) or not isinstance(created_ms, int):
                raise ValueError(f"ready {ready!r} / created_unix_ms {created_ms!r}")
            ready_revision = value.get("ready_revision", 0)  # absent in records written before revisions
            if not isinstance(ready_revision, int) or not 0 <= ready_revision <= revision_of(spec):
                raise ValueError(f"ready_revision {ready_revision!r} (the spec is at revision {revision_of(spec)})")
            return _Job(spec=normalize_spec(spec), ready=ready, created_ms=created_ms,
                        uid=validate_uid(value["uid"]), holders=holders, ready_revision=ready_revision)
        except (KeyError, TypeError, ValueError, json_format.ParseError) as exc:
            raise StateStoreError(
                f"state store {self.store.location}: key {JOB_PREFIX + name!r} holds a bad job record: {exc}"
            ) from None

    def _require(self, name: str) -> _Job:
        job = self._jobs.get(name)
        if job is None:
            raise UnknownJobError(f"no job named {name!r}")
        return job

    def _new_uid(self) -> str:
        while True:  # a repeat is astronomically unlikely, but would confuse incarnations
            uid = secrets.token_hex(8)
            if uid not in self._tombstones and all(job.uid != uid for job in self._jobs.values()):
                return uid

    def _put(self, job: _Job) -> None:
        """Persist ``job``, then make it visible. Caller holds the lock."""
        self.store.apply({JOB_PREFIX + job.spec.name: job.persisted()})
        self._jobs[job.spec.name] = job

    def create(self, spec: common_pb2.JobSpec,
               fingerprints: Mapping[str, str] | None = None) -> tuple[JobRecord, bool]:
        """Register ``spec``; ``(record, True)`` for the creating call, ``(record, False)`` if it existed.

        A new job's ``replicate_gradients``, unset, is decided from ``fingerprints`` (live PS node
        id -> build fingerprint; None: no node known) by dispatcher/replay_policy.py, and logged;
        unset for an existing job, it means "as the job has it". Raises ShardlineConfigError for an
        invalid spec (or replay asked for on nodes of different fingerprints) and
        ShardlineStateError naming the first differing field if a job of that name exists with a
        different spec.
        """
        requested = spec
        spec = normalize_spec(spec)
        with self._cond:
            existing = self._jobs.get(spec.name)
            if existing is not None:
                # options the request leaves unset mean "as the job has them"
                for field in ("replication", "worker_lease_timeout_seconds", "on_worker_failure", "compression"):
                    if not getattr(requested, field):
                        setattr(spec, field, getattr(existing.spec, field))
                if not requested.HasField("replicate_gradients"):
                    spec.replicate_gradients = existing.spec.replicate_gradients
                difference = spec_difference(existing.spec, spec)
                if difference:
                    revision = revision_of(existing.spec)
                    extended = (f" (the job is at revision {revision}: parameter groups were added during training; "
                                f"a worker that starts now passes the job's groups as they are)") if revision else ""
                    raise ShardlineStateError(f"job {spec.name!r} already exists with a different spec: "
                                              f"{difference}{extended}")
                return existing.record(), False
            if not spec.replication:
                spec.replication = self.default_replication
            spec, why = replay_policy.resolve(spec, fingerprints or {})
            if why:  # a BSP/SSP job left to copies: say why (its steps cost three times the bytes for Adam)
                (log.warning if replay_policy.copies_by_default(spec) else log.info)(
                    "job %s: replicate_gradients %s: %s", spec.name, spec.replicate_gradients, why)
            del spec.extensions[:]  # a new job starts at revision 0; extend() makes the others
            job = _Job(spec=spec, ready=False, created_ms=int(self._clock() * 1000), uid=self._new_uid(), holders={})
            self._put(job)
            return job.record(), True

    def restore(self, spec: common_pb2.JobSpec, uid: str, node_id: str) -> tuple[JobRecord, bool]:
        """A PS node restoring incarnation ``uid`` of a job from its checkpoint asks for it.

        ``(existing record, False)`` if a job of that name exists, whatever its uid (the node
        compares uids). Raises ShardlineStateError if ``uid`` was deleted. Otherwise registers the
        normalized spec under ``uid``, ready (its tensors exist: in the checkpoint), and returns
        ``(record, True)``. Raises ShardlineConfigError for a bad spec, uid or node id.
        """
        spec = normalize_spec(spec)
        validate_uid(uid)
        validate_name(node_id, "node_id")
        with self._cond:
            existing = self._jobs.get(spec.name)
            if existing is not None:
                return existing.record(), False
            if uid in self._tombstones:
                raise ShardlineStateError(
                    f"job {spec.name!r} (uid {uid}) was deleted; node {node_id} must drop its checkpoint, not restore it"
                )
            job = _Job(spec=spec, ready=True, created_ms=int(self._clock() * 1000), uid=uid, holders={},
                       ready_revision=revision_of(spec))
            self._put(job)
            return job.record(), True

    def extend(self, name: str, uid: str, ext: common_pb2.JobExtension) -> tuple[JobRecord, bool]:
        """Make revision ``ext.revision`` of the job (a parameter group added during training);
        ``(record, True)`` for the call that made it, ``(record, False)`` if the same extension
        made it before (every rank asks). The revision is durable before it is visible; it is
        ready at once unless it adds tensors (their creator initializes them, then ``mark_ready``).

        Raises UnknownJobError, ShardlineStateError when ``uid`` is not the job's, the job is not
        ready, the revision is not the next one, or another extension made it (naming the first
        difference), ShardlineConfigError for an extension that does not fit the job.
        """
        validate_job_name(name)
        if not isinstance(ext, common_pb2.JobExtension):
            raise ShardlineConfigError(f"extension must be a JobExtension message, got {type(ext).__name__}")
        with self._cond:
            job = self._require(name)
            if uid and job.uid != uid:
                raise ShardlineStateError(f"job {name!r} is now uid {job.uid}, the extension is for uid {uid}")
            if not job.ready:
                raise ShardlineStateError(f"job {name!r} is not ready yet: its creator initializes it first")
            current = revision_of(job.spec)
            if 1 <= ext.revision <= current:
                difference = extension_difference(job.spec.extensions[ext.revision - 1], ext)
                if difference:
                    raise ShardlineStateError(f"revision {ext.revision} of job {name!r} was made by another request: "
                                              f"{difference} (every rank must add the same parameter group before "
                                              f"the same step)")
                return job.record(), False
            if ext.revision > current + 1:
                raise ShardlineStateError(f"job {name!r} is at revision {current}; the request makes revision "
                                          f"{ext.revision}: it missed a parameter group the other ranks added")
            spec = normalize_spec(apply_extension(job.spec, ext))
            extended = dataclasses.replace(job, spec=spec,
                                           ready_revision=ext.revision if not ext.tensors else job.ready_revision)
            self._put(extended)
            self._cond.notify_all()
            return extended.record(), True

    def delete(self, name: str) -> JobRecord:
        """Remove the job and keep its uid as a tombstone; returns the removed record.

        Raises UnknownJobError if there is no such job. Its waiters fail with UnknownJobError.
        """
        validate_job_name(name)
        with self._cond:
            job = self._require(name)
            tombstone = {"job": name, "deleted_unix_ms": int(self._clock() * 1000)}
            self.store.apply({TOMBSTONE_PREFIX + job.uid: tombstone}, deletes=[JOB_PREFIX + name])
            del self._jobs[name]
            self._tombstones[job.uid] = tombstone
            self._cond.notify_all()
            return job.record()

    def report_held(self, node_id: str, held: Iterable, *, record: bool) -> tuple[list[str], dict[str, int]]:
        """Process the jobs a node's heartbeat says it holds; returns ``(drop_jobs, checkpoint_steps)``.

        ``held`` are ``HeldJob`` messages (or anything with ``job``, ``uid``, ``has_durable`` and
        ``durable_step``), the node's complete list. ``drop_jobs``: names of held jobs whose uid was
        deleted, or whose name now has another uid. A held job the registry knows neither by name nor
        by uid (its state was lost) is kept, and so is one with an empty uid (incarnation unknown).
        ``checkpoint_steps``: job name -> ``checkpoint_step`` for held current jobs that have one.

        With ``record`` (the node is registered), the node becomes a holder of each current job it
        lists, with its durable step (None without ``has_durable``), and stops being a holder of the
        jobs it no longer lists; changes are persisted (StateStoreError: nothing changes).
        """
        drop: list[str] = []
        listed: dict[str, int | None] = {}
        with self._cond:
            for item in held:
                job = self._jobs.get(item.job)
                if not item.uid:
                    continue
                if item.uid in self._tombstones or (job is not None and job.uid != item.uid):
                    drop.append(item.job)
                elif job is not None:
                    listed[item.job] = int(item.durable_step) if item.has_durable else None
            changed: list[_Job] = []
            if record:
                for name, job in self._jobs.items():
                    holders = dict(job.holders)
                    if name in listed:
                        holders[node_id] = listed[name]
                    else:
                        holders.pop(node_id, None)
                    if holders != job.holders:
                        changed.append(dataclasses.replace(job, holders=holders))
            if changed:
                self.store.apply({JOB_PREFIX + job.spec.name: job.persisted() for job in changed})
                for job in changed:
                    self._jobs[job.spec.name] = job
            steps = {}
            for name in listed:
                current = self._jobs[name].record()
                if current.has_checkpoint:
                    steps[name] = current.checkpoint_step
            return sorted(set(drop)), steps

    def unknown_held(self, held: Iterable) -> list[str]:
        """Held jobs (``HeldJob``) the registry knows neither by name nor as deleted: a registry that
        lost its state. The node that holds one registers it again (``restore``)."""
        with self._cond:
            return sorted({item.job for item in held
                           if item.uid and item.job not in self._jobs and item.uid not in self._tombstones})

    def get(self, name: str) -> JobRecord:
        """The job named ``name``; raises UnknownJobError if there is none."""
        validate_job_name(name)
        with self._cond:
            return self._require(name).record()

    def mark_ready(self, name: str, revision: int = 0) -> JobRecord:
        """Mark the job's tensors (with ``revision``: also that revision's new tensors) initialized
        and wake its waiters. Idempotent (writes only once). Raises ShardlineStateError for a
        revision the job does not have."""
        validate_job_name(name)
        with self._cond:
            job = self._require(name)
            if isinstance(revision, bool) or not isinstance(revision, int) or not 0 <= revision <= revision_of(job.spec):
                raise ShardlineStateError(f"job {name!r} is at revision {revision_of(job.spec)}; it has no revision "
                                          f"{revision!r} to mark ready")
            if not job.ready or revision > job.ready_revision:
                self._put(dataclasses.replace(job, ready=True, ready_revision=max(job.ready_revision, revision)))
                self._cond.notify_all()
            return self._jobs[name].record()

    def wait_ready(self, name: str, timeout: float, revision: int = 0) -> JobRecord:
        """Block until the job is ready (with ``revision``: and that revision's new tensors are
        initialized), at most ``timeout`` seconds (0: just check).

        Raises UnknownJobError if there is no such job (or it is deleted meanwhile) and
        ShardlineTimeoutError if it is not ready in time.
        """
        validate_job_name(name)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0:
            raise ShardlineConfigError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        with self._cond:
            uid = self._require(name).uid

            def settled() -> bool:
                job = self._jobs.get(name)
                return job is None or job.uid != uid or (job.ready and job.ready_revision >= revision)

            if not self._cond.wait_for(settled, timeout=timeout):
                what = f"revision {revision} of job {name!r}" if revision else f"job {name!r}"
                raise ShardlineTimeoutError(f"{what} was not marked ready within {timeout:g} s")
            job = self._jobs.get(name)
            if job is None or job.uid != uid:
                raise UnknownJobError(f"job {name!r} was deleted while waiting for it to be ready")
            return job.record()

    def list(self) -> list[JobRecord]:
        """All jobs, sorted by name."""
        with self._cond:
            return [self._jobs[name].record() for name in sorted(self._jobs)]

    def incarnations(self) -> dict[str, tuple[str, int]]:
        """Every job's uid and revision by name, sorted by name (what a ring change checks on
        each heartbeat: no spec is copied)."""
        with self._cond:
            return {name: (self._jobs[name].uid, revision_of(self._jobs[name].spec)) for name in sorted(self._jobs)}
