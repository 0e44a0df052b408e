"""The worker's steps in flight, and how it sends them again when the cluster moved under them.

::

    replay of the steps in flight (Replay.state; the transitions: _REPLAY_TRANSITIONS)

                EPOCH_MOVED                  BEGIN                    DONE, FAILED
    CURRENT -----------------> MOVED ------------------> REPLAYING -------------------> CURRENT
       ^                        | ^                       |     ^
       +------- NOTHING --------+ |           EPOCH_MOVED |     | RESTART (at the newer epoch)
                                  |                       v     |
                                  +------- FAILED --- MOVED_WHILE_REPLAYING

    EPOCH_MOVED: the routing epoch changed while steps were in flight (MOVED, MOVED_WHILE_REPLAYING
    absorb it); BEGIN: a request found the replay due; NOTHING: due, but nothing to collect.

    recovery of one node that dropped out (recover_node; wait_for_ring, ask_while_lacking wait alike)

    WAITING --(node left the ring)--> LEFT: its blocks have other owners; the request re-routes
       |  ^
       |  +--(no answer / busy, until recovery_timeout)
       v
    PROBING --(its job step)--> RESENDING (every step in flight it lacks, oldest first) --> BACK

A step is in flight from this worker's first push of it until every node applied it (BSP: one
step, dropped by the pull that follows; SSP: up to ``staleness + 1``). Its :class:`InflightStep`
keeps what the worker sent (the blocks as encoded, the weight, whether it committed), so a resend
is the same bytes; nodes ignore what they already hold, so resending is always safe.

The replay's invariant: **a commit at epoch E follows pushes of every block of the step at E** (a
node that took a block over at E counts the commit as "this rank pushed me the block"), so a replay
the routing interrupts starts over at the newest epoch, pushes first. Design and failure table:
docs/architecture.md, "Worker step protocol".
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from shardline.services import failpoints
from shardline.services.errors import (ErrorCode, RemoteError, ShardlineConnectionError, ShardlineStateError,
                                       ShardlineTimeoutError)
from shardline.services.pb import dataplane_pb2 as dp

log = logging.getLogger("shardline.worker")

# While a node is recovered, one connect to it may take this long (then the routing is checked again).
RECOVERY_CONNECT_TIMEOUT_SECONDS = 2.0
# Replies that mean "this node is there but cannot take the request now": wait and try again
# (stopping or restoring, a bound on connections or bytes in flight reached).
BUSY_CODES = (ErrorCode.UNAVAILABLE, ErrorCode.RESOURCE_EXHAUSTED)


@dataclass
class InflightStep:
    """What this worker sent for one step, kept until every node applied it (BSP: until every
    copy holder holds it too)."""

    step: int
    weight: float
    grads: dict = field(default_factory=dict)   # (tensor, index) -> the block as sent (None: a zero block)
    committed: bool = False
    lr: object = None         # the lrs its pushes and commit carried (a resend carries them again)
    own: list | None = None   # the buffers of its own its tensors were copied into (detach), by dtype

    def detach(self, take: Callable[[torch.dtype, int], torch.Tensor]) -> None:
        """Copy the blocks into buffers of the record's own (``take(dtype, numel)``), one per
        dtype: they were sent from tensors the caller writes again (the gradient buffers, a
        parameter's ``.grad``), and the record outlives the step they held."""
        if self.own is not None:
            return
        by_dtype: dict[torch.dtype, list] = {}
        for key, block in self.grads.items():
            if isinstance(block, torch.Tensor):
                by_dtype.setdefault(block.dtype, []).append(key)
        self.own = []
        for dtype, keys in by_dtype.items():
            sources = [self.grads[key] for key in keys]
            sizes = [t.numel() for t in sources]
            buffer = take(dtype, sum(sizes))
            copies = list(buffer[:sum(sizes)].split(sizes))
            torch._foreach_copy_(copies, sources)
            self.grads.update(zip(keys, copies))
            self.own.append(buffer)


class StepsInFlight:
    """The steps in flight, by step: BSP holds the current one and the one before until the nodes
    call that durable, SSP up to ``staleness + 1``."""

    def __init__(self) -> None:
        self._steps: dict[int, InflightStep] = {}
        self._spare: list[torch.Tensor] = []   # buffers of forgotten detached records, reused

    def record(self, step: int, weight: float, staleness: int, lr=None) -> InflightStep:
        """The record of ``step``, begun on its first push. A step more than ``max(staleness, 1)``
        before it is held by every node and copy holder (the nodes take no push of ``step`` before
        the pull of its parameters, which waited for that), so it is forgotten here at the latest."""
        record = self._steps.get(step)
        if record is None:
            self.forget_before(step - max(staleness, 1))
            record = self._steps[step] = InflightStep(step, weight, lr=lr)
        return record

    def forget_before(self, step: int) -> None:
        """Every node applied the steps before ``step``: nothing of them is resent."""
        for old in [s for s in self._steps if s < step]:
            record = self._steps.pop(old)
            if record.own:
                self._spare = (self._spare + record.own)[-2:]

    def detach_before(self, step: int) -> None:
        """The records of the steps before ``step`` outlive them: each takes its blocks into memory
        of its own (InflightStep.detach), from the spare buffers when one fits."""
        for old, record in self._steps.items():
            if old < step:
                record.detach(self._take)

    def _take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        for i, buffer in enumerate(self._spare):
            if buffer.dtype == dtype and buffer.numel() >= numel:
                return self._spare.pop(i)
        return torch.empty(numel, dtype=dtype)

    def oldest_first(self) -> list[InflightStep]:
        return [self._steps[s] for s in sorted(self._steps)]

    def __getitem__(self, step: int) -> InflightStep:
        return self._steps[step]

    def __contains__(self, step: int) -> bool:
        return step in self._steps

    def __iter__(self) -> Iterator[int]:
        return iter(self._steps)

    def __len__(self) -> int:
        return len(self._steps)


class ReplayEvent(enum.Enum):
    EPOCH_MOVED = "the routing epoch changed while steps were in flight"
    BEGIN = "a request found a replay due"
    NOTHING = "a replay was due but nothing is in flight to collect"
    RESTART = "the epoch moved during the replay: start over at the newer one"
    DONE = "every step in flight was resent at the current epoch"
    FAILED = "a resend raised"


class ReplayState(enum.Enum):
    CURRENT = "current"                              # the steps in flight went out at the current epoch
    MOVED = "moved"                                  # the epoch changed since: a replay is due
    REPLAYING = "replaying"                          # resending every step in flight
    MOVED_WHILE_REPLAYING = "moved_while_replaying"  # ... and the epoch changed again meanwhile

    def after(self, event: ReplayEvent) -> ReplayState:
        """The state ``event`` leads to (the diagram in the module docstring)."""
        try:
            return _REPLAY_TRANSITIONS[(self, event)]
        except KeyError:
            raise ShardlineStateError(f"replay: no transition from {self.value} on {event.name}") from None

    @property
    def due(self) -> bool:
        """The epoch moved since the steps in flight went out: they are (or will be) sent again."""
        return self in (ReplayState.MOVED, ReplayState.MOVED_WHILE_REPLAYING)


_S, _E = ReplayState, ReplayEvent
_REPLAY_TRANSITIONS = {
    (_S.CURRENT, _E.EPOCH_MOVED): _S.MOVED,
    (_S.MOVED, _E.EPOCH_MOVED): _S.MOVED,
    (_S.REPLAYING, _E.EPOCH_MOVED): _S.MOVED_WHILE_REPLAYING,
    (_S.MOVED_WHILE_REPLAYING, _E.EPOCH_MOVED): _S.MOVED_WHILE_REPLAYING,
    (_S.MOVED, _E.BEGIN): _S.REPLAYING,
    (_S.MOVED, _E.NOTHING): _S.CURRENT,
    (_S.MOVED_WHILE_REPLAYING, _E.RESTART): _S.REPLAYING,
    (_S.REPLAYING, _E.DONE): _S.CURRENT,
    (_S.REPLAYING, _E.FAILED): _S.CURRENT,
    (_S.MOVED_WHILE_REPLAYING, _E.FAILED): _S.MOVED,
}


class Replay:
    """The replay of ``steps`` after the routing epoch changed under them (diagram above)."""

    def __init__(self, steps: StepsInFlight) -> None:
        self.steps = steps
        self.state = ReplayState.CURRENT

    def _on(self, event: ReplayEvent) -> None:
        self.state = self.state.after(event)

    def epoch_moved(self) -> None:
        """The client took a routing table of another epoch."""
        if self.steps:
            self._on(ReplayEvent.EPOCH_MOVED)

    def run(self, can_collect: bool, push: Callable[[InflightStep], None],
            commit: Callable[[InflightStep], None], epoch: Callable[[], int]) -> bool:
        """If a replay is due (MOVED), push every step's blocks again and, if this worker had
        committed it, commit it again on every node, oldest step first; True if it did. A replay
        that is running already (the requests it makes come back here) is left to notice a move
        itself. ``can_collect``: the job collects steps (BSP, SSP) and this client knows it."""
        if self.state is not ReplayState.MOVED:
            return False
        if not (self.steps and can_collect):
            self._on(ReplayEvent.NOTHING)
            return False
        self._on(ReplayEvent.BEGIN)
        try:
            while True:
                self._resend_all(push, commit, epoch)
                if self.state is not ReplayState.MOVED_WHILE_REPLAYING:
                    break
                self._on(ReplayEvent.RESTART)
        except BaseException:
            self._on(ReplayEvent.FAILED)
            raise
        self._on(ReplayEvent.DONE)
        return True

    def _resend_all(self, push, commit, epoch) -> None:
        for record in self.steps.oldest_first():
            # Every block, not only those whose owner differs between the two tables this worker
            # saw: a node may have lost a block and got it back in epochs in between (forgetting
            # the pushes); a node that still holds a push ignores the resend.
            if record.grads:
                push(record)
            failpoints.hit("worker.replay_resend", record.step)   # a step's blocks resent, not its commit
            if self.state is ReplayState.MOVED_WHILE_REPLAYING:
                return   # moved again: pushes at the newer epoch first
            if record.committed:
                commit(record)
            log.info("routing moved to epoch %d during step %d: resent %d block(s)%s", epoch(), record.step,
                     len(record.grads), " and the commit" if record.committed else "")


def resend_to_node(steps: StepsInFlight, node_id: str, node_step: int, owner: Callable[[tuple], str],
                   send: Callable[..., int], oldest_step: int | None = None) -> int:
    """``node_id`` answers again at ``node_step``: send it this worker's pushes (and commit) of each
    step in flight it does not hold, oldest first (RESENDING): from its job step, or from
    ``oldest_step`` (the oldest step a block it applies still collects: a block taken over lags
    the job step; one awaiting its handover refused the push) where that is lower.
    ``owner(key)``: the node owning a block; ``send(node_id, keys, op, step, weight, grads)``: one
    request, returning the node's job step. Returns the node's job step; ShardlineStateError if
    the node is behind every step in flight (it restored an older checkpoint and no replica holds
    what it lost)."""
    held = steps.oldest_first()
    since = node_step if oldest_step is None else min(node_step, oldest_step)
    if not held or since > held[-1].step:
        log.info("PS node %r is back at step %d", node_id, node_step)
        return node_step
    if node_step < held[0].step:
        raise ShardlineStateError(
            f"PS node {node_id!r} came back at step {node_step}, behind the job's step {held[0].step}: its updates "
            f"of steps {node_step}..{held[0].step - 1} are lost (it restored an older checkpoint and no replica "
            f"holds them)")
    for record in [r for r in held if r.step >= since]:
        keys = [key for key in record.grads if owner(key) == node_id]
        if keys:
            node_step = send(node_id, keys, dp.OP_PUSH, record.step, record.weight, record.grads)
        if record.committed:
            node_step = send(node_id, [], dp.OP_COMMIT, record.step, record.weight, None)
        log.info("PS node %r is back at step %d; resent %d block(s)%s of step %d", node_id, node_step, len(keys),
                 " and the commit" if record.committed else "", record.step)
    return node_step


def recover_node(node_id: str, cause: Exception, *, recovery_timeout: float, in_ring: Callable[[], bool],
                 probe: Callable[[], int], resend: Callable[[int], int], sleep=time.sleep,
                 clock=time.monotonic) -> int | None:
    """A node dropped out (``cause``): wait until it answers again (WAITING), ask its job step
    (PROBING), resend what it lacks of the steps in flight (``resend(node_step)``: RESENDING) and
    return its job step (BACK); None if it left the routing table instead (LEFT: declared dead,
    its replicas own its blocks now). ``in_ring()`` refreshes the routing and tells whether the node
    is in it; ``probe()`` connects and asks the node's job step. After ``recovery_timeout``,
    ShardlineConnectionError naming the last error."""
    deadline = clock() + recovery_timeout
    busy = isinstance(cause, RemoteError)  # it answered: busy (restoring, a block handed over), not gone
    (log.info if busy else log.warning)("PS node %r %s (%s); waiting up to %g s", node_id,
                                        "asks to retry" if busy else "failed", cause, recovery_timeout)
    delay, last = 0.1, cause
    while True:
        try:
            if not in_ring():
                return None
            node_step = probe()
            return resend(node_step)
        except RemoteError as exc:
            if exc.code not in BUSY_CODES and exc.code != ErrorCode.NOT_OWNER:
                raise
            last = exc
        except (ShardlineConnectionError, ShardlineTimeoutError, ConnectionError, OSError) as exc:
            last = exc
        if clock() + delay > deadline:
            raise ShardlineConnectionError(f"PS node {node_id!r} did not come back within {recovery_timeout:g} s "
                                           f"(recovery_timeout); last error: {last}") from cause
        sleep(delay)
        delay = min(1.0, delay * 2)


def wait_for_ring(job: str, routing: Callable, refresh: Callable[[], None], *, recovery_timeout: float,
                  sleep=time.sleep, clock=time.monotonic) -> None:
    """Every PS node was declared dead (``routing()`` has an empty ring): wait, refreshing the
    routing, until one serves again (a restarted node restores its checkpoint), up to
    ``recovery_timeout``; then ShardlineStateError."""
    deadline = clock() + recovery_timeout
    log.warning("no PS node serves job %r's ring (epoch %d); waiting up to %g s (recovery_timeout)",
                job, routing().epoch, recovery_timeout)
    delay = 0.1
    while True:
        try:
            refresh()
        except (ShardlineConnectionError, ShardlineTimeoutError) as exc:
            log.debug("routing refresh failed: %s", exc)
        if routing().ring is not None:
            log.info("PS nodes serve again at epoch %d", routing().epoch)
            return
        if clock() + delay > deadline:
            raise ShardlineStateError(f"no PS node served job {job!r} within {recovery_timeout:g} s "
                                      f"(recovery_timeout); routing epoch {routing().epoch}")
        sleep(delay)
        delay = min(1.0, delay * 2)


def ask_while_lacking(node_id: str, job: str, exc: RemoteError, first: float, ask: Callable[[], int],
                      forget: Callable[[], None], *, recovery_timeout: float, sleep=time.sleep,
                      clock=time.monotonic) -> int:
    """``node_id`` answered that it lacks a block it owns (``exc``, UNKNOWN_TENSOR: a new owner still
    bringing it in sync): ``ask()`` again, with pauses, until it answers otherwise (a NOT_OWNER sends
    the request to the new owner instead), for up to ``recovery_timeout`` from ``first`` (when it
    was first seen lacking it); then ShardlineStateError naming the node and the block. ``forget()``
    once it has the block or is given up on. Returns the node's job step."""
    log.warning("PS node %r lacks a block it owns (%s); asking again for up to %g s (recovery_timeout): it may "
                "still be bringing it in sync", node_id, exc.remote_message, recovery_timeout)
    delay = 0.1
    while True:
        if clock() - first + delay > recovery_timeout:
            forget()
            raise ShardlineStateError(
                f"PS node {node_id!r} still lacks a block of job {job!r} after {recovery_timeout:g} s "
                f"(recovery_timeout): {exc.remote_message}; no node it could take it from holds it") from exc
        sleep(delay)
        delay = min(1.0, delay * 2)
        try:
            step = ask()
        except RemoteError as again:
            if again.code != ErrorCode.UNKNOWN_TENSOR:
                raise
            exc = again
            continue
        forget()
        log.info("PS node %r has the blocks it lacked now (after %.1f s)", node_id, clock() - first)
        return step
