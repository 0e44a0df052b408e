"""Shardline vs the peers: DDP (gloo), DDP with the balanced split, FSDP2 (``fully_shard`` on
CPU/gloo) and Shardline BSP on the same post-training workload (issues 11 and 40).

    .venv/bin/python bench/vs_ddp.py --out bench/results/vs_ddp.json     # full run
    .venv/bin/python bench/vs_ddp.py --quick                              # smoke run (~1-2 min)
    .venv/bin/python bench/vs_ddp.py --link 2gbit --ps-on-ranks --quick   # two emulated machines (root)

Workload: ``--world`` machines (2) x ``--workers-per-host`` ranks (1), each rank its own process
pinned to one core (``os.sched_setaffinity``, round-robin over the cores, 1 torch thread);
``--model tiny``: TinyGPT of 922,880 parameters (vocab 512, d_model 128, 4 layers, 4 heads, up
to 512 tokens, seed 0), ``--model 25m``: 25,732,096 (vocab 512, d_model 512, 8 layers, 8
heads, up to 512 tokens), or ``--model 100m``: 101,795,840 (d_model 1024, 16 heads); AdamW; every step a global minibatch of 4 sequences per rank, lengths
lognormal(ln 64, 1) clipped to [16, 512] (``--workload lognormal``) or all equal to that
distribution's mean (``--workload balanced``); random token ids; a causal LM loss (labels = the
next token). Every mode sees the same global minibatches and starts from the same weights.

Modes (``--modes``; every Shardline mode runs on one LocalCluster of 1 dispatcher + ``--ps`` PS
nodes, 2 by default, each run a job of its own, deleted after it):

* ``ddp``: DistributedDataParallel, each rank takes its contiguous share of the global minibatch
  and backpropagates its own token mean; DDP averages the ranks, so the gradient is the mean of
  per-rank means (reference ``rank_mean``).
* ``ddp_balanced``: the global minibatch split by ``shardline.balanced_split`` (KK; by default
  evening out a ``CostModel`` that one process fits on this machine before the runs,
  ``--split-cost fitted``: a sequence's fixed cost matters as much as its tokens on this model;
  ``--split-cost tokens`` evens out token counts);
  rank r backpropagates ``world * S_r / T`` (S_r its summed token losses, T all tokens), so DDP's
  average is the gradient of the global token mean (reference ``token_mean``).
* ``fsdp2``: ``fully_shard`` on every block and the root, CPU/gloo, contiguous split and per-rank
  means like ``ddp`` (reference ``rank_mean``).
* ``shardline_default``: PSOptimizer AdamW BSP with no option beyond the job's (cluster, job,
  world size, rank, hyperparameters): whatever PSOptimizer's defaults are, and none of the options
  below (``--replication``, ``--replicate-gradients``, ``--bucket-cap-mb``, ``--block-elements``);
  the balanced split and ``rank_weights`` as ``shardline``. What a user gets.
* ``shardline``: PSOptimizer AdamW BSP, the
  balanced split, each rank pushing with weight = its loss tokens (``rank_weights``) (reference
  ``token_mean``); push during backward (``overlap``, every sequence but the last under
  ``opt.no_sync()``, the weight declared with ``set_step_weight``) and the priority pull
  (``prefetch_window=1``).
* ``shardline_plain``: the same without them (``overlap=False``, ``prefetch_window=0``): push,
  commit and pull all inside ``opt.step()``.
* ``shardline_ssp1``: ``shardline`` with ``sync="ssp", staleness=1``: a rank may compute a step on
  parameters one step old, so it matches ``token_mean`` only approximately (its loss difference is
  reported, not expected to be round-off). ``shardline_ssp1_plain``: the same with
  ``shardline_plain``'s options.
* ``shardline_flat``: ``shardline_plain`` with ``flatten=True``: the model's parameters are one
  tensor on the PS (worker/flat_params.py), so a step moves and steps a few large blocks instead
  of the model's 48 tensors. ``shardline_ssp1_flat``: the same with ``sync="ssp", staleness=1``.

Per rank: tokens/s over the timed steps (every step after ``--warmup``), the share of step time
spent waiting for communication (DDP: time blocked in the all-reduce, measured by a comm hook
that runs each bucket's all-reduce synchronously; FSDP2: step time minus the same rank's
compute on a local unsharded copy, measured in the same step; Shardline: time inside
``opt.zero_grad()`` and ``opt.step()`` plus the time modules' forward pre-hooks waited for the
pull, ``opt.forward_wait_seconds``), peak RSS (``ru_maxrss``) and the loss per step. The loss of a step is the
token mean of the whole global minibatch before the update, so every mode's curve is comparable
to a single-process reference (AdamW on the whole minibatch): ``token_mean`` (loss = S / T) or
``rank_mean`` (loss = mean over the contiguous parts of each part's token mean). The JSON gives,
per mode, the max abs difference from both and which one the mode should match.

With ``--link RATE`` every machine (and, without ``--ps-on-ranks``, every PS node) is a network
namespace behind a NIC of that rate (bench/emulated_link.py); the ranks read their host's eth0
counters between steps (bench/host_counters.py), so each run reports the bytes sent plus received
per NIC per timed step, next to what a ring all-reduce of the model's fp32 gradient moves. The PS
nodes' CPU seconds over the timed steps and their peak RSS during each run are reported too.

Repeats are interleaved (``--repeats N``; the mode order rotates every repeat). Ratios are
relative to ``ddp`` in the same repeat; no absolute numbers are expected anywhere.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from balance import sample_lengths  # noqa: E402
from emulated_link import EmulatedLink, check_rate, python_wrapper  # noqa: E402
from host_counters import (cpu_seconds, nic_delta, peak_rss_mib as process_peak_rss_mib, read_nic,  # noqa: E402
                           reset_peak_rss, ring_allreduce_bytes, status_mib)
from report import run_and_report  # noqa: E402

CLONE_NEWNET = 0x40000000
MODES = ("ddp", "ddp_balanced", "fsdp2", "shardline_default", "shardline", "shardline_plain", "shardline_ssp1", "shardline_ssp1_plain",
         "shardline_flat", "shardline_ssp1_flat")
# Shardline with one of the two levers only (not run by default: --modes names them)
EXTRA_MODES = ("shardline_overlap_only", "shardline_prefetch_only", "shardline_flat_overlap", "shardline_host_alone")
# PSOptimizer options of each Shardline mode (sync defaults to BSP). shardline_default passes none
# (and none of the benchmark's job options either: DEFAULT_MODES): what a user gets.
SHARDLINE_MODES = {"shardline_default": {},
                   "shardline": dict(overlap=True, prefetch_window=1),
                   "shardline_plain": dict(overlap=False, prefetch_window=0),
                   "shardline_overlap_only": dict(overlap=True, prefetch_window=0),
                   "shardline_prefetch_only": dict(overlap=False, prefetch_window=1),
                   "shardline_ssp1": dict(overlap=True, prefetch_window=1, sync="ssp", staleness=1),
                   "shardline_ssp1_plain": dict(overlap=False, prefetch_window=0, sync="ssp", staleness=1),
                   "shardline_flat": dict(overlap=False, prefetch_window=0, flatten=True),
                   "shardline_flat_overlap": dict(overlap=True, prefetch_window=0, flatten=True),
                   "shardline_ssp1_flat": dict(overlap=False, prefetch_window=0, sync="ssp", staleness=1, flatten=True),
                   # the defaults, but every rank pushes alone (no host aggregation): its baseline
                   "shardline_host_alone": dict(host_aggregation=False)}
DEFAULT_MODES = ("shardline_default",)
# TinyGPT sizes (--model): 922,880, 25,732,096 and 101,795,840 parameters, every one trainable (tied LM head).
MODELS = {"tiny": dict(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=512, seed=0),
          "25m": dict(vocab_size=512, d_model=512, n_layers=8, n_heads=8, max_seq_len=512, seed=0),
          "100m": dict(vocab_size=512, d_model=1024, n_layers=8, n_heads=16, max_seq_len=512, seed=0)}
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
PER_RANK = 4
MAX_LEN = 512  # a sequence of L tokens: L - 1 positions predict the next token (its loss tokens)
REFERENCE_OF = {"ddp": "rank_mean", "ddp_balanced": "token_mean", "fsdp2": "rank_mean",
                **{m: "token_mean" for m in SHARDLINE_MODES}}
SPLIT_OF = {"ddp": "contiguous", "ddp_balanced": "kk", "fsdp2": "contiguous", **{m: "kk" for m in SHARDLINE_MODES}}
# Every run is a short job on one shared cluster: a rebalance planned from one run's load would
# place the next runs' blocks, so each run starts from the ring its nodes' capacities give.
NO_REBALANCE = {"rebalance_interval": 0}
# Issue 11's goals for Shardline BSP, per workload: the least tok/s ratio to each peer in the same run.
GOALS = {"lognormal": {"ddp": 1.3, "ddp_balanced": 1.02, "fsdp2": 4.0}, "balanced": {"ddp": 1.0}}
# Issue 40's goals for shardline_default on the lognormal workload, per layout: (summary key, at
# least / at most, bound). "link": two emulated machines with --ps-on-ranks; "one_host": no --link.
GOALS_ISSUE40 = {
    "link": [("ratio_to_ddp_paired_median", ">=", 1.3), ("ratio_to_ddp_balanced_paired_median", ">=", 1.1),
             ("nic_bytes_ratio_to_ring", "<=", 1.05), ("last_rank_wait_ratio_to_ddp_paired_median", "<=", 1.2)],
    "one_host": [("ratio_to_ddp_paired_median", ">=", 1.2), ("ratio_to_ddp_balanced_paired_median", ">=", 1.05)],
    # --link with several workers per host: bytes across hosts per step against the ring
    # all-reduce between the hosts (what one worker per host moves: nic_bytes_ratio_to_ring 1.0)
    "link_hosts": [("cross_host_bytes_ratio_to_ring", "<=", 1.05)]}


# --------------------------------------------------------------------------------------------
# workload (the same in every process)
# --------------------------------------------------------------------------------------------
def balanced_length(seed: int) -> int:
    return round(statistics.fmean(sample_lengths(100_000, seed * 7 + 12345, hi=MAX_LEN)))


def global_batch(step: int, world: int, workload: str, seed: int) -> list[int]:
    """The lengths of step ``step``'s global minibatch (``world * PER_RANK`` sequences)."""
    n = world * PER_RANK
    if workload == "balanced":
        return [balanced_length(seed)] * n
    return sample_lengths(n, seed * 1_000_003 + step, hi=MAX_LEN)


