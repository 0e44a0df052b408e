"""Shardline rebalancing benchmark: max / mean node load on the capacity ring (the baseline, same
run) and after the rebalance policy's counts (dispatcher/rebalance.py), at sizes the integration
test does not reach.

    .venv/bin/python bench/rebalance.py --out bench/results/rebalance.json   # ~1-3 min
    .venv/bin/python bench/rebalance.py --quick                              # ~10 s

A simulated job per case (bytes/s well above the policy's idle threshold): ``hot`` blocks whose rates follow a distribution (``uniform``: all
equal, ``zipf``: rate of the i-th hottest ~ 1 / (i + 1)), and 8 times as many cold blocks
carrying ``cold_share`` of the load together. The policy sees what the dispatcher's heatmap
would hold: the 4096 hottest blocks (dispatcher.heatmap.DEFAULT_MAX_SHARDS) and every node's
total; the rest is spread like uniformly hashed keys. Loads before and after are evaluated with
every block's true rate under the ring (not with the policy's prediction). ``bound`` is the best
any ring could do: max(mean, the hottest block) / mean. Pure computation: no daemons, no
network; the live 4-node figure is tests/integration/test_heat_cluster.py's.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import run_and_report  # noqa: E402

from shardline.dispatcher.rebalance import imbalance, plan  # noqa: E402
from shardline.dispatcher.heatmap import DEFAULT_MAX_SHARDS  # noqa: E402
from shardline.services.blocks import block_hash  # noqa: E402
from shardline.services.ring import HashRing, vnode_counts  # noqa: E402


def true_load(vnodes: dict, rates: dict) -> dict:
    ring = HashRing(vnodes)
    load = dict.fromkeys(vnodes, 0.0)
    for (job, tensor, index), rate in rates.items():
        load[ring.owner(block_hash(job, tensor, index))] += rate
    return load


def case(nodes: int, hot: int, dist: str, cold_share: float, seed: int) -> dict:
    rng = random.Random(seed)
    job = f"bench-{seed}"
    if dist == "uniform":
        hot_rates = [1e4] * hot
    else:
        hot_rates = [1e4 / (i + 1) for i in range(hot)]
        rng.shuffle(hot_rates)
    total_hot = sum(hot_rates)
    cold = 8 * hot
    cold_rate = total_hot * cold_share / (1 - cold_share) / cold if cold_share else 0.0
    rates = {(job, "hot", i): r for i, r in enumerate(hot_rates)}
    rates.update({(job, "cold", i): cold_rate for i in range(cold)})
    base = vnode_counts({f"ps{i}": 1.0 for i in range(nodes)})
    before_load = true_load(base, rates)
    # What the heatmap would hold after a while: the nodes report every busy block in turn, and it
    # keeps the DEFAULT_MAX_SHARDS hottest.
    known = dict(sorted(rates.items(), key=lambda kv: -kv[1])[:DEFAULT_MAX_SHARDS])
    t0 = time.perf_counter()
    p = plan(base, base, before_load, known, now=0.0, last_change=None, cooldown=0.0, pending=False)
    seconds = time.perf_counter() - t0
    after = imbalance(true_load(p.vnodes, rates)) if p else imbalance(before_load)
    mean = sum(rates.values()) / nodes
    return {"nodes": nodes, "hot_blocks": hot, "cold_blocks": cold, "distribution": dist, "cold_share": cold_share,
            "seed": seed, "before": imbalance(before_load), "after": after,
            "predicted_after": p.predicted_after if p else None, "moved": p is not None,
            "bound": max(mean, max(rates.values())) / mean, "plan_seconds": seconds}


def run(args) -> dict:
    sizes = [(4, 48), (8, 256), (16, 1024)] if not args.quick else [(4, 48), (8, 256)]
    seeds = range(args.seeds)
    rows = [case(n, h, dist, share, s) for n, h in sizes for dist in ("uniform", "zipf")
            for share in (0.0, 0.2) for s in seeds]
    return {"benchmark": "rebalance", "target": 1.15, "cases": rows}


def print_table(result: dict) -> None:
    print(f"{'nodes':>5} {'hot':>5} {'dist':>8} {'cold':>5} {'seed':>4} {'before':>7} {'after':>7} "
          f"{'bound':>7} {'plan s':>7}")
    for r in result["cases"]:
        print(f"{r['nodes']:>5} {r['hot_blocks']:>5} {r['distribution']:>8} {r['cold_share']:>5.2f} {r['seed']:>4} "
              f"{r['before']:>7.3f} {r['after']:>7.3f} {r['bound']:>7.3f} {r['plan_seconds']:>7.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, one seed")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per case (default 3)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds = 1
    return run_and_report(run, print_table, args, stopped="computations")


if __name__ == "__main__":
    sys.exit(main())
