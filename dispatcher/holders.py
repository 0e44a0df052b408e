"""Which nodes hold blocks nobody else holds: the dispatcher's check before a node leaves the ring.

A block's holders at an epoch are its owners under the serving ring (services/placement.py: the
primary and its replicas). When nodes go silent, the dispatcher moves a silent node's blocks to
their other holders by taking it out of the ring; a block all of whose holders are silent has no
one to move to, and whoever the smaller ring names its owner would serve a block it never had. So
a node that holds such a block stays in the ring (dispatcher/membership.py, "No ring from partial
data"). Pure: the caller passes the serving nodes and the jobs.
"""

from __future__ import annotations

from typing import Iterable

from shardline.services.extension import revision_of
from shardline.services.pb import common_pb2
from shardline.services.placement import place
from shardline.services.routing import RoutingView

# Keys of the answers remembered (each pass of the dispatcher's expiry asks again while nodes are silent).
CACHE_ENTRIES = 16


def sole_holders(serving: list, reader_racks: dict, leaving: set[str], specs: Iterable[common_pb2.JobSpec],
                 default_replication: int) -> dict[str, str]:
    """Of the nodes ``leaving``, those that hold a block of ``specs`` whose every holder under the
    ring of ``serving`` (NodeRecords or NodeInfos: node_id, rack, vnodes) is leaving too, each with
    what it holds alone ("12 blocks of job 'a', e.g. emb.weight[0]")."""
    if not leaving:
        return {}
    table = common_pb2.RoutingTable(
        nodes=[common_pb2.NodeInfo(node_id=n.node_id, rack=n.rack, vnodes=n.vnodes) for n in serving],
        default_replication=default_replication, reader_racks=reader_racks)
    view = RoutingView.from_proto(table)
    if view.ring is None:
        return {}
    alone: dict[str, dict[str, list]] = {}   # node -> job -> blocks it holds alone
    for spec in specs:
        for key, owners in place(view, spec).owners.items():
            if owners and all(owner in leaving for owner in owners):
                for owner in owners:
                    alone.setdefault(owner, {}).setdefault(spec.name, []).append(key)
    return {node: "; ".join(f"{len(keys)} block(s) of job {job!r}, e.g. {keys[0][0]}[{keys[0][1]}]"
                            for job, keys in sorted(jobs.items()))
            for node, jobs in sorted(alone.items())}


class SoleHolders:
    """``sole_holders`` over a JobRegistry's ready jobs, remembering recent answers (the question
    repeats every expiry pass while nodes stay silent; the answer changes only with the ring, the
    nodes leaving or the jobs). The callable Membership takes."""

    def __init__(self, jobs):
        self._jobs = jobs
        self._cache: dict = {}

    def __call__(self, serving: list, reader_racks: dict, leaving: set[str]) -> dict[str, str]:
        records = [r for r in self._jobs.list() if r.ready]
        key = (tuple((n.node_id, n.rack, n.vnodes) for n in serving), tuple(sorted(reader_racks.items())),
               frozenset(leaving), tuple((r.name, r.uid, revision_of(r.spec)) for r in records),
               self._jobs.default_replication)
        answer = self._cache.get(key)
        if answer is None:
            answer = sole_holders(serving, reader_racks, leaving, [r.spec for r in records],
                                  self._jobs.default_replication)
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            self._cache[key] = answer
        return dict(answer)