def loss_tokens(lengths: list[int]) -> list[int]:
    return [L - 1 for L in lengths]


def sequence_ids(step: int, index: int, length: int, seed: int, vocab: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + index)
    return torch.randint(0, vocab, (1, length), generator=g)


def split_of(mode_split: str, lengths: list[int], world: int, cost=None) -> list[list[int]]:
    """``cost``: the ``CostModel`` of ``--split-cost fitted``, or None (token counts)."""
    from shardline import balanced_split

    return balanced_split(lengths, world, cost=cost, method=mode_split)


def fit_cost_model(cfg: dict) -> dict:
    """``CostModel.measure`` of one forward+backward of the benchmark's model on this core: the
    coefficients every balanced mode then splits by (one process fits, so every rank agrees)."""
    from shardline import CostModel
    from shardline.jobs.models.tinygpt import TinyGPT

    pin(0)
    model = TinyGPT(**cfg["model"])

    def forward_backward(length: int) -> None:
        seq_loss_sum(model, sequence_ids(0, length, length, cfg["seed"], cfg["model"]["vocab_size"])).backward()
        model.zero_grad(set_to_none=True)

    return {"cost_model": CostModel.measure(forward_backward, repeats=5, warmup=2).as_dict()}


def seq_loss_sum(model, ids):
    import torch.nn.functional as F

    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")


def pin(core: int) -> None:
    import torch

    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[core % len(cores)]} if core >= 0 else set(cores))
    torch.set_num_threads(1)


def die_with_parent() -> None:
    try:  # PR_SET_PDEATHSIG = 1: SIGKILL this rank if the benchmark dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# --------------------------------------------------------------------------------------------
