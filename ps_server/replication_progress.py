"""Replication's per-holder state, as pure records: the states drawn in ps_server/replication.py.

Nothing here sends a frame, takes a lock or reads a clock: ``Replicator`` (replication.py) holds
its lock around these records, calls their transitions with what it observed, and does the I/O
the results name. Unit tests (tests/unit/test_replication_progress.py) drive them alone.
docs/architecture.md, "Replication".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable, Iterable

Key = tuple  # (tensor, index)


class HolderState(StrEnum):
    """The primary's view of one copy holder of one job."""

    OUT_OF_SYNC = "out_of_sync"   # sent nothing: the holder asks (OP_SYNC) once it learns the routing
    SYNCING = "syncing"           # its sync answer is queued; the steps after it follow on the same link
    IN_SYNC = "in_sync"           # the answer (or the initial values) went through: steps replicate


@dataclass(frozen=True)
class HolderProgress:
    """One copy holder of one job, at its primary. ``round`` numbers the stretch the holder has
    been replicating since it last joined (a sync or an INIT): a failure of a frame of an older
    round (e.g. sent to the holder's previous process) must not drop it from a newer one.
    ``sent_ahead``: the copies stepped ahead of the commits sent to it in this round
    (key -> the ``Staged`` record), which its step frame then names instead of sending again."""

    state: HolderState = HolderState.OUT_OF_SYNC
    round: int = 0
    sent_ahead: dict = field(default_factory=dict, compare=False)

    @property
    def replicating(self) -> bool:
        """Applied steps are sent to it (and wait for its ack before they become visible)."""
        return self.state is not HolderState.OUT_OF_SYNC

    def sync_asked(self, round_: int) -> HolderProgress:
        """It asked for a sync; the answer is queued, steps follow it: a new round, from any state."""
        return HolderProgress(HolderState.SYNCING, round_)

    def initialized(self, round_: int) -> HolderProgress:
        """The job's initial values were sent to it (a new job starts empty everywhere)."""
        return HolderProgress(HolderState.IN_SYNC, round_)

    def sync_answered(self, round_: int) -> HolderProgress:
        """The last frame of the sync answer of ``round_`` went through."""
        if self.state is HolderState.SYNCING and self.round == round_:
            return HolderProgress(HolderState.IN_SYNC, round_, self.sent_ahead)
        return self

    def failed(self, round_: int | None = None) -> HolderProgress:
        """A frame of ``round_`` (None: any) failed or was refused: out of sync until it asks again."""
        if not self.replicating or (round_ is not None and round_ != self.round):
            return self
        return HolderProgress()


@dataclass(frozen=True)
class SyncAsk:
    """A sync this node asked of ``node`` (the copy holder's side), pending until the last frame
    of an answer to it arrives; only answers to a request of the current routing count."""

    epoch: int

    def answered_by(self, sync_epoch: int) -> bool:
        return sync_epoch == self.epoch


@dataclass(frozen=True)
class Fetch:
    """A block this node applies but lacks: the previous holders to ask, the one asked now first."""

    holders: tuple[str, ...]

    @property
    def asked(self) -> str | None:
        return self.holders[0] if self.holders else None

    def lacked_by(self, sender: str) -> Fetch | None:
        """``sender`` answered its sync without the block: ask the next holder (None: none left)."""
        if self.asked != sender:
            return self
        return Fetch(self.holders[1:]) if len(self.holders) > 1 else None


@dataclass(eq=False)
class StepAcks:
    """An applied step waiting for its copy holders' acknowledgements: ``waiting`` maps each holder
    to the frames of the step not answered yet (a step goes to a holder in frames of at most
    STEP_FRAME_BYTES)."""

    job: object
    step: int
    blocks: list
    waiting: dict = field(default_factory=dict)
    deposed: bool = False   # a holder answered NOT_OWNER: only blocks still applied here become visible

    def answered(self, peer: str) -> bool:
        """One frame to ``peer`` was answered (or failed); True once no frame of the step waits."""
        left = self.waiting.get(peer, 0) - 1
        if left > 0:
            self.waiting[peer] = left
        else:
            self.waiting.pop(peer, None)
        return not self.waiting


