"""Whether a job's copy holders replay gradients, decided from the PS nodes' build fingerprints
(docs/architecture.md, "Replication", "The default and build fingerprints").

Replaying gradients (``JobSpec.replicate_gradients``) sends a copy holder the mean gradient its
primary stepped a block with, and the holder runs the same step: a third of the bytes of a copy
of value and state for Adam, exact only if every PS node steps bit for bit alike. Nodes report a
build fingerprint (services/build_fingerprint.py); two nodes of one fingerprint compute alike.

Rules, pure (the dispatcher's servicer applies them under one lock with membership and jobs):

* ``resolve`` (a job being created): a spec that leaves ``replicate_gradients`` unset gets it
  decided: true for BSP and SSP when every live node reports one same fingerprint (or no node is
  live yet), false otherwise — ASP (it steps a block again at every push: copies), nodes of
  different fingerprints, or a node that reports none (not detected: not assumed). A spec that
  asks for replay (true, BSP or SSP) on a cluster of different fingerprints is refused with
  ShardlineConfigError naming the nodes and fingerprints; ``true`` on an ASP job is kept as asked
  and means copies (as before the default). False stays false. A job of one copy per block
  (``replication`` 1, resolved before) that leaves it unset gets false: no holder would replay,
  and a primary that replays keeps each step's mean gradient for them (4 bytes per parameter).
* ``check_registration`` (a node registering): while a job replays gradients, a node whose
  fingerprint differs from one a live node reported is refused (ShardlineConfigError naming
  both), so a replaying job never gets a copy holder that would step differently. With no
  replaying job every node may register. A fingerprint not known is compared with none: a node
  that reports none (an older build), and live nodes the dispatcher restored from its state,
  which report theirs with their next registration or heartbeat (until then a restarted
  dispatcher would refuse the cluster's own nodes).
"""

from __future__ import annotations

from typing import Mapping

from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2

REPLAYING_SYNCS = ("bsp", "ssp")
UNREPORTED = "(none reported)"


def replays(spec: common_pb2.JobSpec) -> bool:
    """Whether a (resolved) job's copy holders replay its steps: asked for, and BSP or SSP."""
    return spec.replicate_gradients and spec.sync in REPLAYING_SYNCS


def copies_by_default(spec: common_pb2.JobSpec) -> bool:
    """A BSP or SSP job with copy holders that could replay but was decided to copies."""
    return not spec.replicate_gradients and spec.sync in REPLAYING_SYNCS and spec.replication != 1


def describe(fingerprints: Mapping[str, str]) -> str:
    """``node=fingerprint`` of each node, grouped by fingerprint, for an error or a log line."""
    by_print: dict[str, list[str]] = {}
    for node, fingerprint in sorted(fingerprints.items()):
        by_print.setdefault(fingerprint or UNREPORTED, []).append(node)
    return "; ".join(f"{', '.join(nodes)}: {fingerprint}" for fingerprint, nodes in sorted(by_print.items()))


def mixed(fingerprints: Mapping[str, str]) -> bool:
    """The nodes do not all report one same fingerprint (one that reports none counts as different)."""
    distinct = set(fingerprints.values())
    return len(distinct) > 1 or "" in distinct


def resolve(spec: common_pb2.JobSpec, fingerprints: Mapping[str, str]) -> tuple[common_pb2.JobSpec, str]:
    """``spec`` with ``replicate_gradients`` decided (a copy; the rules in the module docstring),
    and why, for the log ("" when the spec said). ``fingerprints``: live node id -> fingerprint.
    Raises ShardlineConfigError for replay asked for on nodes of different fingerprints."""
    out = common_pb2.JobSpec()
    out.CopyFrom(spec)
    if out.HasField("replicate_gradients"):
        if replays(out) and mixed(fingerprints):
            raise ShardlineConfigError(
                f"job {out.name!r} asks for replicate_gradients, which needs every PS node to compute an optimizer "
                f"step bit for bit alike, but the nodes report different build fingerprints ({describe(fingerprints)}); "
                f"run one torch build on every node, or create the job with replicate_gradients=False (copies)")
        return out, ""
    if out.sync not in REPLAYING_SYNCS:
        out.replicate_gradients = False
        return out, f"sync {out.sync!r} replicates copies"
    if out.replication == 1:
        out.replicate_gradients = False
        return out, "one copy of each block (replication 1): no copy holder to replay to"
    if mixed(fingerprints):
        out.replicate_gradients = False
        return out, f"the PS nodes report different build fingerprints ({describe(fingerprints)}): copies"
    out.replicate_gradients = True
    return out, "replaying gradients (every PS node reports one build fingerprint)"


def check_registration(node_id: str, fingerprint: str, others: Mapping[str, str], replaying: list[str]) -> None:
    """Refuse ``node_id`` (ShardlineConfigError) if jobs ``replaying`` exist and its ``fingerprint``
    differs from one a live node reported (``others``: live node id -> fingerprint, "" for none
    known, the node itself left out)."""
    if not replaying or not fingerprint:
        return
    if all(fp == fingerprint for fp in others.values() if fp):
        return
    problem = f"has build fingerprint {fingerprint!r}" if fingerprint else "reports no build fingerprint"
    names = ", ".join(repr(name) for name in sorted(replaying)[:4]) + (" ..." if len(replaying) > 4 else "")
    raise ShardlineConfigError(
        f"node {node_id!r} {problem}, but the cluster's live nodes have {describe(others) or 'none'} and job(s) {names} "
        f"replay gradients, which needs every PS node to compute an optimizer step bit for bit alike; run this "
        f"node with the cluster's torch build, or delete those jobs")