# one process: a rank of a mode, or the single-process reference
# --------------------------------------------------------------------------------------------
def run_reference(cfg: dict) -> dict:
    """One process, AdamW on every step's whole global minibatch; both reference curves, and the
    model's parameter counts."""
    import torch

    from shardline.jobs.models.tinygpt import TinyGPT

    pin(0)
    out = {}
    for kind in ("token_mean", "rank_mean"):
        model = TinyGPT(**cfg["model"])
        opt = torch.optim.AdamW(model.parameters(), **HYPER)
        losses = []
        for step in range(cfg["steps"]):
            lengths = global_batch(step, cfg["world"], cfg["workload"], cfg["seed"])
            parts = split_of("contiguous", lengths, cfg["world"])
            toks = loss_tokens(lengths)
            T = sum(toks)
            opt.zero_grad()
            total = 0.0
            for part in parts:
                t_r = sum(toks[i] for i in part)
                for i in part:
                    s = seq_loss_sum(model, sequence_ids(step, i, lengths[i], cfg["seed"], cfg["model"]["vocab_size"]))
                    total += float(s.detach())
                    scale = 1.0 / T if kind == "token_mean" else 1.0 / (t_r * len(parts))
                    (s * scale).backward()
            opt.step()
            losses.append(total / T)
        out[kind] = losses
    return {"curves": out, "peak_rss_mib": peak_rss_mib(), "parameters": sum(p.numel() for p in model.parameters()),
            "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def run_rank(cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    from shardline import CostModel, rank_weights
    from shardline.jobs.models.tinygpt import TinyGPT

    mode, rank, world = cfg["mode"], cfg["rank"], cfg["world"]
    pin(rank)
    model = TinyGPT(**cfg["model"])
    wait_s = [0.0]
    opt = None
    local = None
    shardline = mode in SHARDLINE_MODES
    uses_dist = not shardline
    if uses_dist:
        dist.init_process_group("gloo", init_method=f"tcp://{cfg.get('master', '127.0.0.1')}:{cfg['port']}", rank=rank,
                                world_size=world)
    if mode in ("ddp", "ddp_balanced"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model)

        def timed_allreduce(state, bucket):
            buf = bucket.buffer()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            wait_s[0] += time.perf_counter() - t0
            buf.div_(world)
            fut = torch.futures.Future()
            fut.set_result(buf)
            return fut

        net.register_comm_hook(None, timed_allreduce)
        opt = torch.optim.AdamW(net.parameters(), **HYPER)
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        local = TinyGPT(**cfg["model"])  # the compute baseline: same part, no communication
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = torch.optim.AdamW(net.parameters(), **HYPER)
    elif shardline:
        from shardline import PSOptimizer

        net = model
        opt = PSOptimizer(model.named_parameters(), cfg["cluster"], cfg["job"], optimizer="adamw",
                          world_size=world, rank=rank, **cfg["ps_options"], **HYPER)
    else:
        raise ValueError(mode)

    cost = CostModel.from_config(cfg["cost_model"]) if cfg.get("cost_model") else None
    losses_s, tokens, step_s, wait_per_step = [], [], [], []
    # Counters over the timed steps, read between steps (file reads, untimed): the NICs of the
    # hosts this rank reads (host -> a pid living there, "self" for its own) and the PS's CPU.
    nic_pids, ps_pids = cfg.get("nic_pids", {}), cfg.get("ps_pids", [])

    def counters() -> dict:
        return {"nic": {host: read_nic(pid) for host, pid in nic_pids.items()},
                "ps_cpu_seconds": sum(cpu_seconds(pid) for pid in ps_pids)}

    before = None
    for step in range(cfg["steps"]):
        if step == cfg["timed_from"]:
            before = counters()
        lengths = global_batch(step, world, cfg["workload"], cfg["seed"])
        parts = split_of(SPLIT_OF[mode], lengths, world, cost)
        mine = parts[rank]
        toks = loss_tokens(lengths)
        T = sum(toks)
        t_r = sum(toks[i] for i in mine)
        seqs = [sequence_ids(step, i, lengths[i], cfg["seed"], cfg["model"]["vocab_size"]) for i in mine]
        if mode == "ddp_balanced":
            scale = world / T
        elif shardline:
            w = rank_weights(parts, toks)[rank]
            scale, weight = w.loss_scale, w.weight
        else:
            scale = 1.0 / t_r
        baseline = None
        if local is not None:  # FSDP2: time the same part on the local copy first, untimed in the step
            t0 = time.perf_counter()
            for ids in seqs:
                (seq_loss_sum(local, ids) * scale).backward()
            local.zero_grad(set_to_none=True)
            baseline = time.perf_counter() - t0
        wait_s[0] = 0.0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if shardline:
            wait_s[0] = time.perf_counter() - t0
            forward_wait = opt.forward_wait_seconds
            opt.set_step_weight(weight)  # pushed with the buckets during the last backward
        s_total = 0.0
        for j, ids in enumerate(seqs):
            last = j == len(seqs) - 1
            if (mode in ("ddp", "ddp_balanced") or shardline) and not last:
                with net.no_sync() if not shardline else opt.no_sync():
                    s = seq_loss_sum(net, ids)
                    (s * scale).backward()
            else:
                if mode == "fsdp2":
                    net.set_requires_gradient_sync(last)
                s = seq_loss_sum(net, ids)
                (s * scale).backward()
            s_total += float(s.detach())
        if shardline:
            ts = time.perf_counter()
            opt.step(weight=weight)
            wait_s[0] += time.perf_counter() - ts + opt.forward_wait_seconds - forward_wait
        else:
            opt.step()
        dt = time.perf_counter() - t0
        if mode == "fsdp2":
            wait_s[0] = max(0.0, dt - baseline)
        losses_s.append(s_total)
        tokens.append(t_r)
        step_s.append(dt)
        wait_per_step.append(wait_s[0])
    after = counters()   # before close(): a pull still in flight counts as one in flight at the start did
    if shardline:
        opt.close()
    if uses_dist:
        dist.barrier()
        dist.destroy_process_group()
    return {"mode": mode, "rank": rank, "loss_sums": losses_s, "tokens": tokens, "step_seconds": step_s,
            "wait_seconds": wait_per_step, "peak_rss_mib": peak_rss_mib(),
            "nic": {host: nic_delta(before["nic"][host], after["nic"][host]) for host in nic_pids},
            "ps_cpu_seconds_timed": after["ps_cpu_seconds"] - before["ps_cpu_seconds"] if ps_pids else None}


def child_main(cfg_path: str, out_path: str) -> int:
    die_with_parent()
    cfg = json.loads(Path(cfg_path).read_text())
    runner = {"reference": run_reference, "fit_cost": fit_cost_model}.get(cfg["mode"], run_rank)
    result = runner(cfg)
    tmp = out_path + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, out_path)
    return 0


