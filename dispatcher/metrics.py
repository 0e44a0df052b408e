"""Prometheus metrics of the dispatcher (module-level: one dispatcher per process).

The dispatcher's expiry loop calls :func:`publish` every ``EXPIRE_PERIOD_SECONDS`` (and every
registration calls it too), so the membership gauges are at most that old when scraped. Per-node
series carry ``node_id`` and ``rack`` (bounded by the cluster size); a node's series disappear
only when the dispatcher forgets the node (today: never; dead nodes stay listed with
``shardline_node_alive 0``). Per-job series carry ``job_name`` (bounded by the jobs) and
disappear when the job is deleted. gRPC request counts and latencies of every daemon come from
:mod:`services.grpc_metrics`.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

from prometheus_client import Counter, Gauge

RING_EPOCH = Gauge("shardline_ring_epoch", "Epoch of the routing table the dispatcher serves")
LIVE_NODES = Gauge("shardline_live_nodes", "PS nodes currently alive")
DEAD_NODES = Gauge("shardline_dead_nodes", "PS nodes declared dead (missed heartbeats past the timeout) and not back")
NODES_DECLARED_DEAD = Counter("shardline_nodes_declared_dead_total", "Times a PS node was declared dead")
HEARTBEAT_TIMEOUT = Gauge("shardline_heartbeat_timeout_seconds",
                          "Heartbeat silence after which the dispatcher declares a PS node dead")
JOBS = Gauge("shardline_jobs", "Jobs registered with the dispatcher")
RING_CHANGE_PENDING = Gauge("shardline_ring_change_pending_seconds",
                            "Seconds the pending ring change (a join, drain or rebalance) has waited; 0: none")
RING_CHANGE_WAITING = Gauge("shardline_ring_change_waiting_nodes",
                            "PS nodes the pending ring change still waits for (shardline status names them)")
JOB_CHECKPOINT_STEP = Gauge("shardline_job_checkpoint_step",
                            "Latest step every PS node holding the job has durable (absent while one has none)",
                            ["job_name"])
ISOLATED = Gauge("shardline_dispatcher_isolated",
                 "1 while the dispatcher suspects its own isolation (most PS nodes went silent together): it "
                 "declares no node dead and no worker lost")
NODES_KEPT_SILENT = Gauge("shardline_nodes_kept_silent",
                          "Silent PS nodes kept in the ring because they hold blocks no node that heartbeats holds")
STATE_STORE_WRITE_FAILURES = Counter("shardline_state_store_write_failures_total",
                                     "Changes of dispatcher state refused because the state store could not write them")

_NODE_LABELS = ["node_id", "rack"]
NODE_ALIVE = Gauge("shardline_node_alive", "1 if the dispatcher considers the PS node alive, 0 if dead", _NODE_LABELS)
NODE_HEARTBEAT_AGE = Gauge("shardline_node_heartbeat_age_seconds", "Seconds since the PS node's last heartbeat",
                           _NODE_LABELS)
NODE_BLOCKS = Gauge("shardline_node_blocks", "Blocks the PS node holds, from its last heartbeat", _NODE_LABELS)
NODE_BYTES = Gauge("shardline_node_parameter_bytes", "Bytes of fp32 parameter values the PS node holds, from its last heartbeat",
                   _NODE_LABELS)
NODE_VNODES = Gauge("shardline_node_vnodes", "Virtual nodes of the PS node on the ring (0 when dead)", _NODE_LABELS)

_NODE_GAUGES = (NODE_ALIVE, NODE_HEARTBEAT_AGE, NODE_BLOCKS, NODE_BYTES, NODE_VNODES)
_lock = threading.Lock()
_published: set[tuple[str, str]] = set()
_published_jobs: set[str] = set()


def publish(epoch: int, nodes: Iterable, *, heartbeat_timeout: float, jobs: int) -> None:
    """Set the membership gauges from ``nodes`` (``NodeRecord``s with heartbeat ages computed now).

    Series of nodes no longer listed (or listed under another rack) are removed.
    """
    alive = dead = 0
    seen: set[tuple[str, str]] = set()
    with _lock:
        for node in nodes:
            key = (node.node_id, node.rack)
            seen.add(key)
            is_alive = node.state == "alive"
            alive += is_alive
            dead += not is_alive
            NODE_ALIVE.labels(*key).set(1 if is_alive else 0)
            NODE_HEARTBEAT_AGE.labels(*key).set(node.heartbeat_age_seconds)
            NODE_BLOCKS.labels(*key).set(node.blocks)
            NODE_BYTES.labels(*key).set(node.bytes)
            NODE_VNODES.labels(*key).set(node.vnodes)
        for key in _published - seen:
            for gauge in _NODE_GAUGES:
                try:
                    gauge.remove(*key)
                except KeyError:
                    pass
        _published.clear()
        _published.update(seen)
        RING_EPOCH.set(epoch)
        LIVE_NODES.set(alive)
        DEAD_NODES.set(dead)
        HEARTBEAT_TIMEOUT.set(heartbeat_timeout)
        JOBS.set(jobs)


def ring_change(pending_seconds: float, waiting_nodes: int) -> None:
    RING_CHANGE_PENDING.set(pending_seconds)
    RING_CHANGE_WAITING.set(waiting_nodes)


def nodes_declared_dead(count: int) -> None:
    if count > 0:
        NODES_DECLARED_DEAD.inc(count)


def failure_detection(isolated: bool, kept_silent: int) -> None:
    ISOLATED.set(1 if isolated else 0)
    NODES_KEPT_SILENT.set(kept_silent)



def publish_checkpoints(steps: Mapping[str, int]) -> None:
    """Set the checkpoint step of each job in ``steps`` (jobs with a checkpoint); remove the others' series."""
    with _lock:
        for job, step in steps.items():
            JOB_CHECKPOINT_STEP.labels(job).set(step)
        for job in _published_jobs - steps.keys():
            try:
                JOB_CHECKPOINT_STEP.remove(job)
            except KeyError:
                pass
        _published_jobs.clear()
        _published_jobs.update(steps)


