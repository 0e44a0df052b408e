"""Replication, the primary's side: the copies a primary sends its copy holders and the
``HolderProgress`` of each (the diagram in ps_server/replication.py); the sync answers it queues
(OP_SYNC); the handover of a block that changes primary mid-step. docs/architecture.md,
"Replication".
"""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace
from typing import Callable

from shardline.ps_server.replication_codec import copy_refs, handover_refs, stepped_nbytes, stepped_refs
from shardline.ps_server.replication_links import Send
from shardline.ps_server.replication_progress import HolderProgress, StepAcks, SyncWait, plan_step
from shardline.ps_server.store import JobStore
from shardline.services import failpoints
from shardline.services.blocks import runs_of
from shardline.services.errors import ErrorCode, RemoteError
from shardline.services.pb import dataplane_pb2 as dp

log = logging.getLogger("shardline.ps.replication")

# Blocks per OP_REPLICATE frame of a sync (bounds a frame; the link sends them in order).
SYNC_BATCH_BYTES = 64 << 20
# A step's blocks go to a copy holder in REPLICATE_STEP frames of about this many payload bytes
# at most (the holder's receive buffer, kept from step to step, is one frame: not all of the
# node's primaries' gradients or copies, 2-12 bytes per parameter).
STEP_FRAME_BYTES = 16 << 20
# A holder dropped this long ago that has not asked for a sync is invited to (REPLICATE_RESYNC),
# again at this interval until it asks: it may not know it was dropped (a frame that timed out).
INVITE_AFTER_SECONDS = 2.0


def sync_batches(codec, items: list) -> list[list]:
    """``items`` ((key, block)) in batches of about SYNC_BATCH_BYTES of packed copies, in order."""
    return runs_of(items, lambda item: codec.copy_nbytes(item[1].value, item[1].state), SYNC_BATCH_BYTES)


