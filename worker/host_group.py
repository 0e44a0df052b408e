"""Host-level aggregation: the workers of one BSP job on one host sum their gradients through
shared memory, so that the host sends one push per block to the PS nodes instead of one per worker.

::

    a worker's place in its host's group (HostGroup.state; the transitions: _TRANSITIONS)

                   BOUND                BEGIN                  SUMMED
        JOINING ------------> LEADING -----------> COLLECTING -----------> AGGREGATED
         | | ^ ^               ^ ^ ^                   |                    |     |
         | | | |               | | +------ ALONE ------+                    |     | PULL_OWED
         | | | |               | +----------------- FINISHED ---------------+     v
         | | | |               +-------------------- PULL_SENT ----------------- SHARING
         | | | |
         | | | +-- UNREACHED (no answer within join_timeout: tried again at the next step)
         | | |
         | | +------------ LEADER_LOST (from MEMBER, WAITING and PULL_AWAITED) -----+
         | |                                                                      |
         | |      JOINED               READY_SENT                                 |
         | +-------------> MEMBER -------------------> WAITING - - - - - - - - - -+
         |                  ^  ^                        |     |
         |                  |  +-------- ANSWERED ------+     | PULL_DUE
         |                  +---------- PULL_TAKEN ------- PULL_AWAITED
         |
         +-- REFUSED --> SOLO (pushes alone for good)

        every state but CLOSED --CLOSE--> CLOSED

    BOUND: this worker bound the group's socket (it leads); JOINED: the leader welcomed its HELLO;
    REFUSED: the leader refused it (another layout, group or protocol, its rank taken, the group
    full), or the socket is held by another user; BEGIN: the leader's begin_step; SUMMED: members
    were included and summed; ALONE: none was; FINISHED: LeaderStep.finish told them the outcome;
    READY_SENT: a member's gradients are in its region and READY went out; ANSWERED: PUSHED, FAILED
    or EXCLUDED came back; LEADER_LOST: the leader's connection ended, or no answer came within
    leader_timeout. The shared pull: PULL_OWED: finish() told PUSHED to members whose READY asked
    for the step's pull (SHARES_PULL); PULL_SENT: share_pull() sent them PULLED, or decline_pull()
    NOT_PULLED; PULL_DUE: such a member was told PUSHED; PULL_TAKEN: take_pull() got PULLED (and
    answered COPIED) or NOT_PULLED.

Membership. ``group_key`` names the group: its digest names an abstract-namespace Unix socket
(per network namespace: emulated hosts in namespaces of their own form groups of their own). The
first worker to bind it leads; the others connect, each sending a HELLO (group digest, layout
digest, rank, incarnation) with the fd of its gradient region: a sealed memfd holding its float32
gradients flat in layout order, each tensor on a 64-byte boundary, which the leader maps read-only.
Both ends check the peer's uid (SO_PEERCRED). Per step only fixed structs travel on the socket:
READY(step, weight, which tensors have a gradient; flag SHARES_PULL) from a member, PUSHED, FAILED
or EXCLUDED(step) back, and the group's ranks (ROSTER) whenever they change; where the pull is
shared, PULLED or NOT_PULLED(step) from the leader and COPIED(step) back.

The shared pull. Once the leader's own pull of a step completed, ``share_pull`` writes the blocks
whose version changed into its pull region (PullLayout: header, per-block version table, values;
a sealed memfd whose fd goes with the first PULLED a member gets), then tells each sharing member
PULLED; ``take_pull`` copies the blocks whose version differs from the member's, adopts the
leader's versions and answers COPIED. Region reuse: the leader rewrites the region only while no
member is between a PULLED and its COPIED; otherwise it tells that step's sharers NOT_PULLED
(each pulls itself). A member cut off by the leader mid-copy notices the hang-up after copying
and keeps none of it.

A step. The leader waits until every member sent READY for the step, until ``member_timeout``
after its own call (the late ones are excluded from the step with a WARNING; their READY is
answered EXCLUDED at once), or until a member's connection ends (removed at once). It sums, per
tensor, ``sum_i weight_i * grad_i`` in float32, **folded in ascending rank order** (``out =
w0 * g0``, then ``out.add_(g1, alpha=w1)``, ...), so the same ranks, weights and gradients give the
same bits whatever order the members came in. A member's region is the leader's from its READY
until the answer: the member writes it again only in its next begin_step, which comes after
``MemberStep.wait()`` (begin_step raises in WAITING). A step is aggregated at most once: a
begin_step for a step not after this worker's last one (a retried step) pushes alone.

Failures (docs/architecture.md, "Host aggregation"; tests/unit/test_host_group.py):

============================================  ==================================================================
failure                                       what happens
============================================  ==================================================================
a member dies before READY                    its connection ends: removed at once, the leader goes on without it
a member dies after READY, before the leader  its region is whole (READY follows the copy): included if the leader
returns                                       returned before it saw the connection end; else summed again without it
                                              (the leader checks every included member's connection after summing)
a member stalls (SIGSTOP)                     excluded after member_timeout (WARNING naming rank and step); its
                                              late READY is answered EXCLUDED; included again the next step
the leader dies before finish()               members' wait() returns False at once (EOF); at their next
                                              begin_step one binds the socket, the others join it; it waits for
                                              the lost group's ranks (ROSTER) up to member_timeout
the leader stalls past leader_timeout         the member hangs up, wait() returns False, it joins again at a
                                              later begin_step; a leader that resumes before returning drops it
                                              (the hang-up check). One that stalled while pushing pushes its
                                              gradient too: the nodes must take a rank's gradient of a step once
two workers start at once                     one binds; the other's bind fails and it connects (retrying while
                                              the winner has not listened yet)
no answer to HELLO within join_timeout        UNREACHED: this step is pushed alone, the join is tried again next
                                              step
another layout, group key or protocol         REFUSED: SOLO, WARNING naming why (both layout digests for a layout)
a peer of another uid                         the leader closes the connection; a member refuses such a leader
                                              (SOLO)
a rank a live process already holds           REFUSED (RANK_TAKEN): SOLO, WARNING naming both incarnations
a lying HELLO (no fd, region not a sealed     the connection closes / REFUSED (REGION)
memfd of the layout's size), a bad message
the leader dies before PULLED                 take_pull() returns None at once (EOF): the member pulls itself
no PULLED within leader_timeout of PUSHED     the member hangs up, take_pull() returns None: it pulls itself
a member has not answered COPIED              the leader does not rewrite the region: NOT_PULLED to the step's
                                              sharers, who pull themselves
another pull layout (digest), or a region of  take_pull() returns None (INFO naming why): the member pulls itself
another size
============================================  ==================================================================
"""

from __future__ import annotations

import enum
import errno
import functools
import hashlib
import logging
import math
import mmap
import numbers
import operator
import os
import select
import selectors
import socket
import struct
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from shardline.services import failpoints
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError, ShardlineStateError
from shardline.services.transport.shm import SharedRegion, ShmProtocolError, check_sealed_file

log = logging.getLogger("shardline.worker")

SOCKET_PREFIX = b"\0shardline-hostgroup/"
MAX_MEMBERS = 64            # ranks in one group, the leader included (a host has a few GPUs)
MAX_TENSORS = 1 << 20       # layout entries: a READY's presence bitmap is 128 KiB at most
ALIGNMENT = 64              # each tensor of a region starts on a cache line
JOIN_RETRY_INTERVAL = 0.01  # s between tries while the socket is bound but not yet listening

_MAGIC, _VERSION = b"SLHG", 3
# HELLO, member -> leader, the region's fd on it: magic, version, rank, tensors, region bytes,
# group digest, layout digest, incarnation (NUL-padded)
_HELLO = struct.Struct("<4sIIIQ32s32s64s")
# every other message: kind, flags, argument, step, value; some kinds carry a tail (_tail_bytes)
_MESSAGE = struct.Struct("<BB2xIQd")
WELCOME, REFUSED, ROSTER, READY, PUSHED, FAILED, EXCLUDED, PULLED, NOT_PULLED, COPIED = range(1, 11)
_KIND_NAMES = {WELCOME: "WELCOME", REFUSED: "REFUSED", ROSTER: "ROSTER", READY: "READY", PUSHED: "PUSHED",
               FAILED: "FAILED", EXCLUDED: "EXCLUDED", PULLED: "PULLED", NOT_PULLED: "NOT_PULLED", COPIED: "COPIED"}