def state_store_write_failed() -> None:
    STATE_STORE_WRITE_FAILURES.inc()


NODE_LOAD = Gauge("shardline_node_load_bytes_per_second",
                  "PS node's data-plane load from its heartbeats (decayed): push bytes in, pull bytes out",
                  _NODE_LABELS + ["direction"])
NODE_APPLY = Gauge("shardline_node_apply_seconds_per_second",
                   "Seconds per second the PS node spends applying optimizer steps (decayed)", _NODE_LABELS)
NODE_LOAD_SHARE = Gauge("shardline_node_load_share", "PS node's share of the cluster's data-plane bytes (decayed)",
                        _NODE_LABELS)
LOAD_IMBALANCE = Gauge("shardline_load_imbalance", "Max over mean data-plane load of the serving PS nodes")
JOB_HOT_SHARD_SHARE = Gauge("shardline_job_hottest_shard_share",
                            "Share of all block accesses (reads + writes) of the job's hottest block", ["job_name"])
JOB_ACCESS_SHARE = Gauge("shardline_job_access_share", "Share of all block accesses that go to the job's hot blocks "
                         "(those in the dispatcher's heatmap)", ["job_name"])
REBALANCES = Counter("shardline_rebalances_total", "Ring rebalances started from measured load")
_heat_nodes: set[tuple[str, str]] = set()
_heat_jobs: set[str] = set()


def publish_heat(nodes: Iterable, shards: Iterable, imbalance: float) -> None:
    """Set the load gauges from ``nodes`` (heatmap NodeHeats) and the per-job shares from ``shards``
    (ShardHeats); series of nodes and jobs no longer present are removed."""
    hottest: dict[str, float] = {}
    total: dict[str, float] = {}
    for s in shards:
        hottest[s.job] = max(hottest.get(s.job, 0.0), s.share)
        total[s.job] = total.get(s.job, 0.0) + s.share
    with _lock:
        seen = set()
        for n in nodes:
            key = (n.node_id, n.rack)
            seen.add(key)
            NODE_LOAD.labels(*key, "in").set(n.bytes_in_per_second)
            NODE_LOAD.labels(*key, "out").set(n.bytes_out_per_second)
            NODE_APPLY.labels(*key).set(n.apply_seconds_per_second)
            NODE_LOAD_SHARE.labels(*key).set(n.share)
        for key in _heat_nodes - seen:
            for gauge, extra in ((NODE_LOAD, ("in",)), (NODE_LOAD, ("out",)), (NODE_APPLY, ()), (NODE_LOAD_SHARE, ())):
                try:
                    gauge.remove(*key, *extra)
                except KeyError:
                    pass
        _heat_nodes.clear()
        _heat_nodes.update(seen)
        for job in hottest:
            JOB_HOT_SHARD_SHARE.labels(job).set(hottest[job])
            JOB_ACCESS_SHARE.labels(job).set(min(1.0, total[job]))
        for job in _heat_jobs - hottest.keys():
            for gauge in (JOB_HOT_SHARD_SHARE, JOB_ACCESS_SHARE):
                try:
                    gauge.remove(job)
                except KeyError:
                    pass
        _heat_jobs.clear()
        _heat_jobs.update(hottest)
        LOAD_IMBALANCE.set(imbalance)


def rebalance_started() -> None:
    REBALANCES.inc()
