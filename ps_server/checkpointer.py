"""When a PS node checkpoints its jobs (periodic, initial, on demand, at a graceful stop), and the
background thread that writes them.

Contract: a checkpoint of a job at step ``s`` is the blocks' values, optimizer state and versions
after ``s`` applied steps (gradients being collected are never part of it). Snapshots are copied
under the job lock at a step boundary; one writer thread writes them in order
(ps_server/checkpoint.py). Every node writes every periodic step: with ``MAX_PENDING_SNAPSHOTS`` of
a job waiting the next boundary waits, and only a writer stalled for
``STALLED_WRITER_TIMEOUT_SECONDS`` makes it skip one (logged and counted). A failed write fails
that checkpoint and its waiters, never the training; the next one diffs against the last durable
checkpoint.

Design: docs/architecture.md, "Checkpoints and restore".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from google.protobuf import json_format

from shardline.ps_server.checkpoint import BlockSnapshot, CheckpointDir, CheckpointError, JobSnapshot
from shardline.ps_server.store import JobStore, StoreError
from shardline.services.errors import ErrorCode

log = logging.getLogger("shardline.ps.checkpoint")

MAX_PENDING_SNAPSHOTS = 2
STALLED_WRITER_TIMEOUT_SECONDS = 120.0


@dataclass
class CheckpointResult:
    step: int
    past: bool = False          # the job was already past the requested step (step = its step)
    bytes_written: int = 0


@dataclass(eq=False)
class _Request:
    step: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None
    bytes_written: int = 0


@dataclass(eq=False)
class _JobState:
    job: JobStore
    every: int
    base: dict | None = None            # block versions at the last durable checkpoint
    durable_step: int | None = None
    incrementals: int = 0               # since the last full checkpoint (durable)
    # The same for the last snapshot taken (queued or durable): the next one diffs against it.
    planned: dict | None = None
    planned_step: int | None = None
    planned_incrementals: int = 0
    pending: int = 0                    # snapshots queued or being written
    waiters: dict = field(default_factory=dict)   # step -> [_Request]
    protect: int | None = None          # the cluster's consistent checkpoint step (retention keeps it)
    initial_taken: bool = False
    dropped: bool = False


class Checkpointer:
    """Checkpoints of every job on one node, in ``ckdir``. ``epoch()`` gives the node's ring epoch
    (recorded in manifests); ``on_durable()`` is called after each successful write (the node
    reports it to the dispatcher without waiting for its next heartbeat)."""

    def __init__(self, ckdir: CheckpointDir, node_id: str, *, every_steps: int, full_every: int, keep: int,
                 epoch: Callable[[], int], metrics=None, on_durable: Callable[[], None] | None = None):
        self.ckdir = ckdir
        self.node_id = node_id
        self.every_steps = every_steps
        self.full_every = full_every
        self.keep = keep
        self._epoch = epoch
        self._metrics = metrics
        self._on_durable = on_durable
        self._lock = threading.Lock()
        self._jobs: dict[str, _JobState] = {}
        self._queue: "queue.Queue[tuple[_JobState, JobSnapshot, list[_Request]] | None]" = queue.Queue()
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    # --- jobs -------------------------------------------------------------------------------
    def attach(self, job: JobStore, spec, restored=None) -> None:
        """Start checkpointing ``job`` (``spec``: its JobSpec). ``restored``: the LoadedCheckpoint
        it was restored from, so the next checkpoint continues that chain."""
        every = spec.checkpoint_every_steps if spec.HasField("checkpoint_every_steps") else self.every_steps
        st = _JobState(job=job, every=int(every))
        if restored is not None:
            st.base = {key: version for key, (version, _v, _s) in restored.blocks.items()}
            st.durable_step = restored.step
            st.incrementals = len(restored.chain) - 1
            st.initial_taken = True
            self._replan_from_durable(st)
        with self._lock:
            self._jobs[job.name] = st
        job.boundary_hooks.append(self._on_boundary)

    def drop(self, name: str) -> None:
        """Forget the job and delete its checkpoints."""
        with self._lock:
            st = self._jobs.pop(name, None)
            if st is not None:
                st.dropped = True
                for requests in st.waiters.values():
                    for r in requests:
                        r.error = StoreError(ErrorCode.UNKNOWN_JOB, f"job {name!r} was dropped from this node")
                        r.done.set()
                st.waiters.clear()
                self._idle.wait_for(lambda: st.pending == 0, timeout=30)
        self.ckdir.delete_job(name)

    def durable_step(self, name: str) -> int | None:
        with self._lock:
            st = self._jobs.get(name)
            return None if st is None else st.durable_step

    def protect(self, name: str, step: int) -> None:
        """The step every node of the job holds durably (from the dispatcher): never deleted."""
        with self._lock:
            st = self._jobs.get(name)
            if st is not None:
                st.protect = step

    # --- triggers ---------------------------------------------------------------------------
    def _on_boundary(self, job: JobStore, step: int) -> None:
        """Boundary hook: runs under the job lock right after ``step`` was applied."""
        with self._lock:
            st = self._jobs.get(job.name)
            if st is None or st.dropped:
                return
            requests = st.waiters.pop(step, [])
            periodic = st.every > 0 and step % st.every == 0 and step != st.durable_step
            if not (periodic or requests):
                return
            # Backpressure: the training of this job waits here (its lock is held) for the writer.
            if not self._idle.wait_for(lambda: st.pending < MAX_PENDING_SNAPSHOTS or st.dropped,
                                       timeout=STALLED_WRITER_TIMEOUT_SECONDS) and not requests:
                if self._metrics is not None:
                    self._metrics.checkpoint_skipped(job.name)
                log.error("job %s: checkpoint of step %d skipped: the writer made no progress for %.0f s "
                          "(a whole-cluster restart may have to go back further)", job.name, step,
                          STALLED_WRITER_TIMEOUT_SECONDS)
                return
        self._take(st, requests)

    def on_request(self, job: JobStore) -> None:
        """Called on every non-INIT request: the first one shows the job was initialized, and its
        step-0 values are checkpointed (cheap check otherwise)."""
        st = self._jobs.get(job.name)
        if st is None or st.initial_taken:
            return
        with job.cond:
            with self._lock:
                if st.initial_taken or st.dropped:
                    return
                st.initial_taken = True
                take = st.durable_step is None and job.step == 0 and bool(job.blocks)
            if take:
                self._take(st, [])

    def request(self, name: str, step: int, timeout: float) -> CheckpointResult:
        """A checkpoint of exactly ``step``, durable before this returns (or past=True if the job
        is beyond ``step``). Raises StoreError (UNKNOWN_JOB, TIMEOUT, INTERNAL)."""
        with self._lock:
            st = self._jobs.get(name)
        if st is None:
            raise StoreError(ErrorCode.UNKNOWN_JOB, f"job {name!r} is not held by this node")
        job = st.job
        req = _Request(step)
        with job.cond:
            if job.step > step:
                return CheckpointResult(step=job.step, past=True)
            with self._lock:
                if job.step == step and st.durable_step == step:
                    return CheckpointResult(step=step)
                if job.step < step:
                    st.waiters.setdefault(step, []).append(req)
                    take = False
                else:
                    take = True
            if take:
                self._take(st, [req])
        if not req.done.wait(timeout):
            with self._lock:
                waiting = st.waiters.get(step, [])
                if req in waiting:
                    waiting.remove(req)
            raise StoreError(ErrorCode.TIMEOUT,
                             f"job {name!r} did not reach a durable checkpoint of step {step} within "
                             f"{timeout:g} s (the node is at step {job.step})")
        if req.error is not None:
            raise req.error if isinstance(req.error, StoreError) else StoreError(ErrorCode.INTERNAL, str(req.error))
        return CheckpointResult(step=step, bytes_written=req.bytes_written)

    def checkpoint_now(self, name: str, timeout: float) -> int | None:
        """Write what changed since the last checkpoint (a stopping node, after ``freeze``) and wait
        until it is durable. Returns the durable step (None if the job has nothing to write)."""
        with self._lock:
            st = self._jobs.get(name)
        if st is None:
            return None
        job = st.job
        req = _Request(job.step)
        with job.cond:
            with self._lock:
                unchanged = st.durable_step == job.step
            if not unchanged and job.blocks:
                self._take(st, [req])
            else:
                req.done.set()
        if not req.done.wait(timeout):
            raise StoreError(ErrorCode.TIMEOUT,
                             f"checkpoint of job {name!r} at step {req.step} not durable within {timeout:g} s")
        if req.error is not None:
            raise req.error
        return self.durable_step(name)

    @staticmethod
    def _replan_from_durable(st: _JobState) -> None:
        st.planned = None if st.base is None else dict(st.base)
        st.planned_step = st.durable_step
        st.planned_incrementals = st.incrementals

    def _take(self, st: _JobState, requests: list[_Request]) -> None:
        """Snapshot the job now (caller holds the job lock) and queue it for the writer. It diffs
        against the previous snapshot, durable or still queued (the writer refuses it if that one
        failed)."""
        job = st.job
        with self._lock:
            full = st.planned is None or self.full_every == 0 or st.planned_incrementals >= self.full_every
            since = None if full else st.planned
            base_step = None if full else st.planned_step
            st.pending += 1
            started = time.perf_counter()
            step, held, copies = job.snapshot(since)
            st.planned, st.planned_step = held, step
            st.planned_incrementals = 0 if full else st.planned_incrementals + 1
        spec = json_format.MessageToDict(job.spec, preserving_proto_field_name=True)
        snap = JobSnapshot(job=job.name, uid=job.uid, node_id=self.node_id, epoch=int(self._epoch()), step=step,
                           spec=spec, held=held, full=full, base_step=base_step,
                           blocks=[BlockSnapshot(t, i, v, value, state) for t, i, v, value, state in copies])
        if self._metrics is not None:
            self._metrics.checkpoint_snapshot(job.name, time.perf_counter() - started)
        self._queue.put((st, snap, requests))

    # --- writer -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            st, snap, requests = item
            error: Exception | None = None
            info = None
            started = time.perf_counter()
            with self._lock:
                base_failed = not snap.full and snap.base_step != st.durable_step
            if st.dropped:
                error = StoreError(ErrorCode.UNKNOWN_JOB, f"job {snap.job!r} was dropped from this node")
            elif base_failed:
                error = StoreError(ErrorCode.INTERNAL,
                                   f"its base, the checkpoint of step {snap.base_step}, was not written")
            else:
                try:
                    info = self.ckdir.write(snap)
                except CheckpointError as exc:
                    error = exc
                except Exception as exc:  # a bug must not kill the writer: fail this checkpoint only
                    log.exception("checkpoint of job %s at step %d failed", snap.job, snap.step)
                    error = exc
            seconds = time.perf_counter() - started
            if error is None:
                with self._lock:
                    st.base = dict(snap.held)
                    st.durable_step = snap.step
                    st.incrementals = 0 if snap.full else st.incrementals + 1
                    protect = [p for p in (st.protect,) if p is not None]
                if snap.full:  # only a new full checkpoint can make an older chain unneeded
                    try:
                        self.ckdir.retain(snap.job, self.keep, protect=protect)
                    except (CheckpointError, OSError) as exc:
                        log.warning("retention of job %s checkpoints failed: %s", snap.job, exc)
                log.info("job %s: %s checkpoint of step %d durable (%d blocks, %d bytes, %.3f s)", snap.job,
                         "full" if snap.full else "incremental", snap.step, len(snap.blocks), info.bytes_written, seconds)
                if self._metrics is not None:
                    self._metrics.checkpoint_written(snap.job, snap.step, info.bytes_written, seconds, snap.full)
            else:
                with self._lock:
                    # The next snapshot must diff against what is durable: unless this one failed only
                    # because its base did (the base's failure replanned already) and a snapshot
                    # taken since is planned on that durable state.
                    if not base_failed or st.planned_step == snap.step:
                        self._replan_from_durable(st)
                log.error("job %s: checkpoint of step %d failed: %s", snap.job, snap.step, error)
                if self._metrics is not None:
                    self._metrics.checkpoint_failed(snap.job)
            for r in requests:
                r.error = error if error is None or isinstance(error, StoreError) else StoreError(
                    ErrorCode.INTERNAL, f"checkpoint failed: {error}")
                r.bytes_written = info.bytes_written if info is not None else 0
                r.done.set()
            with self._lock:
                st.pending -= 1
                self._idle.notify_all()
            # Report it now (the heartbeat loop spaces these out): a whole-cluster restart resumes
            # at the latest step every node reported.
            if error is None and self._on_durable is not None:
                try:
                    self._on_durable()
                except Exception:  # reporting is best effort; the next heartbeat carries it too
                    log.debug("durable-step report failed", exc_info=True)

    def flush(self, timeout: float) -> bool:
        """Wait until every queued snapshot was written (or failed). False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: all(st.pending == 0 for st in self._jobs.values()), timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(None)
        self._thread.join(timeout)
