"""Replication: a block's primary keeps its copy holders (replicas and, during a ring change,
learners; services/placement.py says who holds what) holding the same block, bitwise, at every
step workers can see. docs/architecture.md, "Replication".

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
             from syncing too

``syncing`` and ``in_sync`` holders are sent every applied step (the answer went first on the same
FIFO link), and a step becomes visible once each of them acknowledged it. A holder's ``round``
fences late failures: a frame of an older round (its previous process) drops nobody. The copy
holder's side of the same exchange: a ``SyncAsk`` per node it asked (pending until the last frame
of an answer to a request of the current routing), a ``Fetch`` per block it applies but lacks
(asked of its previous holders in turn), and the copies no role needs any more (dropped after a
grace period).

Messages: ``OP_SYNC`` (holder to primary: the version and step of every copy it holds) and
``OP_REPLICATE`` of one ``ReplicateKind``, each with its own handler:

* ``REPLICATE_STEP`` -- the blocks of an applied step to an in-sync holder: copies (value and
  optimizer state, packed), or with ``replicate_gradients`` the mean gradient and lr the holder
  replays, and zero refs for blocks carried through or sent ahead; the INIT's values too. Fenced:
  only the block's primary at the receiver's epoch (NOT_OWNER: the sender refreshes its routing).
* ``REPLICATE_STAGED`` -- copies of blocks stepped before the step's commits (pipelined apply),
  held apart until the step's STEP frame names them; a holder not sent them in its current
  round gets full copies instead.
* ``REPLICATE_SYNC`` / ``REPLICATE_SYNC_LAST`` -- the answer to the receiver's OP_SYNC: copies of
  whatever differs, queued with the holder's move to ``syncing`` under the job lock, so no
  applied step slips between them and the steps that follow. Accepted at any epoch.
* ``REPLICATE_HANDOVER`` -- a block that changes primary mid-step takes along what its old
  primary collected of the step in flight (``JobStore.accept_handover``).

A block whose copy holders are all out of sync stays invisible until one of them synced (it
carries the block) or none is left in the routing (``SyncWait``). A holder at another version
than a step builds on steps nothing, answers UNAVAILABLE (dropped) and asks for a sync at once.
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
from shardline.services.placement import place


class Replicator(PrimarySide, CopyHolderSide):
    """Replication of one node: the primary's sending side (replication_primary.py) and the copy
    holder's receiving side (replication_holder.py), over what both share, defined here.

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

    def _header(self, op: int, job: JobStore, **fields) -> frame.FrameHeader:
        return frame.FrameHeader(op=op, request_id=next(self._request_ids), job=job.name,
                                 epoch=self.node.routing.epoch, node=self.node.node_id, revision=job.revision, **fields)

    @staticmethod
    def _placement(view, spec):
        """Who holds what under the routing ``view`` (services/placement.py)."""
        return place(view, spec)
