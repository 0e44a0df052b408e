"""Restoring a PS node's jobs from its checkpoint directory when it starts.

Which step a job restores to depends on whether the job is still running elsewhere:

* **warm** — another alive node holds the job in memory at step ``L`` (this node alone restarted):
  restore the latest durable step ``<= L``. Workers hold the gradients of the step in flight and
  resend them, so a node one step behind catches up; further behind cannot (its updates are lost)
  and is reported as an error naming the steps.
* **cold, one holder** — this node is the job's only holder: its latest durable checkpoint.
* **cold, several holders** (a whole-cluster restart) — the dispatcher's ``checkpoint_step``: the
  latest step every holder reported durable. Every node computes the same step from the same
  dispatcher state, so the job resumes consistently; a node that is ahead rolls back to it.
  (Determinism makes any consistent step correct: the workers redo the steps after it.)

After restoring step ``s`` the node deletes its checkpoints newer than ``s``: they belong to an
abandoned timeline and must never be mistaken for the continuation of ``s``. A job the dispatcher
lacks (it lost its state) is registered again from the checkpoint (``RestoreJob``); one that was
deleted, or whose name now belongs to a newer incarnation, has its checkpoints removed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from google.protobuf import json_format

from shardline.ps_server.checkpoint import CheckpointDir, CheckpointError
from shardline.services.errors import ShardlineError, ShardlineStateError
from shardline.services.pb import common_pb2

log = logging.getLogger("shardline.ps.restore")


@dataclass
class RestoreReport:
    job: str
    step: int | None            # None: not restored (deleted, stale or unloadable)
    mode: str                   # "warm", "cold", "single", "stale", "deleted", "failed"
    seconds: float = 0.0
    blocks: int = 0
    bytes_read: int = 0
    message: str = ""


def choose_target(latest: int, *, live_step: int | None, info, node_id: str) -> tuple[str, dict]:
    """``(mode, load kwargs)`` for CheckpointDir.load: see the module docstring. ``info`` is the
    dispatcher's JobInfo (None if it does not know the job)."""
    if live_step is not None:
        return "warm", {"at_most": live_step}
    holders = dict(info.durable_steps) if info is not None else {}
    if info is None or set(holders) <= {node_id}:
        return "single", {}
    if info.has_checkpoint:
        return "cold", {"exact": int(info.checkpoint_step)}
    return "cold", {}


def _discard_newer(ckdir: CheckpointDir, job: str, step: int) -> None:
    newer = [c for c in ckdir.list(job) if c.step > step]
    if newer:
        ckdir.discard_after(job, step)
        log.info("job %s: removed %d checkpoint(s) newer than the restored step %d (abandoned timeline: %s)",
                 job, len(newer), step, ", ".join(str(c.step) for c in newer))


def restore_job(ckdir: CheckpointDir, job: str, *, node_id: str, get_job: Callable, restore_job_rpc: Callable,
                live_step: Callable[[str], int | None], add_job: Callable, metrics=None) -> RestoreReport:
    """Restore one job from ``ckdir`` into the node (``add_job(spec, uid, loaded)``)."""
    started = time.perf_counter()
    checkpoints = ckdir.list(job)
    if not checkpoints:
        return RestoreReport(job, None, "failed", message="no complete checkpoint")
    latest = checkpoints[-1]
    info = get_job(job)
    if info is not None and info.uid and latest.uid and info.uid != latest.uid:
        ckdir.delete_job(job)
        return RestoreReport(job, None, "stale", message=f"checkpoints of uid {latest.uid} belong to an earlier job "
                                                          f"named {job!r} (now uid {info.uid}); removed")
    mode, target = choose_target(latest.step, live_step=live_step(job), info=info, node_id=node_id)
    try:
        loaded = ckdir.load(job, **target)
    except CheckpointError as exc:
        if "exact" not in target:
            return RestoreReport(job, None, "failed", message=str(exc))
        log.error("job %s: the cluster's checkpoint step %d cannot be loaded here (%s); falling back to the latest "
                  "loadable step before it, which the other nodes do not share", job, target["exact"], exc)
        loaded = ckdir.load(job, at_most=target["exact"])
    for step, reason in loaded.skipped:
        log.error("job %s: checkpoint of step %s not used: %s", job, step, reason)
    if info is None:
        spec = json_format.ParseDict(loaded.spec, common_pb2.JobSpec())
        try:
            info = restore_job_rpc(spec, loaded.uid, node_id)
        except ShardlineStateError as exc:  # deleted while this node was away
            ckdir.delete_job(job)
            return RestoreReport(job, None, "deleted", message=str(exc))
        log.warning("job %s was unknown to the dispatcher; registered again from this node's checkpoint", job)
    _discard_newer(ckdir, job, loaded.step)
    add_job(info.spec, info.uid, loaded)
    seconds = time.perf_counter() - started
    if metrics is not None:
        metrics.restored(job, loaded.step, seconds)
    live = live_step(job) if mode == "warm" else None
    report = RestoreReport(job, loaded.step, mode, seconds, len(loaded.blocks), loaded.bytes_read)
    if live is not None and loaded.step < live - 1:
        if replicated(info.spec):
            report.message = (f"restored step {loaded.step}, the job is at step {live}: the node rejoins and syncs "
                              f"what changed from the other copies before it serves")
            log.info("job %s: %s", job, report.message)
        else:
            report.message = (f"restored step {loaded.step} but the job is at step {live} on other nodes: the updates "
                              f"of steps {loaded.step}..{live - 1} on this node are lost (replication 1: no copy "
                              f"elsewhere)")
            log.error("job %s: %s", job, report.message)
    return report


def replicated(spec) -> bool:
    """Whether the job keeps more than one copy of its blocks (0: the dispatcher's default, 2)."""
    return spec.replication != 1


def restore_all(ckdir: CheckpointDir, *, before_job: Callable[[str], None] | None = None, **kwargs) -> list[RestoreReport]:
    """Restore every job of the checkpoint directory; a job that fails is reported, not fatal.
    ``before_job(name)`` runs before each (the daemon tells systemd it is still starting)."""
    reports = []
    for job in ckdir.jobs():
        if before_job is not None:
            before_job(job)
        try:
            report = restore_job(ckdir, job, **kwargs)
        except (CheckpointError, ShardlineError, OSError) as exc:
            report = RestoreReport(job, None, "failed", message=str(exc))
        if report.step is None:
            (log.error if report.mode == "failed" else log.warning)("job %s not restored (%s): %s", job, report.mode,
                                                                   report.message)
        else:
            log.info("restored job %s at step %d (%s start, %d blocks, %.1f MiB read) in %.3f s", job, report.step,
                     report.mode, report.blocks, report.bytes_read / 2**20, report.seconds)
        reports.append(report)
    return reports
