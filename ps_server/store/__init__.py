"""Block store and synchronization for one PS node: pure logic, no sockets.

A node holds, per job, the blocks the ring assigns it: fp32 master values, optimizer state and a
version (the job step that last changed the block; initial values are version 0), each in one
role, Primary (this node applies it) or Copy (blocks.py draws the roles and their transitions).

Sync modes (SPEC "Training semantics"): **BSP** collects every rank's pushes and commits of a step
and steps each pushed block with the weighted mean gradient (commits.py, apply.py; blocks nobody
pushed are not stepped, as ``torch.optim`` skips ``grad is None``); **SSP** (``staleness`` s >= 1)
aggregates as BSP with up to s steps in flight (ahead.py); **ASP** applies each push frame on
arrival (apply.py). **Pipelined apply** (early.py) steps a block whose every push arrived before
the commits, outside the lock, and installs it at the commits. Retries are idempotent within a
step. ``JobStore`` (job.py) is the facade; each concept has its own module over the job's lock.

The design: docs/architecture.md, "Block store".
"""

from shardline.ps_server.store.blocks import (AWAITING_HANDOVER, COPY, HOLDING, PRIMARY, REPLICA, Block, Collection,
                                              Copy, Held, Kept, Primary, Replay, Staged, Takeover)
from shardline.ps_server.store.common import LRs, StoreError, TensorMeta
from shardline.ps_server.store.handover import Handover
from shardline.ps_server.store.job import JobStore, NodeStore
from shardline.ps_server.store.pushes import PushItem, PushRef, PushTicket

__all__ = [
    "AWAITING_HANDOVER", "COPY", "HOLDING", "PRIMARY", "REPLICA", "Block", "Collection", "Copy", "Handover", "Held",
    "JobStore", "Kept", "LRs", "NodeStore", "Primary",
    "PushItem", "PushRef", "PushTicket", "Replay", "Staged", "StoreError", "Takeover", "TensorMeta",
]
