"""Replication, the copy holder's side: one handler per ``ReplicateKind`` of the frames it
receives, the syncs it asks of its primaries after each routing change (``SyncAsk``), the blocks
it applies but still fetches (``Fetch``), and the copies no role needs any more. The states are
drawn in ps_server/replication.py; docs/architecture.md, "Replication".
"""

from __future__ import annotations

import logging
import time

import torch

from shardline.ps_server.replication_codec import read_handover
from shardline.ps_server.replication_links import Send
from shardline.ps_server.store import JobStore, StoreError
from shardline.services import failpoints, frame
from shardline.services.errors import ErrorCode
from shardline.services.pb import dataplane_pb2 as dp

log = logging.getLogger("shardline.ps.replication")


class CopyHolderSide:
    """What a copy holder does: installs what its primaries send (fenced by the routing), asks
    them for syncs and fetches the blocks it takes over from their previous holders.

    Mixed into ``Replicator`` (replication.py), which provides ``node``, ``links``, ``_lock``, the
    per-job records (``_jobs``, ``_job``), ``_rounds``, ``codec``, ``_header`` and ``_placement``.
    """

    def handle_replicate(self, job: JobStore, header, payload) -> None:
        """Take an OP_REPLICATE frame from ``header.node``: one handler per ``replicate_kind``."""
        handler = self._HANDLERS.get(header.replicate_kind)
        if handler is None:
            raise StoreError(ErrorCode.INVALID_ARGUMENT, f"replicate frame of unknown kind {header.replicate_kind}")
        handler(self, job, header, payload)

    def _on_step(self, job: JobStore, header, payload) -> None:
        """REPLICATE_STEP: install the copies of a step the sender applied, replay its gradients,
        carry the blocks it names. Fenced: only the blocks' primary at this node's epoch."""
        copies, carried, replayed = self._read_blocks(job, header, payload, fenced=True)
        job.apply_copies(copies)
        try:
            if replayed:
                failpoints.hit("ps.holder_replay", header.step - 1)  # received, not yet replayed nor acknowledged
                job.replay_steps(replayed, verify=self._verifier(job, header.node))
            if carried:
                job.carry_copies(carried)
        except StoreError as exc:
            # A step this node did not get: its primary drops it from the in-sync holders on this
            # answer; ask it at once for a sync (which makes this node an in-sync holder again)
            # rather than waiting for the next routing change. The sync names every copy this node
            # holds of the sender's blocks, not only the lacking ones: steps applied while it was
            # out of sync reach none of them otherwise (a copy left behind, even one no step
            # changes, cannot serve reads). Only what differs comes back whole.
            lacking = getattr(exc, "keys", None)
            if exc.code == ErrorCode.UNAVAILABLE and lacking:
                self._ask_sync(job, header.node, self._held_from(job, header.node, lacking))
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
            job.replay_steps(replayed, ahead=True, verify=self._verifier(job, header.node))

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

    def _on_resync(self, job: JobStore, header, _payload) -> None:
        """REPLICATE_RESYNC: the sender dropped this node from its in-sync holders, maybe without
        this node knowing (a frame that timed out): ask it for a sync of every copy this node
        holds, or should hold, of its blocks."""
        placement = self._placement(self.node.routing, job.spec)
        _primary, replica, learner = placement.roles(self.node.node_id)
        should = [key for key in replica | learner if placement.primary(key) == header.node]
        self._ask_sync(job, header.node, self._held_from(job, header.node, should))

    _HANDLERS = {dp.REPLICATE_STEP: _on_step, dp.REPLICATE_STAGED: _on_staged, dp.REPLICATE_SYNC: _on_sync_answer,
                 dp.REPLICATE_SYNC_LAST: _on_sync_answer, dp.REPLICATE_HANDOVER: _on_handover,
                 dp.REPLICATE_RESYNC: _on_resync}

    def _read_blocks(self, job: JobStore, header, payload, *, fenced: bool) -> tuple[list, list, list]:
        """The (copies, carried, replayed) of a STEP, STAGED or SYNC frame, checked: float32 runs
        of the block's size; a gradient to replay only in a fenced frame of a job that replays;
        ``fenced``: every block's primary at this node's epoch is the sender (NOT_OWNER otherwise)."""
        sender = header.node
        view = self.node.routing
        placement = self._placement(view, job.spec)
        codec = self.codec(job)
        copies, carried, replayed = [], [], []
        # copies and gradients travel as float32 runs (a copy without state: its value, float32 or
        # bfloat16, BlockCodec.accepts); a run of another dtype would be misread
        bad = next((ref for ref in header.blocks if ref.nbytes and ref.dtype != dp.FLOAT32
                    and (ref.replay or ref.dtype != dp.BFLOAT16)), None)
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
                replayed.append((ref.tensor, ref.index, ref.version, ref.step, ref.base_version, ref.lr, grad,
                                 ref.checksum))
                continue
            if ref.zero:
                carried.append((key, ref.version, ref.step))
                continue
            if not codec.accepts(numel, ref):
                raise StoreError(ErrorCode.INVALID_ARGUMENT, f"copy of {ref.tensor}[{ref.index}] has {ref.numel} "
                                                             f"elements of dtype {ref.dtype}, expected "
                                                             f"{codec.packed_numel(numel)} float32 (or, without "
                                                             f"state, its {numel} values)")
            flat = torch.frombuffer(payload, dtype=frame.TORCH_DTYPE[ref.dtype], count=ref.numel, offset=offset)
            offset += ref.nbytes
            value, state = codec.unpack(numel, flat, ref.tensor)
            copies.append((ref.tensor, ref.index, ref.version, ref.step, value, state))
        return copies, carried, replayed

    def _verifier(self, job: JobStore, primary: str):
        """The divergence check of replayed blocks whose ref carries a checksum (JobStore.replay_steps):
        True if this node's result sums as its primary's did; otherwise a WARNING naming the job,
        block, step and primary, and False (the block is not installed: this node answers
        UNAVAILABLE for it, is dropped, and syncs a full copy)."""
        codec = self.codec(job)

        def verify(key, step: int, value, state: dict, expected: int) -> bool:
            got = codec.checksum(value, state)
            if got == expected:
                return True
            log.warning("job %s: replayed copy of %s[%d] at step %d differs from its primary %s (checksum %08x, "
                        "the primary's %08x): resyncing a full copy", job.name, key[0], key[1], step, primary,
                        got, expected)
            return False
        return verify

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
                before = self._placement(previous, job.spec)
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

    def _held_from(self, job: JobStore, primary: str, lacking) -> list:
        """Holding refs of ``lacking`` and of every other copy this node keeps of ``primary``'s blocks."""
        placement = self._placement(self.node.routing, job.spec)
        with job.cond:
            keys = set(lacking) | {key for key, block in job.blocks.items()
                                   if not block.primary and placement.primary(key) == primary}
            return [self._holding_ref(job, key) for key in sorted(keys)]

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