class PrimarySide:
    """What a primary does for its copy holders: sends each applied step (and the copies stepped
    ahead) to the ``syncing``/``in_sync`` ones, makes the step visible once they acknowledged it,
    answers their syncs, and drops a holder whose frame of its round failed.

    Mixed into ``Replicator`` (replication.py), which provides ``node``, ``links``, ``_lock``, the
    per-job records (``_jobs``, ``_job``), ``_rounds``, ``codec``, ``_header`` and ``_placement``.
    """

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
            record.dropped[peer] = time.monotonic()
        log.warning("job %s: node %s dropped from the in-sync copy holders: %s", name, peer, why)

    def unacked_by(self, job: JobStore, blocks: list) -> str:
        """Who applied ``blocks`` not visible yet wait for (the job lock is held): a holder's sync
        (none in sync), or the in-sync holders' acknowledgements."""
        with self._lock:
            record = self._jobs.get(job.name)
            if record is None:
                return ""
            ids = {id(b) for b in blocks}
            peers = sorted({p for wait in record.sync_waits if ids & {id(b) for b in wait.blocks} for p in wait.peers})
            if peers:
                return (f"no copy holder of it is in sync; it waits for a sync of node{'s' if len(peers) > 1 else ''} "
                        f"{', '.join(peers)}")
            holders = sorted(record.replicating())
        if holders:
            return f"it waits for the acknowledgement of copy holder{'s' if len(holders) > 1 else ''} {', '.join(holders)}"
        return ""

    def invite_dropped(self) -> None:
        """Invite each dropped copy holder still in the routing to sync (REPLICATE_RESYNC), once
        INVITE_AFTER_SECONDS passed without its own ask (from the heartbeat loop). A holder whose
        frame timed out may have missed it without knowing: it would never ask, and steps no
        other holder protects would wait for its sync for ever."""
        with self._lock:
            names = [name for name, record in self._jobs.items() if record.dropped]
        for name in names:
            job = self.node.store.get(name)
            if job is None:
                continue
            placement = self._placement(self.node.routing, job.spec)
            me = self.node.node_id
            with job.cond:
                primaries = [key for key, block in job.blocks.items() if block.primary]
            holders = {peer for key in primaries for peer in placement.copies_of(key) if peer != me}
            now = time.monotonic()
            with self._lock:
                record = self._jobs.get(name)
                due = record.invitations_due(now, INVITE_AFTER_SECONDS, holders) if record is not None else []
            for peer in due:
                log.info("job %s: inviting node %s to sync (dropped from the in-sync copy holders, no ask since)",
                         name, peer)
                header = self._header(dp.OP_REPLICATE, job, replicate_kind=dp.REPLICATE_RESYNC)
                self.links.link(peer).send(Send(header, [], self._invited(name, peer)))

    def _invited(self, name: str, peer: str):
        def done(error, _reply):
            if error is not None:
                log.info("job %s: could not invite node %s to sync (inviting again): %s", name, peer, error)
            with self._lock:
                record = self._jobs.get(name)
                if record is not None:
                    record.invited(peer, time.monotonic())
        return done

    # stage hook (the job lock is held): send copies of blocks stepped ahead of the commits
    def on_staged(self, job: JobStore, items: list) -> None:
        holders = self.in_sync(job.name)
        if not holders or not items:
            return
        placement = self._placement(self.node.routing, job.spec)
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
        checksums: dict = {}   # one per block, whichever holders it goes to
        for peer, sent in by_peer.items():
            refs, payloads = stepped_refs(self.codec(job), [(key, copy) for key, copy, _staged in sent],
                                          checksums=checksums if self.check_due(sent[0][1].step) else None)
            header = self._header(dp.OP_REPLICATE, job, step=sent[0][1].step, blocks=refs,
                                  replicate_kind=dp.REPLICATE_STAGED,
                                  payload_bytes=sum(r.nbytes for r in refs))
            self.links.link(peer).send(Send(header, payloads))  # a failure shows at the step's frame

    # apply hook (the job lock is held): send copies of what was applied, wait for the acks
    def on_applied(self, job: JobStore, step: int, items: list) -> bool:
        failpoints.hit("ps.after_apply", step)
        holders = self.in_sync(job.name)
        plan = plan_step(items, self._placement(self.node.routing, job.spec).copies_of, self.node.node_id, set(holders))
        if plan.unprotected:  # no copy holder in sync: the step would have one copy
            with self._lock:
                self._job(job.name).sync_waits.append(SyncWait(step, plan.unprotected, plan.unsynced))
        if not plan.by_peer:
            if plan.unprotected:  # the rest is visible now; those wait for a holder's sync
                job.mark_visible(plan.protected, step + 1)
            return bool(plan.unprotected)
        copy = job.sync == "asp"  # ASP steps the blocks again at the next push: send a snapshot
        with self._lock:
            ahead = self._job(job.name).take_sent_ahead(key for key, _block in items)

        def sent_ahead(key, block, peer) -> bool:  # the peer holds this very step of the block already
            staged = ahead.get(peer, {}).get(key)
            return staged is not None and block.value is staged.value

        codec = self.codec(job)

        def nbytes(item) -> int:   # what a stepped block adds to the frame
            return stepped_nbytes(codec, item[1], replay=not copy)

        frames = {}
        for peer, peer_items in plan.by_peer.items():
            stepped = [(k, b) for k, b in peer_items if b.version == step + 1 and not sent_ahead(k, b, peer)]
            carried = [(k, b) for k, b in peer_items if b.version != step + 1 or sent_ahead(k, b, peer)]
            batches = runs_of(stepped, nbytes, STEP_FRAME_BYTES) or [[]]
            frames[peer] = (batches, carried)
        acks = StepAcks(job, step, plan.protected, {peer: len(batches) for peer, (batches, _c) in frames.items()})
        checksums = {} if self.check_due(step + 1) else None
        for peer, (batches, carried) in frames.items():
            link, done = self.links.link(peer), self._acked(acks, peer, holders[peer])
            for n, batch in enumerate(batches):
                refs, payloads = stepped_refs(codec, batch, replay=not copy, checksums=checksums)
                if copy:
                    payloads = [bytes(p) for p in payloads]
                if n == len(batches) - 1:   # the blocks carried through go with the step's last frame
                    for key, block in carried:
                        refs.append(dp.BlockRef(tensor=key[0], index=key[1], zero=True, version=block.version,
                                                step=block.step))
                header = self._header(dp.OP_REPLICATE, job, step=step + 1, blocks=refs,
                                      replicate_kind=dp.REPLICATE_STEP, payload_bytes=sum(r.nbytes for r in refs))
                link.send(Send(header, payloads, done))
        return True

    def check_due(self, step: int) -> bool:
        """Whether the replayed blocks of the step that makes version ``step`` carry checksums
        (every ``check_interval`` steps; 0: never)."""
        return bool(self.check_interval) and step % self.check_interval == 0

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
                finished = pending.answered(peer)
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
        placement = self._placement(self.node.routing, job.spec)
        holders = self.in_sync(job.name) if job.revision else None
        by_peer: dict[str, list] = {}
        with job.cond:
            for key in keys:
                for peer in placement.copies_of(key):
                    if peer != self.node.node_id:
                        by_peer.setdefault(peer, []).append((key, job.blocks[key]))
            waits = []
            codec = self.codec(job)
            for peer, items in by_peer.items():
                round_ = (self._join(job.name, peer, HolderProgress.initialized) if holders is None or peer in holders
                          else None)
                # In frames of about SYNC_BATCH_BYTES, as a sync's: one frame of a large job's values
                # and state (600 MB at 100 M parameters) could not arrive within replication_timeout.
                for batch in sync_batches(codec, items):
                    refs, payloads = copy_refs(codec, batch)
                    payloads = [bytes(p) for p in payloads]
                    header = self._header(dp.OP_REPLICATE, job, step=job.step, blocks=refs,
                                          replicate_kind=dp.REPLICATE_STEP, payload_bytes=sum(r.nbytes for r in refs))
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
            batches = sync_batches(codec, items) or [[]]   # an empty answer still ends the sync
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
        placement = self._placement(self.node.routing, job.spec)
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

