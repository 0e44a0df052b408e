"""Calls from the dispatcher to PS nodes: dropping a deleted job, coordinating a checkpoint.

The algorithms are pure over a :class:`NodeCaller` (tests pass fakes; the servicer passes
:class:`GrpcNodeCaller`) and run the per-node calls in parallel on an executor. They take no
dispatcher lock: callers pass snapshots of the nodes.

PS semantics of ``Checkpoint(job, step=T, timeout_seconds)`` that :func:`coordinate_checkpoint`
relies on: a node at step T writes a checkpoint of T (or has one) and replies ``step=T`` once it is
durable; a node below T waits until it reaches T and snapshots exactly there; a node past T replies
at once with ``past=true`` and its current step; NOT_FOUND: the node does not hold the job;
DEADLINE_EXCEEDED: it did not get there within ``timeout_seconds``.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, TypeVar

import grpc

from shardline.services.daemon import grpc_channel
from shardline.services.errors import ShardlineConnectionError, ShardlineError, ShardlineStateError, ShardlineTimeoutError
from shardline.services.pb import ps_pb2, ps_pb2_grpc

# Node answers that retrying within the deadline cannot change.
PERMANENT_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNIMPLEMENTED", "UNAUTHENTICATED",
                             "PERMISSION_DENIED"})
DEFAULT_STATUS_TIMEOUT = 2.0
DEFAULT_DROP_TIMEOUT = 2.0
# Pause before asking again a node whose call failed quickly (unreachable, restarting).
RETRY_DELAY_SECONDS = 0.1
# Extra gRPC deadline over the timeout_seconds a node is given, so its own DEADLINE_EXCEEDED
# reply (which says more) arrives before the client cuts the call.
RPC_DEADLINE_MARGIN_SECONDS = 1.0


@dataclass(frozen=True)
class Target:
    """A PS node to call."""

    node_id: str
    grpc_address: str


class NodeCallError(ShardlineError):
    """A call to a PS node failed; ``code`` is the gRPC status name (``"NOT_FOUND"`` ...)."""

    def __init__(self, node_id: str, code: str, details: str):
        super().__init__(f"node {node_id}: {code}: {details}")
        self.node_id, self.code, self.details = node_id, code, details


class NodeCaller(Protocol):
    """The ParameterServer RPCs the dispatcher makes; failures raise NodeCallError."""

    def status(self, node: Target, timeout: float) -> ps_pb2.NodeStatus: ...

    def checkpoint(self, node: Target, job: str, step: int, timeout: float) -> ps_pb2.CheckpointReply: ...

    def drop(self, node: Target, job: str, uid: str, timeout: float) -> ps_pb2.DropJobReply: ...


class GrpcNodeCaller:
    """:class:`NodeCaller` over gRPC, with the cluster token when there is one and TLS when
    ``tls_ca`` (PEM) is given. A channel per call: these calls are rare and node addresses change."""

    def __init__(self, cluster_token: bytes | None = None, tls_ca: bytes | None = None):
        self._cluster_token = cluster_token
        self._tls_ca = tls_ca

    def _call(self, node: Target, method: str, request, deadline: float):
        channel = grpc_channel(node.grpc_address, self._cluster_token, tls_ca=self._tls_ca)
        try:
            return getattr(ps_pb2_grpc.ParameterServerStub(channel), method)(request, timeout=deadline)
        except grpc.RpcError as exc:
            raise NodeCallError(node.node_id, exc.code().name, exc.details() or "") from None
        finally:
            channel.close()

    def status(self, node: Target, timeout: float) -> ps_pb2.NodeStatus:
        return self._call(node, "GetNodeStatus", ps_pb2.GetNodeStatusRequest(), timeout)

    def checkpoint(self, node: Target, job: str, step: int, timeout: float) -> ps_pb2.CheckpointReply:
        request = ps_pb2.CheckpointRequest(job=job, step=step, timeout_seconds=timeout)
        return self._call(node, "Checkpoint", request, timeout + RPC_DEADLINE_MARGIN_SECONDS)

    def drop(self, node: Target, job: str, uid: str, timeout: float) -> ps_pb2.DropJobReply:
        return self._call(node, "DropJob", ps_pb2.DropJobRequest(job=job, uid=uid), timeout)


R = TypeVar("R")


def fan_out(executor: Executor, call: Callable[[Target], R], nodes: Iterable[Target]) -> dict[str, R | Exception]:
    """``call`` on every node in parallel; node id -> its result or the exception it raised."""
    futures = {node.node_id: executor.submit(call, node) for node in nodes}
    results: dict[str, R | Exception] = {}
    for node_id, future in futures.items():
        error = future.exception()
        results[node_id] = error if error is not None else future.result()
    return results


def drop_everywhere(
    caller: NodeCaller,
    executor: Executor,
    alive: list[Target],
    dead: Iterable[str],
    job: str,
    uid: str,
    *,
    drop_timeout: float = DEFAULT_DROP_TIMEOUT,
) -> tuple[list[str], list[str]]:
    """Best effort: ``DropJob(job, uid)`` on every alive node. Returns ``(dropped_on, pending_on)``.

    ``dropped_on``: nodes that answered (the incarnation is gone there, whether they held it or
    not). ``pending_on``: alive nodes whose call failed, and the dead nodes; they drop it when a
    heartbeat reply lists it in ``drop_jobs``.
    """
    results = fan_out(executor, lambda node: caller.drop(node, job, uid, drop_timeout), alive)
    dropped = sorted(node_id for node_id, result in results.items() if not isinstance(result, Exception))
    pending = sorted({node_id for node_id, result in results.items() if isinstance(result, Exception)} | set(dead))
    return dropped, pending


@dataclass(frozen=True)
class CheckpointResult:
    step: int          # BSP: the step durable on every holder; ASP: the least of their durable steps
    nodes: list[str]   # the holders, sorted


def coordinate_checkpoint(
    caller: NodeCaller,
    executor: Executor,
    nodes: list[Target],
    job: str,
    uid: str,
    *,
    asp: bool,
    timeout: float,
    status_timeout: float = DEFAULT_STATUS_TIMEOUT,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> CheckpointResult:
    """Make every node holding ``job`` (incarnation ``uid``) checkpoint it, within ``timeout`` s.

    Holders are the ``nodes`` whose GetNodeStatus lists the job (with ``uid``, or no uid). BSP:
    T = the largest holder step; every holder is asked to checkpoint T; when one replies past,
    T becomes the largest step reported and every holder is asked again (a checkpoint already
    durable at an earlier T is harmless); done when all are durable at one T. ASP (steps
    legitimately differ): each holder is asked for its own step, again with its new step when past;
    the result is the least durable step. A holder answering NOT_FOUND no longer holds the job.

    Raises ShardlineStateError if no node holds the job or a node refuses for good (e.g.
    UNIMPLEMENTED), ShardlineConnectionError if a node's status cannot be read, and
    ShardlineTimeoutError naming the holders not durable by the deadline and their steps.
    """
    deadline = clock() + timeout
    status_wait = max(0.0, min(status_timeout, deadline - clock()))
    statuses = fan_out(executor, lambda node: caller.status(node, status_wait), nodes)
    unreachable = sorted(str(result) for result in statuses.values() if isinstance(result, Exception))
    if unreachable:
        raise ShardlineConnectionError(
            f"cannot checkpoint job {job!r}: cannot read the status of every alive PS node: {'; '.join(unreachable)}"
        )
    known: dict[str, int] = {}  # holder -> the latest step it reported
    for node_id, status in statuses.items():
        for progress in status.jobs:
            if progress.job == job and (not progress.uid or progress.uid == uid):
                known[node_id] = int(progress.step)
    if not known:
        raise ShardlineStateError(f"no PS node holds job {job!r}")
    holders = {node.node_id: node for node in nodes if node.node_id in known}
    targets = {node_id: known[node_id] if asp else max(known.values()) for node_id in holders}
    durable: dict[str, int] = {}
    errors: dict[str, str] = {}

    while pending := [holders[n] for n in sorted(holders) if durable.get(n) != targets[n]]:
        remaining = deadline - clock()
        if remaining <= 0:
            late = ", ".join(
                f"{node.node_id} at step {known[node.node_id]} (asked for {targets[node.node_id]}"
                + (f"; last error {errors[node.node_id]}" if node.node_id in errors else "") + ")"
                for node in pending
            )
            raise ShardlineTimeoutError(
                f"checkpoint of job {job!r} not durable on every holder within {timeout:g} s: not durable on {late}"
            )
        asked = {node.node_id: targets[node.node_id] for node in pending}
        replies = fan_out(executor, lambda node: caller.checkpoint(node, job, asked[node.node_id], remaining), pending)
        failed = False
        for node_id, reply in sorted(replies.items()):
            target = asked[node_id]
            if isinstance(reply, NodeCallError) and reply.code == "NOT_FOUND":
                del holders[node_id]  # dropped or moved away since its status
                durable.pop(node_id, None)
                continue
            if isinstance(reply, NodeCallError) and reply.code in PERMANENT_CODES:
                raise ShardlineStateError(f"cannot checkpoint job {job!r} at step {target}: {reply}")
            if isinstance(reply, Exception):
                errors[node_id], failed = str(reply), True
                continue
            errors.pop(node_id, None)
            step = int(reply.step)
            known[node_id] = max(known[node_id], step)
            if not reply.past and step == target:
                durable[node_id] = step
            elif step > target:  # past T: aim at the step it reached
                if asp:
                    targets[node_id] = step
                else:
                    targets = dict.fromkeys(targets, max(step, *targets.values()))
            else:
                errors[node_id], failed = f"replied step {step} (past={reply.past}) when asked for {target}", True
        if not holders:
            raise ShardlineStateError(f"no PS node holds job {job!r} (the holders dropped it during the checkpoint)")
        targets = {node_id: step for node_id, step in targets.items() if node_id in holders}
        if failed:
            sleep(max(0.0, min(RETRY_DELAY_SECONDS, deadline - clock())))
    return CheckpointResult(step=min(durable[node_id] for node_id in holders), nodes=sorted(holders))
