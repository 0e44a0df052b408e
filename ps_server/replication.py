"""Replication: a block's primary keeps its replicas (and, during a ring change, its learners)
holding the same block, bitwise, at every step workers can see.

Protocol (services/placement.py says who holds what):

* **Copies, not gradients.** After applying step ``v`` the primary sends each node that holds
  copies of its blocks an ``OP_REPLICATE`` frame with the blocks it just stepped — value and every
  optimizer-state tensor, packed — and the ones it carried through without a change (no payload,
  only their new step). Shipping state rather than the averaged gradient costs ~3x the bytes for
  Adam, but a replica then equals its primary by construction: no assumption that two nodes'
  torch builds compute the optimizer bit for bit alike, one code path for replication, bringing a
  node in sync and migration, and the replica does no optimizer work. A job created with
  ``replicate_gradients`` sends instead, per stepped block, the mean gradient it was stepped with
  and the lr (``BlockRef.replay``); the holder steps its own copy from ``base_version`` the same way
  (``JobStore.replay_steps``), or, stepped ahead, holds the result apart as a staged copy. A holder
  at another version steps nothing and is dropped (UNAVAILABLE), as a holder lacking a copy is.
* **Visibility.** The stepped blocks become visible to pulls only once every in-sync copy holder
  acknowledged them (``JobStore.mark_visible``); a holder that fails or stops answering within
  ``replication_timeout`` is dropped from the job's in-sync set (and re-syncs when it can), so no
  step a worker has seen is held by fewer than the surviving in-sync nodes. A block with no
  holder in sync yet waits for the first holder's sync (it carries the block) instead.
* **Ahead of the commits.** A block its primary stepped before the step's commits (pipelined
  apply, ps_server/store.py) has its copies sent at once, flagged ``staged``: holders keep them
  apart (neither installed nor visible). Once the step is applied the primary names them in the
  step's frame as a carried block (no payload), which installs them, so visibility waits only
  for that header's ack; a holder that lacks them answers an error and is dropped (it syncs
  again). A holder that was not sent them in its current in-sync round gets the full copy.
* **Handover.** A block that changes primary mid-step takes along the gradients its old primary
  collected (``hand_over``): pushes at the new primary wait for them, briefly.
* **In sync.** A node becomes in sync for a job with a primary by asking it (``OP_SYNC`` naming
  the version and step of every copy it holds): under the job lock the primary queues copies of
  whatever differs, marks the last one, and adds the node to the job's in-sync set, so every later
  step follows on the same FIFO link. Nodes re-sync with all their primaries after each routing
  change (cheap when nothing changed: headers only); a node that restarted from a checkpoint thus
  fetches only what changed. A primary that lacks a block it now owns (its copy holder was not its
  predecessor) asks the previous owners the same way.
* **Fencing.** A copy is accepted only from the block's primary at the receiver's epoch (or as the
  answer to the receiver's own sync request); a deposed primary is told NOT_OWNER, refreshes its
  routing and stops serving the blocks.

Initial values (``OP_INIT``) are replicated before the INIT is acknowledged.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Callable

import torch

from shardline.services.placement import place
from shardline.ps_server.store import Handover, JobStore, StoreError
from shardline.services import failpoints, frame
from shardline.services.dataplane_client import DataPlaneConnection
from shardline.services.errors import ErrorCode, RemoteError, ShardlineConnectionError, ShardlineError
from shardline.services.pb import dataplane_pb2 as dp

log = logging.getLogger("shardline.ps.replication")

REPLICATION_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 5.0
# Blocks per OP_REPLICATE frame of a sync (bounds a frame; the link sends them in order).
SYNC_BATCH_BYTES = 64 << 20


# --- block codec --------------------------------------------------------------------------
class BlockCodec:
    """Packs a block's value and optimizer state into one float32 run and back.

    Layout: the value, then the state entries in sorted key order: tensors as float32 (a 0-dim
    tensor as one element), ints as the 8 bytes of an int64 (two float32 slots, bit for bit).
    """

    def __init__(self, job: JobStore):
        self.optimizer = job.optimizer
        template = job.optimizer.init_state(2)
        self.entries = []  # (key, kind, elements per block element or fixed count)
        for key in sorted(template):
            value = template[key]
            if isinstance(value, torch.Tensor):
                self.entries.append((key, "scalar" if value.dim() == 0 else "vector"))
            else:
                self.entries.append((key, "int"))

    def packed_numel(self, numel: int) -> int:
        return numel + sum({"scalar": 1, "vector": numel, "int": 2}[kind] for _k, kind in self.entries)

    def pack(self, value: torch.Tensor, state: dict) -> list[memoryview]:
        parts = [frame.tensor_bytes(value)]
        for key, kind in self.entries:
            item = state[key]
            if kind == "int":
                parts.append(memoryview(int(item).to_bytes(8, "little", signed=True)))
            else:
                parts.append(frame.tensor_bytes(item.reshape(-1) if kind == "vector" else item.reshape(1)))
        return parts

    def unpack(self, numel: int, flat: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Private copies of (value, state) from a received run of ``packed_numel(numel)`` floats."""
        value = flat[:numel].clone()
        offset = numel
        state = {}
        for key, kind in self.entries:
            if kind == "vector":
                state[key] = flat[offset:offset + numel].clone()
                offset += numel
            elif kind == "scalar":
                state[key] = flat[offset:offset + 1].clone().reshape(())
                offset += 1
            else:
                state[key] = int.from_bytes(flat[offset:offset + 2].numpy().tobytes(), "little", signed=True)
                offset += 2
        return value, state