SHARES_PULL = 1             # READY's flag: the member takes the step's pull from the leader (PULLED)
# the pull region's header: magic, version, step, held step, durable step, pull layout digest
_PULL_HEADER = struct.Struct("<4sIQQQ32s")
_PULL_MAGIC = b"SLPR"
_POLL_HUNG_UP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)


class Refusal(enum.IntEnum):
    """Why a leader refused a HELLO (REFUSED's argument)."""

    VERSION = 1     # another protocol version
    GROUP = 2       # another group key (the socket names' digests collided)
    LAYOUT = 3      # another layout digest
    RANK_TAKEN = 4  # the leader's own rank, or one a live process of another incarnation holds
    FULL = 5        # MAX_MEMBERS ranks already
    REGION = 6      # the fd is not a sealed memfd of the layout's region size


class HostGroupProtocolError(ShardlineConnectionError):
    """A group peer broke the protocol (unknown message, bad length, a READY out of turn): its
    connection closes."""


class HostGroupEvent(enum.Enum):
    BOUND = "this worker bound the group's socket: it leads"
    JOINED = "the leader welcomed this worker's HELLO"
    UNREACHED = "no leader answered within join_timeout: try again at the next step"
    REFUSED = "the group refused this worker (or its socket is another user's, or cannot be bound): push alone"
    BEGIN = "the leader's begin_step: collect the members' READY"
    SUMMED = "members were included and summed: the leader returns to push"
    ALONE = "no member was included: the leader pushes alone"
    FINISHED = "the leader told the included members how the push went"
    READY_SENT = "a member's gradients are in its region and READY went out"
    ANSWERED = "the leader answered a member's READY (PUSHED, FAILED or EXCLUDED)"
    LEADER_LOST = "the leader's connection ended, or it did not answer within leader_timeout"
    PULL_OWED = "the leader told members PUSHED, some of which share its pull: it owes them PULLED"
    PULL_SENT = "the leader told the sharing members PULLED (the region holds the step) or NOT_PULLED"
    PULL_DUE = "PUSHED came to a member that shares the pull: it awaits PULLED"
    PULL_TAKEN = "PULLED (copied) or NOT_PULLED came to the member"
    CLOSE = "close()"


class HostGroupState(enum.Enum):
    JOINING = "joining"        # in no group: begin_step binds the group's socket or joins its leader
    LEADING = "leading"        # holds the socket: members join it; between steps
    COLLECTING = "collecting"  # the leader's begin_step: waiting for the members' READY
    AGGREGATED = "aggregated"  # the leader returned a LeaderStep: pushing; finish() answers the members
    SHARING = "sharing"        # the leader owes its sharing members the step's pull (share_pull, decline_pull)
    MEMBER = "member"          # joined a leader; between steps
    WAITING = "waiting"        # READY sent: the region is the leader's until its answer
    PULL_AWAITED = "pull_awaited"   # PUSHED came, the member shares the pull: take_pull() awaits PULLED
    SOLO = "solo"              # refused: pushes alone for good
    CLOSED = "closed"

    def after(self, event: HostGroupEvent) -> HostGroupState:
        """The state ``event`` leads to (the diagram in the module docstring)."""
        try:
            return _TRANSITIONS[(self, event)]
        except KeyError:
            raise ShardlineStateError(f"host group: no transition from {self.value} on {event.name}") from None


_S, _E = HostGroupState, HostGroupEvent
_TRANSITIONS = {
    (_S.JOINING, _E.BOUND): _S.LEADING,
    (_S.JOINING, _E.JOINED): _S.MEMBER,
    (_S.JOINING, _E.UNREACHED): _S.JOINING,
    (_S.JOINING, _E.REFUSED): _S.SOLO,
    (_S.LEADING, _E.BEGIN): _S.COLLECTING,
    (_S.COLLECTING, _E.ALONE): _S.LEADING,
    (_S.COLLECTING, _E.SUMMED): _S.AGGREGATED,
    (_S.AGGREGATED, _E.FINISHED): _S.LEADING,
    (_S.AGGREGATED, _E.PULL_OWED): _S.SHARING,
    (_S.SHARING, _E.PULL_SENT): _S.LEADING,
    (_S.MEMBER, _E.READY_SENT): _S.WAITING,
    (_S.WAITING, _E.ANSWERED): _S.MEMBER,
    (_S.WAITING, _E.PULL_DUE): _S.PULL_AWAITED,
    (_S.PULL_AWAITED, _E.PULL_TAKEN): _S.MEMBER,
    (_S.MEMBER, _E.LEADER_LOST): _S.JOINING,
    (_S.WAITING, _E.LEADER_LOST): _S.JOINING,
    (_S.PULL_AWAITED, _E.LEADER_LOST): _S.JOINING,
    **{(state, _E.CLOSE): _S.CLOSED for state in _S if state is not _S.CLOSED},
}


class SharedPull(NamedTuple):
    """What a member took from its leader's pull (take_pull): the leader's held step and the step
    its replies called every step before durable (Client.adopt_host_pull)."""

    held_step: int
    durable_step: int


@dataclass
class LeaderStep:
    """The leader's step: ``sums`` of ``ranks`` (ascending, the leader included, at least 2) with
    ``weights`` (same order) to push on their behalf. Per layout name, a flat float32 tensor of
    ``sum_i weights_i * grads_i`` folded in ascending rank order, or None where no included rank had
    a gradient. The caller pushes, then calls ``finish`` exactly once (in a ``finally``: the
    members wait for it)."""

    step: int
    ranks: tuple[int, ...]
    weights: tuple[float, ...]
    sums: dict[str, torch.Tensor | None]
    _finish: Callable[[bool], None] = field(default=None, repr=False, compare=False)

    def finish(self, pushed: bool) -> None:
        """Tell the included members PUSHED (their gradients are on the nodes) or FAILED (each
        pushes its own)."""
        self._finish(bool(pushed))


@dataclass
class MemberStep:
    """A member's step: its READY went to ``leader`` (its rank)."""

    step: int
    leader: int
    _wait: Callable[[], bool] = field(default=None, repr=False, compare=False)
    _result: bool | None = field(default=None, repr=False, compare=False)

    def wait(self) -> bool:
        """Block until the leader answers this step: True if the leader pushed this rank's
        gradients; False if this rank must push them itself (told FAILED or EXCLUDED, the leader
        gone, or no answer within leader_timeout). Again: the same answer."""
        if self._result is None:
            self._result = self._wait()
        return self._result


