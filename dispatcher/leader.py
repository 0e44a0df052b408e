"""Leader election of the dispatchers: a small explicit state machine over a lease.

::

    follower --(no leader key)--> candidate --(created the key)--> leader
       ^  ^                           |                              |
       |  +---(another one has it)----+                              |
       +---(lease not renewed for its TTL, key gone or re-created, step_down)---+

Every dispatcher holds one lease of ``ttl`` seconds (renewed every third of it) and announces
itself on it (``<prefix>/dispatchers/<address>``, for cluster status). A candidate creates the
leader key (``<prefix>/leader`` = its advertised address) on its lease in a transaction that
requires the key to be absent, so at most one candidate wins. The winner's term is the key's
create revision (``Holder.token``): every write it makes is fenced by it (state_etcd.py).

A leader stops leading *at once* -- ``on_deposed`` runs (the servicer drops its in-memory state)
and it goes back to following -- when

- its lease was not renewed for the TTL, counted from the *send* of the last successful renewal:
  it gives up no later than etcd can expire the lease and let another dispatcher win;
- the leader key is gone or was created again (another term);
- ``step_down`` is called (a write was fenced, or its outcome is unknown).

``holds(term)`` compares the lease deadline with the clock itself, so a request handled right
after the process wakes from a pause is refused before the election thread has even run. Pure
over an :class:`ElectionBackend` and a clock: unit tests drive ``tick()`` with fakes of both.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from shardline.services.errors import ShardlineConfigError, ShardlineError

log = logging.getLogger("shardline.dispatcher")

FOLLOWER = "follower"
CANDIDATE = "candidate"
LEADER = "leader"
# Pause before asking etcd again after a failed tick.
RETRY_SECONDS = 0.25


@dataclass(frozen=True)
class Holder:
    """Who holds the leader key: ``token`` is the key's create revision (one term of one leader)."""

    address: str
    token: int
    lease: int


@dataclass(frozen=True)
class Observation:
    """The leader key's holder (None: nobody leads) and the addresses of the announced dispatchers."""

    leader: Holder | None
    dispatchers: tuple[str, ...]


class ElectionBackend(Protocol):
    """What the election needs from etcd (state_etcd.EtcdElectionBackend). Failures raise ShardlineError."""

    def grant(self, ttl: int) -> int: ...                               # a new lease id

    def keepalive(self, lease: int) -> bool: ...                        # False: the lease is gone

    def revoke(self, lease: int) -> None: ...                           # drops the lease and its keys

    def campaign(self, lease: int, address: str) -> Holder | None: ...  # create the key if absent; its holder

    def observe(self) -> Observation: ...

    def announce(self, lease: int, address: str) -> None: ...

    def resign(self, holder: Holder) -> None: ...                       # delete the key if it is still that term

    def close(self) -> None: ...


def lease_ttl(lease_timeout: object) -> int:
    """``leader_lease_timeout`` as a lease TTL: a whole number of seconds >= 1 (ShardlineConfigError otherwise)."""
    if (isinstance(lease_timeout, bool) or not isinstance(lease_timeout, (int, float))
            or not math.isfinite(lease_timeout) or lease_timeout < 1 or lease_timeout != int(lease_timeout)):
        raise ShardlineConfigError(
            f"leader_lease_timeout must be a whole number of seconds >= 1 (an etcd lease TTL), got {lease_timeout!r}")
    return int(lease_timeout)


