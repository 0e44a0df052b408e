"""Reads from copy holders: which reads a block's replica may serve, and which holder a worker
reads from. Both sides apply these rules: the worker routes a read to a holder only where a node
serves it (docs/architecture.md, "Reads from copy holders").

A BSP worker's read of a new step (a pull with ``min_step`` > 0, or a commit carrying a pull)
may go to any owner of the block under the serving ring: its primary or a replica. A replica
answers once it holds the step (its primary applied the step first and sent it), so a step a
worker read from a replica is held by two nodes, as one read from the primary is (visible only
once its in-sync holders hold it). Everything else reads the primary: SSP and ASP (a copy may
lag by steps the reader could not tell), a read of step 0 (where to resume: the primaries'
steps decide), a subscriber (deltas and checksums kept by primaries), values of an older step
(``at_step``), learners of a pending ring.
"""

from __future__ import annotations

from typing import Callable

from shardline.services.pb import dataplane_pb2 as dp

# After the job step reached what a read asks for on a copy holder, how long its copies may take
# to follow (their primary's frame is on the way) before the read is refused with COPY_BEHIND and
# the worker asks the primary (a dropped holder's copies do not follow until it synced again).
COPY_READ_TIMEOUT_SECONDS = 2.0
# A worker told COPY_BEHIND by a node reads its blocks from their primaries for this long.
COPY_READ_RETRY_SECONDS = 30.0


def copies_may_serve(op: int, sync: str, *, min_step: int, subscriber: bool = False, at_step: bool = False,
                     pull_applied: bool = False) -> bool:
    """Whether a request may read blocks from a replica (see the module docstring)."""
    if sync != "bsp":
        return False
    if op == dp.OP_COMMIT:
        return pull_applied
    return op == dp.OP_PULL and min_step > 0 and not subscriber and not at_step


def nearest_holder(owners: tuple[str, ...], *, is_local: Callable[[str], bool], rack_of: Callable[[str], str],
                   rack: str | None, rank: int, avoid=frozenset()) -> str:
    """The owner of a block a worker of ``rank`` reads it from: a holder on its own host (shared
    memory, no NIC), else one on its ``rack``, else the primary (``owners[0]``). Among equally
    near holders ranks take turns (``rank`` modulo their number), so readers of one host spread
    over its nodes. Nodes in ``avoid`` (they answered COPY_BEHIND lately) are passed over; the
    primary never is."""
    primary = owners[0]
    candidates = [n for n in owners if n == primary or n not in avoid]
    local = [n for n in candidates if is_local(n)]
    if local:
        return local[rank % len(local)]
    if rack:
        near = [n for n in candidates if rack_of(n) == rack]
        if near:
            return near[rank % len(near)]
    return primary
