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

The pull that follows (:func:`pull_step`, ``prefetch_window=0``) is shared too where this worker's
reads cross hosts (:func:`pull_shared`): a member that asked for it in its READY (and was told
PUSHED) commits without a carried pull and takes the step's changed blocks, with their versions,
from the leader's pull region once the leader's own pull completed (PULLED); told NOT_PULLED, or
the leader gone or silent past leader_timeout, it pulls the step itself. So the host's cross-host
pull bytes per step are one worker's, whatever its number of workers.

::

    leader:  push_step --> pull (pull_changed) --> share_pull: changed blocks into the region, PULLED
                                         \\--its pull raised--> decline_pull: NOT_PULLED, then raise
    member:  push_step (READY with SHARES_PULL; PUSHED; commit without a carried pull)
             --> take_pull: PULLED, copy, COPIED --> adopt_host_pull
                       \\--NOT_PULLED, leader gone or silent--> pull_changed

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


def pull_shared(client: Client, group: HostGroup | None, prefetch_window: int) -> bool:
    """Whether this step's pull is to come from the host's leader (decided once per step): BSP in
    a group with a pull layout, the plain step (``prefetch_window`` 0), and this worker's reads
    would cross hosts (where a node on this host holds every block, they are local already)."""
    return (group is not None and group.pull_layout is not None and prefetch_window == 0
            and client.sync == "bsp" and client.reads_cross_hosts())


def push_step(client: Client, group: HostGroup | None, grads: dict[str, torch.Tensor | None], weight: float, *,
              share_pull: bool = False) -> None:
    """Push this rank's ``grads`` for the client's current step and commit it (``Client.push``'s
    contract), through ``group`` when there is one. ``share_pull``: as a member, take the step's
    pull from the leader (``pull_step`` then); its commit carries no pull."""
    if group is None:
        client.push(grads, weight=weight)
        return
    client.check_finite(grads)   # a NaN fails this rank's step, not its host's push
    role = group.begin_step(client.step, weight, grads, share_pull=share_pull)
    if isinstance(role, LeaderStep):
        _lead(client, role, grads, weight)
    elif isinstance(role, MemberStep):
        if role.wait():
            client.record_pushed(grads, weight=weight)
            # a carried pull would fetch every block across hosts: the leader's pull brings them
            client.commit(weight=weight, carry_pull=not group.pull_awaited)
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


def pull_step(client: Client, group: HostGroup | None) -> None:
    """Bring the caches to the client's step after ``push_step`` (``Client.pull_changed``'s
    contract): a member the leader owes the step's pull takes it from the leader's region (or,
    where it cannot, pulls itself); a leader that owes its members the pull shares it once its
    own completed, or tells them NOT_PULLED if it raised."""
    if group is not None and group.pull_awaited:
        values, versions = client.host_pull_state()
        taken = group.take_pull(versions, values)
        if taken is not None:
            client.adopt_host_pull(taken.held_step, taken.durable_step)
            return
        client.pull_changed()
        return
    try:
        client.pull_changed()
    except BaseException:
        if group is not None and group.pull_owed:
            group.decline_pull("the leader's own pull failed")
        raise
    if group is not None and group.pull_owed:
        values, versions = client.host_pull_state()
        group.share_pull(client.held_step or 0, versions, values, client.durable_step())
