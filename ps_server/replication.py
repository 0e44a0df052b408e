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
import threading
import time
from types import SimpleNamespace
from typing import Callable

import torch

from shardline.ps_server.replication_codec import BlockCodec, copy_refs, handover_refs, read_handover, stepped_refs
from shardline.ps_server.replication_links import PeerLinks, Send
from shardline.ps_server.replication_progress import (HolderProgress, JobReplication, StepAcks, SyncWait,
                                                      plan_step)
from shardline.ps_server.store import JobStore, StoreError
from shardline.services import failpoints, frame
from shardline.services.errors import ErrorCode, RemoteError
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.placement import place

log = logging.getLogger("shardline.ps.replication")

# Blocks per OP_REPLICATE frame of a sync (bounds a frame; the link sends them in order).
SYNC_BATCH_BYTES = 64 << 20


class Replicator:
    """Replication of one node: the primary's sender side and the copy holder's receiving side.

    ``node`` is the PSNode (routing, jobs); ``links`` the PeerLinks to other nodes. What it tracks
    per job is one ``JobReplication`` (replication_progress.py), read and moved under ``_lock``.
    """

    def __init__(self, node, links: PeerLinks, *, metrics=None):
        self.node = node
        self.links = links
        self.metrics = metrics
        self._lock = threading.Lock()
        self._jobs: dict[str, JobReplication] = {}
        self._rounds = itertools.count(1)
        self._codecs: dict[str, BlockCodec] = {}
        self._request_ids = itertools.count(1)
        self._handlers = {dp.REPLICATE_STEP: self._on_step, dp.REPLICATE_STAGED: self._on_staged,
                          dp.REPLICATE_SYNC: self._on_sync_answer, dp.REPLICATE_SYNC_LAST: self._on_sync_answer,
                          dp.REPLICATE_HANDOVER: self._on_handover}

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
            self._jobs.pop(name, None)
            self._codecs.pop(name, None)

    def _job(self, name: str) -> JobReplication:
        """The job's record (``_lock`` held)."""
        record = self._jobs.get(name)
        if record is None:
            record = self._jobs[name] = JobReplication()
        return record

    def in_sync(self, name: str) -> dict[str, int]:
        """Copy holders that are sent every applied step of job ``name`` (SYNCING or IN_SYNC),
        and the round each joined in."""
        with self._lock:
            record = self._jobs.get(name)
            return record.replicating() if record is not None else {}

    def progress(self, name: str, peer: str) -> HolderProgress:
        """``peer``'s state as a copy holder of job ``name``."""
        with self._lock:
            record = self._jobs.get(name)
            return record.progress(peer) if record is not None else HolderProgress()

    def _move(self, name: str, peer: str, transition: Callable[[HolderProgress], HolderProgress]) -> HolderProgress:
        """Apply ``transition`` to ``peer``'s progress; returns the new one."""
        with self._lock:
            record = self._job(name)
            after = transition(record.progress(peer))
            record.move(peer, after)
            return after

    def _join(self, name: str, peer: str, how: Callable[[HolderProgress, int], HolderProgress]) -> int:
        """``peer`` starts a new round (a sync asked, initial values sent); returns it."""
        round_ = next(self._rounds)
        self._move(name, peer, lambda progress: how(progress, round_))
        return round_

    def drop_holder(self, name: str, peer: str, why: str, round_: int | None = None) -> None:
        with self._lock:
            record = self._jobs.get(name)
            before = record.progress(peer) if record is not None else HolderProgress()
            after = before.failed(round_)
            if after is before:
                return
            record.move(peer, after)
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
        for key, staged in items:
            copy = SimpleNamespace(value=staged.value, state=staged.state, version=staged.step + 1,
                                   step=staged.step + 1, replay=staged.replay)
            for peer in placement.copies_of(key):
                if peer != me and peer in holders:
                    by_peer.setdefault(peer, []).append((key, copy, staged))
        with self._lock:
            record = self._job(job.name)
            for peer, sent in by_peer.items():
                progress = record.progress(peer)
                if progress.round == holders[peer]:  # still the round they are sent in
                    progress.sent_ahead.update((key, staged) for key, _copy, staged in sent)
        for peer, sent in by_peer.items():
            refs, payloads = stepped_refs(self.codec(job), [(key, copy) for key, copy, _staged in sent])
            header = self._header(dp.OP_REPLICATE, job, step=sent[0][1].step, blocks=refs,
                                  replicate_kind=dp.REPLICATE_STAGED,
                                  payload_bytes=sum(r.nbytes for r in refs))
            self.links.link(peer).send(Send(header, payloads))  # a failure shows at the step's frame

    # apply hook (the job lock is held): send copies of what was applied, wait for the acks
    def on_applied(self, job: JobStore, step: int, items: list) -> bool:
        failpoints.hit("ps.after_apply", step)
        holders = self.in_sync(job.name)
        plan = plan_step(items, place(self.node.routing, job.spec).copies_of, self.node.node_id, set(holders))
        if plan.unprotected:  # no copy holder in sync: the step would have one copy
            with self._lock:
                self._job(job.name).sync_waits.append(SyncWait(step, plan.unprotected, plan.unsynced))
        if not plan.by_peer:
            if plan.unprotected:  # the rest is visible now; those wait for a holder's sync
                job.mark_visible(plan.protected, step + 1)
            return bool(plan.unprotected)
        acks = StepAcks(job, step, plan.protected, set(plan.by_peer))
        copy = job.sync == "asp"  # ASP steps the blocks again at the next push: send a snapshot
        with self._lock:
            ahead = self._job(job.name).take_sent_ahead(key for key, _block in items)

        def sent_ahead(key, block, peer) -> bool:  # the peer holds this very step of the block already
            staged = ahead.get(peer, {}).get(key)
            return staged is not None and block.value is staged.value

        for peer, items in plan.by_peer.items():
            stepped = [(k, b) for k, b in items if b.version == step + 1 and not sent_ahead(k, b, peer)]
            carried = [(k, b) for k, b in items if b.version != step + 1 or sent_ahead(k, b, peer)]
            refs, payloads = stepped_refs(self.codec(job), stepped, replay=not copy)
            if copy:
                payloads = [bytes(p) for p in payloads]
            for key, block in carried:
                refs.append(dp.BlockRef(tensor=key[0], index=key[1], zero=True, version=block.version, step=block.step))
            header = self._header(dp.OP_REPLICATE, job, step=step + 1, blocks=refs, replicate_kind=dp.REPLICATE_STEP,
                                  payload_bytes=sum(r.nbytes for r in refs))
            self.links.link(peer).send(Send(header, payloads, self._acked(acks, peer, holders[peer])))
        return True

    def _acked(self, pending: StepAcks, peer: str, round_: int):
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
                                      replicate_kind=dp.REPLICATE_STEP, payload_bytes=sum(r.nbytes for r in refs))
                round_ = (self._join(job.name, peer, HolderProgress.initialized) if holders is None or peer in holders
                          else None)
                event = threading.Event()
                self.links.link(peer).send(Send(header, payloads, self._init_done(job, peer, event, round_)))
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
            round_ = self._join(job.name, requester, HolderProgress.sync_asked)
            link = self.links.link(requester)
            for n, batch in enumerate(batches):
                last = n == len(batches) - 1
                refs_out, payloads = copy_refs(codec, batch)
                payloads = [bytes(p) for p in payloads]  # a snapshot: the job goes on meanwhile
                header = self._header(dp.OP_REPLICATE, job, step=job.step, blocks=refs_out,
                                      replicate_kind=dp.REPLICATE_SYNC_LAST if last else dp.REPLICATE_SYNC,
                                      payload_bytes=sum(r.nbytes for r in refs_out), sync_epoch=asked_epoch)
                link.send(Send(header, payloads, self._sync_sent(job, requester, round_, last=last)))

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
            refs, payloads = handover_refs(codec, items)
            header = self._header(dp.OP_REPLICATE, job, blocks=refs, replicate_kind=dp.REPLICATE_HANDOVER,
                                  payload_bytes=sum(r.nbytes for r in refs))
            carried = sum(1 for i in items if i.ranks)
            if carried:
                log.info("job %s: handing %d block(s) with gradients of the step in flight over to %s",
                         job.name, carried, peer)
            self.links.link(peer).send(Send(header, payloads, self._handed(job, peer)))

    @staticmethod
    def _handed(job: JobStore, peer: str):
        def done(error, _reply):
            if error is not None:
                log.warning("job %s: handover to %s failed (it waits, then goes on with the pushes workers "
                            "resend): %s", job.name, peer, error)
        return done

    def _sync_sent(self, job: JobStore, peer: str, round_: int, last: bool = False):
        def done(error, _reply):
            if error is not None:
                self.drop_holder(job.name, peer, f"sync failed: {error}", round_)
            elif last:
                self._move(job.name, peer, lambda progress: progress.sync_answered(round_))
                self.release_sync_waits(job, lambda peers: peer in peers)
        return done

    def release_sync_waits(self, job: JobStore, released: Callable[[frozenset], bool]) -> None:
        """Make visible the blocks waiting for a copy holder's sync whose ``peers`` satisfy
        ``released`` (one of them synced, or none is left in the routing)."""
        with self._lock:
            record = self._jobs.get(job.name)
            done = record.release_sync_waits(released) if record is not None else []
        for wait in done:
            job.mark_visible(wait.blocks, wait.step + 1)

    # --- the copy holder's side -----------------------------------------------------------------
    def handle_replicate(self, job: JobStore, header, payload) -> None:
        """Take an OP_REPLICATE frame from ``header.node``: one handler per ``replicate_kind``."""
        handler = self._handlers.get(header.replicate_kind)
        if handler is None:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"replicate frame of unknown kind {header.replicate_kind}")
        handler(job, header, payload)

    def _on_step(self, job: JobStore, header, payload) -> None:
        """REPLICATE_STEP: install the copies of a step the sender applied, replay its gradients,
        carry the blocks it names. Fenced: only the blocks' primary at this node's epoch."""
        copies, carried, replayed = self._read_blocks(job, header, payload, fenced=True)
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
            if exc.code == ErrorCode.UNAVAILABLE and lacking:
                self._ask_sync(job, header.node, [self._holding_ref(job, key) for key in lacking])
            raise
        # This node took a block over between the fence check and the install (its routing
        # changed meanwhile): the copy was not installed, so the sender must not count it as held.
        taken = job.applied_here([(r.tensor, r.index) for r in header.blocks])
        if taken:
            raise StoreError(ErrorCode.NOT_OWNER, f"node {header.node!r} is no longer the primary of "
                                                  f"{taken[0][0]}[{taken[0][1]}]: this node applies it now")

    def _on_staged(self, job: JobStore, header, payload) -> None:
        """REPLICATE_STAGED: hold copies stepped ahead of the commits apart (a later STEP frame
        names them). Fenced as a step."""
        copies, _carried, replayed = self._read_blocks(job, header, payload, fenced=True)
        job.hold_copies(copies)
        if replayed:
            job.replay_steps(replayed, ahead=True)

    def _on_sync_answer(self, job: JobStore, header, payload) -> None:
        """REPLICATE_SYNC / REPLICATE_SYNC_LAST: copies answering this node's own OP_SYNC, from
        whichever node it asked; after the last one this node is in sync with the sender."""
        copies, carried, _replayed = self._read_blocks(job, header, payload, fenced=False)
        job.apply_copies(copies)
        if carried:
            job.carry_copies(carried)
        if header.replicate_kind == dp.REPLICATE_SYNC_LAST:
            self._sync_answered(job, header.node, header.sync_epoch)

    def _on_handover(self, job: JobStore, header, payload) -> None:
        """REPLICATE_HANDOVER: what the blocks' previous primary collected of the step in flight."""
        job.accept_handover(header.node, read_handover(self.codec(job), job, header.blocks, payload))

    def _read_blocks(self, job: JobStore, header, payload, *, fenced: bool) -> tuple[list, list, list]:
        """The (copies, carried, replayed) of a STEP, STAGED or SYNC frame, checked: float32 runs
        of the block's size; a gradient to replay only in a fenced frame of a job that replays;
        ``fenced``: every block's primary at this node's epoch is the sender (NOT_OWNER otherwise)."""
        sender = header.node
        view = self.node.routing
        placement = place(view, job.spec)
        codec = self.codec(job)
        copies, carried, replayed = [], [], []
        # copies and gradients travel as float32 runs; a run of another dtype would be misread
        bad = next((ref for ref in header.blocks if ref.nbytes and ref.dtype != dp.FLOAT32), None)
        if bad is not None:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"copy of {bad.tensor}[{bad.index}] is not float32 "
                                                         f"(dtype {bad.dtype})")
        offset = 0
        for ref in header.blocks:
            key = (ref.tensor, ref.index)
            numel = job.expected_numel(*key)
            if fenced and placement.primary(key) != sender:
                raise StoreError(ErrorCode.NOT_OWNER, f"node {sender!r} is not the primary of "
                                                      f"{ref.tensor}[{ref.index}] at epoch {view.epoch}")
            if ref.replay:
                if not fenced or not job.replays_gradients:
                    raise StoreError(ErrorCode.INVALID_ARGUMENT, f"a gradient to replay for {ref.tensor}[{ref.index}] "
                                                                 f"in a frame that cannot carry one (a sync answer, or "
                                                                 f"a job without replicate_gradients)")
                grad = None
                if not ref.zero:
                    if ref.numel != numel:
                        raise StoreError(ErrorCode.INVALID_ARGUMENT, f"gradient of {ref.tensor}[{ref.index}] has "
                                                                     f"{ref.numel} elements, expected {numel}")
                    grad = torch.frombuffer(payload, dtype=torch.float32, count=numel, offset=offset)
                    offset += ref.nbytes
                replayed.append((ref.tensor, ref.index, ref.version, ref.step, ref.base_version, ref.lr, grad))
                continue
            if ref.zero:
                carried.append((key, ref.version, ref.step))
                continue
            if ref.numel != codec.packed_numel(numel):
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"copy of {ref.tensor}[{ref.index}] has {ref.numel} "
                                                             f"elements, expected {codec.packed_numel(numel)}")
            flat = torch.frombuffer(payload, dtype=torch.float32, count=ref.numel, offset=offset)
            offset += ref.nbytes
            value, state = codec.unpack(numel, flat)
            copies.append((ref.tensor, ref.index, ref.version, ref.step, value, state))
        return copies, carried, replayed

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
            with self._lock:
                fetch = self._job(job.name).plan_resync(
                    held=set(job.blocks), primary=primary, copies=copies, missing=missing, routed=routed, me=me,
                    now=time.monotonic(), epoch=epoch, asked=by_node)
            for node, keys in fetch.items():
                by_node.setdefault(node, []).extend(self._holding_ref(job, key) for key in keys)
        for node, refs in by_node.items():
            self._ask_sync(job, node, refs)

    def _ask_sync(self, job: JobStore, node: str, refs: list) -> None:
        header = self._header(dp.OP_SYNC, job, blocks=refs)
        self.links.link(node).send(Send(header, [], self._sync_asked(job, node)))

    def _sync_answered(self, job: JobStore, sender: str, sync_epoch: int) -> None:
        """The last frame of ``sender``'s sync answer was installed: the ask it answers ends, the
        blocks fetched from it arrived or it lacks them. A lacked block is asked of the next
        previous holder; with none left the fetch ends (no node holds the block: a job not
        initialized yet, whose INIT brings it)."""
        with job.cond:
            with self._lock:
                ask_next, abandoned = self._job(job.name).sync_answered(sender, sync_epoch, job.blocks,
                                                                        self.node.routing.epoch)
            requests = {node: [self._holding_ref(job, key) for key in keys] for node, keys in ask_next.items()}
        for key in abandoned:
            log.info("job %s: no previous holder of %s[%d] has it (not initialized yet); not waiting for it",
                     job.name, key[0], key[1])
        self.node.on_synced(job, sender)
        for node, refs in requests.items():
            self._ask_sync(job, node, refs)

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
                    self._job(job.name).resync_due = True
        return done

    def retry_failed(self) -> None:
        """Ask again for the syncs that failed (a peer at another epoch, a broken connection)."""
        with self._lock:
            due = [name for name, record in self._jobs.items() if record.resync_due]
            for name in due:
                self._jobs[name].resync_due = False
        for name in due:
            job = self.node.store.get(name)
            if job is not None:
                self.node.assign_roles(job)

    def fetching(self, name: str) -> bool:
        """Whether this node still waits for blocks it applies (requests for them: UNAVAILABLE)."""
        job = self.node.store.get(name)
        with self._lock:
            record = self._jobs.get(name)
            if record is None:
                return False
            return record.fetching(job.blocks if job is not None else ())

    def ready(self) -> bool:
        """Every sync this node asked for has completed (a pending ring change may switch)."""
        with self._lock:
            names = [name for name, record in self._jobs.items() if record.fetches]
        if any(self.fetching(name) for name in names):
            return False
        with self._lock:
            return not any(record.asks for record in self._jobs.values())

    def sweep(self, grace: float = 10.0) -> None:
        """Drop copies that no owner role needed for ``grace`` seconds."""
        now = time.monotonic()
        for job in self.node.store.jobs():
            with self._lock:
                record = self._jobs.get(job.name)
                old = record.expired_unowned(now, grace) if record is not None else []
            if old:
                job.drop_blocks(old)
                log.info("job %s: dropped %d block copies this node no longer holds", job.name, len(old))
