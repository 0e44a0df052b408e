#!/usr/bin/env python3
"""Run a Shardline job file in one process with torch.optim: the reference for the cluster.

With ``--world-size N`` every step trains on the batches that N BSP workers would train on,
weighted as the parameter server weights them, so the parameters this script produces are what an
N-worker BSP run must produce (to float32 round-off).

    .venv/bin/python examples/local_train.py examples/demo_job.yaml --world-size 2 --threads 1
    .venv/bin/python examples/local_train.py examples/lora_job.yaml --world-size 2 --eval-every 50
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from shardline.services.errors import ShardlineConfigError
from shardline.jobs.runner import run_local
from shardline.jobs.spec import load_job
from shardline.worker.progress import Progress


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job", help="job YAML file")
    ap.add_argument("--world-size", type=int, default=2, help="BSP workers to simulate (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--steps", type=int, help="override train.steps")
    ap.add_argument("--lr", type=float, help="override train.lr")
    ap.add_argument("--eval-every", type=int, help="override train.eval_every (accuracy curve)")
    ap.add_argument("--eval-examples", type=int, help="override train.eval_examples")
    ap.add_argument("--json", metavar="PATH", help="write the result (losses, curve, timings) as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress display")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    try:
        spec = load_job(args.job)
    except ShardlineConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("steps", args.steps), ("lr", args.lr), ("eval_every", args.eval_every),
                                   ("eval_examples", args.eval_examples)) if v is not None}
    if overrides:
        spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, **overrides))

    tr = spec.train
    print(f"{spec.name}: {spec.model_kwargs()}", file=sys.stderr)
    print(f"  task {spec.task}; {args.world_size} x {tr.batch_size} examples/step, {tr.steps} steps, "
          f"{tr.optimizer} lr {tr.lr:g}, threads {args.threads}", file=sys.stderr)
    progress = None if args.quiet else Progress(tr.steps, every=tr.log_every)
    t0 = time.perf_counter()
    result = run_local(spec, world_size=args.world_size, progress=progress)
    wall = time.perf_counter() - t0
    print(result.summary())
    print(f"params {result.n_params:,} (trainable {result.n_trainable:,}); "
          f"train {result.train_seconds:.1f} s = {1000 * result.train_seconds / tr.steps:.1f} ms/step; "
          f"eval {result.eval_seconds:.1f} s; wall {wall:.1f} s")
    if len(result.accuracy_curve) > 2:
        print("accuracy curve: " + ", ".join(f"{s}:{100 * a:.0f}%" for s, a in result.accuracy_curve))
    if args.json:
        out = result.to_dict()
        out.update(job=spec.to_dict(), simulated_world_size=args.world_size, threads=args.threads, wall_seconds=wall)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
