"""PS-node membership: registration, heartbeats, failure detection, two-phase ring changes and the
ring epoch.

A node's states (``Membership``)::

 liveness:  (unknown) --register--> alive --silent past heartbeat_timeout (and not kept)--> dead
                                      ^                                                      |
                                      +------------------------register----------------------+

 member role (alive nodes):
   joining --(every node of both rings reported the pending epoch ready: switch)--> serving
   serving --(drain)--> draining --(switch)--> drained

Contract: pure and clock-free (every time-dependent call takes ``now``, seconds on any monotonic
clock); thread-safe, one lock guards all state. The epoch starts at 1, moves on every change of
what the routing table publishes and never goes backwards, restarts included (a restart resumes at
the stored epoch + 1). Every epoch bump and registration change is written to the state store
*before* it becomes visible; a store failure raises StateStoreError and leaves the membership
unchanged. Heartbeats write nothing; a dead or unknown node's heartbeat returns False (it must
register again). A silent node that holds blocks no other live node holds is kept alive and serving
(dispatcher/holders.py) until it or another holder of its blocks answers. Rebalances
(``rebalance``) and reader-rack changes (``set_reader_racks``) are ring changes of the same kind:
they start only while nothing is pending, any other change calls them off, and what is pending is
persisted.

Design: docs/architecture.md, "Membership and ring changes"; also
"Failure detection and partitions" and "Heatmap, rebalancing and reader racks".
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from dataclasses import dataclass

from shardline.dispatcher.isolation import DEFAULT_ISOLATION_SHARE, DEFAULT_ISOLATION_TIMEOUT_SECONDS, IsolationGuard
from shardline.dispatcher.state_memory import MemoryStateStore
from shardline.dispatcher.state_store import EPOCH_KEY, NODE_PREFIX, StateStore, StateStoreError, with_prefix
from shardline.services import build_fingerprint as build_fingerprint_rules
from shardline.services.daemon import parse_host_port
from shardline.services.config import require_positive_number
from shardline.services.errors import ShardlineConfigError, ShardlineStateError
from shardline.services.ring import DEFAULT_VNODES_PER_CAPACITY, check_vnodes, vnode_counts

log = logging.getLogger("shardline.dispatcher")

ALIVE = "alive"
DEAD = "dead"
SERVING, JOINING, DRAINING, DRAINED = "serving", "joining", "draining", "drained"
MEMBER_ROLES = (SERVING, JOINING, DRAINING, DRAINED)
# Epochs travel as uint64; a node may report at most this, so E + 1 and a restart's + 1 stay in range.
MAX_EPOCH = 2**63 - 1
# Why a node does not count as ready after a job was created or extended during a ring change.
NOT_READY_SINCE_JOB_CHANGE = "has not reported ready since a job was created or extended"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
READER_RACKS_KEY = "reader_racks"


@dataclass(frozen=True)
class NodeRecord:
    """A snapshot of one node, as published in the routing table and cluster status."""

    node_id: str
    rack: str
    grpc_address: str
    data_address: str
    capacity: float
    state: str                    # ALIVE or DEAD
    vnodes: int                   # virtual nodes on the ring; 0 when dead
    heartbeat_age_seconds: float
    blocks: int                   # as last reported by the node
    bytes: int
    member: str                   # SERVING, JOINING, DRAINING or DRAINED (alive nodes)
    insecure: bool = False        # serves a non-loopback address without a cluster token
    # During a ring change: why it still waits for this node ("": no change, or the node is ready).
    not_ready: str = ""
    build_fingerprint: str = ""   # services/build_fingerprint.py ("": not reported)


@dataclass(frozen=True)
class RoutingSnapshot:
    """What the routing table publishes: the serving ring and, during a change, the pending one."""

    epoch: int
    serving: list                 # NodeRecords, sorted by id
    pending_epoch: int            # 0: no change in progress
    pending: list                 # NodeRecords of the pending ring
    reader_racks: dict = dataclasses.field(default_factory=dict)          # job -> rack, serving ring
    pending_reader_racks: dict = dataclasses.field(default_factory=dict)  # job -> rack, pending ring


@dataclass
class _Node:
    node_id: str
    rack: str
    grpc_address: str
    data_address: str
    capacity: float
    vnodes: int
    state: str
    last_heartbeat: float
    blocks: int = 0
    bytes: int = 0
    member: str = SERVING
    ready_epoch: int = 0          # the pending epoch the node last reported in sync for (not persisted)
    not_ready: str = ""           # why its last report did not count (status and the dispatcher's warnings)
    incarnation: str = ""         # the process that registered last (not persisted: a new leader learns it)
    insecure: bool = False        # as the node registered (not persisted: it registers again)
    build_fingerprint: str = ""   # as the node registered or last heartbeat (not persisted, likewise)
    pending_vnodes: int = 0       # a rebalance in progress: the count of the pending ring (0: none)
    rebalanced: int | None = None  # counts set by rebalancing, at this vnodes_per_capacity (None: from capacity)

    def published(self) -> tuple:
        """The fields whose change alters the routing table."""
        return (self.state, self.rack, self.grpc_address, self.data_address, self.capacity, self.vnodes, self.member,
                self.pending_vnodes)

    def persisted(self) -> dict:
        """The value of key ``node/<id>``: the registration and its state, nothing per heartbeat."""
        value = {"rack": self.rack, "grpc_address": self.grpc_address, "data_address": self.data_address,
                 "capacity": self.capacity, "state": self.state, "member": self.member}
        if self.rebalanced is not None:  # counts moved by rebalancing, with the density they were made at
            value.update(vnodes=self.vnodes, pending_vnodes=self.pending_vnodes, vnodes_per_capacity=self.rebalanced)
        return value


def validate_name(value: object, what: str) -> str:
    """A node id or rack: 1..128 characters of ``[A-Za-z0-9._-]``."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ShardlineConfigError(f"{what} must be 1..128 characters of [A-Za-z0-9._-], got {value!r}")
    return value


