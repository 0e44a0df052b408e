"""Prometheus metrics of a training worker: what every ``PSOptimizer`` records, and the daemon's extras.

``PSOptimizer`` records :class:`StepMetrics` in prometheus-client's default registry, so a training
script's own exporter shows them, and ``PSOptimizer(..., metrics_port=N)`` serves that registry
(:func:`serve`). The ``shardline-worker`` daemon trains with a ``PSOptimizer`` and adds
:class:`TaskMetrics` (loss, tokens of its job file's task). The metrics are defined once, here at
module level: several optimizers in one process share them, each with its own label values.

Every series carries ``job_name`` and ``rank`` (bounded by the job's world size), so dashboards can
aggregate per job and show the spread between ranks. (``job_name``, not ``job``: Prometheus
reserves ``job`` for the scrape job.) Nothing is labelled per tensor.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram

_LABELS = ["job_name", "rank"]
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# --- recorded by every PSOptimizer (library and daemon) ----------------------------------------------
STEPS = Counter("shardline_worker_steps_total", "Training steps this worker completed", _LABELS)
STEP_SECONDS = Histogram("shardline_worker_step_seconds",
                         "Wall time of one training step (forward, backward, push, wait, pull): from zero_grad() or "
                         "the end of the previous step, whichever is later, to the end of step()",
                         _LABELS, buckets=STEP_BUCKETS)
VERSION = Gauge("shardline_worker_version", "Job step (version) of the parameters this worker holds", _LABELS)
PUSH_BYTES = Counter("shardline_worker_push_bytes_total",
                     "Gradient payload bytes this worker pushed (all-zero blocks go as flags, without payload)",
                     _LABELS)
PULL_BYTES = Counter("shardline_worker_pull_bytes_total",
                     "Parameter payload bytes this worker pulled (changed blocks only)", _LABELS)
PULL_WAIT_SECONDS = Histogram("shardline_worker_pull_wait_seconds",
                              "Time the training thread waited for a step's pull after the commit (the other workers, "
                              "the update on the PS nodes, the transfer); with prefetch_window 1 the part the next "
                              "use of the parameters waited", _LABELS, buckets=WAIT_BUCKETS)

# --- the shardline-worker daemon only (its job file's task) ------------------------------------------
LOSS = Gauge("shardline_worker_loss", "Training loss of the last step", _LABELS)
TOKENS = Counter("shardline_worker_tokens_total", "Non-padding input tokens trained on", _LABELS)

LIBRARY_METRICS = (STEPS, STEP_SECONDS, VERSION, PUSH_BYTES, PULL_BYTES, PULL_WAIT_SECONDS)
DAEMON_METRICS = (LOSS, TOKENS)


class StepMetrics:
    """The series one ``PSOptimizer`` records (``job_name``, ``rank``); creating it makes every
    series visible (at 0) before the first step.

    The optimizer calls :meth:`start` from ``zero_grad()``, :meth:`waited` with the time it blocked
    on a step's pull, :meth:`transferred` once a pull landed (the client's :class:`TransferStats`
    totals; the counters take what grew since the last call), and :meth:`stepped` at the end of
    ``step()``. The optimizer makes these calls one at a time (a background pull of prefetch_window 1
    calls :meth:`transferred` before the training thread goes on).
    """

    def __init__(self, job: str, rank: int):
        labels = (job, str(rank))
        self.steps = STEPS.labels(*labels)
        self.step_seconds = STEP_SECONDS.labels(*labels)
        self.version = VERSION.labels(*labels)
        self.push_bytes = PUSH_BYTES.labels(*labels)
        self.pull_bytes = PULL_BYTES.labels(*labels)
        self.pull_wait_seconds = PULL_WAIT_SECONDS.labels(*labels)
        self._pushed = self._pulled = 0   # the client's totals already counted
        self._started = time.perf_counter()

    def start(self) -> None:
        """A step begins now (``zero_grad()``)."""
        self._started = time.perf_counter()

    def stepped(self) -> None:
        """A step ended: count it and its time since :meth:`start` or the previous step's end."""
        now = time.perf_counter()
        self.steps.inc()
        self.step_seconds.observe(now - self._started)
        self._started = now

    def waited(self, seconds: float) -> None:
        self.pull_wait_seconds.observe(seconds)

    def transferred(self, stats, version: int) -> None:
        """After a pull: count the bytes ``stats`` (pushed_bytes, pulled_bytes totals) moved since the
        last call, and hold ``version``."""
        pushed, pulled = stats.pushed_bytes, stats.pulled_bytes
        self.push_bytes.inc(max(0, pushed - self._pushed))
        self.pull_bytes.inc(max(0, pulled - self._pulled))
        self._pushed, self._pulled = pushed, pulled
        self.version.set(version)


class TaskMetrics:
    """The daemon's series of its task: ``loss`` (NaN before the first step: a gap, not 0) and ``tokens``."""

    def __init__(self, job: str, rank: int):
        labels = (job, str(rank))
        self.loss = LOSS.labels(*labels)
        self.tokens = TOKENS.labels(*labels)
        self.loss.set(float("nan"))


def check_bind(host: str, port: int, *, has_token: bool) -> None:
    """The daemons' bind policy (services/security.py) for a library's metrics endpoint: ``port`` is
    0 (a free port) to 65535, and a ``host`` that is not loopback needs a cluster token. Raises
    ShardlineConfigError."""
    from shardline.services.daemon import format_host_port
    from shardline.services.errors import ShardlineConfigError
    from shardline.services.security import TOKEN_FILE_ENV, is_loopback

    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ShardlineConfigError(f"metrics_port must be a port number (0: a free port), got {port!r}")
    if not has_token and not is_loopback(host):
        raise ShardlineConfigError(
            f"refusing to serve metrics on {format_host_port(str(host), port)}: not a loopback address, and no "
            f"cluster token is set (cluster_token= or {TOKEN_FILE_ENV}); use metrics_host='127.0.0.1' (the "
            f"default) or a cluster token")


def serve(host: str, port: int, *, has_token: bool) -> tuple[object, str]:
    """Serve the default registry on ``host:port`` (0 = a free port) after :func:`check_bind`.
    Returns (server, "host:port"); stop it with ``server.shutdown()`` and ``server.server_close()``.
    Raises ShardlineConfigError (the policy, or the address cannot be bound)."""
    from shardline.services.daemon import format_host_port, start_metrics_server
    from shardline.services.errors import ShardlineConfigError

    check_bind(host, port, has_token=has_token)
    try:
        server, bound = start_metrics_server(host, port)
    except OSError as exc:
        raise ShardlineConfigError(f"cannot serve metrics on {format_host_port(host, port)}: "
                                   f"{exc.strerror or exc}") from None
    return server, format_host_port(host, bound)