def copy_refs(codec: BlockCodec, items) -> tuple[list, list]:
    """BlockRefs and payload parts (views of the blocks) for ``items`` of (key, block)."""
    refs, payloads = [], []
    for (tensor, index), block in items:
        numel = block.value.numel()
        packed = codec.packed_numel(numel)
        refs.append(dp.BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, numel=packed, nbytes=packed * 4,
                                version=block.version, step=block.step))
        payloads.extend(codec.pack(block.value, block.state))
    return refs, payloads


def stepped_refs(codec: BlockCodec, items, *, replay: bool = True) -> tuple[list, list]:
    """BlockRefs and payload parts for stepped ``items`` of (key, block): a copy of each
    (copy_refs), or, for a block carrying a ``replay`` (replicate_gradients) when ``replay``
    allows, the gradient its holders step it with (gradient_refs)."""
    replayed = [(k, b) for k, b in items if replay and b.replay is not None]
    refs, payloads = copy_refs(codec, [(k, b) for k, b in items if not (replay and b.replay is not None)])
    replay_refs, replay_payloads = gradient_refs(replayed)
    return refs + replay_refs, payloads + replay_payloads


def gradient_refs(items) -> tuple[list, list]:
    """BlockRefs and payload parts for ``items`` of (key, block) whose step the holders replay
    (Block.replay: the version it was stepped from, its mean gradient, the lr)."""
    refs, payloads = [], []
    for (tensor, index), block in items:
        base, grad, lr = block.replay
        ref = dp.BlockRef(tensor=tensor, index=index, dtype=dp.FLOAT32, version=block.version, step=block.step,
                          base_version=base, lr=lr, replay=True)
        if grad is None:
            ref.zero = True
        else:
            ref.numel, ref.nbytes = grad.numel(), grad.numel() * 4
            payloads.append(frame.tensor_bytes(grad))
        refs.append(ref)
    return refs, payloads


# --- links to peers -------------------------------------------------------------------------
@dataclass(eq=False)
class _Send:
    header: frame.FrameHeader
    payloads: Callable[[], list] | list
    done: Callable[[Exception | None, frame.FrameHeader | None], None] | None = None


class PeerLink(threading.Thread):
    """Frames to one peer node, in order, on one connection (one sender thread). A failed send is
    retried on a fresh connection until ``replication_timeout``; then its ``done`` gets the error."""

    def __init__(self, peer: str, address_of: Callable[[str], str | None], transport, token: bytes | None,
                 timeout: float):
        super().__init__(name=f"replicate-{peer}", daemon=True)
        self.peer = peer
        self._address_of = address_of
        self._transport = transport
        self._token = token
        self.timeout = timeout
        self.queue: "queue.Queue[_Send | None]" = queue.Queue()
        self._conn: DataPlaneConnection | None = None
        self.start()

    def send(self, item: _Send) -> None:
        self.queue.put(item)

    def close(self) -> None:
        self.queue.put(None)

    def barrier(self) -> threading.Event:
        """An event set once every frame queued before it was sent (or given up on)."""
        reached = threading.Event()
        self.queue.put(reached)
        return reached

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                if self._conn is not None:
                    self._conn.close()
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            error, reply = None, None
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    conn = self._connection()
                    payloads = item.payloads() if callable(item.payloads) else item.payloads
                    reply = conn.request(item.header, payloads, timeout=self.timeout)
                    error = None
                    break
                except RemoteError as exc:  # the peer answered: no point retrying
                    error = exc
                    break
                except (ShardlineError, OSError) as exc:
                    error = exc
                    self._conn = None
                    if time.monotonic() >= deadline or self._address_of(self.peer) is None:
                        break  # out of time, or the peer left the routing table (declared dead)
                    time.sleep(0.2)
            if item.done is not None:
                try:
                    item.done(error, reply)
                except Exception:  # a callback bug must not stop the link
                    log.exception("replication callback failed")

    def abandon_if_gone(self) -> None:
        """From another thread, after a routing change: a peer that left the routing table
        (declared dead, drained) is not waited for. The frame in flight on its connection fails
        at once (its ``done`` gets the error: its holder is dropped, the step's visibility goes on)
        instead of after ``replication_timeout``."""
        conn = self._conn
        if conn is not None and self._address_of(self.peer) is None:
            log.info("node %s left the routing table: its replication link gives up the frame in flight", self.peer)
            conn.abort()

    def _connection(self) -> DataPlaneConnection:
        if self._conn is None:
            address = self._address_of(self.peer)
            if address is None:
                raise ShardlineConnectionError(f"node {self.peer!r} is not in the routing table")
            self._conn = DataPlaneConnection(address, self._transport, CONNECT_TIMEOUT_SECONDS, self._token)
        return self._conn


