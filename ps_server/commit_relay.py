"""Atomic BSP commits across nodes: a node that misses a rank's commit learns it from its peers.
(The same thread ends handover waits that ran out: JobStore.release_expired_waits.)

A worker commits step ``v`` to every node only after all its pushes of ``v`` were acknowledged,
so a commit received by any node means that rank finished pushing ``v`` everywhere. A worker that
dies between its commits to different nodes leaves some nodes able to apply ``v`` and others
waiting for that rank forever. The relay closes the gap: a node whose step has been partially
committed for ``relay_delay`` seconds asks every peer for its commit record of that step
(``GetCommits``) and adopts the commits it lacks (``JobStore.adopt_commits``), so every node
applies ``v`` or none does — never some of them only.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from shardline.ps_server.store import JobStore

log = logging.getLogger("shardline.ps.relay")

RELAY_DELAY_SECONDS = 2.0
RELAY_PERIOD_SECONDS = 0.5


class CommitRelay(threading.Thread):
    """``jobs()`` gives the node's JobStores; ``ask(job, step)`` returns the peers' commit
    records of ``step`` as a list of ``({rank: (weight, epoch)}, lr)`` (unreachable peers left out)."""

    def __init__(self, jobs: Callable[[], Iterable[JobStore]], ask: Callable[[str, int], list],
                 stop: threading.Event, *, relay_delay: float = RELAY_DELAY_SECONDS,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(name="commit-relay", daemon=True)
        self._jobs = jobs
        self._ask = ask
        self._stop = stop
        self.relay_delay = relay_delay
        self._clock = clock
        self._partial_since: dict[tuple[str, int], float] = {}
        self._lock = threading.Lock()  # the relay thread and settle() (heartbeats) both check

    def run(self) -> None:
        while not self._stop.wait(RELAY_PERIOD_SECONDS):
            try:
                self.check()
            except Exception:  # keep relaying whatever one pass hit
                log.exception("commit relay pass failed")

    def settle(self) -> list[tuple[str, int]]:
        """Relay at once for every partially committed job (a ring change is about to move blocks)."""
        return self.check(relay_delay=0.0)

    def check(self, relay_delay: float | None = None) -> list[tuple[str, int]]:
        """One pass: relay for every job partially committed for longer than ``relay_delay``
        (default: the relay's). Returns the (job, step) pairs it asked peers about."""
        with self._lock:
            return self._check(self.relay_delay if relay_delay is None else relay_delay)

    def _check(self, delay: float) -> list[tuple[str, int]]:
        now = self._clock()
        seen, asked = set(), []
        for job in self._jobs():
            if not job.collects:  # BSP and SSP
                continue
            if job.release_expired_waits():
                log.warning("job %s: a block's previous primary did not hand the step in flight over in time; "
                            "it goes on with the pushes workers resend", job.name)
            step = job.step
            record, _lr = job.commits_of(step)
            if not record or len(record) >= job.world_size:
                continue
            key = (job.name, step)
            seen.add(key)
            since = self._partial_since.setdefault(key, now)
            if now - since < delay:
                continue
            asked.append(key)
            for commits, lr in self._ask(job.name, step):
                missing = {rank: c for rank, c in commits.items() if rank not in record}
                if missing:
                    log.warning("job %s: step %d: adopting the commits of ranks %s from a peer (they did not reach "
                                "this node)", job.name, step, sorted(missing))
                    job.adopt_commits(step, missing, lr)
                    record, _lr = job.commits_of(step)
            self._partial_since[key] = now  # ask again only after another delay
        for key in list(self._partial_since):
            if key not in seen:
                del self._partial_since[key]
        return asked
