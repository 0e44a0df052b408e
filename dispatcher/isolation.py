"""Failure detection that tells a node's failure from the dispatcher's own isolation.

A dispatcher whose own network is cut hears from no node: every heartbeat stops at once, exactly
as if the whole fleet died. Declaring them dead would move every block to nodes that are just as
alive as before, and, once the network returns, rebuild the ring from whichever node registers
first. So, as Kubernetes' node lifecycle controller stops evicting when a whole zone goes
unready at once, this guard declares no node dead while more than ``share`` of the nodes are
silent together. Pure and clock-free: ``now`` and the heartbeat ages come from the caller.

States:

* ``connected``: normal failure detection. A node silent for more than ``heartbeat_timeout`` is
  declared dead at the next pass — once it has also been silent for ``decide_after``: at least
  two heartbeat intervals and a half, so that every node cut off at the same moment as it has
  missed a heartbeat by then and is counted below (with the default interval, a third of the
  timeout or less, this never delays a declaration).
* ``isolated``: more than ``share`` of the alive nodes are **late** (no heartbeat for one and a
  half intervals) at a pass that would declare one dead: the dispatcher suspects its own
  isolation, declares none, and logs and reports it (shardline_dispatcher_isolated). Worker
  leases are not expired either (their renewals cannot arrive).
* back to ``connected`` once no more than ``share`` are late: heartbeats returned. They return
  within about an interval of each other, so a node still silent then is timed from that moment:
  it gets one ``heartbeat_timeout`` to answer before it is declared dead, as with a new leader.
  Or, after ``isolation_timeout`` seconds isolated (0: never), with the silent nodes declared
  dead: the fleet really went away.

Transitions happen only in :meth:`dead`, called once per expiry pass.
"""

from __future__ import annotations

import logging
import math

from shardline.services.errors import ShardlineConfigError

log = logging.getLogger("shardline.dispatcher")

CONNECTED, ISOLATED = "connected", "isolated"
DEFAULT_ISOLATION_SHARE = 0.5
DEFAULT_ISOLATION_TIMEOUT_SECONDS = 60.0
# A node that missed a heartbeat by this much of an interval is late (RPC latency and scheduling jitter).
LATE_INTERVALS = 1.5


def check_share(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ShardlineConfigError(f"isolation_share must be a number in (0, 1], got {value!r}")
    return float(value)


def check_timeout(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ShardlineConfigError(f"isolation_timeout must be a finite number of seconds >= 0 (0: never), got {value!r}")
    return float(value)


class IsolationGuard:
    """Decides, each expiry pass, which silent nodes are dead (see the module docstring)."""

    def __init__(self, heartbeat_timeout: float, heartbeat_interval: float, *, share: float = DEFAULT_ISOLATION_SHARE,
                 isolation_timeout: float = DEFAULT_ISOLATION_TIMEOUT_SECONDS):
        self.heartbeat_timeout = heartbeat_timeout
        self.late_after = LATE_INTERVALS * heartbeat_interval
        self.decide_after = max(heartbeat_timeout, self.late_after + heartbeat_interval)
        self.share = check_share(share)
        self.isolation_timeout = check_timeout(isolation_timeout)
        self.state = CONNECTED
        self.since = 0.0            # when the current state began
        self.late: list[str] = []   # the late nodes when it became isolated (for the log and status)
        self._resumed: float | None = None   # when heartbeats returned after an isolation: ages count from then

    def dead(self, ages: dict[str, float], now: float) -> list[str]:
        """The nodes to declare dead now, of the alive ones with these heartbeat ages (seconds)."""
        if self._resumed is not None:
            ages = {n: min(age, now - self._resumed) for n, age in ages.items()}
        silent = sorted(n for n, age in ages.items() if age > self.heartbeat_timeout)
        late = sorted(n for n, age in ages.items() if age > self.late_after)
        isolated = bool(silent) and len(late) > self.share * len(ages)
        if self.state == CONNECTED:
            if not isolated:
                return [n for n in silent if ages[n] > self.decide_after]
            self.state, self.since, self.late = ISOLATED, now, late
            log.warning("%d of %d PS nodes stopped heartbeating together (%s): suspecting this dispatcher's own "
                        "isolation, no node is declared dead until heartbeats return (or for %g s, "
                        "isolation_timeout)", len(late), len(ages), ", ".join(late), self.isolation_timeout)
            return []
        if isolated and not (self.isolation_timeout and now - self.since >= self.isolation_timeout):
            return []
        self.state, self.late = CONNECTED, []
        if isolated:
            log.warning("still no heartbeat from %d of %d PS nodes after %.0f s (isolation_timeout): they are "
                        "declared dead", len(late), len(ages), now - self.since)
            self.since = now
            return silent
        log.warning("heartbeats returned after %.1f s of suspected isolation%s", now - self.since,
                    f"; still silent, given {self.heartbeat_timeout:g} s from now: {', '.join(silent)}" if silent else "")
        self.since = self._resumed = now
        return []

    @property
    def isolated(self) -> bool:
        return self.state == ISOLATED
