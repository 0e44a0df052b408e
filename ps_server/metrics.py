"""Prometheus metrics of a PS node (module-level: one node per process).

Two kinds:

* **Events**, recorded by the data plane through :class:`PSMetrics` (requests, payload bytes,
  latencies, optimizer apply time, BSP barrier and pull waits).
* **State**, read from the node when Prometheus scrapes (:func:`watch_node` registers it once):
  blocks and bytes held, job steps, BSP barrier fill, ring epoch, heartbeat age. Nothing to keep
  in sync, and always current.

Labels stay bounded: ``op`` (data-plane operations), ``code`` (data-plane error codes),
``direction`` (received/sent) and ``job_name`` (jobs on the cluster; ``job_name`` because Prometheus
reserves ``job`` for the scrape job). No per-block or per-tensor labels.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shardline.ps_server.memory_report import job_reports, process_memory
from shardline.services.errors import ErrorCode

# Data-plane requests: ~150 µs ping-pong on loopback up to pulls that wait for a BSP barrier.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Optimizer application of one step over a node's blocks: sub-millisecond to seconds.
APPLY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Waits for other workers: as long as the slowest worker's step.
WAIT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Payload of one request: zero-flag pushes and deltas of nothing up to ~1 GiB frames.
PAYLOAD_BUCKETS = (0, 1024, 16384, 131072, 1048576, 4194304, 16777216, 67108864, 268435456, 1073741824)

REQUESTS = Counter("shardline_ps_requests_total", "Data-plane requests by operation and result code (errors: code != OK)",
                   ["op", "code"])
REQUEST_SECONDS = Histogram("shardline_ps_request_seconds",
                            "Data-plane request handling time in seconds, header received to reply sent, including pull waits",
                            ["op"], buckets=LATENCY_BUCKETS)
PAYLOAD_BYTES = Counter("shardline_ps_payload_bytes_total", "Tensor payload bytes received (push, init) and sent (pull)",
                        ["op", "direction"])
REQUEST_PAYLOAD_BYTES = Histogram("shardline_ps_request_payload_bytes",
                                  "Tensor payload bytes moved by one successful request (received plus sent)",
                                  ["op"], buckets=PAYLOAD_BUCKETS)
CONNECTIONS = Gauge("shardline_ps_dataplane_connections", "Open data-plane connections")
CONNECTIONS_REFUSED = Counter("shardline_ps_dataplane_connections_refused_total",
                              "Data-plane connections turned away because the node had max_connections open")
INFLIGHT_BYTES = Gauge("shardline_ps_inflight_payload_bytes",
                       "Bytes of payload buffers data-plane connections hold (bounded by max_inflight_bytes)")
INFLIGHT_LIMIT = Gauge("shardline_ps_inflight_payload_limit_bytes", "The node's max_inflight_bytes")
APPLY_SECONDS = Histogram("shardline_ps_optimizer_apply_seconds",
                          "Time to apply one optimizer update on this node (BSP: a whole step; ASP: one push)",
                          ["job_name"], buckets=APPLY_BUCKETS)
BARRIER_SECONDS = Histogram("shardline_ps_bsp_barrier_seconds",
                            "BSP: time from the first commit of a step to its application on this node "
                            "(how long the fastest worker waited for the slowest)",
                            ["job_name"], buckets=WAIT_BUCKETS)
PULL_WAIT_SECONDS = Histogram("shardline_ps_pull_wait_seconds",
                              "Time a pull waited server-side for the job to reach the step it asked for (0: no wait)",
                              ["job_name"], buckets=WAIT_BUCKETS)
HEARTBEAT_FAILURES = Counter("shardline_ps_heartbeat_failures_total", "Heartbeats to the dispatcher that failed")
# Checkpoints: a few ms for a LoRA delta up to minutes for a full multi-GB node.
CHECKPOINT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CHECKPOINTS = Counter("shardline_ps_checkpoints_total", "Checkpoints written by this node, by kind (full, incremental)",
                      ["job_name", "kind"])
CHECKPOINT_FAILURES = Counter("shardline_ps_checkpoint_failures_total",
                              "Checkpoints that failed to write (disk full, I/O error); training goes on", ["job_name"])
CHECKPOINTS_SKIPPED = Counter("shardline_ps_checkpoints_skipped_total",
                              "Periodic checkpoints skipped because the writer was stalled (a disk that stopped responding)", ["job_name"])
CHECKPOINT_BYTES = Counter("shardline_ps_checkpoint_bytes_total", "Bytes written by checkpoints (files and manifests)",
                           ["job_name"])
CHECKPOINT_SECONDS = Histogram("shardline_ps_checkpoint_write_seconds",
                               "Time to write one checkpoint (background thread, off the training path)",
                               ["job_name"], buckets=CHECKPOINT_BUCKETS)
CHECKPOINT_SNAPSHOT_SECONDS = Histogram("shardline_ps_checkpoint_snapshot_seconds",
                                        "Time the job lock was held to copy the blocks of one checkpoint",
                                        ["job_name"], buckets=CHECKPOINT_BUCKETS)
CHECKPOINT_STEP = Gauge("shardline_ps_checkpoint_step", "Step of the newest durable checkpoint on this node",
                        ["job_name"])
RESTORE_SECONDS = Gauge("shardline_ps_restore_seconds", "Time the node took to restore a job from its checkpoint at start",
                        ["job_name"])
INFO = Gauge("shardline_ps_info", "Identity of this PS node (value 1)", ["node_id", "rack"])


class PSMetrics:
    """What the data plane and the node record; one per process (``ps_server.main`` makes it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._barrier_open: dict[str, tuple[int, float]] = {}  # job -> (step, first commit time)

    def request(self, op: str | None, code: str, *, seconds: float | None = None, bytes_in: int = 0, bytes_out: int = 0) -> None:
        """One data-plane request finished with ``code`` ("OK" or an ErrorCode name)."""
        op = op.removeprefix("OP_") if op else "UNKNOWN"  # "PUSH", "PULL", ... (bad frames: UNKNOWN)
        REQUESTS.labels(op, code).inc()
        if seconds is not None:
            REQUEST_SECONDS.labels(op).observe(seconds)
        if bytes_in:
            PAYLOAD_BYTES.labels(op, "received").inc(bytes_in)
        if bytes_out:
            PAYLOAD_BYTES.labels(op, "sent").inc(bytes_out)
        if code == ErrorCode.OK:
            REQUEST_PAYLOAD_BYTES.labels(op).observe(bytes_in + bytes_out)

    def apply(self, job: str, seconds: float) -> None:
        """An optimizer update of ``job`` took ``seconds`` on this node."""
        APPLY_SECONDS.labels(job).observe(seconds)

    def pull_wait(self, job: str, seconds: float) -> None:
        PULL_WAIT_SECONDS.labels(job).observe(seconds)

    def commit(self, job: str, step: int, applied: bool, now: float | None = None) -> None:
        """A BSP commit of ``step`` was accepted; ``applied`` if it completed the barrier.

        The barrier time of a step runs from its first accepted commit to its application.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            opened = self._barrier_open.get(job)
            if opened is None or opened[0] != step:
                opened = self._barrier_open[job] = (step, now)
            if applied:
                del self._barrier_open[job]
        if applied:
            BARRIER_SECONDS.labels(job).observe(max(0.0, now - opened[1]))

    def checkpoint_written(self, job: str, step: int, nbytes: int, seconds: float, full: bool) -> None:
        CHECKPOINTS.labels(job, "full" if full else "incremental").inc()
        CHECKPOINT_BYTES.labels(job).inc(nbytes)
        CHECKPOINT_SECONDS.labels(job).observe(seconds)
        CHECKPOINT_STEP.labels(job).set(step)

    def checkpoint_failed(self, job: str) -> None:
        CHECKPOINT_FAILURES.labels(job).inc()

    def checkpoint_skipped(self, job: str) -> None:
        CHECKPOINTS_SKIPPED.labels(job).inc()

    def checkpoint_snapshot(self, job: str, seconds: float) -> None:
        CHECKPOINT_SNAPSHOT_SECONDS.labels(job).observe(seconds)

    def restored(self, job: str, step: int, seconds: float) -> None:
        RESTORE_SECONDS.labels(job).set(seconds)
        CHECKPOINT_STEP.labels(job).set(step)

    def timed_commit(self, job: str, step: int, commit: Callable[[], int]) -> int:
        """Run ``commit()`` (returns the job step after) and record barrier and apply time."""
        started = time.perf_counter()
        after = commit()
        applied = after > step
        if applied:
            self.apply(job, time.perf_counter() - started)
        self.commit(job, step, applied)
        return after


class NodeCollector(Collector):
    """Scrape-time state of the node set by :func:`watch_node` (no series until then)."""

    def __init__(self):
        self.node = None
        self.last_heartbeat: float | None = None  # time.monotonic() of the last successful heartbeat

    def collect(self):
        node = self.node
        blocks = GaugeMetricFamily("shardline_ps_blocks", "Blocks held by this node", labels=["job_name"])
        nbytes = GaugeMetricFamily("shardline_ps_parameter_bytes", "Bytes of fp32 parameter values held by this node",
                                   labels=["job_name"])
        step = GaugeMetricFamily("shardline_ps_job_step", "Job step (version of the newest update) on this node",
                                 labels=["job_name"])
        world = GaugeMetricFamily("shardline_ps_job_world_size", "Workers in the job", labels=["job_name"])
        committed = GaugeMetricFamily("shardline_ps_bsp_committed_workers",
                                      "BSP: workers that committed the step being collected (world size reached: applied)",
                                      labels=["job_name"])
        early = CounterMetricFamily("shardline_ps_blocks_applied_early",
                                    "BSP: blocks whose step was computed when every worker's gradient had arrived, "
                                    "before the commits (pipelined apply)", labels=["job_name"])
        unused = CounterMetricFamily("shardline_ps_blocks_stepped_early_unused",
                                     "BSP: blocks stepped early whose result was not used (the commits applied, "
                                     "moved or dropped the block first): optimizer work done twice", labels=["job_name"])
        replayed = CounterMetricFamily("shardline_ps_blocks_replayed",
                                       "Copy holder, replicate_gradients: block steps computed here from the "
                                       "primary's mean gradient", labels=["job_name"])
        copy_reads = CounterMetricFamily("shardline_ps_blocks_read_from_copies",
                                         "Copy holder: blocks of workers' BSP reads served from the copies held "
                                         "here (reads from copy holders)", labels=["job_name"])
        diverged = CounterMetricFamily("shardline_ps_replica_divergence",
                                       "Copy holder, replicate_gradients: replayed blocks whose checksum differed from "
                                       "the primary's at a divergence check (each resynced with a full copy)",
                                       labels=["job_name"])
        aggregated = CounterMetricFamily("shardline_ps_aggregated_push_ranks",
                                         "BSP/SSP: ranks whose gradients came summed in a host's aggregated push "
                                         "(one push for several ranks; resends not counted)", labels=["job_name"])
        before_acks = CounterMetricFamily("shardline_ps_blocks_read_before_acks",
                                          "Primary, BSP with replayed gradients: blocks of workers' reads served at a "
                                          "step its copy holders had not acknowledged yet (the workers keep that "
                                          "step's gradients to resend)", labels=["job_name"])
        memory = GaugeMetricFamily("shardline_ps_memory_bytes",
                                   "Bytes of a job's tensors on this node by kind (values, optimizer_state, gradients, "
                                   "parked_gradients, replay_spares, kept_values, staging, held_copies, frozen_files, "
                                   "delta_history): docs/operations.md, \"Memory\"", labels=["job_name", "kind"])
        held = GaugeMetricFamily("shardline_ps_memory_parameters",
                                 "Parameters of the blocks a job holds on this node (primaries and copies): "
                                 "shardline_ps_memory_bytes per parameter is counted against these",
                                 labels=["job_name"])
        families = [blocks, nbytes, step, world, committed, early, unused, replayed, copy_reads, diverged, aggregated,
                    before_acks, memory, held]
        if node is not None:
            for report in job_reports(node):
                held.add_metric([report.name], report.parameters)
                for kind, value in report.bytes.items():
                    memory.add_metric([report.name, kind], value)
            anon = process_memory()[1]
            if anon:
                families.append(GaugeMetricFamily("shardline_ps_process_anon_bytes",
                                                  "Anonymous resident memory of this process (RssAnon: the heap, "
                                                  "not files nor shared memory)", value=anon))
            for job in node.store.jobs():
                name = job.name
                blocks.add_metric([name], len(job.blocks))
                nbytes.add_metric([name], job.bytes)
                step.add_metric([name], job.step)
                world.add_metric([name], job.world_size)
                committed.add_metric([name], len(getattr(job, "committed", ()) or ()))
                early.add_metric([name], getattr(job, "applied_early", 0))
                unused.add_metric([name], getattr(job, "early_unused", 0))
                replayed.add_metric([name], getattr(job, "steps_replayed", 0))
                copy_reads.add_metric([name], getattr(job, "copy_reads", 0))
                diverged.add_metric([name], getattr(job, "replica_divergences", 0))
                aggregated.add_metric([name], getattr(job, "aggregated_ranks", 0))
                before_acks.add_metric([name], getattr(job, "reads_before_acks_served", 0))
            families.append(GaugeMetricFamily("shardline_ps_ring_epoch", "Ring epoch this node routes with",
                                              value=node.routing.epoch))
            if self.last_heartbeat is not None:
                families.append(GaugeMetricFamily(
                    "shardline_ps_heartbeat_age_seconds",
                    "Seconds since this node's last successful heartbeat to the dispatcher",
                    value=max(0.0, time.monotonic() - self.last_heartbeat)))
        return families

    def describe(self):
        return []  # state appears once a node is watched; no fixed description needed


_COLLECTOR = NodeCollector()
REGISTRY.register(_COLLECTOR)


def watch_node(node, node_id: str | None = None, rack: str | None = None) -> None:
    """Export ``node``'s state at scrape time (and its identity as ``shardline_ps_info``)."""
    _COLLECTOR.node = node
    if node_id is not None:
        INFO.labels(node_id, rack or "default").set(1)


def heartbeat(ok: bool) -> None:
    """A heartbeat to the dispatcher succeeded (``ok``) or failed."""
    if ok:
        _COLLECTOR.last_heartbeat = time.monotonic()
    else:
        HEARTBEAT_FAILURES.inc()