# --------------------------------------------------------------------------------------------
# the orchestrator
# --------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Children:
    """Every process the benchmark starts, stopped by pid in ``stop_all`` (SIGTERM, then SIGKILL)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.link = None        # an EmulatedLink (--link): rank r runs in host rank_host(r)
        self.rank_host = None

    def start(self, cfg: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, Path]:
        cfg_path, out_path, log = workdir / f"{name}.cfg.json", workdir / f"{name}.result.json", workdir / f"{name}.log"
        cfg_path.write_text(json.dumps(cfg))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(cfg_path), str(out_path)]
        if self.link is not None and "rank" in cfg:
            argv = self.link.command(self.rank_host(cfg["rank"]), argv)
            env["GLOO_SOCKET_IFNAME"] = "eth0"   # gloo would pick the address of the hostname (loopback)
        with open(log, "ab") as fh:
            p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(p)
        return p, out_path

    def wait(self, procs, outs, timeout: float, logs: list[Path]) -> list[dict]:
        deadline = time.monotonic() + timeout
        pending = list(procs)
        while pending:
            for p in list(pending):
                code = p.poll()
                if code is None:
                    continue
                pending.remove(p)
                if code != 0:
                    tails = "\n".join(f"--- {lg.name}\n" + "\n".join(lg.read_text(errors="replace").splitlines()[-25:])
                                      for lg in logs)
                    raise RuntimeError(f"a rank process exited with {code}:\n{tails}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank processes did not finish in {timeout:g} s (logs in {logs[0].parent})")
            time.sleep(0.02)
        return [json.loads(o.read_text()) for o in outs]

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        self.procs = []


def ps_options(mode: str, args) -> dict:
    """The PSOptimizer keyword arguments of ``mode`` beyond the job's (cluster, job, optimizer,
    world size, rank, hyperparameters). shardline_default: none, whatever the command line says."""
    if mode in DEFAULT_MODES:
        return {}
    options = dict(bucket_cap_mb=args.bucket_cap_mb, block_elements=args.block_elements, replication=args.replication,
                   **SHARDLINE_MODES[mode])
    if args.replicate_gradients:   # else the job's default, whatever it is
        options["replicate_gradients"] = True
    return options


def counter_readers(mode: str, args, children: Children, cluster) -> dict[int, dict]:
    """What each rank reads between steps (run_rank's counters): rank -> {"nic_pids", "ps_pids"}.
    The first rank of each host reads its host's NIC; rank 0 also reads the NICs of the hosts
    only PS nodes run in (through their pids; a Shardline mode's) and the PS nodes' CPU time."""
    readers: dict[int, dict] = {r: {"nic_pids": {}, "ps_pids": []} for r in range(args.ranks)}
    if children.link is not None:
        for r in range(0, args.ranks, args.workers_per_host):
            readers[r]["nic_pids"][children.rank_host(r)] = "self"
    if mode in SHARDLINE_MODES:
        readers[0]["ps_pids"] = [n.pid for n in cluster.nodes]
        if children.link is not None and not args.ps_on_ranks:
            readers[0]["nic_pids"].update({args.ps_host(i): n.pid for i, n in enumerate(cluster.nodes)})
    return readers


def run_mode(mode: str, args, workdir: Path, children: Children, repeat: int, cluster) -> dict:
    world = args.ranks
    base = {"mode": mode, "world": world, "steps": args.steps, "timed_from": min(args.warmup, args.steps - 1),
            "workload": args.workload, "seed": args.seed, "cost_model": args.cost_model, "model": MODELS[args.model]}
    shardline = mode in SHARDLINE_MODES
    if shardline:
        base.update(cluster=cluster.address, job=f"vsddp-{mode}-{os.getpid()}-{repeat}", ps_options=ps_options(mode, args))
    else:
        base["port"] = free_port()
        if children.link is not None:
            base["master"] = children.link.address(children.rank_host(0))
    readers = counter_readers(mode, args, children, cluster)
    # the PS nodes' peak RSS of this run alone: restarted from their RSS now (the jobs before are deleted)
    rss_reset = all([reset_peak_rss(n.pid) for n in cluster.nodes]) if shardline else None
    rss_start = {n.name: round(status_mib(n.pid, "VmRSS"), 1) for n in cluster.nodes} if shardline else None
    started, outs, logs = [], [], []
    for r in range(world):
        name = f"r{repeat}-{mode}-rank{r}"
        p, out = children.start(dict(base, rank=r, **readers[r]), workdir, name)
        started.append(p)
        outs.append(out)
        logs.append(workdir / f"{name}.log")
    ps_cpu = ps_cpu_seconds(cluster) if shardline else None
    t0 = time.monotonic()
    ranks = children.wait(started, outs, args.timeout, logs)
    wall = time.monotonic() - t0
    children.procs = [p for p in children.procs if p not in started]
    summary = summarize_mode(mode, ranks, args, wall)
    if shardline:
        rss = {n.name: round(process_peak_rss_mib(n.pid), 1) for n in cluster.nodes}
        cpu_timed = ranks[0]["ps_cpu_seconds_timed"]
        summary["ps"] = dict(early_blocks(cluster, base["job"]), cpu_seconds=ps_cpu_seconds(cluster) - ps_cpu,
                             cpu_seconds_timed=cpu_timed, cpu_seconds_per_step=cpu_timed / summary["timed_steps"],
                             peak_rss_mib=rss, peak_rss_mib_max=max(rss.values()), peak_rss_since_run_start=rss_reset,
                             rss_at_run_start_mib=rss_start,
                             primary_share=primary_share(cluster, base["job"]),
                             job_deleted=delete_job(cluster, base["job"]))
    return summary


def delete_job(cluster, job: str) -> bool | str:
    """Delete a finished run's job, so that the PS nodes' memory holds one run's job at a time
    (a 25 M-parameter job keeps values, moments, replicas and the restart copies: ~0.5 GB a node).
    True, or the error's text (the run's numbers stand either way)."""
    client = cluster.client()
    try:
        client.delete_job(job)
        return True
    except Exception as exc:  # noqa: BLE001 - reported in the run's JSON, not fatal to the benchmark
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def enter_namespace(name: str) -> int:
    """Move this process (single-threaded still: threads started later follow it) into network
    namespace ``name``; returns a descriptor of the one it left, for leave_namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {name}")
    finally:
        os.close(target)
    return home


def leave_namespace(home: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setns(home, CLONE_NEWNET)
    os.close(home)


def ps_cpu_seconds(cluster) -> float:
    """User + system CPU seconds the cluster's PS processes used so far (/proc/PID/stat)."""
    return sum(cpu_seconds(node.pid) for node in cluster.nodes)


def primary_share(cluster, job: str) -> dict:
    """Each PS node's share of ``job``'s trainable elements it is the primary of (what it receives
    pushes for and steps): the consistent-hash placement of the job's blocks. A flat job has a few
    large blocks, so on several nodes one node often holds most of them."""
    from shardline.services.placement import place, trainable_keys
    from shardline.services.blocks import block_slice
    from shardline.services.routing import RoutingView

    client = cluster.client()
    try:
        view, spec = RoutingView.from_proto(client.get_routing()), client.get_job(job).spec
    finally:
        client.close()
    placement, numel = place(view, spec), {t.name: math.prod(t.shape) for t in spec.tensors}
    elements: dict[str, int] = {}
    for tensor, index in trainable_keys(spec):
        node = placement.primary((tensor, index))
        elements[node] = elements.get(node, 0) + block_slice(numel[tensor], spec.block_elements, index).numel
    total = sum(elements.values()) or 1
    return {node: round(n / total, 3) for node, n in sorted(elements.items())}


def early_blocks(cluster, job: str) -> dict:
    """The PS nodes' pipelined-apply counters for ``job`` (their Prometheus metrics): blocks
    applied from an early step, and blocks stepped early in vain."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"shardline_ps_blocks_applied_early": "applied_early",
              "shardline_ps_blocks_stepped_early_unused": "stepped_early_unused"}
    out = dict.fromkeys(wanted.values(), 0)
    for node in cluster.nodes:
        text = urllib.request.urlopen(f"http://{node.metrics}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                name = sample.name.removesuffix("_total")
                if name in wanted and sample.labels.get("job_name") == job:
                    out[wanted[name]] += int(sample.value)
    return out


def summarize_mode(mode: str, ranks: list[dict], args, wall: float) -> dict:
    timed = range(min(args.warmup, args.steps - 1), args.steps)
    per_rank = []
    for r in ranks:
        secs = sum(r["step_seconds"][s] for s in timed)
        toks = sum(r["tokens"][s] for s in timed)
        wait = sum(r["wait_seconds"][s] for s in timed)
        per_rank.append({"rank": r["rank"], "tokens_per_s": toks / secs, "wait_share": wait / secs, "seconds": secs,
                         "tokens": toks, "peak_rss_mib": r["peak_rss_mib"],
                         "step_ms_median": 1e3 * statistics.median(r["step_seconds"][s] for s in timed)})
    total_tokens = sum(p["tokens"] for p in per_rank)
    slowest = max(p["seconds"] for p in per_rank)
    # The ranks' own time (step time less every wait): the throughput this run's compute allows at
    # best, were communication, the optimizer step and the slowest rank all free.
    busiest = max(p["seconds"] * (1.0 - p["wait_share"]) for p in per_rank)
    # The smaller wait of a step is the wait of the rank that finished its compute last: what the
    # step's communication and optimizer cost with no imbalance in it.
    last_wait = statistics.median(min(r["wait_seconds"][s] for r in ranks) for s in timed)
    losses = [sum(r["loss_sums"][s] for r in ranks) / sum(r["tokens"][s] for r in ranks) for s in range(args.steps)]
    nic = {host: delta for r in ranks for host, delta in r["nic"].items()}
    nic_figures = nic_per_step(nic, len(timed)) if nic else {}
    return {"mode": mode, "tokens_per_s": total_tokens / slowest, "tokens_per_s_without_waits": total_tokens / busiest,
            "timed_steps": len(timed), "nic": nic, **nic_figures,
            "last_rank_wait_ms": 1e3 * last_wait,
            "wait_share_mean": statistics.fmean(p["wait_share"] for p in per_rank),
            "wait_share_max": max(p["wait_share"] for p in per_rank), "peak_rss_mib_max": max(p["peak_rss_mib"] for p in per_rank),
            "per_rank": per_rank, "losses": losses, "wall_seconds": wall}


def nic_per_step(nic: dict[str, dict[str, int]], steps: int) -> dict:
    """A run's NIC figures from each host's counter deltas over ``steps`` timed steps:
    ``nic_bytes_per_step_per_host`` (sent plus received), ``nic_bytes_per_step`` (their mean over
    the NICs) and ``cross_host_bytes_per_step`` (every host's sent bytes: what crossed the switch)."""
    per_host = {host: (d["tx_bytes"] + d["rx_bytes"]) / steps for host, d in sorted(nic.items())}
    return {"nic_bytes_per_step_per_host": per_host, "nic_bytes_per_step": statistics.fmean(per_host.values()),
            "cross_host_bytes_per_step": sum(d["tx_bytes"] for d in nic.values()) / steps}


def ring_figures(trainable_parameters: int, hosts: int) -> dict:
    """What a ring all-reduce of the model's fp32 gradient over ``hosts`` hosts moves per step:
    per host each way, per NIC sent plus received (comparable with nic_bytes_per_step), and summed
    over the hosts' sends (comparable with cross_host_bytes_per_step)."""
    payload = 4 * trainable_parameters
    each_way = ring_allreduce_bytes(payload, hosts)
    return {"hosts": hosts, "payload_bytes": payload, "bytes_each_way_per_host": each_way,
            "nic_bytes_per_step": 2 * each_way, "cross_host_bytes_per_step": hosts * each_way}


def machine_info() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cores": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0))}
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    return info


def run(args) -> dict:
    from shardline.local_cluster import LocalCluster
    from shardline.services.security import write_new_token

    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="shardline-vsddp-"))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES + EXTRA_MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES + EXTRA_MODES)}")
    result: dict = {"machine": machine_info(), "timestamp": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "command": " ".join(sys.argv), "loadavg_start": os.getloadavg(), "workdir": str(workdir),
                    "config": {"modes": modes, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                               "workload": args.workload, "world": args.world, "workers_per_host": args.workers_per_host,
                               "ranks": args.ranks, "per_rank": PER_RANK, "seed": args.seed,
                               "split_cost": args.split_cost, "ps_nodes": args.ps, "ps_threads": args.ps_threads, "replication": args.replication,
                               "replicate_gradients": args.replicate_gradients, "bucket_cap_mb": args.bucket_cap_mb, "block_elements": args.block_elements,
                               "model": dict(MODELS[args.model], name=args.model, architecture="TinyGPT"),
                               "hyper": {k: list(v) if isinstance(v, tuple) else v for k, v in HYPER.items()},
                               "split": {m: SPLIT_OF[m] for m in modes}, "reference": {m: REFERENCE_OF[m] for m in modes},
                               "ps_options": {m: ps_options(m, args) for m in modes if m in SHARDLINE_MODES}},
                    "skipped": {}}
    children = Children()
    cluster = link = home = None
    try:
        p, out = children.start({"mode": "reference", "world": args.ranks, "steps": args.steps, "workload": args.workload,
                                 "seed": args.seed, "model": MODELS[args.model]}, workdir, "reference")
        ref = children.wait([p], [out], args.timeout, [workdir / "reference.log"])[0]
        children.procs = []
        result["reference"] = ref
        result["config"]["model"].update(parameters=ref["parameters"], trainable_parameters=ref["trainable_parameters"])
        args.cost_model = None
        if args.split_cost == "fitted" and args.workload != "balanced":  # equal lengths: every cost splits alike
            p, out = children.start({"mode": "fit_cost", "seed": args.seed, "model": MODELS[args.model]}, workdir, "fit_cost")
            args.cost_model = children.wait([p], [out], args.timeout, [workdir / "fit_cost.log"])[0]["cost_model"]
            children.procs = []
        result["config"]["split_cost_model"] = args.cost_model
        # hosts of --link: the ranks' machines ("host<h>", workers_per_host ranks each, contiguous)
        # and, without --ps-on-ranks, one per PS node ("ps<i>")
        hosts = [f"host{h}" for h in range(args.world)]
        children.rank_host = lambda r: hosts[r // args.workers_per_host]
        args.ps_host = (lambda i: hosts[i % args.world]) if args.ps_on_ranks else (lambda i: f"ps{i}")
        if args.link:
            own = [] if args.ps_on_ranks else [args.ps_host(i) for i in range(args.ps)]
            link = EmulatedLink(own + hosts, args.link)
            children.link = link
            home = enter_namespace(link.hosts[args.ps_host(0)][0])  # this process's own calls (status, metrics) go from there
            result["config"]["link"] = {"rate": args.link, "hosts": {k: v[1] for k, v in link.hosts.items()},
                                        "ps_hosts": [args.ps_host(i) for i in range(args.ps)],
                                        "rank_hosts": [children.rank_host(r) for r in range(args.ranks)]}
            result["config"]["ring_allreduce"] = ring_figures(ref["trainable_parameters"], args.world)
        if any(m in SHARDLINE_MODES for m in modes):
            if link is None:
                cluster = LocalCluster(workdir / "daemons")
                cluster.start_dispatcher(**NO_REBALANCE)
                nodes = [cluster.add_node(wait=False, torch_threads=args.ps_threads) for _ in range(args.ps)]
            else:  # every daemon in its host, TCP between hosts (a non-loopback address needs the token)
                token = workdir / "cluster.token"
                write_new_token(token)
                os.environ["SHARDLINE_CLUSTER_TOKEN_FILE"] = str(token)   # the ranks' PSOptimizer reads it
                cluster = LocalCluster(workdir / "daemons", python=python_wrapper(workdir / "python", sys.executable),
                                       cluster_token_file=str(token))
                host = lambda i: dict(listen=f"{link.address(args.ps_host(i))}:0",  # noqa: E731
                                      env={"EMULATED_HOST_NETNS": link.hosts[args.ps_host(i)][0]})
                cluster.start_dispatcher(**host(0), **NO_REBALANCE)
                nodes = [cluster.add_node(wait=False, torch_threads=args.ps_threads, **host(i)) for i in range(args.ps)]
            for n in nodes:
                cluster.wait_ready(n)
            cluster.wait_for_nodes(args.ps, timeout=30)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.repeats):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            for m in order:
                if m in result["skipped"]:
                    continue
                try:
                    res = run_mode(m, args, workdir, children, rep, cluster)
                except RuntimeError as exc:
                    if m == "fsdp2":  # never silently: the exact reason goes to the JSON
                        result["skipped"][m] = str(exc)[-2000:]
                        children.stop_all()
                        continue
                    raise
                res["repeat"] = rep
                runs[m].append(res)
                if args.verbose:
                    print(repeat_line(rep, m, res, result["config"].get("ring_allreduce")), flush=True)
        result["runs"] = runs
        result["summary"] = summarize(runs, ref["curves"], args, result["config"].get("ring_allreduce"))
        # issue 11's goals are for one host (its measurements); between emulated hosts they are not held
        result["goals"] = {} if args.link else goal_checks(result["summary"], args.workload)
        result["goals_issue40"] = issue40_goal_checks(result["summary"], args)
    finally:
        children.stop_all()
        if cluster is not None:
            cluster.shutdown()
            result["daemon_exit_codes"] = {h.name: h.returncode for h in cluster.handles.values()}
        if home is not None:
            leave_namespace(home)
        if link is not None:
            link.close()
    result["loadavg_end"] = os.getloadavg()
    result["wall_seconds"] = time.monotonic() - t_start
    return result