def validate_address(value: object, what: str) -> str:
    """A ``HOST:PORT`` that peers can dial (port 1..65535)."""
    if not isinstance(value, str):
        raise ShardlineConfigError(f"{what} must be HOST:PORT, got {value!r}")
    _host, port = parse_host_port(value, what=what)
    if port == 0:
        raise ShardlineConfigError(f"{what} must name the bound port, not 0, got {value!r}")
    return value


def _validate_count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ShardlineConfigError(f"{what} must be an integer >= 0, got {value!r}")
    return value


_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


def reachable_address(address: str, peer: str) -> str:
    """The address others should use for a node that registered ``address`` from gRPC ``peer``.

    A node bound to a wildcard host (``0.0.0.0:7200``) cannot name the interface its clients should
    dial, so the host it registered from takes its place; other addresses are kept as given.
    ``peer`` is gRPC's form: ``ipv4:10.0.0.7:51234`` or ``ipv6:[fd00::7]:51234``.
    """
    host, sep, port = address.rpartition(":")
    if not sep or host not in _WILDCARD_HOSTS:
        return address  # malformed addresses are left for validation to reject
    kind, _, rest = peer.partition(":")
    peer_host = rest.rpartition(":")[0]
    if kind == "ipv4" and peer_host:
        return f"{peer_host}:{port}"
    if kind == "ipv6" and peer_host:
        return f"{peer_host if peer_host.startswith('[') else f'[{peer_host}]'}:{port}"
    return address


