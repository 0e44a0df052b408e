"""Watching the PS nodes a worker waits on: a request that gets no reply is given up as soon as
its node leaves the ring.

A request to a PS node blocks on its connection until the reply comes. A node that stops
answering (its network cut, its process paused) is declared dead by the dispatcher within the
failure timeout and its blocks move to their replicas; the worker must then leave it at once, not
wait out the connection's I/O timeout, and resend to the new owners. So while a request has
waited ``interval`` seconds, a watch thread asks the dispatcher every ``interval`` whether the
routing moved (naming the epochs it holds: a cheap call while nothing changed). Once the node a
request waits on is not in the serving ring any more, it aborts that request's connection: the
waiting thread fails at once and the client's recovery finds the node gone and resends
(worker/client.py). It also logs, once per step and node, that the step waits for that node.

A node that is still in the ring is waited for: it may be a slow or restarting node, or the
dispatcher may have kept it because no other node holds its blocks. Except after a cut of this
worker's own network: while the dispatcher does not answer, the watch dials it afresh for each
check (``on_unreachable``: the watch's own dispatcher client); once it answers again
(``on_reachable_again``: the client's other calls dial afresh too), a request whose TCP
connection is still resending what the cut lost is aborted too, to go out again on a new
connection at once instead of when TCP's backoff next tries (seconds after the network is back).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from shardline.services.errors import ShardlineError
from shardline.services.routing import RoutingView

log = logging.getLogger("shardline.worker")

# How often a request that waits is checked against the routing (and how long it waits first).
WATCH_INTERVAL_SECONDS = 0.5
# A request in flight this long is logged as waiting (once per step and node).
WAITING_LOG_SECONDS = 1.0


@dataclass(eq=False)
class Wait:
    """One request in flight to ``node_id`` over ``conn``."""

    node_id: str
    address: str
    conn: object                  # has abort(): ends the connection from another thread
    what: str                     # "OP_PUSH of step 12"
    step: int
    waits: bool                   # a pull that waits on purpose (a step not applied yet): not logged as stuck
    since: float = field(default_factory=time.monotonic)
    abandoned: str = ""           # why the watch aborted it ("" while it did not)


class NodeWatch:
    """Requests in flight and the thread that watches them (started with the first one).

    ``fetch(known)`` returns the routing now, given the RoutingView ``known`` (the newest this
    watch saw): ``known`` itself when unchanged. ``current()`` is the client's own RoutingView.
    """

    def __init__(self, fetch: Callable[[RoutingView], RoutingView], current: Callable[[], RoutingView],
                 interval: float = WATCH_INTERVAL_SECONDS, on_unreachable: Callable[[], None] = lambda: None,
                 on_reachable_again: Callable[[], None] = lambda: None):
        self._fetch = fetch
        self._current = current
        self._on_unreachable = on_unreachable
        self._on_reachable_again = on_reachable_again
        self._unreachable = False   # the last check could not reach the dispatcher
        self.interval = interval
        self._cond = threading.Condition()
        self._waits: set[Wait] = set()
        self._logged: set[tuple[int, str]] = set()   # (step, node) already logged as waited for
        self._closed = False
        self._thread: threading.Thread | None = None
        self._view: RoutingView | None = None

    @contextlib.contextmanager
    def waiting(self, node_id: str, address: str, conn, what: str, step: int, waits: bool = False) -> Iterator[Wait]:
        """Register a request to ``node_id`` over ``conn`` for the time of the ``with`` block."""
        wait = Wait(node_id, address, conn, what, step, waits)
        with self._cond:
            self._waits.add(wait)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="shardline-node-watch", daemon=True)
                self._thread.start()
        try:
            yield wait
        finally:
            with self._cond:
                self._waits.discard(wait)
                if not self._waits:
                    self._cond.notify_all()   # the thread ends now: an idle client holds none

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        """While a request waits and the watch is open; the next request starts another thread."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self._waits, timeout=self.interval)
                if self._closed or not self._waits:
                    self._thread = None
                    return
                now = time.monotonic()
                overdue = [w for w in self._waits if now - w.since >= self.interval and not w.abandoned]
            if overdue:
                self.check(overdue, now)

    def check(self, waits: list[Wait], now: float) -> None:
        """Log the requests that wait long, and abort those whose node left the ring."""
        for w in waits:
            if not w.waits and now - w.since >= WAITING_LOG_SECONDS and (w.step, w.node_id) not in self._logged:
                self._logged.add((w.step, w.node_id))
                if len(self._logged) > 1024:
                    self._logged = {(w.step, w.node_id)}
                log.warning("step %d waits for PS node %r (%s): no reply to its %s for %.1f s; it is given up once "
                            "the dispatcher takes it out of the ring", w.step, w.node_id, w.address, w.what, now - w.since)
        current = self._current()
        known = self._view if self._view is not None and self._view.epoch >= current.epoch else current
        try:
            view = self._fetch(known)
        except ShardlineError as exc:   # the dispatcher unreachable: keep waiting, ask again on a new connection
            log.debug("routing check failed: %s", exc)
            self._unreachable = True
            self._on_unreachable()
            return
        back, self._unreachable, self._view = self._unreachable, False, view
        if back:
            self._on_reachable_again()
        for w in waits:
            if w.node_id not in view.nodes:
                w.abandoned = f"it left the ring at epoch {view.epoch} (declared dead or drained)"
                log.warning("PS node %r (%s) left the ring at epoch %d; giving up its %s after %.1f s and resending "
                            "to the new owners", w.node_id, w.address, view.epoch, w.what, now - w.since)
                w.conn.abort()
            elif back and getattr(w.conn, "retransmitting", lambda: False)():
                w.abandoned = "the network is back, and its connection still waits to resend what it lost"
                log.warning("the dispatcher answers again: sending the %s of PS node %r (%s) again on a new "
                            "connection", w.what, w.node_id, w.address)
                w.conn.abort()
