"""What each tensor of a job costs per step: a job of many small tensors against one tensor of the same bytes.

    .venv/bin/python bench/many_tensors.py --out bench/results/many_tensors.json
    .venv/bin/python bench/many_tensors.py --quick

A Hugging Face model has hundreds of parameter tensors, many of them tiny (norms, biases); every
one is at least one block, and every block costs the client and the PS fixed work per push and
pull. One LocalCluster (a dispatcher and one PS node on 127.0.0.1) holds two BSP AdamW jobs of
one worker: ``many``, ``--tensors`` tensors of ``--elements`` fp32 each, and ``one``, a single
tensor of the same bytes (the baseline). Each iteration is a push with commit and a pull of what
changed, the two jobs alternating, over ``--transport`` (shm: the node is on this host).

Reported: the median step of each job, their ratio, the cost per tensor
``(many - one) / tensors``, and the PS node's CPU time per step of each job (from
/proc/<pid>/stat, summed over that job's steps; 10 ms ticks, so read it as an estimate). No
absolute expectations are asserted anywhere.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import run_and_report  # noqa: E402
from vs_ddp import machine_info  # noqa: E402

JOBS = ("many", "one")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args) -> dict:
    import torch

    from shardline.local_cluster import LocalCluster
    from shardline.worker.client import connect

    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="shardline-manytensors-"))
    result = {"machine": machine_info(), "timestamp": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": " ".join(sys.argv), "loadavg_start": os.getloadavg(),
              "config": {"tensors": args.tensors, "elements": args.elements, "iterations": args.iterations,
                         "warmup": args.warmup, "transport": args.transport, "optimizer": "adamw", "sync": "bsp"}}
    g = torch.Generator().manual_seed(0)
    shapes = {"many": {f"t{i}": args.elements for i in range(args.tensors)}, "one": {"w": args.tensors * args.elements}}
    with LocalCluster(workdir / "daemons") as cluster:
        cluster.start_dispatcher()
        node = cluster.add_node(transport=args.transport)
        cluster.wait_for_nodes(1, timeout=30)
        clients, grads = {}, {}
        try:
            for job in JOBS:
                c = clients[job] = connect(cluster.address, f"manytensors-{job}", transport=args.transport,
                                           pull_timeout=60.0)
                c.init({n: torch.randn(k, generator=g) for n, k in shapes[job].items()}, optimizer="adamw", lr=1e-3,
                       sync="bsp", world_size=1)
                c.lr = 1e-3  # the lr rides on the pushes, as PSOptimizer sends it
                grads[job] = {n: torch.randn(k, generator=g) * 1e-3 for n, k in shapes[job].items()}
            step_s = {job: [] for job in JOBS}
            node_cpu = dict.fromkeys(JOBS, 0.0)
            for it in range(args.warmup + args.iterations):
                for job in (JOBS if it % 2 == 0 else JOBS[::-1]):
                    c = clients[job]
                    cpu0, t0 = cpu_seconds(node.pid), time.perf_counter()
                    c.push(grads[job])
                    c.pull_changed()
                    t1, cpu1 = time.perf_counter(), cpu_seconds(node.pid)
                    if it >= args.warmup:
                        step_s[job].append(t1 - t0)
                        node_cpu[job] += cpu1 - cpu0
        finally:
            for c in clients.values():
                c.close()
    med = {job: statistics.median(step_s[job]) for job in JOBS}
    result["summary"] = {
        **{f"{job}_step_ms_median": 1e3 * med[job] for job in JOBS},
        **{f"{job}_node_cpu_ms_per_step": 1e3 * node_cpu[job] / args.iterations for job in JOBS},
        "ratio_many_to_one": med["many"] / med["one"],
        "us_per_tensor": 1e6 * (med["many"] - med["one"]) / args.tensors,
    }
    result.update(step_seconds=step_s, loadavg_end=os.getloadavg())
    return result


def print_table(result: dict) -> None:
    cfg, s = result["config"], result["summary"]
    kib = cfg["tensors"] * cfg["elements"] * 4 / 1024
    print(f"\nmany_tensors: {cfg['tensors']} tensors x {cfg['elements']} fp32 against 1 tensor of the same "
          f"{kib:.0f} KiB, AdamW BSP, push+commit+pull, {cfg['transport']}, {cfg['iterations']} iterations each")
    print(f"{'job':<8}{'step ms':>10}{'node CPU ms/step':>19}")
    for job in JOBS:
        print(f"{job:<8}{s[f'{job}_step_ms_median']:>10.2f}{s[f'{job}_node_cpu_ms_per_step']:>19.2f}")
    print(f"ratio many/one {s['ratio_many_to_one']:.2f}; per tensor {s['us_per_tensor']:.1f} us per step")
    print(f"load {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--elements", type=int, default=1024)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--transport", choices=("shm", "tcp"), default="shm")
    ap.add_argument("--quick", action="store_true", help="smoke run: 10 iterations, 2 warm-up")
    ap.add_argument("--out", help="write the JSON here (e.g. bench/results/many_tensors.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup = 10, 2
    for name in ("tensors", "elements", "iterations"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return run_and_report(run, print_table, args)


if __name__ == "__main__":
    sys.exit(main())
