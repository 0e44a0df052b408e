"""Who a BSP step waits for: the ranks that have not committed it, and the PS nodes waiting for them.

A worker whose pull of step ``v + 1`` still waits after ``straggler_warning_seconds`` asks every PS
node of the routing table over gRPC (``GetCommits(job, v)`` and ``GetNodeStatus``) which ranks'
commits of ``v`` it holds; :func:`straggler_report` turns the answers into a report that the
WARNING and the pull timeout's error print. The dispatcher's worker leases (``lease_text``) add
what is known of each missing rank: never connected, alive at some step, or lost since when.
``shardline status`` uses ``lease_text`` for its per-rank table too.

The pure part (``straggler_report``, ``lease_text``) needs no network; ``ask_commits`` does the calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeCommits:
    """One PS node's answer: its job step (None: it did not answer) and the ranks whose commit of
    the step asked about it holds."""

    node_id: str
    step: int | None
    ranks: frozenset[int] = frozenset()


@dataclass(frozen=True)
class StragglerReport:
    step: int                                   # the step being collected
    missing: tuple[int, ...]                    # ranks some waiting node has no commit from
    waiting: dict[str, tuple[int, ...]] = field(default_factory=dict)  # node -> ranks it waits for
    complete: tuple[str, ...] = ()              # nodes with every commit that have not applied the step yet
    unreachable: tuple[str, ...] = ()           # nodes that did not answer
    ranks: dict[int, str] = field(default_factory=dict)  # what the dispatcher knows of each missing rank

    def describe(self) -> str:
        """One line: who has not committed, which nodes wait for whom, what is known of the ranks."""
        parts = []
        if self.missing:
            groups: dict[tuple[int, ...], list[str]] = {}
            for node, ranks in sorted(self.waiting.items()):
                groups.setdefault(ranks, []).append(node)
            text = f"ranks {list(self.missing)} did not commit step {self.step}"
            if len(groups) == 1:
                (nodes,) = groups.values()
                text += f" (PS node{'s' if len(nodes) > 1 else ''} {', '.join(nodes)} wait{'' if len(nodes) > 1 else 's'} for them)"
            else:
                text += " (" + "; ".join(f"{', '.join(nodes)} wait{'' if len(nodes) > 1 else 's'} for ranks {list(ranks)}"
                                         for ranks, nodes in sorted(groups.items())) + ")"
            parts.append(text)
            known = [f"rank {rank}: {self.ranks[rank]}" for rank in self.missing if rank in self.ranks]
            if known:
                parts.append("; ".join(known))
        if self.complete:
            parts.append(f"PS node{'s' if len(self.complete) > 1 else ''} {', '.join(self.complete)} "
                         f"{'hold' if len(self.complete) > 1 else 'holds'} every commit of step {self.step} but "
                         f"{'have' if len(self.complete) > 1 else 'has'} not applied it yet (waiting for replicas "
                         f"or a block handover)")
        if self.unreachable:
            parts.append(f"PS node{'s' if len(self.unreachable) > 1 else ''} {', '.join(self.unreachable)} "
                         f"did not answer")
        return "; ".join(parts) if parts else (
            f"every PS node applied step {self.step}; the blocks waited for are not visible yet: their copy "
            f"holders have not acknowledged or synced it (a PS node's log says which)")


def straggler_report(step: int, world_size: int, answers: list[NodeCommits],
                     ranks: dict[int, str] | None = None) -> StragglerReport:
    """The report of a BSP ``step`` of a job of ``world_size`` ranks from the nodes' ``answers``.
    Nodes already past ``step`` are done and left out. ``ranks``: what is known of each rank."""
    everyone = frozenset(range(world_size))
    waiting: dict[str, tuple[int, ...]] = {}
    complete, unreachable = [], []
    for answer in answers:
        if answer.step is None:
            unreachable.append(answer.node_id)
        elif answer.step <= step:
            absent = tuple(sorted(everyone - answer.ranks))
            if absent:
                waiting[answer.node_id] = absent
            else:
                complete.append(answer.node_id)
    missing = tuple(sorted({r for absent in waiting.values() for r in absent}))
    known = {r: text for r, text in (ranks or {}).items() if r in missing}
    return StragglerReport(step, missing, waiting, tuple(sorted(complete)), tuple(sorted(unreachable)), known)


def lost_for_seconds(lease, now_unix_ms: float) -> float | None:
    """Seconds since a lost ``lease`` (a WorkerLease) was declared lost; None if it is not lost."""
    if lease.state != "lost" or not lease.lost_unix_ms:
        return None
    return max(0.0, (now_unix_ms - lease.lost_unix_ms) / 1000)


def lease_text(lease, now_unix_ms: float | None = None) -> str:
    """What the dispatcher's lease (a WorkerLease) says of a rank: ``alive, at step 3, heartbeat
    0.4 s ago``, ``lost 12 s ago (last at step 3, ...)``, ``never connected``."""
    age = lease.age_seconds
    if not lease.incarnation:
        return "never connected" + (f" (lost: no heartbeat for {age:.0f} s)" if lease.state == "lost" else "")
    if lease.state == "lost":
        lost_for = lost_for_seconds(lease, time.time() * 1000 if now_unix_ms is None else now_unix_ms)
        ago = f" {lost_for:.0f} s ago" if lost_for is not None else ""
        return f"lost{ago} (last at step {lease.step}, last heartbeat {age:.0f} s ago)"
    return f"{lease.state}, at step {lease.step}, heartbeat {age:.1f} s ago"


def ask_commits(nodes: dict[str, str], job: str, step: int, *, cluster_token: bytes | None = None,
                tls_ca: bytes | None = None, timeout: float = 2.0) -> list[NodeCommits]:
    """Ask each node (node id -> gRPC address) for its commits of ``job``'s ``step`` and then its
    job step. A node that does not hold the job is left out; one that does not answer has step None."""
    import grpc

    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2, ps_pb2_grpc

    answers = []
    for node_id, address in sorted(nodes.items()):
        try:
            with grpc_channel(address, cluster_token, tls_ca=tls_ca) as channel:
                stub = ps_pb2_grpc.ParameterServerStub(channel)
                commits = stub.GetCommits(ps_pb2.GetCommitsRequest(job=job, step=step), timeout=timeout)
                # after the commits: a step applied in between shows as done, not as nobody committed
                status = stub.GetNodeStatus(ps_pb2.GetNodeStatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                continue
            answers.append(NodeCommits(node_id, None))
            continue
        node_step = next((int(j.step) for j in status.jobs if j.job == job), None)
        if node_step is None:
            continue
        answers.append(NodeCommits(node_id, node_step, frozenset(int(c.rank) for c in commits.commits)))
    return answers