class HostGroup:
    """One worker's place in its host's aggregation group for one job.

    ``layout``: the job's trainable float32 tensors as ``(name, numel)``, in one order every member
    uses (members of another layout are refused). ``incarnation``: this process's identity as its
    rank (a restarted rank has another). ``member_timeout``: how long the leader waits for the
    members' READY after its own begin_step; ``leader_timeout``: how long a member waits for the
    answer after its READY; ``join_timeout``: one attempt to lead or join. Joins at construction.
    One training thread calls it; ``close()`` ends it (the leader's connection thread too).
    """

    def __init__(self, group_key: str, rank: int, layout: Sequence[tuple[str, int]], *, incarnation: str,
                 member_timeout: float = 10.0, leader_timeout: float = 60.0, join_timeout: float = 5.0,
                 pull_layout: PullLayout | None = None) -> None:
        if not isinstance(group_key, str) or not group_key:
            raise ShardlineConfigError(f"host group: group_key must be a non-empty string, got {group_key!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2 ** 32:
            raise ShardlineConfigError(f"host group: rank must be an integer in [0, 2**32), got {rank!r}")
        encoded = incarnation.encode() if isinstance(incarnation, str) else b""
        if not 0 < len(encoded) <= 64 or b"\0" in encoded:
            raise ShardlineConfigError(f"host group: incarnation must be a string of 1 to 64 bytes, got {incarnation!r}")
        self.member_timeout = _checked_timeout("member_timeout", member_timeout)
        self.leader_timeout = _checked_timeout("leader_timeout", leader_timeout)
        self.join_timeout = _checked_timeout("join_timeout", join_timeout)
        self.group_key, self.rank, self.incarnation = group_key, rank, incarnation
        self._layout = _Layout(layout)
        self.pull_layout = pull_layout   # None: this worker neither shares nor takes the host's pull
        self._group_digest = hashlib.sha256(group_key.encode()).digest()
        self._name = socket_name(group_key)
        self._state = HostGroupState.JOINING
        self._last_step = -1          # the last step begun: one not after it is pushed alone
        self._inherited: set[int] = set()   # a lost leader's other ranks: awaited should this worker lead
        # member side
        self._conn: socket.socket | None = None
        self._inbox = bytearray()
        self._leader = -1
        self._roster: frozenset[int] = frozenset()
        self._region: SharedRegion | None = None
        self._region_views: list[torch.Tensor] = []
        self._waiting_step, self._ready_at, self._answered_at = -1, 0.0, 0.0
        self._sharing_step = False        # the READY sent asked for the step's pull (SHARES_PULL)
        self._pull_map: mmap.mmap | None = None   # the leader's pull region, mapped read-only
        # leader side: the connection thread and the training thread share these under _cond
        self._cond = threading.Condition()
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._peers: dict[int, _Peer] = {}
        self._hellos: list[_Hello] = []
        self._awaited: set[int] = set()     # ranks expected to join (a lost leader's group)
        self._retired: list[_Peer] = []     # gone; their regions unmapped by the training thread
        self._current, self._open = -1, False   # the step collected (or last collected), and whether still
        self._included: list[_Peer] = []
        self._sharers: list[_Peer] = []     # the included members the leader owes the step's pull (SHARING)
        self._pull_region: SharedRegion | None = None   # the leader's pull region
        self._pull_written: list[int] = []  # the version of each block the pull region holds
        self._join()

    # -- public ------------------------------------------------------------------------------------

    @property
    def state(self) -> HostGroupState:
        return self._state

    def begin_step(self, step: int, weight: float, grads: Mapping[str, torch.Tensor | None], *,
                   share_pull: bool = False) -> LeaderStep | MemberStep | None:
        """Offer this worker's gradients of ``step`` (float32 CPU tensors of the layout's sizes, any
        shape; None or absent: no gradient) with ``weight`` (finite, > 0) to the group. Returns a
        LeaderStep (this worker pushes the sums; call its ``finish``), a MemberStep (the leader has
        them; call its ``wait``), or None: push alone (no member included, not in a group, or a
        step already begun). ``share_pull`` (needs a ``pull_layout``): as a member, take the
        step's pull from the leader (``take_pull``) once it answers PUSHED."""
        step = _checked_step(step)
        weight = _checked_weight(weight)
        flat = self._layout.flat(grads)
        if share_pull and self.pull_layout is None:
            raise ShardlineConfigError("host group: share_pull needs the group's pull_layout")
        if self._state is HostGroupState.CLOSED:
            raise ShardlineStateError("host group: begin_step after close()")
        if self._state is HostGroupState.SHARING:
            self.decline_pull(f"step {step} began before the pull of step {self._current} was shared")
        if self._state is HostGroupState.PULL_AWAITED:
            self._lose_leader(f"step {step} began before the pull of step {self._waiting_step} was taken")
        if self._state is HostGroupState.WAITING:
            raise ShardlineStateError(f"host group: begin_step({step}) before step {self._waiting_step}'s "
                                      f"MemberStep.wait(): the leader may still read this worker's region")
        if self._state is HostGroupState.AGGREGATED:
            raise ShardlineStateError(f"host group: begin_step({step}) before step {self._current}'s "
                                      f"LeaderStep.finish(): its members wait for it")
        if self._state not in (HostGroupState.JOINING, HostGroupState.LEADING, HostGroupState.MEMBER,
                               HostGroupState.SOLO):
            raise ShardlineStateError(f"host group: begin_step({step}) in state {self._state.value} (one thread "
                                      f"calls it)")
        if step <= self._last_step:
            log.info("host group %r: step %d is not after step %d (a retry): rank %d pushes it alone",
                     self.group_key, step, self._last_step, self.rank)
            return None
        self._last_step = step
        if self._state is HostGroupState.MEMBER:
            self._drain()               # the leader may have gone since the last step: JOINING
        for _ in range(2):              # a leader that goes away as READY is sent: join (or lead) once more
            if self._state is HostGroupState.JOINING:
                self._join()
            if self._state is HostGroupState.LEADING:
                return self._lead(step, weight, flat)
            if self._state is not HostGroupState.MEMBER:
                return None             # SOLO, or still JOINING
            sent = self._contribute(step, weight, flat, share_pull)
            if sent is not None:
                return sent
        return None

    @property
    def pull_owed(self) -> bool:
        """The leader told members that share its pull PUSHED: call ``share_pull`` once its pull of
        the step is done, or ``decline_pull``."""
        return self._state is HostGroupState.SHARING

    @property
    def pull_awaited(self) -> bool:
        """The leader pushed this member's gradients and owes it the step's pull: call ``take_pull``."""
        return self._state is HostGroupState.PULL_AWAITED

    def share_pull(self, held_step: int, versions: Mapping[tuple[str, int], int],
                   values: Mapping[str, torch.Tensor], durable_step: int = 0) -> bool:
        """SHARING: the leader's caches hold the step (its pull completed): ``values`` (name -> the
        flat cache, float32 or bfloat16) at ``versions`` ((name, index) -> block version), with
        ``held_step`` and the ``durable_step`` its replies named (Client.durable_step). Writes the blocks whose version changed into the pull region, then tells
        each sharing member PULLED. The region is rewritten only while no member is between a
        PULLED and its COPIED (every member told PULLED answered it, or left): otherwise, or where
        ``values`` are not the pull layout's, the members are told NOT_PULLED. True if PULLED went
        out."""
        if self._state is not HostGroupState.SHARING:
            raise ShardlineStateError(f"host group: share_pull() in state {self._state.value}")
        layout = self.pull_layout
        if len(values) != len(layout.names) or any(
                name not in values or values[name].numel() != numel or str(values[name].dtype) != dtype
                for name, numel, dtype in zip(layout.names, layout.numels, layout.dtypes)):
            self.decline_pull("the job's tensors are no longer the pull layout's")
            return False
        with self._cond:
            sharers = [p for p in self._sharers if not p.closed]
            reading = sorted(p.rank for p in self._peers.values() if p.pull_unacked is not None)
        if reading:
            self.decline_pull(f"rank(s) {reading} did not answer COPIED to the last PULLED yet (the region is theirs)")
            return False
        if not sharers:
            self.decline_pull("no sharing member is left")
            return False
        self._write_pull(held_step, durable_step, versions, values)
        with self._cond:
            for peer in self._sharers:
                if not peer.closed:
                    self._send(peer, PULLED, self._current, fd=None if peer.pull_fd_sent else self._pull_region.fd)
                    peer.pull_fd_sent = True
                    peer.pull_unacked = self._current
            self._sharers = []
        self._on(HostGroupEvent.PULL_SENT)
        return True

    def decline_pull(self, why: str) -> None:
        """SHARING: tell the sharing members NOT_PULLED (each pulls the step itself), naming ``why``."""
        if self._state is not HostGroupState.SHARING:
            raise ShardlineStateError(f"host group: decline_pull() in state {self._state.value}")
        with self._cond:
            ranks = sorted(p.rank for p in self._sharers if not p.closed)
            for peer in self._sharers:
                if not peer.closed:
                    self._send(peer, NOT_PULLED, self._current)
            self._sharers = []
        log.info("host group %r: the pull of step %d is not shared (%s): rank(s) %s pull it themselves",
                 self.group_key, self._current, why, ranks)
        self._on(HostGroupEvent.PULL_SENT)

    def take_pull(self, versions: dict[tuple[str, int], int],
                  values: Mapping[str, torch.Tensor]) -> SharedPull | None:
        """PULL_AWAITED: wait for the leader's PULLED of the step (until leader_timeout after its
        PUSHED), copy into ``values`` (name -> flat cache) the blocks whose version in the region
        differs from ``versions``, adopt the leader's versions into ``versions``, answer COPIED.
        Returns the leader's held and durable steps, or None: pull the step yourself (NOT_PULLED, another
        layout, the leader gone or silent; the blocks copied, if any, lose their version)."""
        if self._state is not HostGroupState.PULL_AWAITED:
            raise ShardlineStateError(f"host group: take_pull() in state {self._state.value}")
        step = self._waiting_step
        answer = self._await_reply(step, (PULLED, NOT_PULLED), self._answered_at, f"the pull of step {step}")
        if answer is None:
            return None
        self._on(HostGroupEvent.PULL_TAKEN)
        if answer == NOT_PULLED:
            log.debug("host group %r: leader rank %d did not share the pull of step %d: rank %d pulls it",
                      self.group_key, self._leader, step, self.rank)
            return None
        try:
            held, copied, why = self._copy_pull(step, versions, values)   # held: a SharedPull
        finally:
            self._answer_copied(step)
        if why is not None:
            log.info("host group %r: rank %d cannot take leader rank %d's pull of step %d (%s): pulling it itself",
                     self.group_key, self.rank, self._leader, step, why)
            return None
        log.debug("host group %r: rank %d took %d changed block(s) of step %d from leader rank %d", self.group_key,
                  self.rank, copied, step, self._leader)
        return held

    def close(self) -> None:
        """Leave the group: a leader closes its socket (its members see the end and re-form), a
        member its connection; the regions are freed. Again: nothing."""
        if self._state is HostGroupState.CLOSED:
            return
        self._stop_leading()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._free_region()
        self._unmap_pull()
        self._on(HostGroupEvent.CLOSE)

    def _free_region(self) -> None:
        if self._region is not None:
            self._region_views = []
            self._region.close()
            try:
                self._region.memory.close()
            except BufferError:   # a view escaped: the mapping goes with it
                log.debug("host group %r: region still viewed as it is freed", self.group_key)
            self._region = None

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- state -------------------------------------------------------------------------------------

    def _on(self, event: HostGroupEvent) -> None:
        before, self._state = self._state, self._state.after(event)
        log.debug("host group %r rank %d: %s -> %s (%s)", self.group_key, self.rank, before.value,
                  self._state.value, event.name)

    # -- joining -----------------------------------------------------------------------------------

    def _join(self) -> None:
        """JOINING: lead (bind the group's socket) or join the leader that holds it, within
        join_timeout; REFUSED leads to SOLO, no answer to UNREACHED (JOINING)."""
        deadline = time.monotonic() + self.join_timeout
        last: Exception | None = None
        while True:
            try:
                if self._bind():
                    return
            except OSError as exc:   # not EADDRINUSE: this kernel gives no abstract socket here
                log.warning("host group %r: rank %d cannot bind the group's socket (%s): pushing alone",
                            self.group_key, self.rank, exc)
                self._on(HostGroupEvent.REFUSED)
                return
            try:
                if self._connect(deadline):
                    return
            except (OSError, ShardlineConnectionError) as exc:   # not listening yet, gone mid-HELLO, no answer
                last = exc
            if time.monotonic() + JOIN_RETRY_INTERVAL >= deadline:
                log.warning("host group %r: rank %d could not lead or join within join_timeout %g s (%s): "
                            "pushing alone, trying again next step", self.group_key, self.rank,
                            self.join_timeout, last)
                self._on(HostGroupEvent.UNREACHED)
                return
            time.sleep(JOIN_RETRY_INTERVAL)

    def _bind(self) -> bool:
        """Bind the group's socket and lead (True), or False if another process holds it."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self._name)
            sock.listen(MAX_MEMBERS)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
        _take_read_only_warning()
        self._listener = sock
        self._wake = socket.socketpair()
        self._wake[0].setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(sock, selectors.EVENT_READ, self._accept)
        self._selector.register(self._wake[0], selectors.EVENT_READ, None)
        with self._cond:
            self._peers, self._hellos, self._retired, self._included, self._sharers = {}, [], [], [], []
            self._awaited, self._inherited = set(self._inherited), set()
            self._current, self._open = self._last_step, False
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=f"shardline-host-group-{self.rank}", daemon=True)
        self._thread.start()
        self._on(HostGroupEvent.BOUND)
        log.info("host group %r: rank %d leads%s", self.group_key, self.rank,
                 f" (awaiting ranks {sorted(self._awaited)} of the lost leader's group)" if self._awaited else "")
        return True

    def _connect(self, deadline: float) -> bool:
        """Connect to the leader and send HELLO: True once JOINED or REFUSED; OSError or
        ShardlineConnectionError when it is worth another try (nobody listening yet, the leader
        gone mid-HELLO, no answer by ``deadline``)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.connect(self._name)
            pid, uid = _peer_credentials(sock)
            if uid != os.getuid():
                log.warning("host group %r: its socket is held by pid %d of uid %d, not this user's (%d): rank %d "
                            "pushes alone", self.group_key, pid, uid, os.getuid(), self.rank)
                sock.close()
                self._on(HostGroupEvent.REFUSED)
                return True
            if self._region is None:
                self._region = SharedRegion(self._layout.region_bytes)
                self._region_views = [self._region.tensor(torch.float32, offset, numel)
                                      for offset, numel in zip(self._layout.offsets, self._layout.numels)]
            hello = _HELLO.pack(_MAGIC, _VERSION, self.rank, len(self._layout.names), self._layout.region_bytes,
                                self._group_digest, self._layout.digest, self.incarnation.encode())
            socket.send_fds(sock, [hello], [self._region.fd])
            inbox = bytearray()
            while (first := _next_message(inbox)) is None:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                data = sock.recv(65536)
                if not data:
                    raise ShardlineConnectionError("the leader closed the connection before answering HELLO")
                inbox += data
        except BaseException:
            sock.close()
            raise
        if first.kind == REFUSED:
            sock.close()
            self._refused(first, pid)
            return True
        if first.kind != WELCOME:
            sock.close()
            raise HostGroupProtocolError(f"the leader answered HELLO with {_kind_name(first.kind)}")
        sock.settimeout(None)
        self._conn, self._leader, self._inbox = sock, first.argument, inbox
        self._roster = frozenset({self._leader, self.rank})
        self._take_replies(-1, ())
        self._on(HostGroupEvent.JOINED)
        log.info("host group %r: rank %d joined leader rank %d (pid %d)", self.group_key, self.rank, self._leader, pid)
        return True

    def _refused(self, message: _Message, pid: int) -> None:
        try:
            reason = Refusal(message.argument)
        except ValueError:
            reason = message.argument
        if reason is Refusal.LAYOUT:
            why = (f"its layout digest {self._layout.digest.hex()[:16]} differs from the leader's "
                   f"{message.tail.hex()[:16]}")
        else:
            why = {Refusal.VERSION: "another protocol version", Refusal.GROUP: "another group key",
                   Refusal.RANK_TAKEN: f"rank {self.rank} is held by another live process of the group",
                   Refusal.FULL: f"the group has {MAX_MEMBERS} ranks already",
                   Refusal.REGION: "its gradient region was refused"}.get(reason, f"reason {reason}")
        log.warning("host group %r: the leader (pid %d) refused rank %d: %s; pushing alone", self.group_key, pid,
                    self.rank, why)
        self._free_region()   # alone for good: nobody maps it
        self._on(HostGroupEvent.REFUSED)

    # -- member ------------------------------------------------------------------------------------

    def _contribute(self, step: int, weight: float, flat: list[torch.Tensor | None],
                    share_pull: bool) -> MemberStep | None:
        """Copy the gradients into the region and send READY (flagged SHARES_PULL where this
        member takes the step's pull from the leader): the MemberStep, or None (JOINING) if the
        leader's connection failed."""
        with torch.no_grad():
            for view, grad in zip(self._region_views, flat):
                if grad is not None:
                    view.copy_(grad)
        message = _message(READY, len(flat), step, weight, _bitmap([g is not None for g in flat]),
                           flags=SHARES_PULL if share_pull else 0)
        self._sharing_step = share_pull
        try:
            self._conn.settimeout(self.leader_timeout)
            self._conn.sendall(message)
        except OSError as exc:
            self._lose_leader(f"its connection failed ({exc})")
            return None
        self._waiting_step, self._ready_at = step, time.monotonic()
        self._on(HostGroupEvent.READY_SENT)
        failpoints.hit("worker.host_group_ready", step)
        return MemberStep(step, self._leader, functools.partial(self._await_answer, step))

    def _await_answer(self, step: int) -> bool:
        if self._state is not HostGroupState.WAITING or self._waiting_step != step:
            return False   # closed (or the leader lost) meanwhile: nobody pushed it
        answer = self._await_reply(step, (PUSHED, FAILED, EXCLUDED), self._ready_at, f"step {step}")
        if answer is None:
            return False
        self._answered_at = time.monotonic()
        if answer == PUSHED and self._sharing_step:
            self._on(HostGroupEvent.PULL_DUE)
            return True
        self._on(HostGroupEvent.ANSWERED)
        if answer == EXCLUDED:
            log.info("host group %r: leader rank %d excluded rank %d from step %d (it came late): pushing "
                     "alone", self.group_key, self._leader, self.rank, step)
        return answer == PUSHED

    def _await_reply(self, step: int, kinds: tuple[int, ...], since: float, what: str) -> int | None:
        """The leader's answer of one of ``kinds`` for ``step``, within leader_timeout of ``since``;
        None once the leader is lost (JOINING: its connection ended or broke the protocol, or no
        answer came in time)."""
        deadline = since + self.leader_timeout
        while True:
            try:
                answer = self._take_replies(step, kinds)
            except HostGroupProtocolError as exc:
                self._lose_leader(str(exc))
                return None
            if answer is not None:
                return answer
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._lose_leader(f"no answer for {what} within leader_timeout {self.leader_timeout:g} s")
                return None
            try:
                self._conn.settimeout(remaining)
                data = self._receive()
            except TimeoutError:
                continue
            except OSError as exc:
                self._lose_leader(f"its connection failed ({exc})")
                return None
            if not data:
                self._lose_leader("its connection ended")
                return None
            self._inbox += data

    def _receive(self) -> bytes:
        """Bytes from the leader; an fd that comes with them is its pull region (with the first
        PULLED this member gets), mapped at once."""
        data, fds, _flags, _ = socket.recv_fds(self._conn, 65536, 4, socket.MSG_CMSG_CLOEXEC)
        for fd in fds:
            try:
                self._map_pull(fd)
            finally:
                os.close(fd)
        return data

    def _map_pull(self, fd: int) -> None:
        self._unmap_pull()
        if self.pull_layout is None:
            return
        try:
            self._pull_map = _map_region(fd, self.pull_layout.region_bytes)
        except (OSError, HostGroupProtocolError) as exc:   # another layout: PULLED is then not taken
            log.info("host group %r: rank %d cannot map leader rank %d's pull region: %s", self.group_key,
                     self.rank, self._leader, exc)

    def _unmap_pull(self) -> None:
        if self._pull_map is not None:
            try:
                self._pull_map.close()
            except BufferError:   # a view escaped: the mapping goes with it
                log.debug("host group %r: pull region still viewed as it is unmapped", self.group_key)
            self._pull_map = None

    def _copy_pull(self, step: int, versions: dict,
                   values: Mapping[str, torch.Tensor]) -> tuple[SharedPull | None, int, str | None]:
        """Copy the changed blocks of the leader's pull region (PULLED of ``step`` came): (its
        held and durable steps, blocks copied, None), or (None, 0, why not) where nothing was adopted."""
        layout, region = self.pull_layout, self._pull_map
        if region is None:
            return None, 0, "no pull region of this layout's size came"
        magic, version, got_step, held, durable, digest = _PULL_HEADER.unpack_from(region, 0)
        if (magic, version) != (_PULL_MAGIC, _VERSION) or digest != layout.digest:
            return None, 0, "the leader's pull layout is another (tensors, sizes or cache dtypes differ)"
        if got_step != step:
            return None, 0, f"the region holds step {got_step}"
        if len(values) != len(layout.names) or any(
                name not in values or values[name].numel() != numel or str(values[name].dtype) != dtype
                for name, numel, dtype in zip(layout.names, layout.numels, layout.dtypes)):
            return None, 0, "this worker's tensors are no longer the pull layout's"
        keys = layout.keys()
        table = torch.frombuffer(region, dtype=torch.int64, count=len(keys), offset=layout.versions_offset).tolist()
        if min(table, default=0) < 0:
            return None, 0, "the leader holds no version of some block"
        copied = []
        block = layout.block_elements
        with torch.no_grad():
            k = 0
            for name, numel, count, offset in zip(layout.names, layout.numels, layout.blocks, layout.offsets):
                source = torch.frombuffer(region, dtype=torch.float32, count=numel, offset=offset)
                target = values[name]
                for index in range(count):
                    if versions.get((name, index)) != table[k]:
                        start = index * block
                        target[start:start + block].copy_(source[start:start + block])
                        copied.append(((name, index), table[k]))
                    k += 1
                del source
        poller = select.poll()
        poller.register(self._conn, _POLL_HUNG_UP)
        if any(events & _POLL_HUNG_UP for _fd, events in poller.poll(0)):
            # the leader cut this member off: it may have rewritten the region during the copy
            for key, _version in copied:
                versions.pop(key, None)
            return None, 0, "the leader hung up during the copy"
        for key, version in copied:
            versions[key] = version
        return SharedPull(held, durable), len(copied), None

    def _answer_copied(self, step: int) -> None:
        """COPIED: the region is the leader's again."""
        try:
            self._conn.settimeout(self.leader_timeout)
            self._conn.sendall(_message(COPIED, 0, step, 0.0))
        except OSError as exc:
            self._lose_leader(f"its connection failed ({exc})")

    def _drain(self) -> None:
        """MEMBER, between steps: take what the leader sent since (rosters); its connection ended
        (it died, or closed): JOINING."""
        try:
            self._conn.setblocking(False)
            while True:
                data = self._receive()
                if not data:
                    self._lose_leader("its connection ended")
                    return
                self._inbox += data
                self._take_replies(-1, ())
        except BlockingIOError:
            pass
        except (OSError, HostGroupProtocolError) as exc:
            self._lose_leader(str(exc))

    def _take_replies(self, step: int, kinds: tuple[int, ...]) -> int | None:
        """Take the inbox's messages up to the answer of one of ``kinds`` for ``step`` (its kind;
        the messages after it stay), noting rosters; None if it is not in. Answers of other steps
        are stale (a step this worker gave up on) and dropped; a stale PULLED is answered COPIED
        (nothing of it was read)."""
        while (message := _next_message(self._inbox)) is not None:
            if message.kind == ROSTER:
                self._roster = frozenset(struct.unpack(f"<{message.argument}I", message.tail))
            elif message.kind in (PUSHED, FAILED, EXCLUDED, PULLED, NOT_PULLED):
                if message.step == step and message.kind in kinds:
                    return message.kind
                log.debug("host group %r: stale %s of step %d", self.group_key, _kind_name(message.kind),
                          message.step)
                if message.kind == PULLED:
                    self._answer_copied(message.step)
                    if self._conn is None:
                        return None
            else:
                raise HostGroupProtocolError(f"the leader sent {_kind_name(message.kind)} to a member")
        return None

    def _lose_leader(self, why: str) -> None:
        """The leader is gone (or given up on): hang up, and remember its group's other ranks."""
        log.warning("host group %r: rank %d lost leader rank %d: %s; pushing alone until the group re-forms",
                    self.group_key, self.rank, self._leader, why)
        self._inherited = set(self._roster) - {self._leader, self.rank}
        self._conn.close()
        self._conn, self._inbox, self._leader = None, bytearray(), -1
        self._unmap_pull()   # the next leader sends its own
        self._on(HostGroupEvent.LEADER_LOST)

    # -- leader: the training thread ---------------------------------------------------------------

    def _lead(self, step: int, weight: float, flat: list[torch.Tensor | None]) -> LeaderStep | None:
        self._unmap_retired()
        self._on(HostGroupEvent.BEGIN)
        try:
            included = self._included = self._collect(step)
            while included:
                contributions = sorted([(self.rank, weight, flat)]
                                       + [(p.rank, p.weight, p.gradients()) for p in included])
                sums = _weighted_sums(self._layout.names, contributions)
                gone = self._hung_up(included)
                if not gone:
                    break
                log.warning("host group %r: rank(s) %s hung up while step %d was summed: summing it again without "
                            "them", self.group_key, sorted(p.rank for p in gone), step)
                included = self._included = [p for p in included if p not in gone]
            if not included:
                self._on(HostGroupEvent.ALONE)
                return None
            failpoints.hit("worker.host_group_leader_summed", step)
        except BaseException:
            self._abandon(step)
            raise
        self._on(HostGroupEvent.SUMMED)
        ranks, weights = zip(*[(rank, w) for rank, w, _ in contributions])
        return LeaderStep(step, ranks, weights, sums, functools.partial(self._finish, step))

    def _collect(self, step: int) -> list[_Peer]:
        """Wait for every member's READY of ``step`` (and for the awaited ranks to join) until
        member_timeout; the members included, by rank."""
        deadline = time.monotonic() + self.member_timeout
        with self._cond:
            self._current, self._open = step, True
            for peer in self._peers.values():
                if peer.ready is not None and peer.ready.step < step:   # a step this leader skipped
                    self._send(peer, EXCLUDED, peer.ready.step)
                    peer.ready = None
            while True:
                late = sorted(rank for rank, p in self._peers.items() if p.ready is None)
                remaining = deadline - time.monotonic()
                if not (late or self._awaited) or remaining <= 0:
                    break
                self._cond.wait(remaining)
            self._open = False
            included = sorted((p for p in self._peers.values() if p.ready is not None and p.ready.step == step),
                              key=lambda p: p.rank)
            for peer in included:
                peer.weight, peer.present, peer.shares_pull = peer.ready.weight, peer.ready.present, peer.ready.shares_pull
                peer.ready = None
            never_joined, self._awaited = sorted(self._awaited), set()
        if late:
            log.warning("host group %r: rank(s) %s sent no gradients for step %d within member_timeout %g s: "
                        "excluded from it (they push alone)", self.group_key, late, step, self.member_timeout)
        if never_joined:
            log.warning("host group %r: rank(s) %s of the lost leader's group did not join within member_timeout "
                        "%g s of step %d: no longer awaited", self.group_key, never_joined, self.member_timeout, step)
        return included

    def _hung_up(self, included: list[_Peer]) -> list[_Peer]:
        """The included members whose connection ended: one that gave up on this leader (or died)
        may write its region again, so what was read of it may be torn."""
        with self._cond:
            gone = [p for p in included if p.closed]
            poller = select.poll()
            for peer in included:
                if not peer.closed:
                    poller.register(peer.sock, _POLL_HUNG_UP)
            hung = {fd for fd, events in poller.poll(0) if events & _POLL_HUNG_UP}
            return gone + [p for p in included if not p.closed and p.sock.fileno() in hung]

    def _finish(self, step: int, pushed: bool) -> None:
        if self._state is HostGroupState.CLOSED:
            return   # the members saw the connection end: they push alone
        if self._state is not HostGroupState.AGGREGATED or self._current != step:
            raise ShardlineStateError(f"host group: finish() of step {step} in state {self._state.value} "
                                      f"(step {self._current})")
        with self._cond:
            for peer in self._included:
                if not peer.closed:
                    self._send(peer, PUSHED if pushed else FAILED, step)
            self._sharers = [p for p in self._included if pushed and p.shares_pull and not p.closed]
            self._included = []
        self._on(HostGroupEvent.PULL_OWED if self._sharers else HostGroupEvent.FINISHED)
        self._unmap_retired()

    def _write_pull(self, held_step: int, durable_step: int, versions: Mapping[tuple[str, int], int],
                    values: Mapping[str, torch.Tensor]) -> None:
        """(SHARING, no member reading the region) The blocks whose version changed since the
        region's last write, the version table, then the header."""
        layout = self.pull_layout
        if self._pull_region is None:
            self._pull_region = SharedRegion(layout.region_bytes)
            self._pull_written = [-1] * sum(layout.blocks)
        written, block, k = self._pull_written, layout.block_elements, 0
        with torch.no_grad():
            for name, numel, count, offset in zip(layout.names, layout.numels, layout.blocks, layout.offsets):
                target = self._pull_region.tensor(torch.float32, offset, numel)
                source = values[name].reshape(-1)
                for index in range(count):
                    version = versions.get((name, index), -1)
                    if version != written[k]:
                        if version >= 0:
                            start = index * block
                            target[start:start + block].copy_(source[start:start + block])
                        written[k] = version
                    k += 1
            self._pull_region.tensor(torch.int64, layout.versions_offset, len(written)).copy_(
                torch.tensor(written, dtype=torch.int64))
        _PULL_HEADER.pack_into(self._pull_region.memory, 0, _PULL_MAGIC, _VERSION, self._current, held_step,
                               durable_step, layout.digest)

    def _free_pull(self) -> None:
        if self._pull_region is not None:
            self._pull_region.close()
            try:
                self._pull_region.memory.close()
            except BufferError:   # a view escaped: the mapping goes with it
                log.debug("host group %r: pull region still viewed as it is freed", self.group_key)
            self._pull_region, self._pull_written = None, []

    def _abandon(self, step: int) -> None:
        """The leader's begin_step raised: the included members push alone (FAILED), a READY
        of the step not yet taken is answered EXCLUDED."""
        with self._cond:
            self._open = False
            for peer in self._included:
                if not peer.closed:
                    self._send(peer, FAILED, step)
            for peer in self._peers.values():
                if peer.ready is not None and peer.ready.step == step:
                    self._send(peer, EXCLUDED, step)
                    peer.ready = None
            self._included = []
        self._on(HostGroupEvent.ALONE)

    def _unmap_retired(self) -> None:
        """Unmap the regions of members gone since (the training thread's: no sum reads them now)."""
        with self._cond:
            retired, self._retired = self._retired, []
        for peer in retired:
            peer.unmap()

    def _stop_leading(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        try:
            self._wake[1].send(b"\0")
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():
            log.error("host group %r: the leader's connection thread did not stop within 5 s", self.group_key)
        self._thread = None
        self._selector.close()
        self._listener.close()   # the name is free: a member may bind it now
        for end in self._wake:
            end.close()
        with self._cond:
            for peer in self._peers.values():
                peer.closed = True
                peer.sock.close()
                self._retired.append(peer)
            for hello in self._hellos:
                hello.close()
            self._peers, self._hellos, self._included, self._sharers = {}, [], [], []
        self._unmap_retired()
        self._free_pull()

    # -- leader: the connection thread -------------------------------------------------------------

    def _serve(self) -> None:
        """Accept members, take their HELLO and READY, notice their connections end."""
        while not self._stopping:
            now = time.monotonic()
            timeout = min([h.deadline - now for h in self._hellos] + [1.0])
            for key, _ in self._selector.select(max(timeout, 0.0)):
                if key.data is None:
                    try:
                        key.fileobj.recv(64)
                    except BlockingIOError:
                        pass
                    continue
                try:
                    key.data(key.fileobj)
                except Exception:   # one connection's trouble must not stop the group's: that one closes
                    log.exception("host group %r: handling a member's connection failed", self.group_key)
                    self._discard(key.fileobj)
            now = time.monotonic()
            for hello in [h for h in self._hellos if h.deadline <= now]:
                log.warning("host group %r: a connection sent no HELLO within join_timeout %g s: closed",
                            self.group_key, self.join_timeout)
                self._forget_hello(hello)

    def _discard(self, sock: socket.socket) -> None:
        """Close ``sock``, whichever HELLO or member it is (its handler raised)."""
        with self._cond:
            hello = next((h for h in self._hellos if h.sock is sock), None)
            peer = next((p for p in self._peers.values() if p.sock is sock), None)
        if hello is not None:
            self._forget_hello(hello)
        elif peer is not None:
            with self._cond:
                self._drop(peer, "its handling failed")
        else:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid = _peer_credentials(sock)
        if uid != os.getuid():
            log.warning("host group %r: refused a connection from pid %d of uid %d (this user is %d)",
                        self.group_key, pid, uid, os.getuid())
            sock.close()
            return
        sock.setblocking(False)
        hello = _Hello(sock, pid, time.monotonic() + self.join_timeout)
        with self._cond:
            self._hellos.append(hello)
        self._selector.register(sock, selectors.EVENT_READ, functools.partial(self._on_hello, hello))

    def _forget_hello(self, hello: _Hello) -> None:
        self._selector.unregister(hello.sock)
        with self._cond:
            if hello in self._hellos:
                self._hellos.remove(hello)
        hello.close()

    def _on_hello(self, hello: _Hello, sock: socket.socket) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, _HELLO.size - len(hello.buffer), 4,
                                                  socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            return
        except OSError as exc:
            data, fds, flags = b"", [], 0
            log.debug("host group %r: a HELLO failed: %s", self.group_key, exc)
        hello.fds.extend(fds)
        if not data or flags & socket.MSG_CTRUNC:
            if flags & socket.MSG_CTRUNC:
                log.warning("host group %r: pid %d sent a HELLO with too many fds: closed", self.group_key, hello.pid)
            self._forget_hello(hello)
            return
        hello.buffer += data
        if len(hello.buffer) < _HELLO.size:
            return
        self._selector.unregister(sock)
        with self._cond:
            self._hellos.remove(hello)
        try:
            self._admit(hello)
        finally:
            for fd in hello.fds:
                os.close(fd)
            hello.fds = []

    def _admit(self, hello: _Hello) -> None:
        """A whole HELLO: welcome the member (map its region, note it in the roster) or refuse it."""
        magic, version, rank, tensors, region_bytes, group, layout, incarnation = _HELLO.unpack(hello.buffer)
        incarnation = incarnation.rstrip(b"\0").decode(errors="replace")
        if magic != _MAGIC or version != _VERSION:
            return self._refuse(hello, Refusal.VERSION, f"pid {hello.pid} speaks {magic!r} version {version}")
        if group != self._group_digest:
            return self._refuse(hello, Refusal.GROUP, f"rank {rank} (pid {hello.pid}) names another group key")
        if layout != self._layout.digest or tensors != len(self._layout.names) \
                or region_bytes != self._layout.region_bytes:
            return self._refuse(hello, Refusal.LAYOUT, f"rank {rank} (pid {hello.pid}) has layout digest "
                                f"{layout.hex()[:16]}, this group {self._layout.digest.hex()[:16]}")
        if len(hello.fds) != 1:
            log.warning("host group %r: rank %d (pid %d) sent a HELLO with %d fds, not its region's: closed",
                        self.group_key, rank, hello.pid, len(hello.fds))
            hello.close()
            return
        with self._cond:
            holder = self._peers.get(rank)
            if rank == self.rank or (holder is not None and holder.incarnation != incarnation
                                     and not self._hung_up([holder])):
                held_by = self.incarnation if rank == self.rank else holder.incarnation
                return self._refuse(hello, Refusal.RANK_TAKEN, f"rank {rank} (pid {hello.pid}, incarnation "
                                    f"{incarnation!r}) is held by incarnation {held_by!r}")
            if holder is None and len(self._peers) + 1 >= MAX_MEMBERS:
                return self._refuse(hello, Refusal.FULL, f"rank {rank} (pid {hello.pid}) would make more than "
                                    f"{MAX_MEMBERS} ranks")
        try:
            region = _map_region(hello.fds[0], self._layout.region_bytes)
        except (OSError, HostGroupProtocolError) as exc:
            return self._refuse(hello, Refusal.REGION, f"rank {rank} (pid {hello.pid}): {exc}")
        peer = _Peer(rank, incarnation, hello.sock, region, self._layout)
        hello.sock = None   # the peer's now
        self._selector.register(peer.sock, selectors.EVENT_READ, functools.partial(self._on_readable, peer))
        with self._cond:
            if holder is not None:
                self._drop(holder, f"incarnation {incarnation!r} of the rank joined again")
            self._peers[rank] = peer
            self._awaited.discard(rank)
            self._send(peer, WELCOME, 0, argument=self.rank)
            self._send_roster()
            self._cond.notify_all()
        log.info("host group %r: rank %d (pid %d, incarnation %r) joined; ranks %s", self.group_key, rank,
                 hello.pid, incarnation, sorted([self.rank, *self._peers]))

    def _refuse(self, hello: _Hello, reason: Refusal, why: str) -> None:
        log.warning("host group %r: refused %s (%s): it pushes alone", self.group_key, why, reason.name)
        try:
            hello.sock.send(_message(REFUSED, reason, 0, 0.0, self._layout.digest))
        except OSError:
            pass
        hello.close()

    def _on_readable(self, peer: _Peer, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            log.debug("host group %r: rank %d's connection failed: %s", self.group_key, peer.rank, exc)
            data = b""
        with self._cond:
            if not data:
                self._drop(peer, "its connection ended")
                return
            peer.inbox += data
            try:
                for message in _take_messages(peer.inbox):
                    self._on_ready(peer, message)
            except HostGroupProtocolError as exc:
                log.warning("host group %r: rank %d broke the protocol (%s): dropped", self.group_key, peer.rank, exc)
                self._drop(peer, str(exc))

    def _on_ready(self, peer: _Peer, message: _Message) -> None:
        """(under _cond) A member's READY: kept for the step collected (or a later one), answered
        EXCLUDED if that step was summed already; its COPIED: the pull region is the leader's again."""
        if message.kind == COPIED:
            if peer.pull_unacked != message.step:
                raise HostGroupProtocolError(f"COPIED of step {message.step}, PULLED was of step {peer.pull_unacked}")
            peer.pull_unacked = None
            return
        if message.kind != READY:
            raise HostGroupProtocolError(f"a member sent {_kind_name(message.kind)}")
        if message.argument != len(self._layout.names):
            raise HostGroupProtocolError(f"READY for {message.argument} tensors, the layout has "
                                         f"{len(self._layout.names)}")
        if not (math.isfinite(message.value) and message.value > 0):
            raise HostGroupProtocolError(f"READY with weight {message.value!r}")
        if peer.ready is not None:
            raise HostGroupProtocolError(f"READY for step {message.step} before step {peer.ready.step}'s answer")
        if message.step > self._current or (message.step == self._current and self._open):
            peer.ready = _Ready(message.step, message.value, _present(message.tail, message.argument),
                                bool(message.flags & SHARES_PULL) and self.pull_layout is not None)
            self._cond.notify_all()
        else:
            log.info("host group %r: rank %d's READY for step %d came after it was summed: EXCLUDED",
                     self.group_key, peer.rank, message.step)
            self._send(peer, EXCLUDED, message.step)

    def _drop(self, peer: _Peer, why: str) -> None:
        """(under _cond, connection thread) ``peer`` leaves: its connection closes now, its region
        is unmapped by the training thread (a sum may be reading it)."""
        if peer.closed:
            return
        try:
            self._selector.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.closed = True
        peer.sock.close()
        peer.ready = None
        if self._peers.get(peer.rank) is peer:
            del self._peers[peer.rank]
            self._send_roster()
        self._retired.append(peer)
        self._cond.notify_all()
        log.info("host group %r: rank %d left (%s); ranks %s", self.group_key, peer.rank, why,
                 sorted([self.rank, *self._peers]))

    def _send(self, peer: _Peer, kind: int, step: int, *, argument: int = 0, tail: bytes = b"",
              fd: int | None = None) -> None:
        """(under _cond) One message to ``peer`` (with ``fd``, if given); a member that cannot take
        it (its buffer full: stopped for long) is cut off: the connection thread then sees it end
        and drops it."""
        try:
            if fd is None:
                peer.sock.send(_message(kind, argument, step, 0.0, tail))
            else:
                socket.send_fds(peer.sock, [_message(kind, argument, step, 0.0, tail)], [fd])
        except OSError as exc:
            log.warning("host group %r: could not send %s to rank %d (%s): cutting it off", self.group_key,
                        _kind_name(kind), peer.rank, exc)
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _send_roster(self) -> None:
        """(under _cond) Tell every member the group's ranks: should this leader go, each knows whom
        the next one awaits."""
        ranks = sorted([self.rank, *self._peers])
        tail = struct.pack(f"<{len(ranks)}I", *ranks)
        for peer in self._peers.values():
            self._send(peer, ROSTER, 0, argument=len(ranks), tail=tail)


# -- helpers ---------------------------------------------------------------------------------------

def socket_name(group_key: str) -> bytes:
    """The abstract Unix socket name of ``group_key``'s group (its leader binds it)."""
    return SOCKET_PREFIX + hashlib.sha256(group_key.encode()).hexdigest()[:32].encode()


@dataclass(frozen=True)
class _Message:
    kind: int
    argument: int
    step: int
    value: float
    tail: bytes
    flags: int = 0


@dataclass(frozen=True)
class _Ready:
    step: int
    weight: float
    present: tuple[bool, ...]
    shares_pull: bool = False


class _Hello:
    """An accepted connection whose HELLO is not in yet."""

    def __init__(self, sock: socket.socket, pid: int, deadline: float):
        self.sock, self.pid, self.deadline = sock, pid, deadline
        self.buffer = bytearray()
        self.fds: list[int] = []

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class _Peer:
    """A member as its leader sees it: its connection, its region mapped read-only, its READY."""

    def __init__(self, rank: int, incarnation: str, sock: socket.socket, region: mmap.mmap, layout: _Layout):
        self.rank, self.incarnation, self.sock, self.region = rank, incarnation, sock, region
        self.views = [torch.frombuffer(region, dtype=torch.float32, count=numel, offset=offset)
                      for offset, numel in zip(layout.offsets, layout.numels)]
        self.inbox = bytearray()
        self.ready: _Ready | None = None
        self.weight, self.present = 0.0, ()   # of the step it is included in
        self.shares_pull = False              # ... and whether it takes that step's pull (SHARES_PULL)
        self.pull_fd_sent = False             # it has the pull region's fd
        self.pull_unacked: int | None = None  # the step of a PULLED it has not answered COPIED yet
        self.closed = False

    def gradients(self) -> list[torch.Tensor | None]:
        return [view if present else None for view, present in zip(self.views, self.present)]

    def unmap(self) -> None:
        self.views = []
        try:
            self.region.close()
        except BufferError:   # a view escaped: the mapping goes with it
            pass


class PullLayout:
    """What the host's shared pull carries (the pull region): every tensor of the job as ``(name,
    numel, cache dtype)`` in one order, cut in blocks of ``block_elements``. The region is, from
    offset 0: the header (_PULL_HEADER: magic, version, the step, the leader's held and durable
    steps, this layout's digest), the version table at offset 64 (one int64 per block, tensors in order, blocks
    in index order; -1: the leader holds no version of it), then each tensor's values as float32
    (a bfloat16 cache's values convert exactly), each on a 64-byte boundary. A member takes the
    region only where its own layout's digest is the leader's."""

    def __init__(self, tensors: Sequence[tuple[str, int, str]], block_elements: int):
        if isinstance(block_elements, bool) or not isinstance(block_elements, int) or block_elements <= 0:
            raise ShardlineConfigError(f"host group: block_elements must be an integer > 0, got {block_elements!r}")
        digest = hashlib.sha256(b"shardline-host-pull-layout/1\0" + struct.pack("<Q", block_elements))
        names, numels, blocks, dtypes = [], [], [], []
        for name, numel, dtype in tensors:
            dtypes.append(str(dtype))
            encoded = f"{name}\0{dtype}".encode()
            digest.update(struct.pack("<I", len(encoded)) + encoded + struct.pack("<Q", numel))
            names.append(name)
            numels.append(int(numel))
            blocks.append(-(-int(numel) // block_elements))
        self.names, self.numels, self.blocks, self.dtypes = tuple(names), tuple(numels), tuple(blocks), tuple(dtypes)
        self.block_elements = block_elements
        self.digest = digest.digest()
        self.versions_offset = ALIGNMENT
        offset = _aligned(self.versions_offset + 8 * sum(blocks))
        self.offsets = []
        for numel in numels:
            self.offsets.append(offset)
            offset = _aligned(offset + 4 * numel)
        self.region_bytes = offset

    def keys(self) -> list[tuple[str, int]]:
        """Every block as (tensor, index), in the version table's order."""
        return [(name, index) for name, count in zip(self.names, self.blocks) for index in range(count)]


class _Layout:
    """The job's trainable tensors as every member lays them out: names, sizes, where each starts
    in a member's region (64-byte aligned, in layout order), and the digest members compare."""

    def __init__(self, layout: Sequence[tuple[str, int]]):
        names, numels, offsets, seen = [], [], [], set()
        digest = hashlib.sha256(b"shardline-host-group-layout/1\0")
        offset = 0
        for entry in layout:
            try:
                name, numel = entry
                numel = operator.index(numel)
            except (TypeError, ValueError):
                raise ShardlineConfigError(f"host group: a layout entry must be (name, numel), got {entry!r}") from None
            if not isinstance(name, str) or not name or isinstance(entry[1], bool) or numel <= 0:
                raise ShardlineConfigError(f"host group: a layout entry must be (a non-empty name, numel > 0), "
                                           f"got {entry!r}")
            if name in seen:
                raise ShardlineConfigError(f"host group: layout names {name!r} twice")
            seen.add(name)
            encoded = name.encode()
            digest.update(struct.pack("<I", len(encoded)) + encoded + struct.pack("<Q", numel))
            offset = _aligned(offset)
            names.append(name)
            numels.append(numel)
            offsets.append(offset)
            offset += numel * 4
        if not names or len(names) > MAX_TENSORS:
            raise ShardlineConfigError(f"host group: layout must name 1 to {MAX_TENSORS} tensors, got {len(names)}")
        self.names, self.numels, self.offsets = tuple(names), tuple(numels), tuple(offsets)
        self.index = {name: i for i, name in enumerate(names)}
        self.region_bytes = _aligned(offset)
        self.digest = digest.digest()

    def flat(self, grads: Mapping[str, torch.Tensor | None]) -> list[torch.Tensor | None]:
        """``grads`` checked and flattened, in layout order (None: no gradient)."""
        unknown = [name for name in grads if name not in self.index]
        if unknown:
            raise ShardlineConfigError(f"host group: gradients of tensors not in the layout: {sorted(unknown)[:4]}")
        flat = []
        for name, numel in zip(self.names, self.numels):
            grad = grads.get(name)
            if grad is not None and not (isinstance(grad, torch.Tensor) and grad.dtype == torch.float32
                                         and grad.device.type == "cpu" and grad.numel() == numel):
                got = (f"{grad.dtype} on {grad.device} with {grad.numel()} elements"
                       if isinstance(grad, torch.Tensor) else type(grad).__name__)
                raise ShardlineConfigError(f"host group: gradient {name!r} must be a float32 CPU tensor of {numel} "
                                           f"elements, got {got}")
            flat.append(None if grad is None else grad.detach().reshape(-1))
        return flat


def _weighted_sums(names: Sequence[str], contributions) -> dict[str, torch.Tensor | None]:
    """Per tensor, ``sum_i w_i * g_i`` over ``contributions`` ((rank, weight, gradients), ascending
    rank), folded in that order: the same inputs give the same bits."""
    sums: dict[str, torch.Tensor | None] = {}
    with torch.no_grad():
        for i, name in enumerate(names):
            out = None
            for _rank, weight, grads in contributions:
                grad = grads[i]
                if grad is None:
                    continue
                if out is None:
                    out = torch.mul(grad, weight)
                else:
                    out.add_(grad, alpha=weight)
            sums[name] = out
    return sums


@functools.lru_cache(maxsize=1)
def _take_read_only_warning() -> None:
    """torch warns once per process that a tensor over a read-only buffer looks writable; the
    leader's views of its members' regions are such tensors, and only read. Take that one warning
    here, silenced, in the training thread (``catch_warnings`` is not thread-safe), before the
    leader's connection thread makes the views."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(bytes(4), dtype=torch.float32)


def _map_region(fd: int, size: int) -> mmap.mmap:
    """A peer's region (a SharedRegion), mapped read-only: a regular file of ``size`` bytes sealed
    against resizing (a region that could shrink would fault the reads), as shm checks its peers'."""
    try:
        check_sealed_file(fd, size, "region")
    except ShmProtocolError as exc:
        raise HostGroupProtocolError(str(exc)) from None
    return mmap.mmap(fd, size, prot=mmap.PROT_READ)


def _message(kind: int, argument: int, step: int, value: float, tail: bytes = b"", *, flags: int = 0) -> bytes:
    return _MESSAGE.pack(kind, flags, argument, step, value) + tail


def _tail_bytes(kind: int, argument: int) -> int:
    if kind == READY:
        if not 0 < argument <= MAX_TENSORS:
            raise HostGroupProtocolError(f"READY for {argument} tensors")
        return (argument + 7) // 8
    if kind == ROSTER:
        if not 0 < argument <= MAX_MEMBERS:
            raise HostGroupProtocolError(f"ROSTER of {argument} ranks")
        return 4 * argument
    if kind == REFUSED:
        return 32
    if kind in (WELCOME, PUSHED, FAILED, EXCLUDED, PULLED, NOT_PULLED, COPIED):
        return 0
    raise HostGroupProtocolError(f"unknown message kind {kind}")


def _take_messages(buffer: bytearray) -> list[_Message]:
    """The whole messages at the start of ``buffer``, removed from it (a partial one stays)."""
    messages = []
    while (message := _next_message(buffer)) is not None:
        messages.append(message)
    return messages


def _next_message(buffer: bytearray) -> _Message | None:
    """The whole message at the start of ``buffer``, removed from it; None if it is not whole yet."""
    if len(buffer) < _MESSAGE.size:
        return None
    kind, flags, argument, step, value = _MESSAGE.unpack_from(buffer)
    end = _MESSAGE.size + _tail_bytes(kind, argument)
    if len(buffer) < end:
        return None
    message = _Message(kind, argument, step, value, bytes(buffer[_MESSAGE.size:end]), flags)
    del buffer[:end]
    return message


def _kind_name(kind: int) -> str:
    return _KIND_NAMES.get(kind, f"kind {kind}")


def _bitmap(present: Sequence[bool]) -> bytes:
    bits = bytearray((len(present) + 7) // 8)
    for i, here in enumerate(present):
        if here:
            bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def _present(bitmap: bytes, count: int) -> tuple[bool, ...]:
    return tuple(bool(bitmap[i // 8] & (1 << (i % 8))) for i in range(count))


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of Unix socket ``sock`` (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _checked_step(step) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step < 2 ** 63:
        raise ShardlineConfigError(f"host group: step must be an integer in [0, 2**63), got {step!r}")
    return int(step)


def _checked_weight(weight) -> float:
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) \
            or not (math.isfinite(float(weight)) and float(weight) > 0):
        raise ShardlineConfigError(f"host group: weight must be finite and > 0, got {weight!r}")
    return float(weight)


def _checked_timeout(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not (math.isfinite(float(value)) and float(value) > 0):
        raise ShardlineConfigError(f"host group: {name} must be finite and > 0, got {value!r}")
    return float(value)
