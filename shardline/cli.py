"""``shardline``: the operator CLI.

    shardline up [--ps 2] [--workers 2] [--job examples/demo_job.yaml] [--workdir DIR] [--keep-logs]
    shardline status --cluster HOST:PORT[,HOST:PORT...] [--json] [--hot [--limit N] [--job NAME]]
    shardline checkpoint --cluster HOST:PORT --job NAME
    shardline export (--cluster HOST:PORT | --checkpoint-dir DIR ...) --job NAME --out FILE [--dtype bf16]
    shardline export (--cluster HOST:PORT | --checkpoint-dir DIR ...) --job NAME --hf-dir OUT --from-model DIR
                     [--job-file FILE | --lora-alpha X --lora-dropout P] [--dtype bf16]
    shardline job delete --cluster HOST:PORT NAME
    shardline drain --cluster HOST:PORT NODE_ID

``up`` runs a whole cluster on this machine (127.0.0.1): one dispatcher, ``--ps`` PS nodes and
``--workers`` workers training the job file, as real daemons under a :class:`LocalCluster`. It
streams rank 0's output (progress, loss, tokens/s, version), prints a summary (per worker: status,
steps, final loss, tokens/s; per node: blocks, bytes, share of the ring; rank 0's accuracy and
before/after sample answers) and shuts everything down, also on Ctrl-C and when a daemon fails.
Every daemon and worker gets a cluster token: ``--cluster-token-file``, else a new random one in
``<workdir>/cluster.token`` (0600) whose path it prints (``SHARDLINE_CLUSTER_TOKEN_FILE``).
Exit codes: 0 done, 1 a daemon failed or timed out, 2 bad arguments, 130 interrupted.

``status`` asks a dispatcher for its cluster status: nodes (id, rack, address, state, heartbeat
age, blocks, bytes, virtual nodes, share of the key space), the ring epoch, jobs (name, sync,
world size, tensors, parameters, ready), each job's ranks (alive, lost or never connected, the
step each last reported and how long ago) and how the cluster is secured (token, TLS; daemons
running ``allow_insecure`` come first, as WARNING lines), as tables or, with ``--json``, as one
JSON object. ``status --hot`` shows the dispatcher's access heatmap instead: the hottest blocks
(job, tensor, block, node, reads/s, writes/s, bytes/s, share of all accesses) and each serving
node's load (bytes/s in and out, pulls/s, apply seconds per second, share). Every command takes ``--cluster-token-file`` and ``--tls-ca-file`` (default
``$SHARDLINE_CLUSTER_TOKEN_FILE``, ``$SHARDLINE_TLS_CA_FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from shardline.services.errors import ShardlineConfigError, ShardlineError

PROG = "shardline"
_PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JOB = "examples/demo_job.yaml"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


# -- formatting helpers ---------------------------------------------------------------------------

def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_rate(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.1f}"


def format_table(headers: list[str], rows: list[list[Any]], right: set[int] | None = None) -> str:
    """A plain-text table; columns whose index is in ``right`` are right-aligned."""
    right = right or set()
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


# -- status ---------------------------------------------------------------------------------------

def node_reports(status, timeout: float, cluster_token: bytes | None = None, tls_ca: bytes | None = None) -> dict:
    """Ask every alive PS node for its status (``GetNodeStatus``): {node_id: NodeStatus}
    (unreachable nodes left out). The dispatcher does not see training progress nor memory; the
    nodes that hold the blocks do."""
    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2, ps_pb2_grpc

    reports = {}
    for n in status.all_nodes:
        if n.state != "alive":
            continue
        try:
            with grpc_channel(n.grpc_address, cluster_token, tls_ca=tls_ca) as channel:
                reports[n.node_id] = ps_pb2_grpc.ParameterServerStub(channel).GetNodeStatus(
                    ps_pb2.GetNodeStatusRequest(), timeout=timeout)
        except Exception:  # noqa: BLE001 - a node that cannot answer is shown without progress
            continue
    return reports


def node_progress(reports: dict) -> dict[str, dict[str, int]]:
    """{node_id: {job: step}} of ``node_reports``."""
    return {node: {j.job: int(j.step) for j in reply.jobs} for node, reply in reports.items()}


def node_memory(reports: dict) -> dict[str, dict]:
    """{node_id: {"rss_bytes", "anon_bytes", "receive_buffer_bytes", "jobs": {job: {"parameters",
    "bytes": {kind: bytes}}}}} of ``node_reports`` (ps_server/store/memory.py names the kinds)."""
    return {node: {"rss_bytes": int(reply.rss_bytes), "anon_bytes": int(reply.anon_bytes),
                   "receive_buffer_bytes": int(reply.receive_buffer_bytes),
                   "jobs": {j.job: {"parameters": int(j.parameters), "bytes": {m.kind: int(m.bytes) for m in j.memory}}
                            for j in reply.jobs}}
            for node, reply in reports.items()}


def status_dict(status, cluster: str, progress: dict[str, dict[str, int]] | None = None,
                memory: dict[str, dict] | None = None) -> dict:
    """A JSON-ready view of a ClusterStatus (protobuf), the nodes' job steps (``node_progress``)
    and their memory (``node_memory``).

    A job's ``step`` is the lowest step over the nodes that hold it (BSP nodes agree; under ASP
    each node counts its own updates, see ``steps_by_node``).
    """
    progress = progress or {}
    from shardline.services.ring import HashRing
    from shardline.services.stragglers import lost_for_seconds

    vnodes = {n.node_id: int(n.vnodes) for n in status.routing.nodes if n.vnodes > 0}
    share = HashRing(vnodes).share() if vnodes else {}
    nodes = []
    for n in status.all_nodes:
        nodes.append({
            "node_id": n.node_id, "rack": n.rack, "grpc": n.grpc_address, "data": n.data_address,
            "state": n.state, "member": n.member or None, "capacity": n.capacity, "vnodes": int(n.vnodes),
            "heartbeat_age_seconds": round(n.heartbeat_age_seconds, 3), "blocks": int(n.blocks), "bytes": int(n.bytes),
            "key_share": share.get(n.node_id, 0.0), "insecure": bool(n.insecure),
            "build_fingerprint": n.build_fingerprint or None,   # who steps alike (replaying gradients)
            "not_ready": n.not_ready or None,   # during a ring change: why it still waits for this node
        })
    jobs = []
    for j in status.jobs:
        params = 0
        for t in j.spec.tensors:
            numel = 1
            for d in t.shape:
                numel *= int(d)
            params += numel
        steps = {node: jobs_on_node[j.spec.name] for node, jobs_on_node in sorted(progress.items())
                 if j.spec.name in jobs_on_node}
        now_ms = time.time() * 1000
        workers = []
        for w in status.workers:
            if w.job == j.spec.name:
                lost_for = lost_for_seconds(w, now_ms)
                workers.append({"rank": int(w.rank), "state": w.state, "incarnation": w.incarnation,
                                "connected": bool(w.incarnation), "step": int(w.step),
                                "heartbeat_age_seconds": round(w.age_seconds, 3),
                                "lost_for_seconds": round(lost_for, 1) if lost_for is not None else None})
        jobs.append({
            "name": j.spec.name, "sync": j.spec.sync, "staleness": int(j.spec.staleness) or None,  # None: not SSP
            "world_size": int(j.spec.world_size),
            "step": min(steps.values()) if steps else None, "steps_by_node": steps,
            "uid": j.uid, "checkpoint_step": int(j.checkpoint_step) if j.has_checkpoint else None,
            "durable_steps": {node: int(step) for node, step in sorted(j.durable_steps.items())},
            "optimizer": j.spec.optimizer.kind, "tensors": len(j.spec.tensors), "parameters": params,
            "ready": bool(j.ready), "created_unix_ms": int(j.created_unix_ms),
            "replication": int(j.spec.replication) or None, "on_worker_failure": j.spec.on_worker_failure or "wait",
            "compression": j.spec.compression or "none",  # empty: a job made before the option
            # topology-aware placement: the rack one copy of each block is kept on (None: none)
            "reader_rack": status.routing.reader_racks.get(j.spec.name) or None,
            # the reader rack under a pending ring change when it differs ("": none), else None
            "reader_rack_change": _reader_rack_change(status.routing, j.spec.name),
            "workers": workers, "missing_ranks": sorted(w["rank"] for w in workers if w["state"] == "lost"),
        })
    return {
        "cluster": cluster, "epoch": int(status.routing.epoch),
        "leader": status.leader or None,  # None: a single dispatcher (no election)
        "dispatchers": [{"address": d.address, "role": d.role} for d in status.dispatchers],
        "alive_nodes": sum(1 for n in nodes if n["state"] == "alive"),
        "pending_epoch": int(status.routing.pending_epoch) or None,  # a ring change in progress
        "nodes": nodes, "jobs": jobs, "memory": memory or {},
        "caches": [{"cache_id": c.cache_id, "rack": c.rack, "data": c.data_address, "grpc": c.grpc_address,
                    "capacity_bytes": int(c.capacity_bytes), "resident_bytes": int(c.resident_bytes),
                    "hits": int(c.hits), "misses": int(c.misses),
                    "heartbeat_age_seconds": round(c.heartbeat_age_seconds, 3)} for c in status.routing.caches],
        # how the dispatcher that answered is secured, and which alive PS nodes run exposed without a token
        "security": {"insecure": bool(status.insecure), "cluster_token": bool(status.cluster_token),
                     "tls": bool(status.tls),
                     "insecure_nodes": [n["node_id"] for n in nodes if n["insecure"] and n["state"] == "alive"]},
    }


def _reader_rack_change(routing, job: str) -> str | None:
    serving = routing.reader_racks.get(job, "")
    pending = routing.pending_reader_racks.get(job, "") if routing.pending_epoch else serving
    return pending if pending != serving else None


def security_lines(security: dict) -> tuple[list[str], str]:
    """How the cluster is secured, for ``status``: (WARNING lines for what runs insecure, one summary line)."""
    warnings = []
    if security.get("insecure"):
        warnings.append("WARNING: INSECURE: the dispatcher serves a non-loopback address without a cluster token "
                        "(allow_insecure): anyone who reaches it can read and change every job")
    if security.get("insecure_nodes"):
        warnings.append(f"WARNING: INSECURE: PS node(s) {', '.join(security['insecure_nodes'])} serve non-loopback "
                        f"addresses without a cluster token (allow_insecure)")
    if security.get("cluster_token"):
        auth = "cluster token"
    else:
        auth = "NONE" if security.get("insecure") else "none (loopback only)"
    return warnings, f"security: authentication {auth}, gRPC {'TLS' if security.get('tls') else 'plaintext'}"


def render_status(data: dict) -> str:
    warnings, summary = security_lines(data.get("security", {}))
    lines = warnings + [f"cluster {data['cluster']}: ring epoch {data['epoch']}, "
                        f"{data['alive_nodes']}/{len(data['nodes'])} PS node(s) alive, {len(data['jobs'])} job(s)",
                        summary]
    if data.get("leader"):
        others = ", ".join(f"{d['address']} ({d['role']})" for d in data.get("dispatchers", []))
        lines.append(f"leader {data['leader']}" + (f"; dispatchers: {others}" if others else ""))
    if data.get("pending_epoch"):
        moving = ", ".join(f"{n['node_id']} {n['member']}" for n in data["nodes"] if n.get("member") in ("joining", "draining"))
        lines.append(f"ring change in progress (pending epoch {data['pending_epoch']}): {moving}")
        waiting = [f"{n['node_id']} {n['not_ready']}" for n in data["nodes"] if n.get("not_ready")]
        lines.append("  waiting for: " + ("; ".join(waiting) if waiting else "none (it switches at the next heartbeat)"))
    if data["nodes"]:
        rows = [[n["node_id"], n["rack"], n["grpc"], n["data"],
                 n["state"] if n["state"] != "alive" or n.get("member") in (None, "serving") else n["member"],
                 f"{n['heartbeat_age_seconds']:.1f}s",
                 n["blocks"], human_bytes(n["bytes"]), n["vnodes"], f"{100 * n['key_share']:.1f}%"]
                for n in data["nodes"]]
        lines += ["", "nodes:", format_table(
            ["NODE", "RACK", "ADDRESS", "DATA", "STATE", "HEARTBEAT", "BLOCKS", "BYTES", "VNODES", "KEY SHARE"],
            rows, right={5, 6, 7, 8, 9})]
    else:
        lines += ["", "nodes: none registered"]
    for c in data.get("caches", []):  # one line per rack cache (L2)
        lookups = c["hits"] + c["misses"]
        hit_rate = f"{100 * c['hits'] / lookups:.0f}% hits" if lookups else "no pulls yet"
        lines.append(f"rack cache {c['cache_id']}: rack {c['rack']}, data {c['data']}, "
                     f"{human_bytes(c['resident_bytes'])} of {human_bytes(c['capacity_bytes'])}, {hit_rate}, "
                     f"heartbeat {c['heartbeat_age_seconds']:.1f}s")
    memory = render_memory(data.get("memory") or {})
    if memory:
        lines += ["", "memory:", memory]
    if data["jobs"]:
        rows = [[j["name"], f"ssp, s={j['staleness']}" if j.get("staleness") else j["sync"], j["optimizer"], j["world_size"], "-" if j["step"] is None else j["step"],
                 "-" if j.get("checkpoint_step") is None else j["checkpoint_step"],
                 j["tensors"], f"{j['parameters']:,}", "yes" if j["ready"] else "no", j.get("compression", "none")]
                for j in data["jobs"]]
        lines += ["", "jobs:", format_table(["JOB", "SYNC", "OPTIMIZER", "WORLD", "STEP", "CHECKPOINT", "TENSORS",
                                             "PARAMS", "READY", "COMPRESSION"], rows, right={3, 4, 5, 6, 7})]
        workers = render_workers(data["jobs"])
        if workers:
            lines += ["", "workers:", workers]
        for j in data["jobs"]:
            change = j.get("reader_rack_change")
            if j.get("reader_rack") or change is not None:
                lines.append(f"job {j['name']}: reader rack {j.get('reader_rack') or 'none'}"
                             + (f" (moving to {change or 'none'})" if change is not None else ""))
            for w in j.get("workers", []):
                if w["state"] == "lost":
                    lines.append(f"job {j['name']}: rank {w['rank']} missing for {w['lost_for_seconds']:.0f} s "
                                 f"(last at step {w['step']}; on_worker_failure: {j['on_worker_failure']})")
    else:
        lines += ["", "jobs: none"]
    return "\n".join(lines)


# ``shardline status``'s short names of the memory kinds (ps_server/store/memory.py).
MEMORY_COLUMNS = {"values": "VALUES", "optimizer_state": "OPT STATE", "gradients": "GRADS", "parked_gradients": "PARKED",
                  "replay_spares": "SPARES", "kept_values": "KEPT", "staging": "STAGING", "held_copies": "HELD",
                  "delta_history": "DELTAS", "frozen_files": "IN FILES"}
# Kinds kept in files (the page cache), not the process's memory: out of TOTAL and B/PARAM.
FILE_KINDS = ("frozen_files",)


def in_memory(by_kind: dict) -> int:
    """Bytes of the kinds a PS node holds in memory (frozen values in files are the page cache)."""
    return sum(v for k, v in by_kind.items() if k not in FILE_KINDS)


def render_memory(memory: dict[str, dict]) -> str:
    """Each node's resident memory and each job's bytes on it by kind (kinds no row holds left
    out), with bytes per parameter held (of memory: frozen values in files are a column of their
    own, not in TOTAL). '' if no node reported."""
    if not memory:
        return ""
    kinds = [k for k in MEMORY_COLUMNS if any(j["bytes"].get(k) for n in memory.values() for j in n["jobs"].values())]
    node_rows, job_rows = [], []
    for node, report in sorted(memory.items()):
        accounted = sum(in_memory(j["bytes"]) for j in report["jobs"].values())
        node_rows.append([node, human_bytes(report["rss_bytes"]), human_bytes(report["anon_bytes"]),
                          human_bytes(accounted), human_bytes(report["receive_buffer_bytes"])])
        for job, j in sorted(report["jobs"].items()):
            total = in_memory(j["bytes"])
            per = f"{total / j['parameters']:.1f}" if j["parameters"] else "-"
            job_rows.append([node, job, f"{j['parameters']:,}", *(human_bytes(j["bytes"].get(k, 0)) for k in kinds),
                             human_bytes(total), per])
    text = format_table(["NODE", "RSS", "ANONYMOUS", "JOBS' TENSORS", "RECEIVE BUFFERS"], node_rows,
                        right={1, 2, 3, 4})
    if job_rows:
        text += "\n\n" + format_table(["NODE", "JOB", "PARAMS", *(MEMORY_COLUMNS[k] for k in kinds), "TOTAL", "B/PARAM"],
                                       job_rows, right=set(range(2, len(kinds) + 5)))
    return text


def render_workers(jobs: list[dict]) -> str:
    """Each job's ranks (0..world_size-1) as the dispatcher's leases see them: state, the step a
    worker last reported and how long ago it did. '' if no job has a lease."""
    rows = []
    for j in jobs:
        by_rank = {w["rank"]: w for w in j.get("workers", [])}
        if not by_rank:
            continue
        for rank in range(max(j["world_size"], max(by_rank) + 1)):
            w = by_rank.get(rank)
            if w is None:  # released (finished or stopped), or not seen by this dispatcher (a new leader)
                rows.append([j["name"], rank, "no lease", "-", "-", "finished, or not seen since this dispatcher started"])
                continue
            if not w.get("connected", True):
                state, step, seen = ("lost" if w["state"] == "lost" else "waiting"), "-", "never"
                note = "never connected"
            else:
                state, step, seen, note = w["state"], w["step"], f"{w['heartbeat_age_seconds']:.1f}s ago", ""
            rows.append([j["name"], rank, state, step, seen, note])
    if not rows:
        return ""
    return format_table(["JOB", "RANK", "STATE", "STEP", "LAST HEARTBEAT", "NOTE"], rows, right={1, 3, 4})


class _UsageError(Exception):
    """Bad command-line input: the message is printed and the exit code is 2."""


def _connect_dispatcher(args: argparse.Namespace):
    """A DispatcherClient for ``--cluster`` (or $SHARDLINE_CLUSTER: one dispatcher or several,
    comma-separated) with the cluster token and TLS CA, once one of them answers as the leader;
    sets ``args.token`` and ``args.tls_ca``. Raises _UsageError (bad input) or ShardlineError (unreachable)."""
    from shardline.services.auth import load_token
    from shardline.services.config import parse_address_list
    from shardline.services.dispatcher_client import DispatcherClient
    from shardline.services.security import load_ca

    cluster = args.cluster or os.environ.get("SHARDLINE_CLUSTER")
    if not cluster:
        raise _UsageError("--cluster HOST:PORT[,HOST:PORT...] (the dispatchers) is required")
    try:
        cluster = ",".join(parse_address_list(cluster, what="--cluster"))
        token = load_token(args.cluster_token_file)
        tls_ca = load_ca(args.tls_ca_file)
    except ShardlineConfigError as exc:
        raise _UsageError(str(exc)) from None
    client = DispatcherClient(cluster, rpc_timeout=args.timeout, cluster_token=token, tls_ca=tls_ca)
    try:
        client.wait_until_reachable(args.timeout, timeout_name="--timeout")
    except ShardlineError:
        client.close()
        raise
    args.cluster, args.token, args.tls_ca = cluster, token, tls_ca
    return client


def _run_command(name: str, body, args: argparse.Namespace) -> int:
    """Run ``body(args)`` with the CLI's error conventions: usage errors exit 2, Shardline errors 1."""
    try:
        return body(args)
    except _UsageError as exc:
        print(f"{PROG} {name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ShardlineError as exc:
        print(f"{PROG} {name}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def hot_dict(heat, cluster: str) -> dict:
    """A HeatMap (GetHotShards) as plain data, for ``status --hot``."""
    return {
        "cluster": cluster, "epoch": int(heat.epoch), "half_life_seconds": heat.half_life_seconds,
        "accesses_per_second": heat.accesses_per_second,
        "rebalance_interval_seconds": heat.rebalance_interval_seconds or None,   # None: rebalancing off
        "last_rebalance": heat.last_rebalance or None,
        "shards": [{"job": s.job, "tensor": s.tensor, "block": int(s.block), "node": s.node,
                    "reads_per_second": s.reads_per_second, "writes_per_second": s.writes_per_second,
                    "bytes_per_second": s.bytes_per_second, "share": s.share} for s in heat.shards],
        "nodes": [{"node_id": n.node_id, "rack": n.rack, "bytes_in_per_second": n.bytes_in_per_second,
                   "bytes_out_per_second": n.bytes_out_per_second, "pulls_per_second": n.pulls_per_second,
                   "pushes_per_second": n.pushes_per_second, "apply_seconds_per_second": n.apply_seconds_per_second,
                   "share": n.share} for n in heat.nodes],
    }


def render_hot(data: dict) -> str:
    rebalance = (f"every {data['rebalance_interval_seconds']:g} s" if data["rebalance_interval_seconds"]
                 else "off")
    lines = [f"cluster {data['cluster']}  epoch {data['epoch']}  heat half-life {data['half_life_seconds']:g} s  "
             f"{human_rate(data['accesses_per_second'])} block accesses/s  rebalancing {rebalance}"]
    if data["last_rebalance"]:
        lines.append(f"last rebalance: {data['last_rebalance']}")
    lines += ["", "hottest shards:"]
    if data["shards"]:
        lines.append(format_table(
            ["job", "tensor", "block", "node", "reads/s", "writes/s", "bytes/s", "share"],
            [[s["job"], s["tensor"], s["block"], s["node"], human_rate(s["reads_per_second"]),
              human_rate(s["writes_per_second"]), human_bytes(s["bytes_per_second"]) + "/s",
              f"{100 * s['share']:.1f}%"] for s in data["shards"]], right={2, 4, 5, 6, 7}))
    else:
        lines.append("(no accesses reported yet)")
    lines += ["", "node load:", format_table(
        ["node", "rack", "in/s", "out/s", "pulls/s", "pushes/s", "apply s/s", "share"],
        [[n["node_id"], n["rack"], human_bytes(n["bytes_in_per_second"]) + "/s",
          human_bytes(n["bytes_out_per_second"]) + "/s", human_rate(n["pulls_per_second"]),
          human_rate(n["pushes_per_second"]), f"{n['apply_seconds_per_second']:.3f}", f"{100 * n['share']:.1f}%"]
         for n in data["nodes"]], right={2, 3, 4, 5, 6, 7})]
    return "\n".join(lines)


def _status_hot(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise _UsageError(f"--limit must be >= 0, got {args.limit!r}")
    with _connect_dispatcher(args) as client:
        data = hot_dict(client.hot_shards(args.limit, args.job or ""), args.cluster)
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_hot(data))
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    if args.hot:
        return _status_hot(args)
    with _connect_dispatcher(args) as client:
        status = client.cluster_status()
    reports = node_reports(status, args.timeout, args.token, args.tls_ca)
    data = status_dict(status, args.cluster, node_progress(reports), node_memory(reports))
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_status(data))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    return _run_command("status", _status, args)


def _checkpoint(args: argparse.Namespace) -> int:
    with _connect_dispatcher(args) as client:
        started = time.monotonic()
        reply = client.checkpoint_job(args.job, args.wait)
    print(f"job {args.job}: step {reply.step} durable on {len(reply.nodes)} node(s) ({', '.join(reply.nodes)}) "
          f"in {time.monotonic() - started:.2f} s")
    return EXIT_OK


def cmd_checkpoint(args: argparse.Namespace) -> int:
    return _run_command("checkpoint", _checkpoint, args)


def _job_delete(args: argparse.Namespace) -> int:
    with _connect_dispatcher(args) as client:
        reply = client.delete_job(args.name)
    if reply is None:
        raise ShardlineError(f"no job named {args.name!r}")
    pending = f"; pending on {', '.join(reply.pending_on)} (dropped when they next heartbeat)" if reply.pending_on else ""
    print(f"job {args.name} (uid {reply.uid}) deleted: blocks and checkpoints dropped on "
          f"{', '.join(reply.dropped_on) or 'no node'}{pending}")
    return EXIT_OK


def _drain(args: argparse.Namespace) -> int:
    with _connect_dispatcher(args) as client:
        reply = client.drain_node(args.node_id)
        print(f"draining {args.node_id}: its blocks move to the other nodes (pending ring of epoch {reply.epoch})",
              flush=True)
        if args.no_wait:
            return EXIT_OK
        deadline = time.monotonic() + args.wait
        while True:
            status = client.cluster_status()
            node = next((n for n in status.all_nodes if n.node_id == args.node_id), None)
            if node is None or node.state != "alive":
                raise ShardlineError(f"node {args.node_id!r} is gone ({'unknown' if node is None else node.state}) "
                                     f"before its drain completed")
            if node.member == "drained":
                print(f"{args.node_id} drained at epoch {status.routing.epoch}: it holds no blocks any more and "
                      f"can be stopped")
                return EXIT_OK
            if node.member == "serving":
                raise ShardlineError(f"the drain of {args.node_id!r} was called off (another node stopped)")
            if time.monotonic() > deadline:
                raise ShardlineError(f"{args.node_id!r} is still draining after {args.wait:g} s (nodes still "
                                     f"bringing its blocks in sync); see shardline status")
            time.sleep(0.2)


def cmd_fit_cost(args: argparse.Namespace) -> int:
    """Time the job's model on this machine and print the train.cost line for length balancing."""
    import platform
    import torch

    from shardline.jobs.cost_fit import cost_line, fit_cost
    from shardline.jobs.spec import load_job

    try:
        spec = load_job(args.job)
        torch.set_num_threads(args.threads)
        cost, lengths = fit_cost(spec, repeats=args.repeats)
    except ShardlineError as exc:
        print(f"shardline fit-cost: error: {exc}", file=sys.stderr)
        return 2
    print(f"# fitted on {platform.node()} ({args.threads} torch thread(s)): one forward+backward of job "
          f"{spec.name}'s model per sequence of {lengths[0]}..{lengths[-1]} tokens, fastest of {args.repeats}")
    print(f"# put under train: (with balance: tokens)\n{cost_line(cost)}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    return _run_command("drain", _drain, args)


def cmd_job_delete(args: argparse.Namespace) -> int:
    return _run_command("job delete", _job_delete, args)


EXPORT_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16"}


def _job_tensors(args: argparse.Namespace) -> tuple[int, dict, str]:
    """``(step, {name: float32 tensor}, where from)`` of ``--job``: from a running cluster
    (``--cluster``, one consistent step) or offline from ``--checkpoint-dir``s."""
    if args.checkpoint_dir and args.cluster:
        raise _UsageError("give either --cluster (a running cluster) or --checkpoint-dir (offline), not both")
    if args.checkpoint_dir:
        from shardline.ps_server.checkpoint import CheckpointError, read_job_tensors

        try:
            step, _spec, tensors = read_job_tensors(args.checkpoint_dir, args.job, step=args.step)
        except CheckpointError as exc:
            raise ShardlineError(str(exc)) from None
        return step, tensors, f"{len(args.checkpoint_dir)} checkpoint dir(s)"
    if args.step is not None:
        raise _UsageError("--step applies to --checkpoint-dir exports (a running cluster exports its current step)")
    from shardline.worker.client import connect

    with _connect_dispatcher(args) as dispatcher:
        if dispatcher.get_job(args.job) is None:
            raise ShardlineError(f"no job named {args.job!r} on the cluster at {args.cluster}")
    client = connect(args.cluster, job=args.job, cluster_token=args.token, tls_ca=args.tls_ca,
                     connect_timeout=args.timeout)
    try:
        client.wait_ready(args.timeout)
        step, tensors = client.consistent_pull()
    finally:
        client.close()
    return step, tensors, f"cluster {args.cluster}"


def _export(args: argparse.Namespace) -> int:
    import torch

    if bool(args.out) == bool(args.hf_dir):
        raise _UsageError("give one of --out F.safetensors and --hf-dir OUT")
    if args.hf_dir:
        return _export_hf(args)
    hf_only = [flag for flag, value in (("--from-model", args.from_model), ("--job-file", args.job_file),
                                        ("--lora-alpha", args.lora_alpha), ("--lora-dropout", args.lora_dropout))
               if value is not None]
    if hf_only:
        raise _UsageError(f"{hf_only[0]} applies to --hf-dir exports")
    if not args.job:
        raise _UsageError("--job NAME is required")
    from safetensors.torch import save_file

    dtype_name = EXPORT_DTYPES[args.dtype or "fp32"]
    started = time.monotonic()
    step, tensors, source = _job_tensors(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp.{os.getpid()}")
    tensors = {name: t.to(getattr(torch, dtype_name)).contiguous() for name, t in tensors.items()}
    save_file(tensors, str(tmp), metadata={"shardline_job": args.job, "shardline_step": str(step)})
    os.replace(tmp, out)
    total = sum(t.numel() for t in tensors.values())
    print(f"job {args.job} at step {step} from {source}: {len(tensors)} tensors, {total:,} parameters "
          f"({dtype_name}) -> {out} in {time.monotonic() - started:.2f} s")
    return EXIT_OK


def _export_hf(args: argparse.Namespace) -> int:
    """--hf-dir: the logic is jobs/hf_export.py; this resolves the flags (and --job-file defaults)."""
    import torch

    from shardline.jobs.hf_export import HFExporter

    lora = None
    if args.job_file:
        from shardline.jobs.spec import load_job

        spec = load_job(args.job_file)
        args.job = args.job or spec.name
        args.from_model = args.from_model or spec.model.hf_path
        lora = spec.lora
    if not args.job:
        raise _UsageError("--job NAME (or --job-file) is required")
    if not args.from_model:
        raise _UsageError("--hf-dir needs --from-model DIR (the source model), or a --job-file whose "
                          "model.hf_path names it")
    started = time.monotonic()
    dtype = getattr(torch, EXPORT_DTYPES[args.dtype]) if args.dtype else None
    exporter = HFExporter(args.from_model, args.hf_dir, dtype)  # checks DIR and OUT before any pull
    step, tensors, source = _job_tensors(args)
    result = exporter.write(tensors, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, lora=lora,
                            metadata={"shardline_job": args.job, "shardline_step": str(step)})
    what = (f"LoRA adapter (r {result.adapter_config['r']}, alpha {result.adapter_config['lora_alpha']:g}, "
            f"target_modules {','.join(sorted(result.adapter_config['target_modules']))})"
            if result.kind == "lora" else "model")
    print(f"job {args.job} at step {step} from {source}: {what}, {result.tensors} tensors, {result.parameters:,} "
          f"parameters ({str(result.dtype).removeprefix('torch.')}) -> {result.out}/ ({', '.join(result.files)}) "
          f"in {time.monotonic() - started:.2f} s")
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    return _run_command("export", _export, args)


# -- up -------------------------------------------------------------------------------------------

_PROGRESS_LINE = re.compile(r"^(\[rank \d+\] )?step \d+/\d+\b")


class LogFollower:
    """Echo the lines a daemon appends to its log file. On a terminal, progress lines are redrawn
    in place instead of scrolling."""

    def __init__(self, path: Path, out: TextIO, tty: bool, start: int = 0):
        self.path = path
        self.out = out
        self.tty = tty
        self.start = start      # byte offset to follow from (the log may hold earlier runs)
        self._fh = None
        self._partial = ""
        self._progress_shown = False

    def poll(self, final: bool = False) -> None:
        if self._fh is None:
            try:
                self._fh = open(self.path, encoding="utf-8", errors="replace")
                self._fh.seek(self.start)
            except OSError:
                return
        chunk = self._fh.read()
        if not chunk and not (final and self._partial):
            return
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        if final and self._partial:
            lines.append(self._partial)
            self._partial = ""
        for line in lines:
            self._emit(line.rstrip("\r"))
        self.out.flush()

    def _emit(self, line: str) -> None:
        if line.startswith("=== ") and "LocalCluster start" in line:
            return
        if self.tty and _PROGRESS_LINE.match(line):
            self.out.write("\r\x1b[K" + line)
            self._progress_shown = True
            return
        if self._progress_shown:
            self.out.write("\n")
            self._progress_shown = False
        self.out.write(line + "\n")

    def close(self) -> None:
        self.poll(final=True)
        if self._progress_shown:
            self.out.write("\n")
            self._progress_shown = False
            self.out.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, _frame):
    raise _Interrupted(signum)


def _find_job(path: str | None) -> Path:
    if path:
        p = Path(path)
        if not p.is_file():
            raise ShardlineConfigError(f"job file {path!r} does not exist")
        return p.resolve()
    for base in (Path.cwd(), _PROJECT_ROOT):
        p = base / DEFAULT_JOB
        if p.is_file():
            return p.resolve()
    raise ShardlineConfigError(f"no --job given and no {DEFAULT_JOB} found in {Path.cwd()} or {_PROJECT_ROOT}")


def _job_header(path: Path) -> dict:
    """Just enough of the job file for the banner; the workers validate it fully."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ShardlineConfigError(f"cannot read job file {str(path)!r}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("job"), dict) or "name" not in data["job"]:
        raise ShardlineConfigError(f"job file {str(path)!r} has no job.name")
    train = data.get("train") if isinstance(data.get("train"), dict) else {}
    return {"name": str(data["job"]["name"]), "steps": train.get("steps", 300), "sync": train.get("sync", "bsp"),
            "optimizer": train.get("optimizer", "adamw")}



def _fmt_loss(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "-"


def render_up_summary(job: dict, results: list[dict | None], codes: list[int | None], status: dict | None,
                      wall: float) -> str:
    lines = [f"== summary: job {job['name']} ({job['sync']}, {job['optimizer']}), {len(results)} worker(s), "
             f"{len(status['nodes']) if status else '?'} PS node(s), {wall:.1f} s =="]
    rows = []
    for rank, (res, code) in enumerate(zip(results, codes)):
        res = res or {}
        transfer = res.get("transfer") or {}
        rows.append([
            f"rank {rank}", res.get("status", "no result"), "-" if code is None else code,
            f"{res.get('steps_done', 0)}/{res.get('steps_planned', job['steps'])}", _fmt_loss(res.get("final_loss")),
            human_rate(res.get("tokens_per_s") or 0.0), res.get("version", "-"),
            f"{res['train_seconds']:.1f}s" if isinstance(res.get("train_seconds"), (int, float)) else "-",
            human_bytes(transfer.get("pushed_bytes", 0)), human_bytes(transfer.get("pulled_bytes", 0)),
        ])
    lines += ["", format_table(["WORKER", "STATUS", "EXIT", "STEPS", "FINAL LOSS", "TOK/S", "VERSION", "TRAIN",
                                "PUSHED", "PULLED"], rows, right={2, 3, 4, 5, 6, 7, 8, 9})]
    if status:
        rows = [[n["node_id"], n["rack"], n["state"], n["blocks"], human_bytes(n["bytes"]),
                 f"{100 * n['key_share']:.1f}%"] for n in status["nodes"]]
        lines += ["", f"ring epoch {status['epoch']}:",
                  format_table(["NODE", "RACK", "STATE", "BLOCKS", "BYTES", "KEY SHARE"], rows, right={3, 4, 5})]
    lead = results[0] if results else None
    if lead and lead.get("summary"):
        # rank 0's own summary: loss, accuracy before -> after and the before/after sample answers
        lines += ["", "rank 0 result:", lead["summary"]]
    return "\n".join(lines)


def _wait_fresh_heartbeats(cluster, since: float, timeout: float) -> dict | None:
    """Cluster status once every alive node heartbeated after ``since`` (monotonic), so the
    blocks/bytes it reports include the finished training."""
    deadline = time.monotonic() + timeout
    status = None
    while True:
        try:
            status = cluster.cluster_status()
        except ShardlineError:
            return None
        elapsed = time.monotonic() - since
        if all(n.heartbeat_age_seconds < elapsed for n in status.all_nodes if n.state == "alive"):
            break
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    return status_dict(status, cluster.address)


UP_SHAPE_FILE = "up.json"


def default_up_dir(job_name: str) -> Path:
    """Where ``shardline up`` keeps a job's cluster state between runs (``$SHARDLINE_UP_DIR``, else
    ``$XDG_STATE_HOME/shardline/up/<job>``, else ``~/.local/state/shardline/up/<job>``)."""
    base = os.environ.get("SHARDLINE_UP_DIR")
    if base:
        return Path(base).resolve() / job_name
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "shardline" / "up" / job_name


def prepare_up_dir(workdir: Path, shape: dict, *, fresh: bool) -> bool:
    """Create ``workdir`` for a run of ``shape`` (job, ps, workers). True if it holds the state of an
    earlier run of the same shape (the run resumes it); a different shape is refused (its nodes own
    other blocks), unless ``fresh`` discards the old state first."""
    marker = workdir / UP_SHAPE_FILE
    if fresh and workdir.exists():
        for child in workdir.iterdir():
            if child.is_dir() and (child.name == "dispatcher-state" or child.name.endswith("-checkpoints")):
                shutil.rmtree(child)
        marker.unlink(missing_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    previous = None
    if marker.exists():
        try:
            previous = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            previous = None
    if previous is not None and previous != shape:
        raise ShardlineConfigError(
            f"{workdir} holds a run of job {previous.get('job')!r} with --ps {previous.get('ps')} --workers "
            f"{previous.get('workers')}; use the same, or --fresh to discard it")
    marker.write_text(json.dumps(shape) + "\n", encoding="utf-8")
    return previous is not None and (workdir / "dispatcher-state").exists()


UP_TOKEN_FILE = "cluster.token"


def _up_token_file(given: str | None, workdir: Path) -> Path:
    """The token file of an ``up`` cluster: ``given`` (checked readable and valid), else a fresh
    random token written to ``workdir/cluster.token`` (0600), new for every run. Raises
    ShardlineConfigError or OSError."""
    from shardline.services.auth import load_token
    from shardline.services.security import write_new_token

    if given:
        load_token(given)
        return Path(given).resolve()
    path = workdir / UP_TOKEN_FILE
    write_new_token(path)
    return path


def cmd_up(args: argparse.Namespace) -> int:
    from shardline.local_cluster import DaemonStartError, LocalCluster, read_json_object

    out = sys.stdout
    try:
        if args.ps < 1:
            raise ShardlineConfigError(f"--ps must be >= 1, got {args.ps}")
        if args.workers < 1:
            raise ShardlineConfigError(f"--workers must be >= 1, got {args.workers}")
        if args.steps is not None and args.steps < 1:
            raise ShardlineConfigError(f"--steps must be >= 1, got {args.steps}")
        job_path = _find_job(args.job)
        job = _job_header(job_path)
        if args.steps is not None:
            job["steps"] = args.steps
    except ShardlineConfigError as exc:
        print(f"{PROG} up: error: {exc}", file=sys.stderr)
        return EXIT_USAGE

    own_workdir = args.workdir is None
    workdir = default_up_dir(job["name"]) if own_workdir else Path(args.workdir).resolve()
    try:
        resumed = prepare_up_dir(workdir, {"job": job["name"], "ps": args.ps, "workers": args.workers}, fresh=args.fresh)
    except ShardlineConfigError as exc:
        print(f"{PROG} up: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        token_file = _up_token_file(args.cluster_token_file, workdir)
    except (ShardlineConfigError, OSError) as exc:
        print(f"{PROG} up: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    tty = out.isatty()
    print(f"shardline up: 1 dispatcher, {args.ps} PS node(s), {args.workers} worker(s); job {job['name']} "
          f"({job_path}), {job['steps']} steps; state and logs in {workdir}", file=out, flush=True)
    if resumed:
        print(f"resuming job {job['name']} from the state of an earlier run in {workdir} (--fresh starts over)",
              file=out, flush=True)

    old_handlers = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(workdir, start_timeout=args.start_timeout, cluster_token_file=str(token_file))
    code = EXIT_FAILED
    failed = True
    follower: LogFollower | None = None
    started = time.monotonic()
    try:
        # Durable state in the workdir: an interrupted run resumes where it stopped.
        cluster.start_dispatcher(state_dir=str(workdir / "dispatcher-state"))
        nodes = [cluster.add_node(node_id=f"ps-{i}", wait=False, checkpoint_dir=str(workdir / f"ps-{i}-checkpoints"),
                                  checkpoint_every_steps=args.checkpoint_every) for i in range(args.ps)]
        for h in nodes:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(args.ps, timeout=args.start_timeout)
        print(f"cluster at {cluster.address}; PS nodes: " + ", ".join(f"{h.node_id} {h.grpc}" for h in nodes),
              file=out, flush=True)
        print(f"cluster token in {token_file}: connect with SHARDLINE_CLUSTER_TOKEN_FILE={token_file} "
              f"(scripts: PSOptimizer/connect read it; shardline status --cluster {cluster.address} "
              f"--cluster-token-file {token_file})", file=out, flush=True)

        worker_flags: dict[str, Any] = {"threads": args.threads, "summary": "line"}
        if args.steps is not None:
            worker_flags["steps"] = args.steps
        result_files = [workdir / f"worker-{r}.result.json" for r in range(args.workers)]
        for f in result_files:
            f.unlink(missing_ok=True)
        lead_log = workdir / "worker-0.log"
        follow_from = lead_log.stat().st_size if lead_log.exists() else 0  # earlier runs' lines stay unshown
        workers = [cluster.add_worker(job_path, r, args.workers, wait=False, result_file=str(result_files[r]),
                                      **worker_flags) for r in range(args.workers)]
        follower = LogFollower(workers[0].log_path, out, tty, start=follow_from)
        deadline = None if not args.timeout else started + args.timeout
        failure = None
        while True:
            follower.poll()
            codes = [w.proc.poll() for w in workers]
            bad = [(w, c) for w, c in zip(workers, codes) if c not in (None, 0)]
            if bad:
                failure = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            dead = [h for h in [cluster.dispatcher, *nodes] if not h.alive()]
            if dead:
                failure = (dead[0], dead[0].returncode)
                break
            if deadline is not None and time.monotonic() > deadline:
                failure = (None, None)
                break
            time.sleep(0.1)
        finished = time.monotonic()
        follower.close()
        if failure is not None:
            handle, rc = failure
            if handle is None:
                print(f"\n{PROG} up: error: the job did not finish within --timeout {args.timeout:g} s; "
                      f"logs in {workdir}", file=sys.stderr)
            else:
                what = f"{handle.name}" + (f" (rank {workers.index(handle)})" if handle in workers else "")
                res = read_json_object(result_files[workers.index(handle)]) if handle in workers else None
                reason = f": {res['error']}" if res and res.get("error") else ""
                print(f"\n{PROG} up: error: {what} exited with code {rc}{reason}\n"
                      f"last lines of {handle.log_path}:\n{handle.log_tail(30)}", file=sys.stderr)
            code = EXIT_FAILED
        else:
            status = _wait_fresh_heartbeats(cluster, finished, timeout=3.0)
            results = [read_json_object(f) for f in result_files]
            print("", file=out)
            print(render_up_summary(job, results, [w.returncode for w in workers], status,
                                    finished - started), file=out, flush=True)
            code = EXIT_OK
            failed = False
    except _Interrupted as exc:
        if follower is not None:
            follower.close()
        print(f"\n{PROG} up: {exc} received, shutting down", file=sys.stderr, flush=True)
        code = EXIT_INTERRUPTED
    except (DaemonStartError, TimeoutError, ShardlineError) as exc:
        if follower is not None:
            follower.close()
        print(f"\n{PROG} up: error: {exc}", file=sys.stderr, flush=True)
        code = EXIT_FAILED
    finally:
        # Shutting down is bounded (SIGTERM, then SIGKILL after 10 s): do not let a second Ctrl-C
        # interrupt it halfway.
        for s in old_handlers:
            signal.signal(s, signal.SIG_IGN)
        codes = cluster.shutdown()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    stuck = [name for name, c in codes.items() if c is None]
    unclean = [f"{name} ({c})" for name, c in codes.items() if c not in (0, None)
               and not name.startswith("worker-")]
    if stuck:
        print(f"{PROG} up: killed after the grace period: {', '.join(stuck)}", file=sys.stderr)
    if unclean and not failed:
        print(f"{PROG} up: warning: unclean exit of {', '.join(unclean)}", file=sys.stderr)
    if code == EXIT_OK and own_workdir and not args.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)  # the job is complete: nothing to resume
    elif code == EXIT_OK:
        print(f"state and logs kept in {workdir}", file=out, flush=True)
    else:
        again = "the same command" if own_workdir else f"it again with --workdir {workdir}"
        print(f"state and logs kept in {workdir}: run {again} to resume the job, or add --fresh to start over",
              file=sys.stderr, flush=True)
    print(f"cluster shut down ({time.monotonic() - started:.1f} s)", file=out, flush=True)
    return code


# -- entry point ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Shardline operator CLI")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    up = sub.add_parser("up", help="run a local all-in-one cluster training a job file, then shut it down",
                        description="Start a dispatcher, PS nodes and workers on 127.0.0.1, run the job, "
                                    "print a summary and shut everything down (also on Ctrl-C or a failure).")
    up.add_argument("--ps", type=int, default=2, help="number of PS nodes (default 2)")
    up.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--job", default=None, help=f"job file (default {DEFAULT_JOB})")
    up.add_argument("--workdir", default=None,
                    help="directory for the cluster's state, logs, ready and result files; an interrupted run "
                         "resumes from it (default: ~/.local/state/shardline/up/<job>, removed after a completed run)")
    up.add_argument("--keep-logs", action="store_true", help="keep the default workdir after a completed run")
    up.add_argument("--fresh", action="store_true", help="discard the saved state of an earlier run and start over")
    up.add_argument("--checkpoint-every", type=int, default=50,
                    help="PS checkpoint period in steps (a Ctrl-C always checkpoints; default 50)")
    up.add_argument("--steps", type=int, default=None, help="override train.steps of the job file")
    up.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    up.add_argument("--timeout", type=float, default=0, help="give up after this many seconds (default: none)")
    up.add_argument("--start-timeout", type=float, default=90.0, help="seconds each daemon may take to start")
    up.add_argument("--cluster-token-file", default=None,
                    help="the cluster token every daemon and worker gets (default: a new random token in "
                         "<workdir>/cluster.token, readable by you only)")
    up.set_defaults(func=cmd_up)

    def cluster_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--cluster", default=None, help="dispatcher HOST:PORT, or several comma-separated (they "
                       "share an etcd state store; the leader answers) (default $SHARDLINE_CLUSTER)")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the dispatcher")
        p.add_argument("--cluster-token-file", default=os.environ.get("SHARDLINE_CLUSTER_TOKEN_FILE"),
                       help="the cluster token, if the cluster has one (default $SHARDLINE_CLUSTER_TOKEN_FILE)")
        p.add_argument("--tls-ca-file", default=os.environ.get("SHARDLINE_TLS_CA_FILE") or None,
                       help="CA that signed the cluster's gRPC certificates, if it uses TLS "
                            "(default $SHARDLINE_TLS_CA_FILE)")

    st = sub.add_parser("status", help="show nodes, ring and jobs of a running cluster")
    cluster_args(st)
    st.add_argument("--json", action="store_true", help="print JSON instead of tables")
    st.add_argument("--hot", action="store_true", help="show the hottest shards and each node's load instead")
    st.add_argument("--limit", type=int, default=0, help="with --hot: at most this many shards (default 32)")
    st.add_argument("--job", default=None, help="with --hot: only this job's shards")
    st.set_defaults(func=cmd_status)

    ck = sub.add_parser("checkpoint", help="checkpoint a job now, on every node at one same step",
                        description="Returns once every PS node holding the job has one same step durable, "
                                    "and prints that step.")
    cluster_args(ck)
    ck.add_argument("--job", required=True, help="job name")
    ck.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the checkpoint (default 300)")
    ck.set_defaults(func=cmd_checkpoint)

    ex = sub.add_parser("export", help="write a job's full tensors to one safetensors file or a Hugging Face "
                                       "directory",
                        description="From a running cluster (--cluster) or offline from the PS nodes' checkpoint "
                                    "directories (--checkpoint-dir, once per node). --out: one file that loads with "
                                    "safetensors.torch.load_file and model.load_state_dict. --hf-dir with "
                                    "--from-model: a save_pretrained model directory, or for a LoRA job a peft "
                                    "adapter directory (docs/jobs.md).")
    cluster_args(ex)
    ex.add_argument("--checkpoint-dir", action="append", default=[], metavar="DIR",
                    help="a PS node's checkpoint directory (repeat for every node of the cluster)")
    ex.add_argument("--job", default=None, help="job name (required, unless --job-file names it)")
    ex.add_argument("--out", default=None, help="output .safetensors file")
    ex.add_argument("--hf-dir", default=None, metavar="OUT",
                    help="output Hugging Face directory (must not exist or be empty)")
    ex.add_argument("--from-model", default=None, metavar="DIR",
                    help="--hf-dir: the local model directory the job was trained from (config and tokenizer are "
                         "copied from it; the job's tensors must match it)")
    ex.add_argument("--job-file", default=None, metavar="FILE",
                    help="--hf-dir: the worker's job file: its job name, model.hf_path and lora section are the "
                         "defaults of --job, --from-model, --lora-alpha and --lora-dropout")
    ex.add_argument("--lora-alpha", type=float, default=None,
                    help="--hf-dir of a LoRA job: the adapters' alpha (the cluster does not record it)")
    ex.add_argument("--lora-dropout", type=float, default=None,
                    help="--hf-dir of a LoRA job: the adapters' dropout for adapter_config.json (default 0)")
    ex.add_argument("--dtype", choices=sorted(EXPORT_DTYPES), default=None,
                    help="tensor dtype in the output (default: fp32; --hf-dir: the source model's dtype, fp32 "
                         "for LoRA adapters)")
    ex.add_argument("--step", type=int, default=None, help="offline: this checkpointed step (default: the latest "
                                                            "every directory holds)")
    ex.set_defaults(func=cmd_export)

    dr = sub.add_parser("drain", help="move every block off a PS node, then take it out of the ring",
                        description="A two-phase ring change: the other nodes bring the node's blocks in sync "
                                    "while training goes on, then the ring switches. Returns once the node is drained.")
    cluster_args(dr)
    dr.add_argument("node_id", help="the PS node's id")
    dr.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the drain (default 600)")
    dr.add_argument("--no-wait", action="store_true", help="start the drain and return")
    dr.set_defaults(func=cmd_drain)

    jb = sub.add_parser("job", help="manage jobs")
    jsub = jb.add_subparsers(dest="job_command", metavar="ACTION")
    jsub.required = True
    fc = sub.add_parser("fit-cost", help="time a job's model on this machine and print the train.cost line "
                                          "that length-balanced minibatches (balance: tokens) split by")
    fc.add_argument("job", help="job file (YAML)")
    fc.add_argument("--repeats", type=int, default=3, help="timings per length; the fastest counts (default 3)")
    fc.add_argument("--threads", type=int, default=1, help="torch threads, as the workers will use (default 1)")
    fc.set_defaults(func=cmd_fit_cost)

    jd = jsub.add_parser("delete", help="delete a job, its blocks and its checkpoints on every node")
    cluster_args(jd)
    jd.add_argument("name", help="job name")
    jd.set_defaults(func=cmd_job_delete)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