class Membership:
    """The set of PS nodes known to the dispatcher and the epoch of their routing table.

    ``store`` keeps them across restarts (default: memory, i.e. not kept); ``now`` is the start
    time on the caller's clock, from which restored alive nodes get their heartbeat grace;
    ``has_data()`` says whether any job holds blocks (a node joining then syncs first);
    ``sole_holders`` (docs/architecture.md, "Failure detection and partitions"; None: every silent
    node may leave) keeps the last holders of blocks in the ring; ``heartbeat_interval`` (default:
    the dispatcher's, the smaller of 1 s and a third of the timeout), ``isolation_share`` and
    ``isolation_timeout`` configure the :attr:`isolation` guard. Raises StateStoreError naming the store if its state
    cannot be read or written.
    """

    def __init__(
        self,
        heartbeat_timeout: float,
        vnodes_per_capacity: int = DEFAULT_VNODES_PER_CAPACITY,
        *,
        store: StateStore | None = None,
        now: float = 0.0,
        has_data=None,
        sole_holders=None,
        heartbeat_interval: float | None = None,
        isolation_share: float = DEFAULT_ISOLATION_SHARE,
        isolation_timeout: float = DEFAULT_ISOLATION_TIMEOUT_SECONDS,
    ):
        self.heartbeat_timeout = require_positive_number(heartbeat_timeout, "heartbeat_timeout (seconds)")
        vnode_counts({}, vnodes_per_capacity)  # validates the density
        self.vnodes_per_capacity = vnodes_per_capacity
        self.store = store if store is not None else MemoryStateStore()
        self._has_data = has_data or (lambda: False)
        self._sole_holders = sole_holders
        interval = min(1.0, heartbeat_timeout / 3) if heartbeat_interval is None else heartbeat_interval
        self.isolation = IsolationGuard(self.heartbeat_timeout, interval, share=isolation_share,
                                        isolation_timeout=isolation_timeout)
        self._kept: dict[str, str] = {}   # silent nodes kept in the ring last pass -> what only they hold
        self._lock = threading.Lock()
        self._jobs_version = 0   # job creations and extensions seen (jobs_changed); not persisted, as readiness is not
        state = self.store.load()
        # The epoch stored by the previous run, None on a fresh store (for the start-up log).
        self.recovered_epoch: int | None = None
        if EPOCH_KEY in state:
            self.recovered_epoch = self._decode_epoch(state[EPOCH_KEY])
        self._nodes: dict[str, _Node] = {
            node_id: self._decode_node(node_id, value, now) for node_id, value in with_prefix(state, NODE_PREFIX).items()
        }
        self._reader_racks, self._pending_reader_racks = self._decode_reader_racks(state.get(READER_RACKS_KEY))
        epoch = 1 if self.recovered_epoch is None else self.recovered_epoch + 1
        self.store.apply({EPOCH_KEY: {"epoch": epoch}})
        self._epoch = epoch
        self._pending_epoch = epoch if self._changing() else 0

    def _decode_epoch(self, value: dict) -> int:
        epoch = value.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 1 <= epoch <= MAX_EPOCH:
            raise StateStoreError(f"state store {self.store.location}: key {EPOCH_KEY!r} holds a bad epoch {value!r}")
        return epoch

    def _decode_reader_racks(self, value) -> tuple[dict, dict | None]:
        if value is None:
            return {}, None
        try:
            maps = [value["serving"], value.get("pending")]
            for m in maps:
                for job, rack in (m or {}).items():
                    validate_name(rack, f"reader rack of job {job!r}")
            return dict(maps[0]), (dict(maps[1]) if maps[1] is not None else None)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise StateStoreError(f"state store {self.store.location}: key {READER_RACKS_KEY!r} holds bad reader "
                                  f"racks {value!r}: {exc}") from None

    def _decode_node(self, node_id: str, value: dict, now: float) -> _Node:
        try:
            validate_name(node_id, "node_id")
            capacity = value["capacity"]
            state = value["state"]
            if state not in (ALIVE, DEAD):
                raise ShardlineConfigError(f"state must be {ALIVE} or {DEAD}, got {state!r}")
            # Rebalanced counts, if made at this density (another density recomputes the ring from capacity).
            rebalanced = value.get("vnodes_per_capacity") == self.vnodes_per_capacity
            vnodes = value["vnodes"] if rebalanced else vnode_counts({node_id: capacity}, self.vnodes_per_capacity)[node_id]
            pending_vnodes = value.get("pending_vnodes", 0) if rebalanced else 0
            check_vnodes({node_id: vnodes})
            if pending_vnodes:
                check_vnodes({node_id: pending_vnodes})
            return _Node(
                node_id=node_id,
                rack=validate_name(value["rack"], "rack"),
                grpc_address=validate_address(value["grpc_address"], "grpc_address"),
                data_address=validate_address(value["data_address"], "data_address"),
                capacity=float(capacity),
                vnodes=vnodes,
                state=state,
                last_heartbeat=now,
                member=value.get("member", SERVING) if value.get("member", SERVING) in MEMBER_ROLES else SERVING,
                pending_vnodes=pending_vnodes,
                rebalanced=self.vnodes_per_capacity if rebalanced else None,
            )
        except (KeyError, TypeError, ValueError) as exc:  # ShardlineConfigError is a ValueError
            raise StateStoreError(
                f"state store {self.store.location}: key {NODE_PREFIX + node_id!r} holds a bad node record: {exc}"
            ) from None

    def _bump(self, changed: list[_Node], epoch: int | None = None, readers=None) -> None:
        """Persist ``epoch`` (default: the current one + 1) with the new records of ``changed``,
        then publish them. Caller holds the lock. ``readers`` is the new (serving, pending) reader
        racks; without it a pending reader-rack change is called off when nodes change.

        Write-ahead: if the store fails, it raises and nothing in memory has changed.
        """
        epoch = self._epoch + 1 if epoch is None else epoch
        if readers is None:
            readers = (self._reader_racks, None if changed else self._pending_reader_racks)
        puts = {NODE_PREFIX + node.node_id: node.persisted() for node in changed}
        puts[EPOCH_KEY] = {"epoch": epoch}
        if readers != (self._reader_racks, self._pending_reader_racks):
            puts[READER_RACKS_KEY] = {"serving": readers[0], "pending": readers[1]}
        self.store.apply(puts)
        pending_before = self._pending_members()
        for node in changed:
            self._nodes[node.node_id] = node
        self._reader_racks, self._pending_reader_racks = readers
        self._epoch = epoch
        if not self._changing():
            self._pending_epoch = 0
        elif self._pending_members() != pending_before or not self._pending_epoch:
            self._pending_epoch = epoch  # a new pending ring: every node must sync for it again
            for node in self._nodes.values():
                node.not_ready = ""      # reasons given for the ring before

    def _changing(self) -> bool:
        return self._pending_reader_racks is not None or any(
            n.state == ALIVE and (n.member in (JOINING, DRAINING) or n.pending_vnodes) for n in self._nodes.values())

    def _pending_members(self) -> tuple:
        return tuple(sorted((n.node_id, n.pending_vnodes or n.vnodes) for n in self._nodes.values()
                            if n.state == ALIVE and n.member in (SERVING, JOINING))), \
            tuple(sorted((self._pending_reader_racks or self._reader_racks).items()))

    def _call_off_rebalance(self, but: str = "") -> list[_Node]:
        """Records that end a pending rebalance (the nodes keep their counts in use). Caller holds the lock."""
        return [dataclasses.replace(n, pending_vnodes=0) for n in self._nodes.values()
                if n.pending_vnodes and n.node_id != but]

    def rebalancing(self) -> bool:
        """A rebalance (pending virtual-node counts) is in progress."""
        with self._lock:
            return any(n.state == ALIVE and n.pending_vnodes for n in self._nodes.values())

    def ring_counts(self) -> tuple[dict[str, int], dict[str, int], bool]:
        """``(base, current, pending)`` of the serving nodes: capacity-derived counts, counts in use,
        and whether any ring change is pending."""
        with self._lock:
            serving = [n for n in self._nodes.values() if n.state == ALIVE and n.member == SERVING]
            base = vnode_counts({n.node_id: n.capacity for n in serving}, self.vnodes_per_capacity)
            return base, {n.node_id: n.vnodes for n in serving}, self._changing()

    def rebalance(self, vnodes: dict[str, int]) -> int:
        """Start moving the serving ring to ``vnodes`` (every serving node's new count) as a pending
        ring change. Returns the pending epoch (0: the counts are those in use, nothing to do).

        Raises ShardlineStateError if another change is pending or ``vnodes`` does not name exactly
        the serving nodes, ShardlineConfigError for a bad count, StateStoreError if not persisted."""
        check_vnodes(vnodes)
        with self._lock:
            if self._changing():
                raise ShardlineStateError("a ring change is in progress: no rebalance until it completes")
            serving = {n.node_id: n for n in self._nodes.values() if n.state == ALIVE and n.member == SERVING}
            if set(vnodes) != set(serving):
                raise ShardlineStateError(f"a rebalance must name exactly the serving nodes {sorted(serving)}, "
                                          f"got {sorted(vnodes)}")
            changed = [dataclasses.replace(n, pending_vnodes=vnodes[i], rebalanced=self.vnodes_per_capacity)
                       for i, n in sorted(serving.items()) if vnodes[i] != n.vnodes]
            if not changed:
                return 0
            self._bump(changed)
            return self._pending_epoch

    def reader_racks(self) -> tuple[dict[str, str], bool]:
        """``(job -> reader rack in use, whether any ring change is pending)``."""
        with self._lock:
            return dict(self._reader_racks), self._changing()

    def set_reader_racks(self, racks: dict[str, str]) -> int:
        """Start moving to the reader racks ``racks`` (job -> rack; every job's, absent: none) as a
        pending ring change. Returns the pending epoch (0: the map is the one in use).

        Raises ShardlineStateError if another change is pending, ShardlineConfigError for a bad
        rack name, StateStoreError if not persisted."""
        racks = {job: validate_name(rack, f"reader rack of job {job!r}") for job, rack in racks.items()}
        with self._lock:
            if self._changing():
                raise ShardlineStateError("a ring change is in progress: no reader-rack change until it completes")
            if racks == self._reader_racks:
                return 0
            self._bump([], readers=(self._reader_racks, racks))
            return self._pending_epoch

    @property
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    @property
    def pending_epoch(self) -> int:
        """The pending ring's epoch; 0: no ring change."""
        with self._lock:
            return self._pending_epoch

    def epochs(self) -> tuple[int, int]:
        """``(epoch, pending_epoch)``, read together."""
        with self._lock:
            return self._epoch, self._pending_epoch

    def fingerprints(self, but: str | None = None) -> dict[str, str]:
        """Node id -> build fingerprint of every alive node ("" where none was reported), ``but``
        left out."""
        with self._lock:
            return {node.node_id: node.build_fingerprint for node in self._nodes.values()
                    if node.state == ALIVE and node.node_id != but}

    @property
    def alive_count(self) -> int:
        with self._lock:
            return sum(1 for node in self._nodes.values() if node.state == ALIVE)

    def register(
        self,
        node_id: str,
        rack: str,
        grpc_address: str,
        data_address: str,
        capacity: float,
        now: float,
        incarnation: str = "",
        insecure: bool = False,
        remembered: tuple[int, list] | None = None,
        build_fingerprint: str = "",
    ) -> int:
        """Add a node, revive a dead one, or refresh/update a known one. Returns the epoch after.

        ``incarnation`` identifies the node's process: an alive member registering with a new one
        restarted (kill -9 and back before it was declared dead) and rejoins like a revived node.
        ``insecure``: the node serves a non-loopback address without a cluster token (status shows it).
        ``build_fingerprint``: what it computes optimizer steps with (dispatcher/replay_policy.py).
        ``remembered``: ``(epoch, NodeInfos)`` of the serving ring the node last routed by, taken
        back if no node serves (docs/architecture.md, "Failure detection and partitions").

        Re-registering an alive node with the same rack, addresses and capacity only refreshes its
        heartbeat (a node retrying registration must not churn the ring, nor write to the store).
        Any other change, including a node coming back from dead, bumps the epoch. Raises
        ShardlineConfigError on a bad field and StateStoreError if the change cannot be persisted.
        """
        validate_name(node_id, "node_id")
        validate_name(rack, "rack")
        validate_address(grpc_address, "grpc_address")
        validate_address(data_address, "data_address")
        build_fingerprint_rules.validate(build_fingerprint)
        vnodes = vnode_counts({node_id: capacity}, self.vnodes_per_capacity)[node_id]
        with self._lock:
            before = self._nodes.get(node_id)
            node = _Node(
                node_id=node_id,
                rack=rack,
                grpc_address=grpc_address,
                data_address=data_address,
                capacity=float(capacity),
                vnodes=vnodes,
                state=ALIVE,
                last_heartbeat=now,
            )
            if before is not None:
                # Keep the last storage report until the node sends a fresh one.
                node.blocks, node.bytes = before.blocks, before.bytes
                if before.capacity == node.capacity:  # keep rebalanced counts (a capacity change resets them)
                    node.vnodes, node.pending_vnodes = before.vnodes, before.pending_vnodes
                    node.rebalanced = before.rebalanced
            node.incarnation = incarnation
            node.insecure = bool(insecure)
            node.build_fingerprint = build_fingerprint
            ring_back = self._ring_back(remembered, node_id, now)
            if ring_back is not None:
                node.vnodes, node.member = ring_back.pop(node_id), SERVING
                node.rebalanced = None if node.vnodes == vnodes else self.vnodes_per_capacity
                self._bump([node, *ring_back.values()], epoch=max(self._epoch, remembered[0]) + 1)
                log.warning("no node served: took back the ring of epoch %d that node %s remembers (serving %s) "
                            "at epoch %d", remembered[0], node_id, ", ".join(sorted([node_id, *ring_back])), self._epoch)
                return self._epoch
            serving = [n for n in self._nodes.values() if n.state == ALIVE and n.member == SERVING and n.node_id != node_id]
            restarted = before is not None and bool(incarnation) and before.incarnation not in ("", incarnation)
            if before is not None and before.state == ALIVE and before.member in (SERVING, JOINING, DRAINING) \
                    and (not restarted or (before.member != JOINING and self._holds_alone(node_id, now))):
                # a known member re-registering (new addresses, a retry), or one that restarted and
                # holds blocks no live node holds: it serves them on (from its checkpoint)
                node.member = before.member
            elif serving and self._has_data():
                node.member = JOINING        # new, revived or drained: brought in sync before it serves
            else:
                node.member = SERVING        # the first node of an empty ring: nothing to sync
            if before is None or before.published() != node.published():
                called_off = []
                if node.member == JOINING:  # a join calls off a pending rebalance
                    node.pending_vnodes = 0
                    called_off = self._call_off_rebalance(but=node_id)
                self._bump([node] + called_off)
            else:
                self._nodes[node_id] = node
            return self._epoch

    def _ring_back(self, remembered: tuple[int, list] | None, node_id: str, now: float) -> dict | None:
        """If no node serves and ``node_id`` is in the ring it ``remembered``: the ring's nodes
        to serve again, id -> vnodes for ``node_id`` and a new record (alive, serving, with a
        heartbeat timeout of grace) for each other one. None: nothing to take back. Lock held."""
        if remembered is None or any(n.state == ALIVE and n.member in (SERVING, DRAINING) for n in self._nodes.values()):
            return None
        epoch, infos = remembered
        if node_id not in {info.node_id for info in infos}:
            return None
        back: dict = {}
        for info in infos:
            check_vnodes({info.node_id: info.vnodes})
            if info.node_id == node_id:
                back[node_id] = info.vnodes
                continue
            before = self._nodes.get(info.node_id)
            derived = vnode_counts({info.node_id: info.capacity}, self.vnodes_per_capacity)[info.node_id]
            back[info.node_id] = _Node(
                node_id=validate_name(info.node_id, "node_id"), rack=validate_name(info.rack, "rack"),
                grpc_address=validate_address(info.grpc_address, "grpc_address"),
                data_address=validate_address(info.data_address, "data_address"),
                capacity=float(info.capacity), vnodes=info.vnodes, state=ALIVE, last_heartbeat=now, member=SERVING,
                blocks=before.blocks if before else 0, bytes=before.bytes if before else 0,
                rebalanced=None if info.vnodes == derived else self.vnodes_per_capacity)
        return back

    def heartbeat(self, node_id: str, now: float, blocks: int = 0, bytes: int = 0, epoch: int = 0,
                  insecure: bool | None = None, build_fingerprint: str | None = None) -> bool:
        """Record a heartbeat with the node's storage report. False: unknown or dead, register again.
        ``insecure`` (None: not reported) refreshes the registration's flag (a new leader learns it so);
        ``build_fingerprint`` (None or "": not reported) likewise.

        ``epoch`` is the one the node routes with (0: not reported). One above the dispatcher's
        moves the dispatcher's to ``epoch + 1`` (persisted; StateStoreError if that fails), whether
        or not the node is registered.
        """
        _validate_count(blocks, "blocks")
        _validate_count(bytes, "bytes")
        _validate_count(epoch, "epoch")
        if epoch >= MAX_EPOCH:
            raise ShardlineConfigError(f"epoch must be below {MAX_EPOCH}, got {epoch!r}")
        with self._lock:
            if epoch > self._epoch:
                self._bump([], epoch=epoch + 1)
            node = self._nodes.get(node_id)
            if node is None or node.state != ALIVE:
                return False
            node.last_heartbeat = max(node.last_heartbeat, now)
            node.blocks, node.bytes = blocks, bytes
            if insecure is not None:
                node.insecure = bool(insecure)
            if build_fingerprint and build_fingerprint_rules.valid(build_fingerprint):  # a bad one: not liveness's
                node.build_fingerprint = build_fingerprint
            return True

    @property
    def jobs_version(self) -> int:
        """Bumped by :meth:`jobs_changed`; read it before the job list a readiness report is
        checked against, and pass it to :meth:`report_ready`."""
        with self._lock:
            return self._jobs_version

    def jobs_changed(self) -> None:
        """A job was created or extended: every readiness report so far was made without it (a
        node that does not hold the job, or its new tensors, has none of their blocks in sync and
        would drop a handover for them), so none counts any more; nodes report again once they
        hold it."""
        with self._lock:
            self._jobs_version += 1
            for node in self._nodes.values():
                node.ready_epoch = 0
                node.not_ready = NOT_READY_SINCE_JOB_CHANGE if self._pending_epoch else ""

    def report_ready(self, node_id: str, ready_epoch: int, *, jobs_version: int | None = None,
                     why: str = "") -> bool:
        """A node holds in sync everything the pending ring of ``ready_epoch`` gives it. Switches
        the change once every member of both rings did (returns True then). ``jobs_version``:
        the :attr:`jobs_version` read before the report was checked against the job list; a
        report checked against a list older than the last :meth:`jobs_changed` counts as 0.
        ``why``: the caller's reason for a report of 0 (status shows it while the change waits)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None or node.state != ALIVE:
                return False
            stale = jobs_version is not None and jobs_version != self._jobs_version
            node.ready_epoch = 0 if stale else ready_epoch
            node.not_ready = "" if node.ready_epoch and node.ready_epoch == self._pending_epoch else (
                NOT_READY_SINCE_JOB_CHANGE if stale
                else why or "is bringing its blocks in sync")
            if not self._pending_epoch:
                return False
            participants = [n for n in self._nodes.values() if n.state == ALIVE and n.member != DRAINED]
            if not all(n.ready_epoch == self._pending_epoch for n in participants):
                return False
            switched = []
            for n in participants:
                if n.member == JOINING:
                    n = dataclasses.replace(n, member=SERVING)
                elif n.member == DRAINING:
                    n = dataclasses.replace(n, member=DRAINED)
                if n.pending_vnodes:  # a rebalance: the pending counts serve now
                    n = dataclasses.replace(n, vnodes=n.pending_vnodes, pending_vnodes=0)
                if n is not self._nodes[n.node_id]:
                    switched.append(n)
            pending_readers = self._pending_reader_racks
            self._bump(switched, readers=(self._reader_racks if pending_readers is None else pending_readers, None))
            return True

    def drain(self, node_id: str, *, leaving: bool = False) -> int:
        """Start moving every block off ``node_id`` (a serving node). Returns the pending epoch.

        Raises ShardlineStateError if the node is unknown, dead or not serving, or if no other node
        would serve; with ``leaving`` (the node itself is stopping) also if another change is in
        progress — then the drains in progress are called off (their nodes serve again), since a
        cluster whose nodes all stop at once has nowhere to move blocks to."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None or node.state != ALIVE:
                raise ShardlineStateError(f"node {node_id!r} is not an alive node of this cluster")
            if node.member == DRAINING:
                return self._pending_epoch
            if node.member != SERVING:
                raise ShardlineStateError(f"node {node_id!r} is {node.member}, not serving: nothing to drain")
            called_off = self._call_off_rebalance()  # a drain supersedes a pending rebalance
            if leaving and any(n.state == ALIVE and n.member in (JOINING, DRAINING) for n in self._nodes.values()):
                cancelled = [dataclasses.replace(n, member=SERVING) for n in self._nodes.values()
                             if n.state == ALIVE and n.member == DRAINING]
                if cancelled:
                    self._bump(cancelled)
                raise ShardlineStateError(f"another ring change is in progress; node {node_id!r} stops without draining")
            others = [n for n in self._nodes.values() if n.state == ALIVE and n.member == SERVING and n.node_id != node_id]
            if not others:
                raise ShardlineStateError(f"node {node_id!r} is the only serving node: its blocks have nowhere to go")
            self._bump([dataclasses.replace(node, member=DRAINING, pending_vnodes=0)]
                       + [n for n in called_off if n.node_id != node_id])
            return self._pending_epoch

    def snapshot(self, now: float | None = None) -> RoutingSnapshot:
        """The serving ring and the pending one (docs/architecture.md, "Membership and ring changes")."""
        with self._lock:
            alive = sorted((n for n in self._nodes.values() if n.state == ALIVE), key=lambda n: n.node_id)
            serving = [self._record(n, now) for n in alive if n.member in (SERVING, DRAINING)]
            pending = []
            if self._pending_epoch:
                pending = [self._record(n, now, pending=True) for n in alive if n.member in (SERVING, JOINING)]
            readers = dict(self._reader_racks)
            pending_readers = dict(self._pending_reader_racks if self._pending_reader_racks is not None else readers)
            return RoutingSnapshot(self._epoch, serving, self._pending_epoch, pending, readers,
                                   pending_readers if self._pending_epoch else {})

    def _silent(self, now: float) -> set[str]:
        """Alive nodes without a heartbeat for more than heartbeat_timeout. Lock held."""
        return {n.node_id for n in self._nodes.values() if n.state == ALIVE and now - n.last_heartbeat > self.heartbeat_timeout}

    def _holding_alone(self, leaving: set[str]) -> dict[str, str]:
        """Of ``leaving``, the serving nodes that hold blocks no other serving node holds, with what
        (see ``sole_holders``). Lock held."""
        if self._sole_holders is None or not leaving or not self._has_data():
            return {}
        serving = [self._record(n, None) for n in sorted(self._nodes.values(), key=lambda n: n.node_id)
                   if n.state == ALIVE and n.member in (SERVING, DRAINING)]
        return self._sole_holders(serving, dict(self._reader_racks), set(leaving))

    def _holds_alone(self, node_id: str, now: float) -> bool:
        """``node_id`` holds blocks no serving node that still heartbeats holds. Lock held."""
        return node_id in self._holding_alone(self._silent(now) | {node_id})

    def kept(self) -> dict[str, str]:
        """Silent nodes the last :meth:`expire` kept in the ring, with the blocks only they hold."""
        with self._lock:
            return dict(self._kept)

    def expire(self, now: float) -> list[str]:
        """Declare dead the alive nodes silent for more than ``heartbeat_timeout`` that the
        isolation guard gives up on and that hold no block alone
        (docs/architecture.md, "Failure detection and partitions"). Returns their ids.

        Raises StateStoreError (and declares none dead) if the change cannot be persisted.
        """
        with self._lock:
            ages = {n.node_id: now - n.last_heartbeat for n in self._nodes.values() if n.state == ALIVE}
            expired = self.isolation.dead(ages, now)
            if not self.isolation.isolated:   # (isolated: none expired, the kept ones stay as they were)
                # covered only by holders that heartbeat: a node silent but not yet declared dead counts as gone
                alone = self._holding_alone(self._silent(now)) if expired else {}
                self._kept = {node_id: what for node_id, what in alone.items() if node_id in expired}
                expired = [node_id for node_id in expired if node_id not in alone]
            if expired:
                changed = [dataclasses.replace(self._nodes[node_id], state=DEAD, pending_vnodes=0) for node_id in expired]
                # a death calls off a pending rebalance (failover changes the loads it was planned from)
                changed += [n for n in self._call_off_rebalance() if n.node_id not in expired]
                left = [n for n in self._nodes.values() if n.state == ALIVE and n.node_id not in expired
                        and n.member in (SERVING, JOINING)]
                if not left:  # draining nodes have nowhere left to move their blocks: they serve on
                    changed += [dataclasses.replace(n, member=SERVING) for n in self._nodes.values()
                                if n.state == ALIVE and n.node_id not in expired and n.member == DRAINING]
                self._bump(changed)
            return expired

    def routing_table(self, now: float | None = None) -> tuple[int, list[NodeRecord]]:
        """``(epoch, serving nodes sorted by id)``; the ring is ``HashRing({n.node_id: n.vnodes})``.

        Heartbeat ages are computed against ``now`` when given, else reported as 0.
        """
        snap = self.snapshot(now)
        return snap.epoch, snap.serving

    def waiting_for(self) -> tuple[int, dict[str, str]]:
        """The pending epoch (0: no ring change) and the nodes the change still waits for, with
        why (node id -> reason)."""
        with self._lock:
            reasons = {n.node_id: self._not_ready(n) for n in sorted(self._nodes.values(), key=lambda n: n.node_id)}
            return self._pending_epoch, {node_id: why for node_id, why in reasons.items() if why}

    def _not_ready(self, node: _Node) -> str:
        """Why the pending ring change waits for ``node`` ("": it does not). Lock held."""
        if not self._pending_epoch or node.state != ALIVE or node.member == DRAINED \
                or node.ready_epoch == self._pending_epoch:
            return ""
        return node.not_ready or "has not reported ready yet"

    def all_nodes(self, now: float) -> list[NodeRecord]:
        """Every known node, alive and dead, sorted by id, with heartbeat ages at ``now``."""
        with self._lock:
            return [self._record(node, now, waiting=True) for node in sorted(self._nodes.values(), key=lambda n: n.node_id)]

    def _record(self, node: _Node, now: float | None, pending: bool = False, waiting: bool = False) -> NodeRecord:
        """``waiting``: with ``not_ready`` (status; routing tables leave it out, as it changes with
        every heartbeat during a ring change)."""
        return NodeRecord(
            node_id=node.node_id,
            rack=node.rack,
            grpc_address=node.grpc_address,
            data_address=node.data_address,
            capacity=node.capacity,
            state=node.state,
            vnodes=0 if node.state != ALIVE else (node.pending_vnodes or node.vnodes) if pending else node.vnodes,
            heartbeat_age_seconds=0.0 if now is None else max(0.0, now - node.last_heartbeat),
            blocks=node.blocks,
            bytes=node.bytes,
            member=node.member if node.state == ALIVE else "",
            insecure=node.insecure,
            build_fingerprint=node.build_fingerprint,
            not_ready=self._not_ready(node) if waiting else "",
        )
