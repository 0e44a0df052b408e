"""A worker's lease of (job, rank) with the dispatcher.

::

    IDLE --(start: the job is known)--> RENEWING --(close: released, leaving=True)--> RELEASED

While RENEWING a thread heartbeats every ``interval_seconds`` the dispatcher asks (the first at
once: a worker that dies early is still known). If the job failed because another rank was lost
(``on_worker_failure: fail``), ``lost`` holds the ShardlineWorkerLostError naming it, which the
client's next request raises. Design: docs/architecture.md, "Worker leases".
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Callable

from shardline.services.errors import ShardlineWorkerLostError

log = logging.getLogger("shardline.worker")

# close() waits this long for the lease thread to leave its last renewal (the channel it uses is
# closed first, which cancels a call in flight).
LEASE_STOP_TIMEOUT_SECONDS = 5.0


class LeaseState(enum.Enum):
    IDLE = "idle"
    RENEWING = "renewing"
    RELEASED = "released"


class WorkerLease:
    """The lease of (``job``, ``rank``) held by this process (``incarnation``). ``heartbeat(**kw)``
    is the dispatcher's WorkerHeartbeat; ``step()`` the step this worker is at."""

    def __init__(self, job: str, rank: int, incarnation: str, heartbeat: Callable, step: Callable[[], int]):
        self.job, self.rank, self.incarnation = job, rank, incarnation
        self._heartbeat, self._step = heartbeat, step
        self.state = LeaseState.IDLE
        self.lost: ShardlineWorkerLostError | None = None   # the job failed: another rank was lost
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Renew in the background (idempotent; nothing once released)."""
        if self.state is LeaseState.IDLE:
            self.state = LeaseState.RENEWING
            self._thread = threading.Thread(target=self._renew, name="shardline-lease", daemon=True)
            self._thread.start()

    def _renew(self) -> None:
        interval = 0.0  # the first renewal at once: a worker that dies early is still known
        while not self._closed.wait(interval):
            interval = 1.0
            try:
                resp = self._heartbeat(job=self.job, rank=self.rank, incarnation=self.incarnation, step=self._step())
            except Exception as exc:  # noqa: BLE001 - the dispatcher may be failing over: try again
                log.debug("lease renewal failed: %s", exc)
                continue
            interval = max(0.2, resp.interval_seconds or interval)
            if resp.failed and self.lost is None:
                ranks = tuple(sorted(lease.rank for lease in resp.lost))
                self.lost = ShardlineWorkerLostError(f"job {self.job!r} failed: {resp.failed}", ranks)
                log.error("%s", self.lost)

    def stop_renewing(self) -> None:
        """No renewal after this (the renewal in flight ends when its channel closes)."""
        self._closed.set()

    def release(self) -> None:
        """Tell the dispatcher this worker leaves: a worker that finished is not lost."""
        renewing, self.state = self.state is LeaseState.RENEWING, LeaseState.RELEASED
        self._closed.set()
        if not renewing:
            return
        try:
            self._heartbeat(job=self.job, rank=self.rank, incarnation=self.incarnation, step=self._step(), leaving=True)
        except Exception as exc:  # noqa: BLE001 - it expires anyway
            log.debug("lease release failed: %s", exc)

    def join(self) -> None:
        """Wait for the renewal thread to end: one still inside a gRPC call when the interpreter
        exits aborts the process ("terminate called without an active exception")."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(LEASE_STOP_TIMEOUT_SECONDS)