def summarize(runs: dict, curves: dict, args, ring: dict | None = None) -> dict:
    """Per mode, the medians over repeats (ratios: paired by repeat). ``ring``: ring_figures of
    a --link run, which the NIC bytes are compared with."""
    out = {}
    base = {r["repeat"]: r for r in runs.get("ddp", [])}
    balanced = {r["repeat"]: r for r in runs.get("ddp_balanced", [])}
    fsdp = {r["repeat"]: r for r in runs.get("fsdp2", [])}

    def paired(rs, peers, key="tokens_per_s"):  # per repeat: this mode's key over the peer's tok/s
        return [r[key] / peers[r["repeat"]]["tokens_per_s"] for r in rs if r["repeat"] in peers]

    def median(ratios):
        return statistics.median(ratios) if ratios else None

    for m, rs in runs.items():
        if not rs:
            continue
        ratios = paired(rs, base)
        diffs = {k: max(max(abs(a - b) for a, b in zip(r["losses"], c)) for r in rs) for k, c in curves.items()}
        out[m] = {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "ratio_to_ddp_paired_median": median(ratios),
            "ratio_to_ddp_min": min(ratios) if ratios else None, "ratio_to_ddp_max": max(ratios) if ratios else None,
            "wait_share_mean_median": statistics.median(r["wait_share_mean"] for r in rs),
            "wait_share_max_median": statistics.median(r["wait_share_max"] for r in rs),
            "last_rank_wait_ms_median": statistics.median(r["last_rank_wait_ms"] for r in rs),
            "peak_rss_mib_max": max(r["peak_rss_mib_max"] for r in rs),
            "reference": REFERENCE_OF[m], "split": SPLIT_OF[m],
            "loss_max_abs_diff": diffs, "loss_max_abs_diff_own_reference": diffs[REFERENCE_OF[m]],
            "first_loss": rs[0]["losses"][0], "last_loss": rs[0]["losses"][-1],
            "ratio_to_ddp_balanced_paired_median": median(paired(rs, balanced)),
            "ratio_to_fsdp2_paired_median": median(paired(rs, fsdp)),
            "tokens_per_s_without_waits_median": statistics.median(r["tokens_per_s_without_waits"] for r in rs),
            "without_waits_ratio_to_ddp_paired_median": median(paired(rs, base, "tokens_per_s_without_waits")),
            "without_waits_ratio_to_fsdp2_paired_median": median(paired(rs, fsdp, "tokens_per_s_without_waits")),
            "last_rank_wait_ratio_to_ddp_paired_median": median(
                [r["last_rank_wait_ms"] / base[r["repeat"]]["last_rank_wait_ms"] for r in rs
                 if r["repeat"] in base and base[r["repeat"]]["last_rank_wait_ms"] > 0]),
            **resource_summary(rs, ring),
        }
    return out


