"""Worker leases: which ranks of each job are training, which were lost, and which jobs failed.

A rank's states: *alive* (renewed by every heartbeat) -> *lost* (its lease older than the job's
``worker_lease_timeout_seconds``) -> *alive* again (it heartbeats again); *released* once it
leaves cleanly (never lost).

Contract: pure and clock-free (``now`` is any monotonic clock, in seconds). With
``on_worker_failure: fail`` a lost rank fails the job until every lost rank is back (workers get
ShardlineWorkerLostError, the PS nodes refuse with WORKER_LOST); with ``wait`` the step waits.
Soft state: a new leader starts with none and every rank gets one lease timeout to check in.

Design: docs/architecture.md, "Worker leases".
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

DEFAULT_LEASE_TIMEOUT_SECONDS = 30.0
ON_WORKER_FAILURE = ("wait", "fail")


@dataclass
class Lease:
    job: str
    rank: int
    incarnation: str
    last: float                  # monotonic time of the last heartbeat
    step: int = 0
    lost_at: float | None = None  # wall-clock seconds when declared lost
    restarts: int = 0            # incarnations seen after the first


class WorkerLeases:
    """Leases of every job's ranks. ``policy(job)`` gives ``(lease timeout, on_worker_failure)``
    for a job (None: the job is unknown; its leases are dropped). Thread-safe."""

    def __init__(self, policy, wall_clock=time.time):
        self._policy = policy
        self._wall = wall_clock
        self._lock = threading.Lock()
        self._leases: dict[tuple[str, int], Lease] = {}
        self._left: set[tuple[str, int]] = set()   # ranks that released their lease (done)
        self._failed: dict[str, str] = {}

    def heartbeat(self, job: str, rank: int, incarnation: str, step: int, now: float, *, leaving: bool = False,
                  world_size: int | None = None) -> None:
        """Renew (job, rank)'s lease. With ``world_size``, the job's other ranks that never checked in
        get a lease from now on too (incarnation ""): one that never comes is lost like one that died."""
        with self._lock:
            if world_size is not None and not leaving:
                for other in range(world_size):
                    if other != rank and (job, other) not in self._leases and (job, other) not in self._left:
                        self._leases[(job, other)] = Lease(job, other, "", now)
            key = (job, rank)
            if leaving:
                lease = self._leases.get(key)
                if lease is not None and lease.incarnation == incarnation:
                    del self._leases[key]
                    self._left.add(key)
                return
            self._left.discard(key)
            lease = self._leases.get(key)
            if lease is None:
                self._leases[key] = Lease(job, rank, incarnation, now, step)
            else:
                if lease.incarnation != incarnation:
                    lease.incarnation, lease.restarts = incarnation, lease.restarts + 1
                lease.last, lease.step, lease.lost_at = max(lease.last, now), step, None
            self._clear_failure(job)

    def expire(self, now: float) -> list[Lease]:
        """Declare lost every lease past its job's timeout; returns the newly lost ones. A job whose
        policy is ``fail`` fails with a message naming its lost ranks."""
        lost = []
        with self._lock:
            for key, lease in list(self._leases.items()):
                policy = self._policy(lease.job)
                if policy is None:
                    del self._leases[key]
                    continue
                timeout, _on_failure = policy
                if lease.lost_at is None and now - lease.last > timeout:
                    lease.lost_at = self._wall()
                    lost.append(lease)
            for lease in lost:
                timeout, on_failure = self._policy(lease.job)
                if on_failure == "fail":
                    ranks = sorted(lo.rank for lo in self._leases.values() if lo.job == lease.job and lo.lost_at is not None)
                    self._failed[lease.job] = (f"rank{'s' if len(ranks) > 1 else ''} "
                                               f"{ranks if len(ranks) > 1 else ranks[0]} lost: no heartbeat for "
                                               f"{timeout:g} s (worker_lease_timeout)")
        return lost

    def extend(self, now: float) -> None:
        """Renew every lease not lost as of ``now``: after a time in which renewals could not arrive
        (the dispatcher suspected its own isolation), each rank gets one lease timeout to check in,
        as with a new leader."""
        with self._lock:
            for lease in self._leases.values():
                if lease.lost_at is None:
                    lease.last = max(lease.last, now)

    def _clear_failure(self, job: str) -> None:
        if job in self._failed and not any(lo.lost_at is not None for lo in self._leases.values() if lo.job == job):
            del self._failed[job]

    def failed(self) -> dict[str, str]:
        """Jobs that failed (a rank lost, ``on_worker_failure: fail``): job -> why."""
        with self._lock:
            return dict(self._failed)

    def of_job(self, job: str) -> list[Lease]:
        with self._lock:
            return sorted((lo for lo in self._leases.values() if lo.job == job), key=lambda lo: lo.rank)

    def all(self) -> list[Lease]:
        with self._lock:
            return sorted(self._leases.values(), key=lambda lo: (lo.job, lo.rank))

    def forget_job(self, job: str) -> None:
        with self._lock:
            for key in [k for k in self._leases if k[0] == job]:
                del self._leases[key]
            self._left = {k for k in self._left if k[0] != job}
            self._failed.pop(job, None)