class PeerLinks:
    """One PeerLink per peer, created on first use."""

    def __init__(self, address_of: Callable[[str], str | None], transport, token: bytes | None,
                 timeout: float = REPLICATION_TIMEOUT_SECONDS):
        self._address_of = address_of
        self._transport = transport
        self._token = token
        self.timeout = timeout
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()

    def link(self, peer: str) -> PeerLink:
        with self._lock:
            link = self._links.get(peer)
            if link is None or not link.is_alive():
                link = self._links[peer] = PeerLink(peer, self._address_of, self._transport, self._token, self.timeout)
            return link

    def abandon_gone(self) -> None:
        """After a routing change: links to peers that left it give up the frame in flight."""
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.abandon_if_gone()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every frame queued so far went out; False if some did not."""
        with self._lock:
            barriers = [link.barrier() for link in self._links.values() if link.is_alive()]
        deadline = time.monotonic() + timeout
        return all(b.wait(max(0.0, deadline - time.monotonic())) for b in barriers)

    def close(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()


# --- the primary's side -----------------------------------------------------------------------
@dataclass(eq=False)
class _Pending:
    """An applied step waiting for its copy holders' acknowledgements."""

    job: JobStore
    step: int
    blocks: list
    waiting: set = field(default_factory=set)
    deposed: bool = False   # a holder answered NOT_OWNER: only blocks still applied here become visible


@dataclass
class _SyncWait:
    """Applied blocks none of whose copy holders is in sync yet (a new primary whose replicas
    have not asked for their sync): visible once one of ``peers`` completes a sync, which
    carries them, or once none of ``peers`` is in the routing any more."""

    step: int
    blocks: list
    peers: set