@dataclass(frozen=True)
class SyncWait:
    """Applied blocks none of whose copy holders is in sync yet (a new primary whose replicas
    have not asked for their sync): visible once one of ``peers`` completes a sync, which
    carries them, or once none of ``peers`` is in the routing any more."""

    step: int
    blocks: list
    peers: frozenset


@dataclass(frozen=True)
class StepPlan:
    """Where the blocks of one applied step go: ``by_peer`` the in-sync holders and their blocks;
    ``protected`` visible once those acked; ``unprotected`` blocks whose holders are all out of
    sync, waiting for one of ``unsynced`` to sync (SyncWait)."""

    by_peer: dict
    protected: list
    unprotected: list
    unsynced: frozenset


def plan_step(items: Iterable, copies_of: Callable[[Key], Iterable[str]], me: str, replicating: set) -> StepPlan:
    """Route the applied ``items`` of (key, block) to the copy holders that are ``replicating``."""
    by_peer: dict[str, list] = {}
    protected, unprotected, unsynced = [], [], set()
    for key, block in items:
        peers = [p for p in copies_of(key) if p != me]
        synced = [p for p in peers if p in replicating]
        for peer in synced:
            by_peer.setdefault(peer, []).append((key, block))
        if peers and not synced:
            unprotected.append(block)
            unsynced.update(peers)
        else:
            protected.append(block)
    return StepPlan(by_peer, protected, unprotected, frozenset(unsynced))


