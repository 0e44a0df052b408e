"""Exposed communication of one worker: a local ``torch.optim.AdamW`` step against ``PSOptimizer``.

    .venv/bin/python bench/step_overhead.py --out bench/results/step_overhead.json
    .venv/bin/python bench/step_overhead.py --quick

One training process (1 torch thread) and a LocalCluster of one dispatcher and one PS node on
127.0.0.1; the same TinyGPT as bench/vs_ddp.py (922,880 parameters), every iteration a batch of
``--batch`` sequences of ``--length`` tokens, a causal LM loss. Modes, each its own copy of the
model from the same seed, run interleaved in the same process (the order rotates every
iteration, so load changes hit every mode alike):

* ``local``: ``torch.optim.AdamW`` (the baseline; foreach, as torch picks on CPU);
* ``ps_overlap``: PSOptimizer BSP with push during backward and the priority pull
  (``overlap=True, prefetch_window=1``);
* ``ps_plain``: PSOptimizer BSP, everything inside ``step()`` (``overlap=False, prefetch_window=0``);
* ``ps_flat``: ``ps_plain`` with ``flatten=True`` (the model's parameters one tensor on the PS).
* ``ps_flat_overlap``: ``ps_flat`` with ``overlap=True`` (the flat tensor's blocks pushed during backward).

Per mode: the median of ``opt.step()`` time and of the whole iteration (``zero_grad``, forward,
backward, ``step``), and for the PS modes the exposed communication: ``zero_grad`` + ``step`` +
the time modules' forward pre-hooks waited for the pull (``opt.forward_wait_seconds``). With the
priority pull part of the wait moves from ``step()`` into the next forward, so the iteration time
is the fair comparison; the ratios to ``local`` are reported for both. ``--pin CORE`` pins the
training threads to one core (the PS daemon keeps every core), as bench/vs_ddp.py pins a rank. The goal of issue 11 is one-worker ``PSOptimizer.step()`` <= 1.5x a local AdamW step.
No absolute expectations are asserted anywhere.
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
from vs_ddp import HYPER, MODELS, machine_info, seq_loss_sum  # noqa: E402

MODEL = MODELS["tiny"]   # the TinyGPT of vs_ddp.py --model tiny

MODES = ("local", "ps_overlap", "ps_plain", "ps_flat", "ps_flat_overlap")
PS_MODES = {"ps_overlap": dict(overlap=True, prefetch_window=1), "ps_plain": dict(overlap=False, prefetch_window=0),
            "ps_flat": dict(overlap=False, prefetch_window=0, flatten=True),
            "ps_flat_overlap": dict(overlap=True, prefetch_window=0, flatten=True)}


def run(args) -> dict:
    import torch

    from shardline import PSOptimizer
    from shardline.jobs.models.tinygpt import TinyGPT
    from shardline.local_cluster import LocalCluster

    torch.set_num_threads(1)
    workdir = Path(tempfile.mkdtemp(prefix="shardline-stepoverhead-"))
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, MODEL["vocab_size"], (args.batch, args.length + 1), generator=g)
    result = {"machine": machine_info(), "timestamp": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "command": " ".join(sys.argv), "loadavg_start": os.getloadavg(),
              "config": {"iterations": args.iterations, "pin": args.pin, "warmup": args.warmup, "batch": args.batch,
                         "length": args.length, "model": MODEL, "bucket_cap_mb": args.bucket_cap_mb,
                         "modes": {"local": "torch.optim.AdamW", **PS_MODES}}}
    with LocalCluster(workdir / "daemons") as cluster:
        cluster.start_dispatcher()
        cluster.add_node()
        cluster.wait_for_nodes(1, timeout=30)
        if args.pin is not None:  # this thread and the threads it starts; the PS daemon started before keeps every core
            cores = sorted(os.sched_getaffinity(0))
            os.sched_setaffinity(0, {cores[args.pin % len(cores)]})
        models, opts = {}, {}
        initial = {n: p.detach().clone() for n, p in TinyGPT(**MODEL).named_parameters()}
        for mode in MODES:
            models[mode] = TinyGPT(**MODEL)
            if mode == "local":
                opts[mode] = torch.optim.AdamW(models[mode].parameters(), **HYPER)
            else:
                opts[mode] = PSOptimizer(models[mode].named_parameters(), cluster.address, f"overhead-{mode}",
                                         optimizer="adamw", bucket_cap_mb=args.bucket_cap_mb, **PS_MODES[mode],
                                         **HYPER)
        step_s = {m: [] for m in MODES}
        iter_s = {m: [] for m in MODES}
        exposed_s = {m: [] for m in PS_MODES}  # zero_grad + step + forward pre-hooks waiting for the pull
        try:
            for it in range(args.warmup + args.iterations):
                order = MODES[it % len(MODES):] + MODES[:it % len(MODES)]
                for mode in order:
                    model, opt = models[mode], opts[mode]
                    forward_wait = getattr(opt, "forward_wait_seconds", 0.0)
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    tz = time.perf_counter()
                    seq_loss_sum(model, ids).backward()
                    ts = time.perf_counter()
                    opt.step()
                    t1 = time.perf_counter()
                    if it >= args.warmup:
                        step_s[mode].append(t1 - ts)
                        iter_s[mode].append(t1 - t0)
                        if mode in PS_MODES:
                            exposed_s[mode].append(t1 - ts + tz - t0 + opt.forward_wait_seconds - forward_wait)
            for mode in PS_MODES:
                opts[mode].wait()
            # every mode trained the same steps on the same data from the same weights
            ref = dict(models["local"].named_parameters())
            result["max_abs_diff_to_local"] = {
                m: max((p.detach() - ref[n].detach()).abs().max().item() for n, p in models[m].named_parameters())
                for m in PS_MODES}
            result["local_max_abs_change"] = max((p.detach() - initial[n]).abs().max().item() for n, p in ref.items())
        finally:
            for mode in PS_MODES:
                opts[mode].close()
    summary = {}
    for mode in MODES:
        summary[mode] = {"step_ms_median": 1e3 * statistics.median(step_s[mode]),
                         "iteration_ms_median": 1e3 * statistics.median(iter_s[mode])}
    for mode in PS_MODES:
        summary[mode]["exposed_ms_median"] = 1e3 * statistics.median(exposed_s[mode])
        summary[mode]["step_ratio_to_local"] = summary[mode]["step_ms_median"] / summary["local"]["step_ms_median"]
        summary[mode]["iteration_ratio_to_local"] = (summary[mode]["iteration_ms_median"]
                                                     / summary["local"]["iteration_ms_median"])
    result.update(summary=summary, step_seconds=step_s, iteration_seconds=iter_s, exposed_seconds=exposed_s,
                  loadavg_end=os.getloadavg())
    return result


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(f"\nstep_overhead: TinyGPT 922,880 params, batch {cfg['batch']} x {cfg['length']} tokens, "
          f"{cfg['iterations']} iterations ({cfg['warmup']} warm-up) per mode, interleaved")
    print(f"{'mode':<16}{'step ms':>10}{'x local':>9}{'iter ms':>10}{'x local':>9}{'exposed ms':>12}"
          f"{'max|dw| vs local':>18}")
    for mode, s in result["summary"].items():
        diff = result["max_abs_diff_to_local"].get(mode)
        exposed = s.get("exposed_ms_median")
        print(f"{mode:<16}{s['step_ms_median']:>10.2f}{s.get('step_ratio_to_local', 1.0):>9.2f}"
              f"{s['iteration_ms_median']:>10.2f}{s.get('iteration_ratio_to_local', 1.0):>9.2f}"
              f"{'' if exposed is None else f'{exposed:.2f}':>12}{'' if diff is None else f'{diff:.1e}':>18}")
    print(f"(local AdamW moved the weights by up to {result['local_max_abs_change']:.1e}; exposed: zero_grad + step "
          f"+ forward pre-hooks waiting for the pull)")
    print(f"load {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pin", type=int, help="pin the training process's threads to this core (the PS is not pinned)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 10 iterations, 2 warm-up")
    ap.add_argument("--out", help="write the JSON here (e.g. bench/results/step_overhead.json)")
    args = ap.parse_args(argv)
    if args.quick:
        args.iterations, args.warmup = 10, 2
    return run_and_report(run, print_table, args)


if __name__ == "__main__":
    sys.exit(main())
