"""Replication: a block's primary keeps its copy holders (replicas and, during a ring change,
learners; services/placement.py says who holds what) bitwise equal to it at every step workers can
see. ``Replicator`` joins the primary's side and the copy holder's side over one lock.

The primary's view of each copy holder of a job (``HolderProgress``, replication_progress.py)::

                       OP_SYNC received: answer queued, new round
    out_of_sync ---------------------------------------------------> syncing
     ^   |                                                         |     ^
     |   | initial values sent (INIT), new round        SYNC_LAST  |     | OP_SYNC again,
     |   v                                            went through |     | new round
     |  in_sync <--------------------------------------------------+     |
     |   |   +-----------------------------------------------------------+
     |   |
     +---+-- a frame of its round failed or was refused (timeout, NOT_OWNER, lacks a step);
             from syncing too; still routed and silent INVITE_AFTER_SECONDS later: invited to
             sync (REPLICATE_RESYNC), again at that interval

Contract: a step's blocks become visible only once every ``syncing``/``in_sync`` holder
acknowledged its ``REPLICATE_STEP`` frame or was dropped; a failure of an older round drops
nobody. ``REPLICATE_STEP``/``STAGED`` frames are fenced (only the block's primary at the
receiver's epoch, else ``NOT_OWNER``); a holder not at the version a step builds on answers
``UNAVAILABLE`` and asks for a sync. A sync answer is queued with the holder's move to ``syncing``
under the job lock. Per-job records (``JobReplication``) are read and moved under ``_lock``.

Design: docs/architecture.md, "Replication" (states, messages, invariants, failure table).
"""

from __future__ import annotations

import itertools
import threading

from shardline.ps_server.replication_codec import BlockCodec
from shardline.ps_server.replication_holder import CopyHolderSide
from shardline.ps_server.replication_links import PeerLinks
from shardline.ps_server.replication_primary import PrimarySide
from shardline.ps_server.replication_progress import JobReplication
from shardline.ps_server.store import JobStore
from shardline.services import frame
from shardline.services.errors import ShardlineConfigError
from shardline.services.placement import place

# Every this many steps a replayed step's blocks carry checksums (the PS option replica_check_interval).
DEFAULT_CHECK_INTERVAL = 100


class Replicator(PrimarySide, CopyHolderSide):
    """Replication of one node: the primary's sending side (replication_primary.py) and the copy
    holder's receiving side (replication_holder.py), over what both share, defined here.

    ``node`` is the PSNode (routing, jobs); ``links`` the PeerLinks to other nodes. What it tracks
    per job is one ``JobReplication`` (replication_progress.py), read and moved under ``_lock``.
    """

    def __init__(self, node, links: PeerLinks, *, metrics=None, check_interval: int = DEFAULT_CHECK_INTERVAL):
        if not isinstance(check_interval, int) or isinstance(check_interval, bool) or check_interval < 0:
            raise ShardlineConfigError(f"replica_check_interval must be an integer >= 0 (0: no check), "
                                       f"got {check_interval!r}")
        self.check_interval = check_interval   # replayed steps carry checksums every this many (0: never)
        self.node = node
        self.links = links
        self.metrics = metrics
        self._lock = threading.Lock()
        self._jobs: dict[str, JobReplication] = {}
        self._rounds = itertools.count(1)
        self._codecs: dict[str, BlockCodec] = {}
        self._request_ids = itertools.count(1)

    def codec(self, job: JobStore) -> BlockCodec:
        codec = self._codecs.get(job.name)
        if codec is None:
            codec = self._codecs[job.name] = BlockCodec(job)
        return codec

    def attach(self, job: JobStore) -> None:
        job.apply_hooks.append(self.on_applied)
        job.stage_hooks.append(self.on_staged)
        job.unacked_by = self.unacked_by

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

    def _header(self, op: int, job: JobStore, **fields) -> frame.FrameHeader:
        return frame.FrameHeader(op=op, request_id=next(self._request_ids), job=job.name,
                                 epoch=self.node.routing.epoch, node=self.node.node_id, revision=job.revision, **fields)

    @staticmethod
    def _placement(view, spec):
        """Who holds what under the routing ``view`` (services/placement.py)."""
        return place(view, spec)