def resource_summary(rs: list[dict], ring: dict | None) -> dict:
    """A mode's bytes on the NICs (None without --link) and its PS nodes' memory and CPU (None for
    the peers), over its repeats: medians, the peak RSS a max."""
    def median_of(key):
        values = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(values) if values else None

    nic = median_of("nic_bytes_per_step")
    hosts = sorted({h for r in rs for h in r.get("nic_bytes_per_step_per_host", {})})
    ps = [r["ps"] for r in rs if r.get("ps")]
    return {
        "nic_bytes_per_step": nic,
        "nic_bytes_per_step_per_host": {h: statistics.median(r["nic_bytes_per_step_per_host"][h] for r in rs
                                                             if h in r.get("nic_bytes_per_step_per_host", {}))
                                        for h in hosts},
        "cross_host_bytes_per_step": median_of("cross_host_bytes_per_step"),
        "ring_nic_bytes_per_step": ring["nic_bytes_per_step"] if ring and nic is not None else None,
        "nic_bytes_ratio_to_ring": nic / ring["nic_bytes_per_step"] if ring and nic is not None else None,
        "cross_host_bytes_ratio_to_ring": (median_of("cross_host_bytes_per_step") / ring["cross_host_bytes_per_step"]
                                           if ring and nic is not None else None),
        "ps_peak_rss_mib": max(p["peak_rss_mib_max"] for p in ps) if ps else None,
        "ps_cpu_seconds_per_step": statistics.median(p["cpu_seconds_per_step"] for p in ps) if ps else None,
    }


