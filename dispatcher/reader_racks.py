"""Where each job's readers are, and which rack its placement should prefer: pure, thread-safe.

PS nodes report, with each heartbeat, the bytes they sent per (job, reader rack) since the
previous one (pulls name their reader's rack: a rack cache's fetches its own, a client with
``rack=`` its own; ps_server/heat.py). Counts are decayed like the heatmap's (dispatcher/heatmap.py): a count ``c``
reported at ``t`` weighs ``c * 2**(-(now - t) / half_life)`` at ``now``. Memory is bounded: at
most ``max_racks`` racks per job (the decayed-smallest is dropped); the caller forgets deleted jobs.

``decide`` turns the shares into a job -> reader rack map for the routing table's
``reader_racks`` (services/placement.py ``prefer_rack`` applies it). Hysteresis keeps it from
flapping: a rack becomes a job's reader rack when its share reaches ``enter_share``, and stays one
while its share is at least ``leave_share`` and the job still reads at ``min_bytes_per_second``.
A rack without a serving PS node is never chosen (and a chosen one whose nodes all left is
dropped), nor is a job with replication < 2 given one (it has no copy to move). Soft state: a new
leader starts empty, keeps the table's current preferences while it learns (``decide`` with no
data keeps nothing new and drops nothing: see ``warm``), and decides again once warm.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

from shardline.dispatcher.decay import DecayedSums
from shardline.dispatcher.heatmap import DEFAULT_HALF_LIFE_SECONDS
from shardline.services.config import require_nonnegative_number, require_positive_number
from shardline.services.errors import ShardlineConfigError

DEFAULT_MAX_RACKS = 4
DEFAULT_ENTER_SHARE = 0.6
DEFAULT_LEAVE_SHARE = 0.4
DEFAULT_MIN_BYTES_PER_SECOND = 1.0


def _share(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ShardlineConfigError(f"{what} must be a number in (0, 1], got {value!r}")
    return float(value)


class ReaderRacks:
    """Decayed read bytes per (job, rack) and the reader-rack decision (module docstring)."""

    def __init__(self, half_life: float = DEFAULT_HALF_LIFE_SECONDS, *, max_racks: int = DEFAULT_MAX_RACKS,
                 enter_share: float = DEFAULT_ENTER_SHARE, leave_share: float = DEFAULT_LEAVE_SHARE,
                 min_bytes_per_second: float = DEFAULT_MIN_BYTES_PER_SECOND, warm_seconds: float | None = None):
        self.half_life = require_positive_number(half_life, "reader rack half_life (seconds)")
        if isinstance(max_racks, bool) or not isinstance(max_racks, int) or max_racks < 1:
            raise ShardlineConfigError(f"max_racks must be an integer >= 1, got {max_racks!r}")
        self.max_racks = max_racks
        self.enter_share = _share(enter_share, "reader rack enter_share")
        self.leave_share = _share(leave_share, "reader rack leave_share")
        if self.leave_share > self.enter_share:
            raise ShardlineConfigError(
                f"reader rack leave_share ({leave_share!r}) must not exceed enter_share ({enter_share!r})")
        self.min_bytes_per_second = require_positive_number(min_bytes_per_second, "reader rack min_bytes_per_second")
        self.warm_seconds = self.half_life if warm_seconds is None else require_positive_number(
            warm_seconds, "reader rack warm_seconds")
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, DecayedSums]] = {}
        self._first: float | None = None

    def report(self, rack: str, fetched: Mapping[str, float], now: float) -> None:
        """Reads from ``rack``: ``fetched`` is job -> bytes sent since the reporter's previous report."""
        if not rack:
            return  # a reader with no rack says nothing about where reads are
        with self._lock:
            if self._first is None:
                self._first = now
            for job, nbytes in fetched.items():
                amount = require_nonnegative_number(nbytes, f"bytes fetched for job {job!r}")
                if amount == 0:
                    continue
                racks = self._jobs.setdefault(job, {})
                record = racks.get(rack)
                if record is None:
                    record = racks[rack] = DecayedSums(1, now)
                record.add(now, self.half_life, (amount,))
                if len(racks) > self.max_racks:
                    for r in racks.values():
                        r.advance(now, self.half_life)
                    del racks[min(racks, key=lambda r: (racks[r].values[0], r))]

    def jobs(self) -> set[str]:
        """The jobs with records."""
        with self._lock:
            return set(self._jobs)

    def forget(self, jobs: Iterable[str]) -> None:
        """Drop the records of ``jobs`` (deleted jobs)."""
        with self._lock:
            for job in jobs:
                self._jobs.pop(job, None)

    def shares(self, job: str, now: float) -> dict[str, float]:
        """rack -> share of ``job``'s decayed read bytes (empty when it has none)."""
        with self._lock:
            return self._shares(job, now)[0]

    def _shares(self, job: str, now: float) -> tuple[dict[str, float], float]:
        racks = self._jobs.get(job, {})
        for record in racks.values():
            record.advance(now, self.half_life)
        total = sum(r.values[0] for r in racks.values())
        if total <= 0:
            return {}, 0.0
        return {rack: r.values[0] / total for rack, r in racks.items()}, total

    def warm(self, now: float) -> bool:
        """Whether reports have covered ``warm_seconds`` (before that, ``decide`` changes nothing)."""
        with self._lock:
            return self._first is not None and now - self._first >= self.warm_seconds

    def decide(self, current: Mapping[str, str], replication: Mapping[str, int],
               node_racks: Iterable[str], now: float) -> dict[str, str]:
        """The job -> reader rack map to have: ``current`` is the table's, ``replication`` each live
        job's R, ``node_racks`` the racks of the serving PS nodes. Returns ``current`` (restricted to
        live jobs) until warm."""
        live = {job: rack for job, rack in current.items() if job in replication}
        if not self.warm(now):
            return live
        with_nodes = set(node_racks)
        # A decayed sum at steady rate r tends to r * tau; compare rates, not sums.
        floor = self.min_bytes_per_second * self.half_life / 0.6931471805599453
        out: dict[str, str] = {}
        with self._lock:
            for job, r in replication.items():
                if r < 2:
                    continue
                shares, total = self._shares(job, now)
                if total < floor:
                    continue
                held = live.get(job)
                if held in with_nodes and shares.get(held, 0.0) >= self.leave_share:
                    out[job] = held
                    continue
                best = max((rack for rack in shares if rack in with_nodes),
                           key=lambda rack: (shares[rack], rack), default=None)
                if best is not None and shares[best] >= self.enter_share:
                    out[job] = best
        return out
