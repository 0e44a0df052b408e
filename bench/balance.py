"""Shardline balancing benchmark: the per-rank compute imbalance (max / mean over ranks) of a
global minibatch split naively (contiguous chunks of equal count) vs by LPT and Karmarkar-Karp
(``shardline.balanced_split``).

    .venv/bin/python bench/balance.py --out bench/results/balance.json   # ~15-30 s
    .venv/bin/python bench/balance.py --quick                            # ~5 s

The workload is the issue's: lengths lognormal(ln 64, 1) clipped to [16, 512] (``sample_lengths``).
Two sections:

* **cost**: per-rank sums of a cost model, over ``--batches`` random global minibatches of
  ``--batch-sizes`` sequences, on 2, 4 and 8 ranks; with the token count as the cost (what the
  split balances) and the split made by it.
* **timed**: one forward+backward of a small TinyGPT (jobs/models/tinygpt.py) per sequence of each rank's
  part, run one part after the other in this process and timed (the fastest of ``--time-reps``
  runs per part); the cost model the balanced split uses is fitted on this machine first
  (``CostModel.measure`` on the same model). Reports max / mean of the measured per-rank seconds:
  naive, KK by token count, KK by the fitted cost. The machine is shared and noisy; compare the
  ratios of one run.

tests/unit/test_balance.py drives ``timed_imbalance`` too (with fewer batches).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD_SIZES = (2, 4, 8)
NAIVE = "contiguous"


def sample_lengths(n: int, seed: int, *, median: float = 64.0, sigma: float = 1.0, lo: int = 16,
                   hi: int = 512) -> list[int]:
    """``n`` sequence lengths, lognormal(ln median, sigma) rounded and clipped to [lo, hi]: a
    post-training minibatch (the issue's workload). Deterministic per ``seed``."""
    rng = random.Random(seed)
    return [min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def summary(values: list[float]) -> dict:
    return {"n": len(values), "mean": statistics.fmean(values), "median": statistics.median(values),
            "min": min(values), "max": max(values)}


def cost_imbalance(batches: int, batch_sizes, world_sizes=WORLD_SIZES, seed: int = 0) -> dict:
    """Per (global batch size, world size, method): max/mean per-rank token cost over ``batches``
    random global minibatches, and the time the split took."""
    from shardline.worker.balance import balanced_split, imbalance, part_costs

    out: dict = {}
    for n in batch_sizes:
        for k in world_sizes:
            rows = {}
            for method in (NAIVE, "lpt", "kk"):
                ratios, seconds = [], []
                for b in range(batches):
                    lengths = sample_lengths(n, seed * 1_000_003 + b)
                    t0 = time.perf_counter()
                    split = balanced_split(lengths, k, method=method)
                    seconds.append(time.perf_counter() - t0)
                    ratios.append(imbalance(part_costs(split, lengths)))
                rows[method] = {"imbalance": summary(ratios), "split_ms_mean": 1e3 * statistics.fmean(seconds)}
            out[f"batch{n}_ranks{k}"] = {"batch": n, "ranks": k, **rows}
    return out


def tiny_model(seed: int = 0):
    """The timed section's model: TinyGPT, 2 layers, d_model 64, vocab 256, up to 512 tokens."""
    from shardline.jobs.models.tinygpt import TinyGPT

    return TinyGPT(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=512, seed=seed)


def forward_backward(model, generator):
    """A callable ``L -> None``: one forward+backward of ``model`` on a random sequence of L tokens."""
    import torch
    import torch.nn.functional as F

    def run(length: int) -> None:
        ids = torch.randint(0, model.vocab_size, (1, length + 1), generator=generator)
        logits = model(ids[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    return run


def timed_imbalance(batches: int = 5, batch_size: int = 32, world_size: int = 4, *, reps: int = 2,
                    measure_repeats: int = 5, seed: int = 0, threads: int = 1) -> dict:
    """Measured compute imbalance, naive vs balanced: for each of ``batches`` random global
    minibatches, run every rank's part (one forward+backward per sequence) one part after the
    other, timing each part (fastest of ``reps``; the splits interleaved), and take max / mean of
    the per-rank seconds. Splits: naive, KK by token count (``kk_tokens``) and KK by a cost model
    measured first on the same model (``kk``). ``threads`` torch threads during the run (restored after)."""
    import torch

    from shardline.worker.balance import CostModel, balanced_split, imbalance

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = tiny_model(seed)
        run = forward_backward(model, torch.Generator().manual_seed(seed))
        t0 = time.perf_counter()
        cost = CostModel.measure(run, repeats=measure_repeats, warmup=1)
        measure_s = time.perf_counter() - t0
        per_method: dict[str, list[float]] = {NAIVE: [], "kk": [], "kk_tokens": []}
        part_seconds: dict[str, list[list[float]]] = {m: [] for m in per_method}
        for b in range(batches):
            lengths = sample_lengths(batch_size, seed * 1_000_003 + 7 + b)
            splits = {NAIVE: balanced_split(lengths, world_size, method=NAIVE),
                      "kk": balanced_split(lengths, world_size, cost=cost, method="kk"),
                      "kk_tokens": balanced_split(lengths, world_size, method="kk")}
            best = {m: [math.inf] * world_size for m in splits}
            for r in range(reps):
                for m in (splits if r % 2 == 0 else reversed(list(splits))):
                    for rank, part in enumerate(splits[m]):
                        start = time.perf_counter()
                        for i in part:
                            run(lengths[i])
                        best[m][rank] = min(best[m][rank], time.perf_counter() - start)
                        model.zero_grad(set_to_none=True)
            for m in splits:
                per_method[m].append(imbalance(best[m]))
                part_seconds[m].append([round(s, 5) for s in best[m]])
    finally:
        torch.set_num_threads(saved_threads)
    return {
        "batches": batches, "batch_size": batch_size, "world_size": world_size, "reps": reps, "threads": threads,
        "cost_model": cost.as_dict(), "measure_seconds": round(measure_s, 3),
        "naive": summary(per_method[NAIVE]), "kk": summary(per_method["kk"]),
        "kk_tokens": summary(per_method["kk_tokens"]),
        "per_batch": {"naive" if m == NAIVE else m: v for m, v in per_method.items()},
        "part_seconds": part_seconds,
    }


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def run(args) -> dict:
    from run import machine_info  # bench/run.py: the same machine fields in every result

    t0 = time.monotonic()
    result = {"machine": machine_info(), "loadavg_start": loadavg(), "command": sys.argv, "config": {"batches": args.batches, "batch_sizes": args.batch_sizes, "world_sizes": list(WORLD_SIZES),
                         "timed_batches": args.timed_batches, "workload": "lognormal(ln 64, 1) clipped to [16, 512]"},
              "cost": cost_imbalance(args.batches, args.batch_sizes)}
    if args.timed_batches:
        result["timed"] = timed_imbalance(args.timed_batches, args.timed_batch_size, args.timed_world_size,
                                          reps=args.time_reps)
    result["loadavg_end"] = loadavg()
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    return result


def print_table(result: dict) -> None:
    print("per-rank token cost, max/mean (mean over batches [worst])")
    print(f"{'batch':>6} {'ranks':>5}  {'naive':>14} {'LPT':>14} {'KK':>14}")
    for row in result["cost"].values():
        cells = [f"{row[m]['imbalance']['mean']:.4f} [{row[m]['imbalance']['max']:.3f}]" for m in (NAIVE, "lpt", "kk")]
        print(f"{row['batch']:>6} {row['ranks']:>5}  " + " ".join(f"{c:>14}" for c in cells))
    t = result.get("timed")
    if t:
        c = t["cost_model"]
        print(f"\ntimed forward+backward, TinyGPT, {t['batches']} batches of {t['batch_size']} on {t['world_size']} ranks"
              f" (cost fitted: c0={c['c0']:.3g} s, c1={c['c1']:.3g} s/token, c2={c['c2']:.3g} s/token^2)")
        for m, label in (("naive", "naive"), ("kk_tokens", "KK, token cost"), ("kk", "KK, fitted cost")):
            s = t[m]
            print(f"  {label:<16} max/mean of measured seconds: mean {s['mean']:.3f}, min {s['min']:.3f}, max {s['max']:.3f}")
    print(f"wall {result['wall_seconds']} s, load {result['loadavg_start']} -> {result['loadavg_end']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Shardline balancing benchmark: naive vs LPT vs KK split imbalance")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="fewer batches (sanity run)")
    p.add_argument("--batches", type=int, default=None, help="random global minibatches per row (default 200, quick 20)")
    p.add_argument("--batch-sizes", default="32,128,512", help="global minibatch sizes (comma-separated)")
    p.add_argument("--timed-batches", type=int, default=None, help="timed minibatches (default 10, quick 3; 0 skips)")
    p.add_argument("--timed-batch-size", type=int, default=32)
    p.add_argument("--timed-world-size", type=int, default=4)
    p.add_argument("--time-reps", type=int, default=3, help="timed runs per rank part (the fastest counts)")
    args = p.parse_args(argv)
    args.batches = args.batches if args.batches is not None else (20 if args.quick else 200)
    args.timed_batches = args.timed_batches if args.timed_batches is not None else (3 if args.quick else 10)
    try:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    if args.batches < 1 or args.timed_batches < 0 or args.time_reps < 1 or not args.batch_sizes \
            or min(args.batch_sizes) < 1 or args.timed_batch_size < 1 or args.timed_world_size < 1:
        p.error("counts must be >= 1 (--timed-batches >= 0)")
    sys.path.insert(0, str(ROOT / "bench"))
    from report import run_and_report  # bench/report.py

    return run_and_report(run, print_table, args, stopped="measurements")


if __name__ == "__main__":
    sys.exit(main())