class LeaderElection:
    """Campaigns for ``address`` over ``backend`` with leases of ``lease_timeout`` seconds.

    ``on_elected(term)`` runs on the election thread once this dispatcher holds the key (it loads
    the state; if it raises, the dispatcher resigns the key and follows again);
    ``on_deposed(reason)`` runs when it stops leading. ``start`` runs ``tick`` on a thread;
    ``close`` stops it, resigns and revokes the lease (so another dispatcher takes over at once).
    """

    def __init__(self, backend: ElectionBackend, address: str, lease_timeout: float, *,
                 on_elected: Callable[[Holder], None], on_deposed: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.ttl = lease_ttl(lease_timeout)
        self.keepalive_interval = self.ttl / 3
        self.address = address
        self._backend = backend
        self._on_elected, self._on_deposed = on_elected, on_deposed
        self._clock = clock
        self._lock = threading.Lock()  # guards what handlers read: role, term, leader, deadline
        self._role = FOLLOWER
        self._term: Holder | None = None
        self._leader = ""
        self._dispatchers: tuple[str, ...] = ()
        self._lease: int | None = None
        self._valid_until = -math.inf   # the lease's deadline on our clock
        self._next_renewal = -math.inf
        self._lost: str | None = None   # a step_down not yet acted on
        self._failing = False           # etcd failures are logged once per outage
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- what handlers read ---------------------------------------------------------------------

    @property
    def role(self) -> str:
        with self._lock:
            return self._role

    @property
    def leader(self) -> str:
        """The leader's address as last seen ('' while none is known)."""
        with self._lock:
            return self._leader

    @property
    def dispatchers(self) -> tuple[str, ...]:
        """The announced dispatchers as last seen (this one included)."""
        with self._lock:
            return tuple(sorted(set(self._dispatchers) | {self.address}))

    def holds(self, term: Holder) -> bool:
        """True while this dispatcher leads in ``term`` and its lease is not past its deadline."""
        with self._lock:
            return (self._role == LEADER and self._term == term and self._lost is None
                    and self._clock() < self._valid_until)

    def step_down(self, reason: str) -> None:
        """Stop leading at once (any thread): ``holds`` is False from now on; the election thread
        calls ``on_deposed`` and, if the key is still this dispatcher's, leads again over a fresh load."""
        with self._lock:
            if self._role != LEADER or self._lost is not None:
                return
            self._lost = reason
        self._wake.set()

    # -- the state machine ----------------------------------------------------------------------

    def tick(self) -> float:
        """One step of the election; returns the seconds until the next one is due."""
        try:
            self._tick()
            if self._failing:
                log.info("etcd %s answers again", getattr(self._backend, "location", ""))
                self._failing = False
        except Exception as exc:  # noqa: BLE001 - etcd unreachable or refusing: the next tick retries
            if not isinstance(exc, ShardlineError):
                log.exception("leader election failed unexpectedly")
            else:
                (log.debug if self._failing else log.warning)("leader election: %s", exc)
            self._failing = True
            self._check_deadline()
            return min(RETRY_SECONDS, self.keepalive_interval)
        now = self._clock()
        with self._lock:
            due = self._next_renewal if self._role != LEADER else min(self._next_renewal, self._valid_until)
        return max(0.01, min(due - now, self.keepalive_interval))

    def _check_deadline(self) -> bool:
        """Depose when a step_down is pending or the lease ran out; True if it did."""
        with self._lock:
            reason = self._lost
            if reason is None and self._role == LEADER and self._clock() >= self._valid_until:
                reason = f"the lease was not renewed for {self.ttl} s (etcd unreachable or this process paused)"
        if reason is None:
            return False
        self._depose(reason)
        return True

    def _tick(self) -> None:
        self._check_deadline()
        if self._lease is not None and self._clock() >= self._valid_until:
            old, self._lease = self._lease, None
            try:  # its keys (leader, announcement) go at once instead of at etcd's expiry
                self._backend.revoke(old)
            except ShardlineError:
                pass
        if self._lease is None:
            sent = self._clock()
            lease = self._backend.grant(self.ttl)
            self._backend.announce(lease, self.address)
            self._lease = lease
            self._renewed(sent)
        elif self._clock() >= self._next_renewal:
            sent = self._clock()
            if not self._backend.keepalive(self._lease):
                self._lease = None
                self._depose("etcd dropped the lease")
                return  # the next tick takes a new one
            self._renewed(sent)
        observed = self._backend.observe()
        holder = observed.leader
        with self._lock:
            self._dispatchers = observed.dispatchers
            role, term = self._role, self._term
        if role == LEADER:
            if holder is not None and holder.token == term.token:
                return
            self._depose("the leader key is gone" if holder is None else
                         f"the leader key now names {holder.address} (term {holder.token})")
        if holder is None:
            with self._lock:
                self._role = CANDIDATE
            try:
                holder = self._backend.campaign(self._lease, self.address)
            finally:
                with self._lock:
                    if self._role == CANDIDATE:
                        self._role = FOLLOWER
        if holder is not None and holder.lease == self._lease:  # won now, or earlier with the reply lost
            self._elect(holder)
        else:
            self._follow(holder)

    def _renewed(self, sent: float) -> None:
        with self._lock:
            self._valid_until = sent + self.ttl
            self._next_renewal = sent + self.keepalive_interval

    def _elect(self, holder: Holder) -> None:
        with self._lock:
            self._role, self._term, self._leader, self._lost = LEADER, holder, self.address, None
        log.info("elected leader as %s (term %d, lease %d s)", self.address, holder.token, self.ttl)
        try:
            self._on_elected(holder)
        except Exception as exc:  # noqa: BLE001 - whatever failed, this dispatcher cannot lead
            log.error("elected but cannot lead: %s", exc)
            self._depose(f"loading the state failed: {exc}")
            try:
                self._backend.resign(holder)
            except ShardlineError:
                pass

    def _follow(self, holder: Holder | None) -> None:
        address = holder.address if holder is not None else ""
        with self._lock:
            changed = address != self._leader
            self._role, self._leader = FOLLOWER, address
        if changed and address:
            log.info("following leader %s (term %d)", address, holder.token)

    def _depose(self, reason: str) -> None:
        with self._lock:
            if self._role != LEADER:
                self._lost = None
                return
            term = self._term
            self._role, self._term, self._leader, self._lost = FOLLOWER, None, "", None
        log.warning("no longer the leader (term %d): %s", term.token, reason)
        try:
            self._on_deposed(reason)
        except Exception:  # noqa: BLE001 - the role changed whatever the callback hit
            log.exception("dropping the leader's state failed")

    # -- the thread -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dispatcher-election", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            delay = self.tick()
            self._wake.wait(delay)
            self._wake.clear()

    def close(self) -> None:
        """Stop campaigning; a leader resigns and the lease is revoked (best effort). Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            term = self._term if self._role == LEADER else None
        if term is not None:
            self._depose("stopping")
        try:
            if term is not None:
                self._backend.resign(term)
            if self._lease is not None:
                self._backend.revoke(self._lease)
        except ShardlineError as exc:
            log.warning("could not hand the leadership over at stop (the lease expires in %d s): %s", self.ttl, exc)
        self._lease = None
        self._backend.close()