def repeat_line(rep: int, mode: str, res: dict, ring: dict | None) -> str:
    """-v: one run's numbers, as it ends."""
    text = (f"repeat {rep} {mode}: {res['tokens_per_s']:.0f} tok/s, wait {res['wait_share_mean']:.1%}, "
            f"last {res['last_rank_wait_ms']:.1f} ms, worker RSS {res['peak_rss_mib_max']:.0f} MiB")
    if res.get("nic_bytes_per_step") is not None:
        text += (f", NIC {res['nic_bytes_per_step'] / 1e6:.2f} MB/step"
                 + (f" ({res['nic_bytes_per_step'] / ring['nic_bytes_per_step']:.2f} x ring)" if ring else "")
                 + " [" + ", ".join(f"{h} {b / 1e6:.2f}" for h, b in res["nic_bytes_per_step_per_host"].items()) + "]"
                 + f", cross-host {res['cross_host_bytes_per_step'] / 1e6:.2f} MB/step")
    ps = res.get("ps")
    if ps is not None:
        text += (f", PS {ps['cpu_seconds']:.2f} CPU s ({1e3 * ps['cpu_seconds_per_step']:.1f} ms/step timed), "
                 f"PS peak RSS {ps['peak_rss_mib']}, blocks applied early "
                 f"{ps['applied_early']} (stepped in vain {ps['stepped_early_unused']}), primary share {ps['primary_share']}")
    return text


def goal_checks(summary: dict, workload: str) -> dict:
    """Each Shardline BSP mode's paired-median ratio to each peer that has a goal (GOALS) and ran:
    ``{mode: {peer: {"ratio", "goal", "met", "bound"}}}``; ``bound`` is the ratio were every wait
    of the mode's ranks gone (ddp and fsdp2 only). SSP modes are reported, not held to the goals."""
    checks = {}
    for mode, s in summary.items():
        if mode not in SHARDLINE_MODES or SHARDLINE_MODES[mode].get("sync", "bsp") != "bsp":
            continue
        for peer, goal in GOALS[workload].items():
            ratio = s.get(f"ratio_to_{peer}_paired_median")
            if ratio is not None:
                checks.setdefault(mode, {})[peer] = {
                    "ratio": ratio, "goal": goal, "met": ratio >= goal,
                    "bound": s.get(f"without_waits_ratio_to_{peer}_paired_median")}
    return checks


def issue40_goal_checks(summary: dict, args) -> dict:
    """shardline_default against issue 40's goals (GOALS_ISSUE40) where the run has one of its
    layouts (lognormal workload; --link with --ps-on-ranks, or one host): ``{"layout", "as_in_issue",
    "checks": {key: {"value", "op", "goal", "met"}}}`` (``met`` None where the value is missing);
    empty otherwise. ``as_in_issue``: 2 PS nodes, default replication, one worker per host."""
    s = summary.get("shardline_default")
    if s is None or args.workload != "lognormal" or (args.link and not args.ps_on_ranks):
        return {}
    layout = "link" if args.link else "one_host"
    checks = {}
    for key, op, goal in GOALS_ISSUE40[layout] + (GOALS_ISSUE40["link_hosts"] if args.link and args.workers_per_host > 1 else []):
        value = s.get(key)
        met = None if value is None else (value >= goal if op == ">=" else value <= goal)
        checks[key] = {"value": value, "op": op, "goal": goal, "met": met}
    return {"layout": layout, "as_in_issue": args.ps == 2 and args.replication is None and args.workers_per_host == 1,
            "checks": checks}


