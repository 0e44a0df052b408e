"""Job registry: validated, normalized job specs and their readiness.

A job is a namespace of tensors with an optimizer, a sync mode and a world size. Every worker of a
job calls ``create`` with the spec it derives from its model; exactly one call creates the job
(``created=True``: that caller initializes the tensors and then calls ``mark_ready``), the others
get the existing job and ``wait_ready`` for it. A spec that differs from the registered one is a
conflict (two different models under one job name), reported with the first differing field.

Specs are normalized before comparison and storage: ``block_elements`` 0 becomes
``DEFAULT_BLOCK_ELEMENTS`` and an empty tensor dtype becomes ``"float32"``. Tensors are compared by
name, so the order in which workers list them does not matter. Pure and thread-safe.
"""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

from shardline.services.blocks import DEFAULT_BLOCK_ELEMENTS, validate_block_elements
from shardline.services.errors import ShardlineConfigError, ShardlineStateError, ShardlineTimeoutError
from shardline.services.pb import common_pb2

JOB_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
TENSOR_NAME_RE = re.compile(r"[A-Za-z0-9._/-]{1,256}")
SYNC_MODES = ("bsp", "asp")
OPTIMIZERS = ("sgd", "adam", "adamw")
DTYPES = ("float32",)
_OPTIMIZER_FIELDS = (
    "kind", "lr", "momentum", "dampening", "nesterov", "weight_decay",
    "beta1", "beta2", "eps", "amsgrad", "maximize",
)


class UnknownJobError(ShardlineStateError, LookupError):
    """No job of that name is registered."""


@dataclass(frozen=True)
class JobRecord:
    """A snapshot of a registered job. ``spec`` is a private copy; mutating it changes nothing."""

    spec: common_pb2.JobSpec
    ready: bool
    created_unix_ms: int

    @property
    def name(self) -> str:
        return self.spec.name


def validate_job_name(name: object) -> str:
    if not isinstance(name, str) or not JOB_NAME_RE.fullmatch(name):
        raise ShardlineConfigError(f"job name must be 1..128 characters of [A-Za-z0-9._-], got {name!r}")
    return name


def _check_real(value: float, what: str, *, low: float = 0.0, below: float | None = None) -> None:
    """``value`` finite and in ``[low, below)`` (or ``[low, inf)``)."""
    if not math.isfinite(value) or value < low or (below is not None and value >= below):
        bound = f"in [{low:g}, {below:g})" if below is not None else f">= {low:g}"
        raise ShardlineConfigError(f"{what} must be finite and {bound}, got {value!r}")


def _validate_optimizer(opt: common_pb2.OptimizerSpec) -> None:
    # Ranges are the ones torch.optim enforces, so a job the PS accepts is one torch would run.
    if opt.kind not in OPTIMIZERS:
        raise ShardlineConfigError(f"optimizer.kind must be one of {', '.join(OPTIMIZERS)}, got {opt.kind!r}")
    _check_real(opt.lr, "optimizer.lr")
    _check_real(opt.weight_decay, "optimizer.weight_decay")
    if opt.kind == "sgd":
        _check_real(opt.momentum, "optimizer.momentum")
        _check_real(opt.dampening, "optimizer.dampening")
        if opt.nesterov and (opt.momentum <= 0 or opt.dampening != 0):
            raise ShardlineConfigError(
                "optimizer.nesterov needs momentum > 0 and dampening 0, "
                f"got momentum={opt.momentum!r}, dampening={opt.dampening!r}"
            )
    else:
        _check_real(opt.beta1, "optimizer.beta1", below=1.0)
        _check_real(opt.beta2, "optimizer.beta2", below=1.0)
        _check_real(opt.eps, "optimizer.eps")