class Replicator:
    """Replication of one node: the primary's sender side and the copy holder's receiving side.

    ``node`` is the PSNode (routing, jobs); ``links`` the PeerLinks to other nodes.
    """

    def __init__(self, node, links: PeerLinks, *, metrics=None):
        self.node = node
        self.links = links
        self.metrics = metrics
        self._lock = threading.Lock()
        # job -> copy holder in sync with this primary -> the sync round that made it so (a failure of
        # a frame of an older round, e.g. to the holder's previous process, must not drop a newer one)
        self._in_sync: dict[str, dict[str, int]] = {}
        self._rounds = itertools.count(1)
        self._codecs: dict[str, BlockCodec] = {}
        self._request_ids = itertools.count(1)
        # copy holder side: job -> node asked -> epoch the sync was asked at (until it completes)
        self._asked: dict[str, dict[str, int]] = {}
        # job -> key this node applies but still lacks -> the previous holders to ask, the one
        # asked now first (a holder whose sync answer lacks the key hands the fetch to the next)
        self._fetching: dict[str, dict[tuple, list[str]]] = {}
        self._failed: set[str] = set()          # jobs whose sync requests failed: asked again
        self._unowned: dict[str, dict] = {}    # job -> key -> when it stopped being owned here
        self._sync_waits: dict[str, list[_SyncWait]] = {}
        # job -> key -> (Staged, {holder: in-sync round}): copies of blocks stepped ahead, sent
        self._sent_ahead: dict[str, dict] = {}

    def codec(self, job: JobStore) -> BlockCodec:
        codec = self._codecs.get(job.name)
        if codec is None:
            codec = self._codecs[job.name] = BlockCodec(job)
        return codec

    def attach(self, job: JobStore) -> None:
        job.apply_hooks.append(self.on_applied)
        job.stage_hooks.append(self.on_staged)

    def forget(self, name: str) -> None:
        with self._lock:
            for table in (self._in_sync, self._codecs, self._asked, self._fetching, self._unowned, self._sync_waits,
                          self._sent_ahead):
                table.pop(name, None)

    def in_sync(self, name: str) -> dict[str, int]:
        """Copy holders in sync for job ``name`` and the round each joined in."""
        with self._lock:
            return dict(self._in_sync.get(name, {}))

    def _add_holder(self, name: str, peer: str) -> int:
        with self._lock:
            round_ = next(self._rounds)
            self._in_sync.setdefault(name, {})[peer] = round_
            return round_

    def drop_holder(self, name: str, peer: str, why: str, round_: int | None = None) -> None:
        with self._lock:
            holders = self._in_sync.get(name)
            if holders is None or peer not in holders or (round_ is not None and holders[peer] != round_):
                return
            del holders[peer]
        log.warning("job %s: node %s dropped from the in-sync copy holders: %s", name, peer, why)

    def _header(self, op: int, job: JobStore, **fields) -> frame.FrameHeader:
        return frame.FrameHeader(op=op, request_id=next(self._request_ids), job=job.name,
                                 epoch=self.node.routing.epoch, node=self.node.node_id, revision=job.revision, **fields)

    # stage hook (the job lock is held): send copies of blocks stepped ahead of the commits
    def on_staged(self, job: JobStore, items: list) -> None:
        holders = self.in_sync(job.name)
        if not holders or not items:
            return
        placement = place(self.node.routing, job.spec)
        me = self.node.node_id
        by_peer: dict[str, list] = {}
        sent = {}
        for key, staged in items:
            peers = [p for p in placement.copies_of(key) if p != me and p in holders]
            copy = SimpleNamespace(value=staged.value, state=staged.state, version=staged.step + 1, step=staged.step + 1,
                                   replay=staged.replay)
            for peer in peers:
                by_peer.setdefault(peer, []).append((key, copy))
            if peers:
                sent[key] = (staged, {peer: holders[peer] for peer in peers})
        with self._lock:
            self._sent_ahead.setdefault(job.name, {}).update(sent)
        for peer, copies in by_peer.items():
            refs, payloads = stepped_refs(self.codec(job), copies)
            header = self._header(dp.OP_REPLICATE, job, step=copies[0][1].step, blocks=refs, staged=True,
                                  payload_bytes=sum(r.nbytes for r in refs))
            self.links.link(peer).send(_Send(header, payloads))  # a failure shows at the step's frame

    # apply hook (the job lock is held): send copies of what was applied, wait for the acks
    def on_applied(self, job: JobStore, step: int, items: list) -> bool:
        failpoints.hit("ps.after_apply", step)
        holders = self.in_sync(job.name)
        placement = place(self.node.routing, job.spec)
        me = self.node.node_id
        by_peer: dict[str, list] = {}
        protected = []                      # visible once the in-sync holders acknowledged them
        unprotected, unsynced = [], set()   # no copy holder in sync: the step would have one copy
        for key, block in items:
            peers = [p for p in placement.copies_of(key) if p != me]
            synced = [p for p in peers if p in holders]
            for peer in synced:
                by_peer.setdefault(peer, []).append((key, block))
            if peers and not synced:
                unprotected.append(block)
                unsynced.update(peers)
            else:
                protected.append(block)
        if unprotected:
            with self._lock:
                self._sync_waits.setdefault(job.name, []).append(_SyncWait(step, unprotected, unsynced))
        if not by_peer:
            if unprotected:  # the rest is visible now; those wait for a holder's sync
                job.mark_visible(protected, step + 1)
            return bool(unprotected)
        pending = _Pending(job, step, protected, set(by_peer))
        rounds = {peer: holders[peer] for peer in by_peer}
        copy = job.sync == "asp"  # ASP steps the blocks again at the next push: send a snapshot
        with self._lock:
            table = self._sent_ahead.get(job.name, {})
            ahead = {key: table.pop(key) for key, _block in items if key in table}

        def sent_ahead(key, block, peer) -> bool:  # the peer holds this very step of the block already
            staged, peers = ahead.get(key, (None, {}))
            return staged is not None and block.value is staged.value and peers.get(peer) == rounds[peer]

        for peer, items in by_peer.items():
            stepped = [(k, b) for k, b in items if b.version == step + 1 and not sent_ahead(k, b, peer)]
            carried = [(k, b) for k, b in items if b.version != step + 1 or sent_ahead(k, b, peer)]
            refs, payloads = stepped_refs(self.codec(job), stepped, replay=not copy)
            if copy:
                payloads = [bytes(p) for p in payloads]
            for key, block in carried:
                refs.append(dp.BlockRef(tensor=key[0], index=key[1], zero=True, version=block.version, step=block.step))
            header = self._header(dp.OP_REPLICATE, job, step=step + 1, blocks=refs,
                                  payload_bytes=sum(r.nbytes for r in refs))
            self.links.link(peer).send(_Send(header, payloads, self._acked(pending, peer, rounds[peer])))
        return True

    def _acked(self, pending: _Pending, peer: str, round_: int):
        def done(error: Exception | None, _reply) -> None:
            if error is not None:
                if isinstance(error, RemoteError) and error.code == ErrorCode.NOT_OWNER:
                    # The peer routes with a newer epoch: this node may be deposed; learn it. The
                    # blocks it lost there never become visible here: their new primary lacks this
                    # step and takes it from the handover (JobStore.accept_handover).
                    self.node.refresh_routing_quietly()
                    pending.deposed = True
                self.drop_holder(pending.job.name, peer, f"replication of step {pending.step} failed: {error}", round_)
            with self._lock:
                pending.waiting.discard(peer)
                finished = not pending.waiting
            if finished:
                blocks = [b for b in pending.blocks if b.primary] if pending.deposed else pending.blocks
                pending.job.mark_visible(blocks, pending.step + 1)
        return done

    def replicate_init(self, job: JobStore, keys: list) -> None:
        """Send the creator's initial values of ``keys`` to every copy holder and wait (they
        become in sync for the job: a new job starts empty everywhere). Blocks of a later revision
        (tensors added during training) go to every copy holder too, but make in sync only those
        that were: another holder may lack earlier steps of other blocks, and syncs once it learns
        the revision."""
        placement = place(self.node.routing, job.spec)
        holders = self.in_sync(job.name) if job.revision else None
        by_peer: dict[str, list] = {}
        with job.cond:
            for key in keys:
                for peer in placement.copies_of(key):
                    if peer != self.node.node_id:
                        by_peer.setdefault(peer, []).append((key, job.blocks[key]))
            waits = []
            for peer, items in by_peer.items():
                refs, payloads = copy_refs(self.codec(job), items)
                payloads = [bytes(p) for p in payloads]
                header = self._header(dp.OP_REPLICATE, job, step=job.step, blocks=refs,
                                      payload_bytes=sum(r.nbytes for r in refs))
                round_ = self._add_holder(job.name, peer) if holders is None or peer in holders else None
                event = threading.Event()
                self.links.link(peer).send(_Send(header, payloads, self._init_done(job, peer, event, round_)))
                waits.append(event)
        for event in waits:
            event.wait(self.links.timeout * 2)

    def _init_done(self, job: JobStore, peer: str, event: threading.Event, round_: int | None):
        def done(error, _reply):
            if error is not None and round_ is not None:  # None: it was not made a holder by this
                self.drop_holder(job.name, peer, f"initial values not replicated: {error}", round_)
            event.set()
        return done

    def handle_sync(self, job: JobStore, requester: str, refs, asked_epoch: int = 0) -> None:
        """``requester`` holds the blocks ``refs`` (version and step; ``has`` false: nothing) and
        wants them in sync: queue copies of those that differ here (the last frame marked) and add
        it to the job's in-sync set, all under the job lock, so that no applied step slips between
        the copies and the replication that follows them on the same link. A node that is not
        the blocks' primary answers too (a new primary that lacks them asks the previous owners)."""
        codec = self.codec(job)
        with job.cond:
            items = []
            for ref in refs:
                key = (ref.tensor, ref.index)
                block = job.blocks.get(key)
                if block is None or (ref.has and ref.version == block.version and ref.step == block.step):
                    continue
                items.append((key, block))
            batches, batch, size = [], [], 0
            for key, block in items:
                batch.append((key, block))
                size += codec.packed_numel(block.value.numel()) * 4
                if size >= SYNC_BATCH_BYTES:
                    batches.append(batch)
                    batch, size = [], 0
            batches.append(batch)
            round_ = self._add_holder(job.name, requester)
            link = self.links.link(requester)
            for n, batch in enumerate(batches):
                refs_out, payloads = copy_refs(codec, batch)
                payloads = [bytes(p) for p in payloads]  # a snapshot: the job goes on meanwhile
                header = self._header(dp.OP_REPLICATE, job, step=job.step, blocks=refs_out,
                                      payload_bytes=sum(r.nbytes for r in refs_out), last=n == len(batches) - 1,
                                      sync_reply=True, sync_epoch=asked_epoch)
                link.send(_Send(header, payloads, self._sync_sent(job, requester, round_, last=n == len(batches) - 1)))

    def hand_over(self, job: JobStore, handovers: list) -> None:
        """Send each lost block's new primary what this node collected of the step in flight
        (``JobStore.set_primary``): the pushes of a rank that dies before it could resend them
        are not lost. Blocks with nothing collected go too, as headers: the new primary stops
        waiting for them."""
        placement = place(self.node.routing, job.spec)
        by_peer: dict[str, list] = {}
        for item in handovers:
            owner = placement.primary(item.key)
            if owner and owner != self.node.node_id:
                by_peer.setdefault(owner, []).append(item)
        codec = self.codec(job)
        for peer, items in by_peer.items():
            refs, payloads = [], []
            for item in items:
                ref = dp.BlockRef(tensor=item.key[0], index=item.key[1], step=item.step, ranks=list(item.ranks),
                                  version=item.version)
                if item.grad is None:
                    ref.zero = True
                else:
                    ref.dtype, ref.numel, ref.nbytes = dp.FLOAT32, item.grad.numel(), item.grad.numel() * 4
                    payloads.append(frame.tensor_bytes(item.grad))
                refs.append(ref)
                if item.copy is not None:  # right after its block's ref
                    value, state = item.copy
                    copy_ref, parts = copy_refs(codec, [(item.key, SimpleNamespace(
                        value=value, state=state, version=item.version, step=item.step))])
                    copy_ref[0].copy = True
                    refs.extend(copy_ref)
                    payloads.extend(parts)
                if item.previous is not None:  # after those: the value from before its last step
                    before, value = item.previous
                    previous_ref = frame.block_ref(item.key[0], item.key[1], value)
                    previous_ref.previous, previous_ref.base_version = True, before
                    refs.append(previous_ref)
                    payloads.append(frame.tensor_bytes(value))
            header = self._header(dp.OP_REPLICATE, job, blocks=refs, handover=True,
                                  payload_bytes=sum(r.nbytes for r in refs))
            carried = sum(1 for i in items if i.ranks)
            if carried:
                log.info("job %s: handing %d block(s) with gradients of the step in flight over to %s",
                         job.name, carried, peer)
            self.links.link(peer).send(_Send(header, payloads, self._handed(job, peer)))

    @staticmethod
    def _handed(job: JobStore, peer: str):
        def done(error, _reply):
            if error is not None:
                log.warning("job %s: handover to %s failed (it waits, then goes on with the pushes workers "
                            "resend): %s", job.name, peer, error)
        return done

    def _handle_handover(self, job: JobStore, header, payload) -> None:
        items, offset = [], 0
        codec = self.codec(job)
        for ref in header.blocks:
            key = (ref.tensor, ref.index)
            numel = job.expected_numel(*key)
            if ref.copy:  # the previous primary's copy of the block named by the ref before it
                if not items or items[-1].key != key or ref.numel != codec.packed_numel(numel) or ref.dtype != dp.FLOAT32:
                    raise StoreError(ErrorCode.INVALID_ARGUMENT, f"handover copy of {ref.tensor}[{ref.index}] must follow its "
                                                         f"block's ref and hold {codec.packed_numel(numel)} float32")
                flat = torch.frombuffer(payload, dtype=torch.float32, count=ref.numel, offset=offset)
                offset += ref.nbytes
                items[-1] = replace(items[-1], copy=codec.unpack(numel, flat))
                continue
            if ref.previous:  # the value from before the last step of the block named by the ref before it
                if not items or items[-1].key != key or ref.numel != numel or ref.dtype != dp.FLOAT32 \
                        or ref.base_version >= items[-1].version:
                    raise StoreError(ErrorCode.INVALID_ARGUMENT, f"handover previous value of {ref.tensor}[{ref.index}] must "
                                                         f"follow its block's ref, hold {numel} float32 and be older")
                value = torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=offset).clone()
                offset += ref.nbytes
                items[-1] = replace(items[-1], previous=(int(ref.base_version), value))
                continue
            grad = None
            if not ref.zero:
                if ref.numel != numel or ref.dtype != dp.FLOAT32:
                    raise StoreError(ErrorCode.INVALID_ARGUMENT, f"handover of {ref.tensor}[{ref.index}] has {ref.numel} "
                                                         f"elements, expected {numel} float32")
                grad = torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=offset).clone()
                offset += ref.nbytes
            ranks = tuple(int(r) for r in ref.ranks)
            if any(r >= job.world_size for r in ranks):
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"handover of {ref.tensor}[{ref.index}] names ranks {list(ranks)}, "
                                                     f"the job has {job.world_size}")
            items.append(Handover(key, int(ref.step), grad, ranks, int(ref.version)))
        job.accept_handover(header.node, items)

    def _sync_sent(self, job: JobStore, peer: str, round_: int, last: bool = False):
        def done(error, _reply):
            if error is not None:
                self.drop_holder(job.name, peer, f"sync failed: {error}", round_)
            elif last:
                self.release_sync_waits(job, lambda peers: peer in peers)
        return done

    def release_sync_waits(self, job: JobStore, released: Callable[[set], bool]) -> None:
        """Make visible the blocks waiting for a copy holder's sync whose ``peers`` satisfy
        ``released`` (one of them synced, or none is left in the routing)."""
        with self._lock:
            waits = self._sync_waits.get(job.name, [])
            done = [w for w in waits if released(w.peers)]
            self._sync_waits[job.name] = [w for w in waits if not released(w.peers)] if done else waits
        for wait in done:
            job.mark_visible(wait.blocks, wait.step + 1)

    # --- the copy holder's side -----------------------------------------------------------------
    def handle_replicate(self, job: JobStore, header, payload) -> None:
        """Install copies from ``header.node``. Fenced: only the block's primary at this node's
        epoch (or a node answering this node's sync) may send them."""
        sender = header.node
        if header.handover:
            self._handle_handover(job, header, payload)
            return
        if header.staged and header.sync_reply:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, "a sync reply carries no copies stepped ahead")
        view = self.node.routing
        placement = place(view, job.spec)
        codec = self.codec(job)
        copies, carried, replayed = [], [], []
        # copies and gradients travel as float32 runs; a run of another dtype would be misread
        bad = next((ref for ref in header.blocks if ref.nbytes and ref.dtype != dp.FLOAT32), None)
        if bad is not None:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"copy of {bad.tensor}[{bad.index}] is not float32 (dtype {bad.dtype})")
        offset = 0
        for ref in header.blocks:
            key = (ref.tensor, ref.index)
            numel = job.expected_numel(*key)
            if not header.sync_reply and placement.primary(key) != sender:
                raise StoreError(ErrorCode.NOT_OWNER, f"node {sender!r} is not the primary of {ref.tensor}[{ref.index}] at "
                                              f"epoch {view.epoch}")
            if ref.replay:
                if header.sync_reply or not job.replays_gradients:
                    raise StoreError(ErrorCode.INVALID_ARGUMENT, f"a gradient to replay for {ref.tensor}[{ref.index}] in a frame "
                                                         f"that cannot carry one (a sync reply, or a job without "
                                                         f"replicate_gradients)")
                grad = None
                if not ref.zero:
                    if ref.numel != numel:
                        raise StoreError(ErrorCode.INVALID_ARGUMENT, f"gradient of {ref.tensor}[{ref.index}] has {ref.numel} "
                                                             f"elements, expected {numel}")
                    grad = torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=offset)
                    offset += ref.nbytes
                replayed.append((ref.tensor, ref.index, ref.version, ref.step, ref.base_version, ref.lr, grad))
                continue
            if ref.zero:
                carried.append((key, ref.version, ref.step))
                continue
            if ref.numel != codec.packed_numel(numel):
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"copy of {ref.tensor}[{ref.index}] has {ref.numel} elements, "
                                                     f"expected {codec.packed_numel(numel)}")
            flat = torch.frombuffer(payload, dtype=torch.float32, count=ref.numel, offset=offset)
            offset += ref.nbytes
            value, state = codec.unpack(numel, flat)
            copies.append((ref.tensor, ref.index, ref.version, ref.step, value, state))
        if header.staged:
            job.hold_copies(copies)
            if replayed:
                job.replay_steps(replayed, ahead=True)
            return
        job.apply_copies(copies)
        try:
            if replayed:
                job.replay_steps(replayed)
            if carried:
                job.carry_copies(carried)
        except StoreError as exc:
            # A step this node did not get: its primary drops it from the in-sync holders on this
            # answer; ask it at once for full copies of what is lacking (a sync, which makes this
            # node an in-sync holder again) rather than waiting for the next routing change.
            lacking = getattr(exc, "keys", None)
            if exc.code == ErrorCode.UNAVAILABLE and lacking and not header.sync_reply:
                self._ask_sync(job, sender, [self._holding_ref(job, key) for key in lacking])
            raise
        if not header.sync_reply:
            # This node took a block over between the fence check and the install (its routing
            # changed meanwhile): the copy was not installed, so the sender must not count it as held.
            taken = job.applied_here([(r.tensor, r.index) for r in header.blocks])
            if taken:
                raise StoreError(ErrorCode.NOT_OWNER, f"node {sender!r} is no longer the primary of {taken[0][0]}[{taken[0][1]}]: "
                                              f"this node applies it now")
        if header.last:
            with self._lock:
                asked = self._asked.get(job.name, {})
                if asked.get(sender) == header.sync_epoch:  # the answer to the current request
                    del asked[sender]
            ask_next = self._answered_fetch(job, sender)
            self.node.on_synced(job, sender)
            for node, refs in ask_next.items():
                self._ask_sync(job, node, refs)

    # --- which copies to bring in sync ------------------------------------------------------------
    def resync(self, job: JobStore, placement, primary: set, copies: set, previous, poke=()) -> None:
        """After a routing change: ask the primary of every block this node keeps a copy of to
        bring it in sync (naming what it holds), and the previous owners of blocks it now applies
        but lacks; note the copies it no longer needs (dropped after a grace period). ``poke``:
        previous primaries whose handover is due: a request at the new epoch makes them learn it."""
        me = self.node.node_id
        epoch = self.node.routing.epoch
        routed = set(self.node.routing.nodes) | set(self.node.routing.pending_nodes)
        self.release_sync_waits(job, lambda peers: not (peers & routed))
        by_node: dict[str, list] = {node: [] for node in poke if node != me}
        with job.cond:
            for key in copies:
                owner = placement.primary(key)
                if owner and owner != me:
                    by_node.setdefault(owner, []).append(self._holding_ref(job, key))
            missing = {}  # blocks this node applies now, lacks, and a previous owner may hold -> holders
            if previous is not None and previous.ring is not None:
                before = place(previous, job.spec)
                for key in primary:
                    if key in job.blocks:
                        continue
                    holders = [n for n in before.owners.get(key, ()) if n != me and n in self.node.routing.nodes]
                    if holders:
                        missing[key] = holders
            now = time.monotonic()
            held = set(job.blocks)
            with self._lock:
                unowned = self._unowned.setdefault(job.name, {})
                for key in held - primary - copies:
                    unowned.setdefault(key, now)
                for key in list(unowned):
                    if key in primary or key in copies:
                        del unowned[key]
                fetching = self._fetching.setdefault(job.name, {})
                for key in list(fetching):
                    # Still missing from an earlier change: asked again of a holder still routed.
                    holders = [n for n in fetching.pop(key) if n in routed and n != me]
                    if key in primary and key not in job.blocks and holders and key not in missing:
                        missing[key] = holders
                fetching.update(missing)
                for key, holders in missing.items():
                    by_node.setdefault(holders[0], []).append(self._holding_ref(job, key))
                # A new routing: only syncs asked under it count (older answers may predate it).
                self._asked[job.name] = {node: epoch for node in by_node}
        for node, refs in by_node.items():
            self._ask_sync(job, node, refs)

    def _ask_sync(self, job: JobStore, node: str, refs: list) -> None:
        header = self._header(dp.OP_SYNC, job, blocks=refs)
        self.links.link(node).send(_Send(header, [], self._sync_asked(job, node)))

    def _answered_fetch(self, job: JobStore, sender: str) -> dict[str, list]:
        """``sender`` finished a sync answer: the blocks asked of it are fetched, or it lacks
        them. A lacked block is asked of the next previous holder; with none left the fetch ends
        (no node holds the block: a job not initialized yet, whose INIT brings it). Returns the
        new requests, node -> refs."""
        ask_next: dict[str, list] = {}
        with job.cond, self._lock:
            fetching = self._fetching.get(job.name)
            if not fetching:
                return ask_next
            for key in list(fetching):
                holders = fetching[key]
                if key in job.blocks:
                    del fetching[key]
                elif holders and holders[0] == sender:
                    holders.pop(0)
                    if holders:
                        ask_next.setdefault(holders[0], []).append(self._holding_ref(job, key))
                    else:
                        del fetching[key]
                        log.info("job %s: no previous holder of %s[%d] has it (not initialized yet); not waiting for it",
                                 job.name, key[0], key[1])
            if ask_next:
                asked = self._asked.setdefault(job.name, {})
                for node in ask_next:
                    asked[node] = self.node.routing.epoch
        return ask_next

    @staticmethod
    def _holding_ref(job: JobStore, key) -> dp.BlockRef:
        block = job.blocks.get(key)
        if block is None:
            return dp.BlockRef(tensor=key[0], index=key[1], has=False)
        return dp.BlockRef(tensor=key[0], index=key[1], has=True, version=block.version, step=block.step)

    def _sync_asked(self, job: JobStore, node: str):
        def done(error, _reply):
            if error is not None:
                # Still not in sync: asked again (retry_failed) or after the next routing change.
                log.warning("job %s: could not ask node %s for a sync (asking again): %s", job.name, node, error)
                with self._lock:
                    self._failed.add(job.name)
        return done

    def retry_failed(self) -> None:
        """Ask again for the syncs that failed (a peer at another epoch, a broken connection)."""
        with self._lock:
            failed, self._failed = self._failed, set()
        for name in failed:
            job = self.node.store.get(name)
            if job is not None:
                self.node.assign_roles(job)

    def fetching(self, name: str) -> bool:
        """Whether this node still waits for blocks it applies (requests for them: UNAVAILABLE)."""
        job = self.node.store.get(name)
        with self._lock:
            fetching = self._fetching.get(name)
            if fetching and job is not None:
                for key in [k for k in fetching if k in job.blocks]:  # arrived otherwise (an INIT)
                    del fetching[key]
            return bool(fetching)

    def ready(self) -> bool:
        """Every sync this node asked for has completed (a pending ring change may switch)."""
        with self._lock:
            names = [name for name, keys in self._fetching.items() if keys]
        if any(self.fetching(name) for name in names):
            return False
        with self._lock:
            return not any(self._asked.values())

    def sweep(self, grace: float = 10.0) -> None:
        """Drop copies that no owner role needed for ``grace`` seconds."""
        now = time.monotonic()
        for job in self.node.store.jobs():
            with self._lock:
                unowned = self._unowned.get(job.name, {})
                old = [key for key, since in unowned.items() if now - since > grace]
                for key in old:
                    del unowned[key]
            if old:
                job.drop_blocks(old)
                log.info("job %s: dropped %d block copies this node no longer holds", job.name, len(old))
