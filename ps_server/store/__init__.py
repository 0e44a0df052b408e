"""Block store and synchronization for one PS node (BSP, SSP, ASP, pipelined apply): pure logic,
no sockets. ``JobStore`` (job.py) is the facade; each concept has its own module, all under the
job's lock; blocks.py draws a block's roles. Retries are idempotent within a step; errors are
``StoreError``.

Design: docs/architecture.md, "Block store" (and "BSP step" for the sync modes).
"""

from shardline.ps_server.store.blocks import (AWAITING_HANDOVER, COPY, HOLDING, PRIMARY, REPLICA, Block, Collection,
                                              Copy, Held, Kept, Primary, Replay, Staged, Takeover)
from shardline.ps_server.store.common import LRs, StoreError, TensorMeta
from shardline.ps_server.store.handover import Handover
from shardline.ps_server.store.job import JobStore, NodeStore
from shardline.ps_server.store.pushes import Aggregate, PushItem, PushRef, PushTicket

__all__ = [
    "AWAITING_HANDOVER", "COPY", "HOLDING", "PRIMARY", "REPLICA", "Aggregate", "Block", "Collection", "Copy", "Handover", "Held",
    "JobStore", "Kept", "LRs", "NodeStore", "Primary",
    "PushItem", "PushRef", "PushTicket", "Replay", "Staged", "StoreError", "Takeover", "TensorMeta",
]
