"""``shardline``: the operator CLI.

    shardline up [--ps 2] [--workers 2] [--job examples/demo_job.yaml] [--workdir DIR] [--keep-logs]
    shardline status --cluster HOST:PORT [--json]

``up`` runs a whole cluster on this machine (127.0.0.1): one dispatcher, ``--ps`` PS nodes and
``--workers`` workers training the job file, as real daemons under a :class:`LocalCluster`. It
streams rank 0's output (progress, loss, tokens/s, version), prints a summary (per worker: status,
steps, final loss, tokens/s; per node: blocks, bytes, share of the ring; rank 0's accuracy and
before/after sample answers) and shuts everything down, also on Ctrl-C and when a daemon fails.
Exit codes: 0 done, 1 a daemon failed or timed out, 2 bad arguments, 130 interrupted.

``status`` asks a dispatcher for its cluster status: nodes (id, rack, address, state, heartbeat
age, blocks, bytes, virtual nodes, share of the key space), the ring epoch, and jobs (name, sync,
world size, tensors, parameters, ready), as tables or, with ``--json``, as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
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

def node_progress(status, timeout: float, cluster_token: bytes | None = None) -> dict[str, dict[str, int]]:
    """Ask every alive PS node for its job steps: {node_id: {job: step}} (unreachable nodes left out).

    The dispatcher does not see training progress; the nodes that apply the steps do.
    """
    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2, ps_pb2_grpc

    progress = {}
    for n in status.all_nodes:
        if n.state != "alive":
            continue
        try:
            with grpc_channel(n.grpc_address, cluster_token) as channel:
                reply = ps_pb2_grpc.ParameterServerStub(channel).GetNodeStatus(ps_pb2.GetNodeStatusRequest(), timeout=timeout)
        except Exception:  # noqa: BLE001 - a node that cannot answer is shown without progress
            continue
        progress[n.node_id] = {j.job: int(j.step) for j in reply.jobs}
    return progress


def status_dict(status, cluster: str, progress: dict[str, dict[str, int]] | None = None) -> dict:
    """A JSON-ready view of a ClusterStatus (protobuf) and the nodes' job steps (``node_progress``).

    A job's ``step`` is the lowest step over the nodes that hold it (BSP nodes agree; under ASP
    each node counts its own updates, see ``steps_by_node``).
    """
    progress = progress or {}
    from shardline.services.ring import HashRing

    vnodes = {n.node_id: int(n.vnodes) for n in status.routing.nodes if n.vnodes > 0}
    share = HashRing(vnodes).share() if vnodes else {}
    nodes = []
    for n in status.all_nodes:
        nodes.append({
            "node_id": n.node_id, "rack": n.rack, "grpc": n.grpc_address, "data": n.data_address,
            "state": n.state, "capacity": n.capacity, "vnodes": int(n.vnodes),
            "heartbeat_age_seconds": round(n.heartbeat_age_seconds, 3), "blocks": int(n.blocks), "bytes": int(n.bytes),
            "key_share": share.get(n.node_id, 0.0),
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
        jobs.append({
            "name": j.spec.name, "sync": j.spec.sync, "world_size": int(j.spec.world_size),
            "step": min(steps.values()) if steps else None, "steps_by_node": steps,
            "optimizer": j.spec.optimizer.kind, "tensors": len(j.spec.tensors), "parameters": params,
            "ready": bool(j.ready), "created_unix_ms": int(j.created_unix_ms),
        })
    return {
        "cluster": cluster, "epoch": int(status.routing.epoch),
        "alive_nodes": sum(1 for n in nodes if n["state"] == "alive"),
        "nodes": nodes, "jobs": jobs,
    }


def render_status(data: dict) -> str:
    lines = [f"cluster {data['cluster']}: ring epoch {data['epoch']}, "
             f"{data['alive_nodes']}/{len(data['nodes'])} PS node(s) alive, {len(data['jobs'])} job(s)"]
    if data["nodes"]:
        rows = [[n["node_id"], n["rack"], n["grpc"], n["data"], n["state"], f"{n['heartbeat_age_seconds']:.1f}s",
                 n["blocks"], human_bytes(n["bytes"]), n["vnodes"], f"{100 * n['key_share']:.1f}%"]
                for n in data["nodes"]]
        lines += ["", "nodes:", format_table(
            ["NODE", "RACK", "ADDRESS", "DATA", "STATE", "HEARTBEAT", "BLOCKS", "BYTES", "VNODES", "KEY SHARE"],
            rows, right={5, 6, 7, 8, 9})]
    else:
        lines += ["", "nodes: none registered"]
    if data["jobs"]:
        rows = [[j["name"], j["sync"], j["optimizer"], j["world_size"], "-" if j["step"] is None else j["step"],
                 j["tensors"], f"{j['parameters']:,}", "yes" if j["ready"] else "no"] for j in data["jobs"]]
        lines += ["", "jobs:", format_table(["JOB", "SYNC", "OPTIMIZER", "WORLD", "STEP", "TENSORS", "PARAMS", "READY"],
                                            rows, right={3, 4, 5, 6})]
    else:
        lines += ["", "jobs: none"]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    from shardline.services.auth import load_token
    from shardline.services.daemon import parse_host_port
    from shardline.services.dispatcher_client import DispatcherClient

    cluster = args.cluster or os.environ.get("SHARDLINE_CLUSTER")
    if not cluster:
        print(f"{PROG} status: error: --cluster HOST:PORT (the dispatcher) is required", file=sys.stderr)
        return EXIT_USAGE
    try:
        parse_host_port(cluster, what="--cluster")
    except ShardlineConfigError as exc:
        print(f"{PROG} status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        token = load_token(args.cluster_token_file)
    except ShardlineConfigError as exc:
        print(f"{PROG} status: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    client = DispatcherClient(cluster, rpc_timeout=args.timeout, cluster_token=token)
    try:
        client.wait_until_reachable(args.timeout)
        status = client.cluster_status()
    except ShardlineError as exc:
        print(f"{PROG} status: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        client.close()
    data = status_dict(status, cluster, node_progress(status, args.timeout, token))
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(render_status(data))
    return EXIT_OK


# -- up -------------------------------------------------------------------------------------------

_PROGRESS_LINE = re.compile(r"^(\[rank \d+\] )?step \d+/\d+\b")


class LogFollower:
    """Echo the lines a daemon appends to its log file. On a terminal, progress lines are redrawn
    in place instead of scrolling."""

    def __init__(self, path: Path, out: TextIO, tty: bool):
        self.path = path
        self.out = out
        self.tty = tty
        self._fh = None
        self._partial = ""
        self._progress_shown = False

    def poll(self, final: bool = False) -> None:
        if self._fh is None:
            try:
                self._fh = open(self.path, encoding="utf-8", errors="replace")
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


def cmd_up(args: argparse.Namespace) -> int:
    from shardline.services.local_cluster import DaemonStartError, LocalCluster, read_json_object

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
    workdir = Path(tempfile.mkdtemp(prefix="shardline-up-")) if own_workdir else Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    tty = out.isatty()
    print(f"shardline up: 1 dispatcher, {args.ps} PS node(s), {args.workers} worker(s); job {job['name']} "
          f"({job_path}), {job['steps']} steps; logs in {workdir}", file=out, flush=True)

    old_handlers = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalCluster(workdir, start_timeout=args.start_timeout)
    code = EXIT_FAILED
    failed = True
    follower: LogFollower | None = None
    started = time.monotonic()
    try:
        cluster.start_dispatcher()
        nodes = [cluster.add_node(wait=False) for _ in range(args.ps)]
        for h in nodes:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(args.ps, timeout=args.start_timeout)
        print(f"cluster at {cluster.address} (shardline status --cluster {cluster.address}); PS nodes: "
              + ", ".join(f"{h.node_id} {h.grpc}" for h in nodes), file=out, flush=True)

        worker_flags: dict[str, Any] = {"threads": args.threads, "summary": "line"}
        if args.steps is not None:
            worker_flags["steps"] = args.steps
        result_files = [workdir / f"worker-{r}.result.json" for r in range(args.workers)]
        for f in result_files:
            f.unlink(missing_ok=True)
        workers = [cluster.add_worker(job_path, r, args.workers, wait=False, result_file=str(result_files[r]),
                                      **worker_flags) for r in range(args.workers)]
        follower = LogFollower(workers[0].log_path, out, tty)
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
    if own_workdir and not args.keep_logs and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs kept in {workdir}", file=out if not failed else sys.stderr, flush=True)
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
    up.add_argument("--workdir", default=None, help="directory for logs, ready and result files (default: a temporary one)")
    up.add_argument("--keep-logs", action="store_true", help="keep the temporary workdir after a successful run")
    up.add_argument("--steps", type=int, default=None, help="override train.steps of the job file")
    up.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    up.add_argument("--timeout", type=float, default=0, help="give up after this many seconds (default: none)")
    up.add_argument("--start-timeout", type=float, default=90.0, help="seconds each daemon may take to start")
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="show nodes, ring and jobs of a running cluster")
    st.add_argument("--cluster", default=None, help="dispatcher HOST:PORT (default $SHARDLINE_CLUSTER)")
    st.add_argument("--json", action="store_true", help="print JSON instead of tables")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the dispatcher")
    st.add_argument("--cluster-token-file", default=os.environ.get("SHARDLINE_CLUSTER_TOKEN_FILE"),
                    help="the cluster token, if the cluster has one (default $SHARDLINE_CLUSTER_TOKEN_FILE)")
    st.set_defaults(func=cmd_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