def print_table(result: dict) -> None:
    cfg = result["config"]
    model = cfg["model"]
    print(f"\nvs_ddp: workload {cfg['workload']}, {cfg['ranks']} ranks ({cfg['workers_per_host']} per host) x "
          f"{cfg['per_rank']} sequences, {cfg['steps']} steps ({cfg['warmup']} warm-up), {cfg['repeats']} repeat(s), "
          f"TinyGPT {model['name']} ({model.get('parameters', 0):,} params: {model['n_layers']} layers, d_model "
          f"{model['d_model']}, vocab {model['vocab_size']}), AdamW, {cfg['ps_nodes']} PS node(s)"
          + (f", link {cfg['link']['rate']}" if cfg.get("link") else ""))
    c = cfg.get("split_cost_model")
    print("balanced split by " + (f"fitted cost: c0 {c['c0'] * 1e3:.3g} ms + c1 {c['c1'] * 1e6:.3g} us/token"
                                  f" + c2 {c['c2'] * 1e9:.3g} ns/token^2" if c else "token count"))
    print(f"{'mode':<24}{'split':<11}{'tok/s':>9}{'x ddp':>8}{'wait mean':>11}{'wait max':>10}{'last ms':>9}"
          f"{'RSS MiB':>9}{'ref':>12}{'max|dloss|':>12}{'other ref':>11}")
    for m, s in result.get("summary", {}).items():
        other = "rank_mean" if s["reference"] == "token_mean" else "token_mean"
        ratio = s["ratio_to_ddp_paired_median"]
        print(f"{m:<24}{s['split']:<11}{s['tokens_per_s_median']:>9.0f}{(f'{ratio:.2f}' if ratio else '-'):>8}"
              f"{s['wait_share_mean_median']:>11.1%}{s['wait_share_max_median']:>10.1%}"
              f"{s['last_rank_wait_ms_median']:>9.1f}{s['peak_rss_mib_max']:>9.0f}"
              f"{s['reference']:>12}{s['loss_max_abs_diff_own_reference']:>12.2e}{s['loss_max_abs_diff'][other]:>11.2e}")
    print("bounds: a mode's tok/s were every wait of its ranks gone (their own forward/backward time only), "
          "against the peers' measured tok/s")
    for m, s in result.get("summary", {}).items():
        if m.startswith("shardline") and s.get("tokens_per_s_without_waits_median"):
            vs = [f"{r:.2f} x {peer}" for peer, r in (("ddp", s["without_waits_ratio_to_ddp_paired_median"]),
                                                     ("fsdp2", s["without_waits_ratio_to_fsdp2_paired_median"]))
                  if r is not None]
            measured = s.get("ratio_to_fsdp2_paired_median")
            print(f"  {m:<22}{s['tokens_per_s_without_waits_median']:>9.0f} tok/s = {', '.join(vs)}"
                  + (f" (measured {measured:.2f} x fsdp2)" if measured is not None else ""))
    summary = result.get("summary", {})
    ring = cfg.get("ring_allreduce")
    print(f"{'mode':<24}{'NIC MB/step':>12}{'x ring':>8}{'cross MB/st':>12}{'last x ddp':>11}{'PS RSS MiB':>11}"
          f"{'PS CPU ms/st':>13}")
    fmt = lambda v, f, scale=1.0: "-" if v is None else format(v * scale, f)  # noqa: E731
    for m, s in summary.items():
        print(f"{m:<24}{fmt(s['nic_bytes_per_step'], '.2f', 1e-6):>12}{fmt(s['nic_bytes_ratio_to_ring'], '.2f'):>8}"
              f"{fmt(s['cross_host_bytes_per_step'], '.2f', 1e-6):>12}"
              f"{fmt(s['last_rank_wait_ratio_to_ddp_paired_median'], '.2f'):>11}{fmt(s['ps_peak_rss_mib'], '.0f'):>11}"
              f"{fmt(s['ps_cpu_seconds_per_step'], '.1f', 1e3):>13}")
    if ring:
        print(f"ring all-reduce of {ring['payload_bytes'] / 1e6:.2f} MB over {ring['hosts']} hosts: "
              f"{ring['bytes_each_way_per_host'] / 1e6:.2f} MB each way per host, "
              f"{ring['nic_bytes_per_step'] / 1e6:.2f} MB sent+received per NIC, "
              f"{ring['cross_host_bytes_per_step'] / 1e6:.2f} MB across hosts per step")
    goals = result.get("goals", {})
    if goals:
        print("goals (issue 11, Shardline BSP, paired medians; bound: every wait gone): "
              + ", ".join(f">= {g:g} x {peer}" for peer, g in GOALS[cfg["workload"]].items()))
    for m, peers in goals.items():
        print(f"  {m:<24}" + "  ".join(
            f"{c['ratio']:.2f} x {peer} {'met' if c['met'] else 'NOT MET'}"
            + (f" (bound {c['bound']:.2f})" if c["bound"] is not None and not c["met"] else "")
            for peer, c in peers.items()))
    g40 = result.get("goals_issue40", {})
    if g40:
        print(f"goals (issue 40, shardline_default, {'two emulated machines, --ps-on-ranks' if g40['layout'] == 'link' else 'one host'}"
              f"{'' if g40['as_in_issue'] else '; NOT the issue layout of 2 PS nodes, replication 2, 1 worker per host'}):")
        for key, c in g40["checks"].items():
            state = "no value" if c["met"] is None else ("met" if c["met"] else "NOT MET")
            print(f"  {key} {fmt(c['value'], '.2f')} {c['op']} {c['goal']:g}: {state}")
    for m, why in result.get("skipped", {}).items():
        print(f"{m}: skipped: {why.splitlines()[-1] if why else why}")
    print(f"wall {result['wall_seconds']:.0f} s, load {result['loadavg_start'][0]:.1f} -> {result['loadavg_end'][0]:.1f}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1], argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES + EXTRA_MODES))
    ap.add_argument("--workload", choices=("lognormal", "balanced"), default="lognormal")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps of every run (still in the loss curve)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=2,
                    help="machines: with --link, emulated hosts that run ranks; ranks = world x workers-per-host")
    ap.add_argument("--workers-per-host", type=int, default=1,
                    help="rank processes per machine (with --link they share the host's namespace and NIC)")
    ap.add_argument("--model", choices=tuple(MODELS), default="tiny",
                    help="TinyGPT size: tiny (922,880 params), 25m (25,732,096: 8 layers, d_model 512) or 100m "
                         "(101,795,840: 8 layers, d_model 1024)")
    ap.add_argument("--split-cost", choices=("fitted", "tokens"), default="fitted",
                    help="what the balanced split (ddp_balanced and every shardline mode) evens out: a CostModel "
                         "fitted on this machine first (c0 + c1*L + c2*L^2 seconds), or the token count")
    ap.add_argument("--ps", type=int, default=2, help="PS nodes of the Shardline modes (2: the cluster a user gets)")
    ap.add_argument("--ps-threads", type=int, default=1,
                    help="torch intra-op threads of each PS node (its torch_threads: the optimizer apply)")
    ap.add_argument("--replication", type=int, default=None,
                    help="copies of every block (default: the dispatcher's, 2, capped at the PS nodes)")
    ap.add_argument("--replicate-gradients", action="store_true",
                    help="the job's replicas replay each step's mean gradient instead of receiving copies "
                         "(PSOptimizer replicate_gradients)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket-cap-mb", type=float, default=1.0, help="PSOptimizer bucket_cap_mb (push and pull chunks)")
    ap.add_argument("--block-elements", type=int, default=None,
                    help="the jobs' block_elements (default the cluster's; with flatten, overlap pushes a block at a time)")
    ap.add_argument("--link", type=check_rate, metavar="RATE",
                    help="run every rank and PS node in a host of its own (network namespaces), each behind a "
                         "NIC of this rate, e.g. 10gbit (bench/emulated_link.py; needs root and iproute2)")
    ap.add_argument("--ps-on-ranks", action="store_true",
                    help="with --link: PS node i runs in rank i's host (mod world), as a cluster whose every machine "
                         "runs a worker and a PS shard; its rank reaches it through shared memory")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run of a mode")
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 steps, 2 warm-up, 1 repeat")
    ap.add_argument("--out", help="write the JSON here (e.g. bench/results/vs_ddp.json)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 8, 2, 1
    if args.steps < 2 or args.repeats < 1:
        ap.error("--steps must be >= 2 and --repeats >= 1")
    if args.workers_per_host < 1 or args.world < 1:
        ap.error("--world and --workers-per-host must be >= 1")
    args.ranks = args.world * args.workers_per_host
    if args.ps_on_ranks and not args.link:
        ap.error("--ps-on-ranks places PS nodes in the ranks' hosts of --link; give --link RATE")
    return run_and_report(run, print_table, args)


if __name__ == "__main__":
    sys.exit(main())
