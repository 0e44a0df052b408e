"""Pipelined apply on the PS: what the slowest rank of a BSP step waits for after its backward.

    .venv/bin/python bench/pipelined_apply.py --numel 16777216 --steps 6 [--out results.json]

A local cluster (1 dispatcher, 2 PS nodes, ``replication 2``) and two clients in this process,
AdamW on ``--numel`` fp32 elements in blocks of 256 K, as ``--buckets`` tensors. Each step rank 0
pushes and commits at once; rank 1 (the slow rank) runs a "backward" of ``--delay`` seconds that
yields its buckets one by one (``--buckets 1``: it pushes after backward; more: it pushes each
bucket as it is ready, as push-during-backward hooks do), then commits and pulls the new version.
Per step of rank 1 it records ``push_commit`` (the last bucket's push and the commit, sent when
its backward ended, as ``PSOptimizer.step`` does), ``pull`` (the pull of the new version: it
waits for the copies to the replica and their acks) and ``exposed`` (their sum: from the end of
its backward to the pull reply). Modes, interleaved:

* ``lr-on-pushes``: the client sends the step's lr with its pushes (as PSOptimizer does), so a
  node steps every block as soon as rank 1's push completes it (pipelined apply);
* ``lr-on-commits``: the lr only on commits (an older client): blocks are stepped at the commit.

``--apply`` instead times the optimizer apply alone, per block (``BlockOptimizer.step``) vs
multi-tensor (``step_many``), for 1 M and 16 M parameters in blocks of 256 K (AdamW, SGD with
momentum). Run it once on a tree without pipelined apply to get the "before" figures. The machine is shared:
only medians of interleaved runs mean much. Everything started is stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch



def run_mode(address: str, job: str, numel: int, buckets: int, steps: int, delay: float,
             lr_on_pushes: bool) -> list[dict]:
    from shardline.worker.client import connect

    clients = [connect(address, job=job, rank=rank) for rank in range(2)]
    lr = 1e-3
    init = {f"w{b}": torch.zeros(numel // buckets) for b in range(buckets)}
    clients[0].init(init, optimizer="adamw", world_size=2, replication=2, lr=lr, weight_decay=0.01)
    clients[1].init(init, optimizer="adamw", world_size=2, replication=2, lr=lr, weight_decay=0.01)
    for c in clients:
        c.pull()
        c.lr = lr if lr_on_pushes else None
    gen = torch.Generator().manual_seed(0)
    grads = [{name: torch.randn(t.numel(), generator=gen) for name, t in init.items()} for _ in range(2)]
    records: list[dict] = []
    errors: list[BaseException] = []

    def fast():
        try:
            for _ in range(steps):
                clients[0].push(grads[0])
                clients[0].pull_changed()
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    thread = threading.Thread(target=fast)
    thread.start()
    try:
        for _ in range(steps):
            names = list(grads[1])
            for name in names[:-1]:
                time.sleep(delay / buckets)   # this bucket's share of the backward
                clients[1].push({name: grads[1][name]}, commit=False)
            time.sleep(delay / buckets)
            t0 = time.perf_counter()          # backward ends: the last bucket and the commit (as PSOptimizer.step)
            clients[1].push({names[-1]: grads[1][names[-1]]})
            t1 = time.perf_counter()
            clients[1].pull_changed()
            t2 = time.perf_counter()
            records.append({"push_commit": t1 - t0, "pull": t2 - t1, "exposed": t2 - t0})
    finally:
        thread.join(timeout=120)
        for c in clients:
            c.close()
    if errors:
        raise errors[0]
    return records[1:]  # the first step also faults in every buffer


def apply_times(repeats: int = 9) -> dict:
    """Median ms of one apply, per block vs multi-tensor."""
    from shardline.ps_server.optimizer import OptimizerConfig, make_optimizer

    block, out = 262_144, {}
    for kind, hp in (("adamw", dict(lr=1e-3, weight_decay=0.01)), ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=0.01))):
        opt = make_optimizer(OptimizerConfig.from_kwargs(kind, **hp))
        for total in (1 << 20, 16 << 20):
            n = total // block
            params = [torch.randn(block) for _ in range(n)]
            grads = [torch.randn(block) for _ in range(n)]
            states = [opt.init_state(block) for _ in range(n)]
            for mode in ("per-block", "multi-tensor"):
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    if mode == "per-block":
                        for p, g, st in zip(params, grads, states):
                            opt.step(p, g, st)
                    else:
                        opt.step_many(params, grads, states)
                    times.append(time.perf_counter() - t)
                key = f"{kind} {total >> 20}M {mode}"
                out[key] = statistics.median(times) * 1e3
                print(f"{key}: {out[key]:.2f} ms", flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=16 << 20)
    parser.add_argument("--buckets", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.3)
    parser.add_argument("--modes", default="lr-on-pushes,lr-on-commits")
    parser.add_argument("--apply", action="store_true", help="time the optimizer apply alone")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.apply:
        times = apply_times()
        if args.out:
            Path(args.out).write_text(json.dumps({"apply_median_ms": times}, indent=1))
        return 0
    from shardline.local_cluster import LocalCluster

    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="shardline-pipelined-") as workdir, LocalCluster(workdir) as cluster:
        cluster.start_dispatcher()
        cluster.add_node(node_id="ps1")
        cluster.add_node(node_id="ps2")
        cluster.wait_for_nodes(2, timeout=60)
        for repeat in range(args.repeats):
            for mode in modes:
                results[mode] += run_mode(cluster.address, f"pl-{mode}-{repeat}", args.numel, args.buckets,
                                          args.steps, args.delay, mode == "lr-on-pushes")
    summary = {}
    for mode, records in results.items():
        summary[mode] = {key: statistics.median(r[key] for r in records) * 1e3 for key in ("push_commit", "pull", "exposed")}
        print(f"{mode:14s} median ms over {len(records)} steps: " +
              ", ".join(f"{k} {v:.1f}" for k, v in summary[mode].items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"numel": args.numel, "buckets": args.buckets, "median_ms": summary,
                                              "steps": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