@dataclass
class JobReplication:
    """Everything replication tracks for one job on this node.

    As the primary: ``holders`` (copy holder -> HolderProgress), ``sync_waits`` and ``dropped``
    (a holder dropped by a failed frame -> when; ``inviting``: invitations in flight). As a copy
    holder: ``asks`` (node -> SyncAsk), ``fetches`` (key -> Fetch), ``unowned`` (key -> when no
    role needed the copy any more: dropped after a grace period) and ``resync_due`` (a sync
    request could not be sent: the roles are assigned again, which asks again).
    """

    holders: dict[str, HolderProgress] = field(default_factory=dict)
    sync_waits: list[SyncWait] = field(default_factory=list)
    dropped: dict[str, float] = field(default_factory=dict)
    inviting: set = field(default_factory=set)
    asks: dict[str, SyncAsk] = field(default_factory=dict)
    fetches: dict[Key, Fetch] = field(default_factory=dict)
    unowned: dict[Key, float] = field(default_factory=dict)
    resync_due: bool = False

    # --- the primary's side -----------------------------------------------------------------
    def progress(self, peer: str) -> HolderProgress:
        return self.holders.get(peer) or HolderProgress()

    def replicating(self) -> dict[str, int]:
        """Holders that are sent every applied step, and their rounds."""
        return {peer: p.round for peer, p in self.holders.items() if p.replicating}

    def move(self, peer: str, progress: HolderProgress) -> HolderProgress:
        """Record ``peer``'s next state; returns the one it leaves."""
        before = self.progress(peer)
        if progress.replicating:
            self.holders[peer] = progress
            self.dropped.pop(peer, None)
        else:
            self.holders.pop(peer, None)
        return before

    def invitations_due(self, now: float, after: float, holders: set) -> list[str]:
        """The dropped holders to invite to sync now (REPLICATE_RESYNC): dropped ``after`` seconds
        ago or more (time for the holder's own ask, which a refusal makes at once), still copy
        holders of this node's blocks (``holders``: the others are forgotten), none invited now.
        They are marked as invited until ``invited``."""
        for peer in [p for p in self.dropped if p not in holders]:
            del self.dropped[peer]
        due = [peer for peer, since in self.dropped.items() if now - since >= after and peer not in self.inviting]
        self.inviting.update(due)
        return due

    def invited(self, peer: str, now: float) -> None:
        """The invitation to ``peer`` went through or failed: if it has not asked by a full
        interval later, the next is due."""
        self.inviting.discard(peer)
        if peer in self.dropped:
            self.dropped[peer] = now

    def take_sent_ahead(self, keys: Iterable[Key]) -> dict[str, dict]:
        """The copies of ``keys`` sent ahead, per holder (key -> Staged), taken out of every round."""
        keys = list(keys)
        taken = {}
        for peer, progress in self.holders.items():
            found = {key: progress.sent_ahead.pop(key) for key in keys if key in progress.sent_ahead}
            if found:
                taken[peer] = found
        return taken

    def release_sync_waits(self, released: Callable[[frozenset], bool]) -> list[SyncWait]:
        """Take the waits whose ``peers`` satisfy ``released``."""
        done = [w for w in self.sync_waits if released(w.peers)]
        if done:
            self.sync_waits = [w for w in self.sync_waits if not released(w.peers)]
        return done

    # --- the copy holder's side -----------------------------------------------------------
    def plan_resync(self, *, held: set, primary: set, copies: set, missing: dict, routed: set, me: str,
                    now: float, epoch: int, asked: Iterable[str]) -> dict[str, list]:
        """After a routing change. ``held``: the keys this node holds; ``primary``/``copies``: the
        keys it applies / keeps a copy of now; ``missing``: keys it applies and lacks -> holders to
        ask (from the previous routing); ``asked``: the nodes asked for a sync of its copies.
        Updates ``unowned`` and ``fetches`` and replaces ``asks`` (only answers to requests of this
        routing count). Returns the fetches to ask for: node -> keys."""
        for key in held - primary - copies:
            self.unowned.setdefault(key, now)
        for key in [k for k in self.unowned if k in primary or k in copies]:
            del self.unowned[key]
        missing = dict(missing)
        for key, fetch in list(self.fetches.items()):
            # still missing from an earlier change: asked again of a holder still routed
            del self.fetches[key]
            holders = [n for n in fetch.holders if n in routed and n != me]
            if key in primary and key not in held and holders and key not in missing:
                missing[key] = holders
        by_node: dict[str, list] = {}
        for key, holders in missing.items():
            self.fetches[key] = Fetch(tuple(holders))
            by_node.setdefault(holders[0], []).append(key)
        self.asks = {node: SyncAsk(epoch) for node in set(asked) | set(by_node)}
        return by_node

    def sync_answered(self, sender: str, sync_epoch: int, held: set, epoch: int) -> tuple[dict[str, list], list]:
        """The last frame of ``sender``'s sync answer arrived (asked at ``sync_epoch``); ``held``:
        the keys this node holds now. Ends the ask it answers; a fetched block it lacked is asked
        of the next previous holder. Returns (node -> keys to ask now, keys no holder has)."""
        ask = self.asks.get(sender)
        if ask is not None and ask.answered_by(sync_epoch):
            del self.asks[sender]
        ask_next: dict[str, list] = {}
        abandoned = []
        for key, fetch in list(self.fetches.items()):
            following = None if key in held else fetch.lacked_by(sender)
            if following is None:
                del self.fetches[key]
                if key not in held:
                    abandoned.append(key)
            elif following is not fetch:
                self.fetches[key] = following
                ask_next.setdefault(following.asked, []).append(key)
        for node in ask_next:
            self.asks[node] = SyncAsk(epoch)
        return ask_next, abandoned

    def fetching(self, held: set) -> bool:
        """Whether a block this node applies is still awaited (one that arrived otherwise, by an
        INIT, is no longer)."""
        for key in [k for k in self.fetches if k in held]:
            del self.fetches[key]
        return bool(self.fetches)

    def expired_unowned(self, now: float, grace: float) -> list:
        """The copies no role needed for ``grace`` seconds, taken out."""
        old = [key for key, since in self.unowned.items() if now - since > grace]
        for key in old:
            del self.unowned[key]
        return old
