"""A BSP step's push through the host's aggregation group (worker/host_group.py).

``PSOptimizer.step`` hands its gradients to :func:`push_step`. Where this worker belongs to a host
group, the group's leader sends ONE push per block for every rank of its host that was ready
(the weighted sum, ``Client.push(..., aggregate=...)``), and its members send nothing but their
commits; otherwise the worker pushes alone, as before. Whatever happens to the group, every rank's
own gradients go into its own step record, so a replay after an epoch change, or a node's recovery,
resends them alone (a node ignores a rank's push of a block it already holds from an aggregate).

::

    leader:  begin_step -> LeaderStep --push(aggregate), acknowledged--> finish(True) --> commit
                                      \\--AGGREGATE_CONFLICT or any error--> finish(False) --> push alone (or raise)
    member:  begin_step -> MemberStep --wait() True--> record_pushed --> commit
                                      \\--wait() False (told, excluded, leader gone)--> push alone --> commit
    alone:   begin_step -> None --> push --> commit

When it applies (:func:`aggregation_wanted`): BSP, no compression (a compressed push carries each
rank's error feedback), no overlap (those pushes leave during backward, per bucket), and, unless
the script asked for it, only where a push crosses hosts: on one host every node is reached over
shared memory, and waiting for the host's slowest rank before pushing would only delay the others'
pushes. Design: docs/architecture.md, "Host aggregation".
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from shardline.services.errors import ErrorCode, RemoteError
from shardline.worker.client import Client, HostAggregate
from shardline.worker.host_group import HostGroup, LeaderStep, MemberStep

log = logging.getLogger("shardline.worker")


def aggregation_wanted(asked: bool | None, *, sync: str, compression: str | None, overlap: bool,
                       nodes: Iterable[str], is_local: Callable[[str], bool]) -> bool:
    """Whether this worker joins its host's aggregation group. ``asked``: the script's
    ``host_aggregation`` (None: decide here). Never for ASP/SSP, compressed or overlapped pushes;
    by default only when a node of the routing is on another host."""
    if sync != "bsp" or compression not in (None, "", "none") or overlap or asked is False:
        return False
    return asked is True or any(not is_local(node) for node in nodes)


def push_step(client: Client, group: HostGroup | None, grads: dict[str, torch.Tensor | None], weight: float) -> None:
    """Push this rank's ``grads`` for the client's current step and commit it (``Client.push``'s
    contract), through ``group`` when there is one."""
    if group is None:
        client.push(grads, weight=weight)
        return
    client.check_finite(grads)   # a NaN fails this rank's step, not its host's push
    role = group.begin_step(client.step, weight, grads)
    if isinstance(role, LeaderStep):
        _lead(client, role, grads, weight)
    elif isinstance(role, MemberStep):
        if role.wait():
            client.record_pushed(grads, weight=weight)
            client.commit(weight=weight)
        else:
            client.push(grads, weight=weight)
    else:
        client.push(grads, weight=weight)


def _lead(client: Client, role: LeaderStep, grads: dict, weight: float) -> None:
    """The leader's step: the aggregate goes out, the members hear whether it did (once every
    node acknowledged it, so that their commits follow), then this rank commits."""
    told = []

    def tell_pushed() -> None:
        told.append(True)
        role.finish(True)

    try:
        sums = {name: None if flat is None else flat.view(client.shape_of(name)) for name, flat in role.sums.items()}
        client.push(grads, weight=weight, aggregate=HostAggregate(role.ranks, role.weights, sums),
                    before_commit=tell_pushed)
    except RemoteError as exc:
        if told:   # the commit failed: the members' gradients are on the nodes all the same
            raise
        role.finish(False)
        if exc.code != ErrorCode.AGGREGATE_CONFLICT:
            raise
        # A member pushed alone meanwhile (it gave up waiting): every rank of the host pushes alone.
        log.warning("job %r step %d: a node refused the host's aggregated push of ranks %s (%s); each pushes alone",
                    client.job, role.step, list(role.ranks), exc.remote_message)
        client.push(grads, weight=weight)
    except BaseException:
        if not told:
            role.finish(False)
        raise
