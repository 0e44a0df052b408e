"""``PSOptimizer``'s keyword arguments grouped by what they are, and the one table checking them.

- :class:`JobOptions`: what the job is (rank 0 creates it so; every other rank must say the same
  or leave the option None, and :data:`MUST_MATCH` compares them with the job's spec);
- :class:`ConnectionOptions`: how this worker reaches the cluster;
- :class:`PerformanceOptions`: how a step's traffic is overlapped with compute (behaviour and
  results unchanged by them, BSP equals torch.optim with any).

:data:`OPTION_CHECKS` is the table of value checks (option -> check -> message), applied in order
by :func:`check_options`; each message quotes the bad value, as torch.distributed.elastic's do.
Design: docs/architecture.md, "Worker step protocol".
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

from shardline.services.compression import compression_of
from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2
from shardline.worker.client import DEFAULT_STRAGGLER_WARNING_SECONDS
from shardline.worker.overlap import DEFAULT_BUCKET_CAP_MB


@dataclass(frozen=True)
class JobOptions:
    """The job spec a worker creates (rank 0) or must find (any other rank). None: the job's own."""

    world_size: int
    rank: int
    sync: str = "bsp"
    staleness: int | None = None
    block_elements: int | None = None
    allow_nonfinite: bool = False
    replication: int | None = None
    worker_lease_timeout: float | None = None
    on_worker_failure: str | None = None
    max_grad_norm: float | None = None
    compression: str | None = None
    exact_restarts: bool | None = None
    replicate_gradients: bool | None = None
    flatten: bool = False

    def create_kwargs(self) -> dict:
        """``Client.init``'s keyword arguments for these options (the creator's defaults filled in)."""
        return dict(sync=self.sync, staleness=self.staleness or 0, world_size=self.world_size,
                    block_elements=self.block_elements, allow_nonfinite=self.allow_nonfinite,
                    replication=self.replication, worker_lease_timeout=self.worker_lease_timeout,
                    on_worker_failure=self.on_worker_failure, max_grad_norm=self.max_grad_norm,
                    compression=self.compression, exact_restarts=self.exact_restarts is not False,
                    replicate_gradients=self.replicate_gradients)


@dataclass(frozen=True)
class ConnectionOptions:
    """How this worker reaches the cluster: ``Client``'s keyword arguments."""

    transport: str = "auto"
    pull_timeout: float = 600.0
    connect_timeout: float = 60.0
    rpc_timeout: float = 10.0
    recovery_timeout: float = 120.0
    cluster_token: bytes | None = None
    tls_ca: bytes | None = None
    straggler_warning_seconds: float = DEFAULT_STRAGGLER_WARNING_SECONDS
    rack: str | None = None

    def client_kwargs(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class PerformanceOptions:
    """How a step's traffic overlaps compute (worker/overlap.py, worker/priority_pull.py)."""

    prefetch_window: int = 0
    overlap: bool = False
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    priority_pull: bool = True
    host_aggregation: bool | None = None   # None: where a push crosses hosts (worker/host_step.py)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _is_bool_or_none(value) -> bool:   # None: as the job has it
    return value is None or isinstance(value, bool)


# option -> the check its value must pass -> what the message says it must be (", got <value>" follows).
OPTION_CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("prefetch_window", lambda v: v in (0, 1) and not isinstance(v, bool),
     "must be 0 (step() returns with fresh parameters) or 1 (the pull runs until the parameters are next "
     "used); a BSP worker cannot run further ahead"),
    ("overlap", _is_bool, "must be True or False"),
    ("priority_pull", _is_bool, "must be True or False"),
    ("flatten", _is_bool, "must be True or False"),
    ("exact_restarts", _is_bool_or_none, "must be True or False"),
    ("replicate_gradients", _is_bool_or_none, "must be True or False"),
    ("host_aggregation", _is_bool_or_none, "must be True, False or None (where a push crosses hosts)"),
)


def check_options(options: dict) -> None:
    """Check each option of ``options`` (name -> value) that :data:`OPTION_CHECKS` lists, in the
    table's order; ShardlineConfigError quoting the first bad value."""
    for name, check, must in OPTION_CHECKS:
        if name in options and not check(options[name]):
            raise ShardlineConfigError(f"{name} {must}, got {options[name]!r}")


@dataclass(frozen=True)
class MustMatch:
    """An option of a worker joining a job that must be what the job has (unless None: the job's)."""

    option: str
    job_has: Callable[[common_pb2.JobSpec], Any]   # the job's value, in the option's terms
    worker_asks: Callable[[JobOptions], Any]       # the worker's; None: it takes the job's
    message: str                                   # formatted with job, has, asks
    same: Callable[[Any, Any], bool] = operator.eq   # (has, asks) -> do they agree


MUST_MATCH: tuple[MustMatch, ...] = (
    MustMatch("world_size", lambda spec: spec.world_size, lambda o: o.world_size,
              "job {job!r} has world_size {has}, this worker says {asks}"),
    MustMatch("staleness", lambda spec: (spec.sync, spec.staleness),
              lambda o: None if o.staleness is None else (o.sync, o.staleness),
              "job {job!r} is sync {has[0]!r} with staleness {has[1]}, this worker says {asks[0]!r} with staleness "
              "{asks[1]!r}"),
    MustMatch("max_grad_norm", lambda spec: spec.max_grad_norm, lambda o: o.max_grad_norm,
              "job {job!r} clips gradients at max_grad_norm {has:g} (0: not at all), this worker asks for {asks!r}",
              same=lambda has, asks: float(asks) == has),
    MustMatch("exact_restarts", lambda spec: not spec.inexact_restarts, lambda o: o.exact_restarts,
              "job {job!r} has exact_restarts {has}, this worker asks for {asks!r}"),
    MustMatch("replicate_gradients", lambda spec: spec.replicate_gradients, lambda o: o.replicate_gradients,
              "job {job!r} has replicate_gradients {has}, this worker asks for {asks!r}"),
    MustMatch("compression", compression_of, lambda o: o.compression,
              "job {job!r} pushes gradients with compression {has!r}, this worker asks for {asks!r}"),
)


def check_job_matches(spec: common_pb2.JobSpec, options: JobOptions) -> None:
    """The job a worker joined must be what the worker's options say: ShardlineConfigError naming
    the first option of :data:`MUST_MATCH` that differs, with both values."""
    for row in MUST_MATCH:
        asks = row.worker_asks(options)
        if asks is None:
            continue
        has = row.job_has(spec)
        if not row.same(has, asks):
            raise ShardlineConfigError(row.message.format(job=spec.name, has=has, asks=asks))