def normalize_spec(spec: common_pb2.JobSpec) -> common_pb2.JobSpec:
    """Validate ``spec`` and return a normalized copy. Raises ShardlineConfigError quoting the bad value."""
    if not isinstance(spec, common_pb2.JobSpec):
        raise ShardlineConfigError(f"job spec must be a JobSpec message, got {type(spec).__name__}")
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    validate_job_name(out.name)
    if out.sync not in SYNC_MODES:
        raise ShardlineConfigError(f"sync must be one of {', '.join(SYNC_MODES)}, got {out.sync!r}")
    if out.world_size < 1:
        raise ShardlineConfigError(f"world_size must be >= 1, got {out.world_size!r}")
    if out.block_elements == 0:
        out.block_elements = DEFAULT_BLOCK_ELEMENTS
    validate_block_elements(out.block_elements)
    _validate_optimizer(out.optimizer)
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
    return out


def spec_difference(existing: common_pb2.JobSpec, requested: common_pb2.JobSpec) -> str | None:
    """The first field where two normalized specs differ, described for a person; None if equal."""

    def differs(field: str, a: object, b: object) -> str | None:
        return None if a == b else f"{field} is {a!r} but the request has {b!r}"

    for field in ("sync", "world_size", "block_elements", "allow_nonfinite"):
        found = differs(field, getattr(existing, field), getattr(requested, field))
        if found:
            return found
    for field in _OPTIMIZER_FIELDS:
        found = differs(f"optimizer.{field}", getattr(existing.optimizer, field), getattr(requested.optimizer, field))
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
        ):
            found = differs(f"tensor {name!r} {field}", a, b)
            if found:
                return found
    return None


class JobRegistry:
    """Registered jobs by name. ``clock`` gives wall-clock seconds for ``created_unix_ms``."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._cond = threading.Condition()
        self._specs: dict[str, common_pb2.JobSpec] = {}
        self._ready: dict[str, bool] = {}
        self._created_ms: dict[str, int] = {}

    def _record(self, name: str) -> JobRecord:
        spec = common_pb2.JobSpec()
        spec.CopyFrom(self._specs[name])
        return JobRecord(spec=spec, ready=self._ready[name], created_unix_ms=self._created_ms[name])

    def _require(self, name: str) -> None:
        if name not in self._specs:
            raise UnknownJobError(f"no job named {name!r}")

    def create(self, spec: common_pb2.JobSpec) -> tuple[JobRecord, bool]:
        """Register ``spec``; ``(record, True)`` for the creating call, ``(record, False)`` if it existed.

        Raises ShardlineConfigError for an invalid spec and ShardlineStateError naming the first
        differing field if a job of that name exists with a different spec.
        """
        spec = normalize_spec(spec)
        with self._cond:
            existing = self._specs.get(spec.name)
            if existing is not None:
                difference = spec_difference(existing, spec)
                if difference:
                    raise ShardlineStateError(f"job {spec.name!r} already exists with a different spec: {difference}")
                return self._record(spec.name), False
            self._specs[spec.name] = spec
            self._ready[spec.name] = False
            self._created_ms[spec.name] = int(self._clock() * 1000)
            return self._record(spec.name), True

    def get(self, name: str) -> JobRecord:
        """The job named ``name``; raises UnknownJobError if there is none."""
        validate_job_name(name)
        with self._cond:
            self._require(name)
            return self._record(name)

    def mark_ready(self, name: str) -> JobRecord:
        """Mark the job's tensors initialized and wake its waiters. Idempotent."""
        validate_job_name(name)
        with self._cond:
            self._require(name)
            self._ready[name] = True
            self._cond.notify_all()
            return self._record(name)

    def wait_ready(self, name: str, timeout: float) -> JobRecord:
        """Block until the job is ready, at most ``timeout`` seconds (0: just check).

        Raises UnknownJobError if there is no such job and ShardlineTimeoutError if it is not ready in time.
        """
        validate_job_name(name)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout < 0:
            raise ShardlineConfigError(f"timeout must be a finite number of seconds >= 0, got {timeout!r}")
        with self._cond:
            self._require(name)
            if not self._cond.wait_for(lambda: self._ready[name], timeout=timeout):
                raise ShardlineTimeoutError(f"job {name!r} was not marked ready within {timeout:g} s")
            return self._record(name)

    def list(self) -> list[JobRecord]:
        """All jobs, sorted by name."""
        with self._cond:
            return [self._record(name) for name in sorted(self._specs)]
