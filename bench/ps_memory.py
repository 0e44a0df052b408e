#!/usr/bin/env python3
"""PS memory per parameter: what a node's jobs account for (shardline_ps_memory_bytes) against
what the process took (its anonymous memory above an idle node), for the cluster a user gets.

Two PS nodes (replication 2, every option at its default), a BSP AdamW job of TinyGPT
(``--model``: tiny 0.92 M, 25m 25.7 M, 100m 101.8 M parameters; lora: a frozen bf16 base of
104.9 M and a trainable adapter of 1.05 M; ``--replication``: the job's, default the
cluster's 2), two ranks on this host training it with
``PSOptimizer`` at its defaults on random tokens. Each node's ``RssAnon`` is read before the job (idle) and
after ``--steps`` steps, its peak RSS over the steps after the first two (``VmHWM`` reset then:
the job's creation and the copies' initial sync happen once); the accounting comes from its
metrics. ``--malloc`` runs the same with
the PS daemons' ``malloc`` option at each value (each on a fresh cluster, in the same run):
``system`` leaves glibc's defaults, under which freed buffers of a step stay in the process.

    python bench/ps_memory.py --model 25m --out bench/results/ps_memory.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_counters import reset_peak_rss, status_mib  # noqa: E402

from shardline.cli import in_memory  # noqa: E402

MODELS = {"tiny": dict(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=512, seed=0),
          "25m": dict(vocab_size=512, d_model=512, n_layers=8, n_heads=8, max_seq_len=512, seed=0),
          "100m": dict(vocab_size=512, d_model=1024, n_layers=8, n_heads=16, max_seq_len=512, seed=0)}
# --model lora: a frozen bf16 base of LORA_BASE parameters and a trainable fp32 adapter of
# LORA_ADAPTER (the base is read once by each rank, as a LoRA job's is)
LORA_BASE, LORA_ADAPTER = 100 * 2 ** 20, 2 ** 20
# The PS daemons' malloc option: bounded (the default: freed large buffers go back to the kernel
# at once, two arenas) or glibc's own defaults.
MALLOC_VARIANTS = {"bounded": {}, "system": {"SHARDLINE_MALLOC": "system"}}
JOB = "ps-memory"
WARM_STEPS = 2   # steps before the peak RSS is measured from
SAMPLE_SECONDS = 0.05
SETTLE_SECONDS = 2.5   # after the ranks finish, before "after" is read: two PS heartbeats


def rank_main(address: str, model: str, rank: int, steps: int, queue, replication: int | None = None) -> None:
    """One rank as a user runs it: TinyGPT, PSOptimizer with every option at its default, a
    forward and backward of random tokens per step."""
    import torch

    from shardline.jobs.models.tinygpt import TinyGPT
    from shardline.worker.optim import PSOptimizer

    torch.manual_seed(0)
    if model == "lora":
        net = torch.nn.Module()
        net.base = torch.nn.Parameter(torch.randn(LORA_BASE // 1024, 1024, dtype=torch.bfloat16), requires_grad=False)
        net.adapter = torch.nn.Parameter(torch.randn(LORA_ADAPTER // 1024, 1024) * 0.01)

        def loss_of(generator):
            rows = torch.randint(0, LORA_BASE // 1024, (LORA_ADAPTER // 1024,), generator=generator)
            return (net.adapter * net.base[rows].float()).sum().square() * 1e-6
    else:
        cfg = dict(MODELS[model])
        cfg.pop("seed")
        net = TinyGPT(**cfg)

        def loss_of(generator):
            ids = torch.randint(0, cfg["vocab_size"], (2, 128), generator=generator)
            logits = net(ids[:, :-1])
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt = PSOptimizer(net.named_parameters(), address, JOB, optimizer="adamw", lr=1e-3, weight_decay=0.01,
                      world_size=2, rank=rank, replication=replication)
    generator = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if step == WARM_STEPS:
            queue.put(("warm", rank))
        loss = loss_of(generator)
        opt.zero_grad()
        loss.backward()
        opt.step()
    opt.close()
    queue.put(("done", rank))


class Sampler:
    """Scrapes the nodes every SAMPLE_SECONDS while the ranks train: each kind's largest bytes,
    and the largest anonymous memory with what the accounting said at that sample."""

    def __init__(self, nodes):
        self.nodes = nodes
        self.max_kinds = {n.node_id: {} for n in nodes}
        self.max_anon = {n.node_id: 0.0 for n in nodes}
        self.accounted_at_max = {n.node_id: 0.0 for n in nodes}
        self.max_shmem = {n.node_id: 0.0 for n in nodes}   # shared memory mapped: the workers' regions, rings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            for n in self.nodes:
                try:
                    report, anon = scrape(n.metrics), status_mib(n.pid, "RssAnon")
                    self.max_shmem[n.node_id] = max(self.max_shmem[n.node_id], status_mib(n.pid, "RssShmem"))
                except (OSError, LookupError):
                    continue
                kinds = self.max_kinds[n.node_id]
                for kind, value in report["kinds"].items():
                    kinds[kind] = max(kinds.get(kind, 0.0), value)
                if anon > self.max_anon[n.node_id]:
                    self.max_anon[n.node_id] = anon
                    self.accounted_at_max[n.node_id] = in_memory(report["kinds"]) + report["receive_buffers"]


def scrape(metrics_address: str) -> dict:
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    kinds = {m.group(1): float(m.group(2)) for m in re.finditer(
        rf'^shardline_ps_memory_bytes{{job_name="{JOB}",kind="([a-z_]+)"}} (\S+)$', text, re.M)}
    params = re.search(rf'^shardline_ps_memory_parameters{{job_name="{JOB}"}} (\S+)$', text, re.M)
    receive = re.search(r'^shardline_ps_inflight_payload_bytes (\S+)$', text, re.M)
    return {"kinds": kinds, "parameters": float(params.group(1)) if params else 0.0,
            "receive_buffers": float(receive.group(1)) if receive else 0.0}


def run_variant(name: str, env: dict, model: str, steps: int, replication: int | None = None) -> dict:
    from shardline.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="shardline-psmem-") as work, LocalCluster(Path(work) / "daemons") as cluster:
        cluster.start_dispatcher()
        nodes = [cluster.add_node(wait=False, env=env) for _ in range(2)]
        for node in nodes:
            cluster.wait_ready(node)
        cluster.wait_for_nodes(2, timeout=60)
        time.sleep(1.0)
        idle = {n.node_id: status_mib(n.pid, "RssAnon") for n in nodes}
        idle_rss = {n.node_id: status_mib(n.pid, "VmRSS") for n in nodes}
        idle_file = {n.node_id: status_mib(n.pid, "RssFile") for n in nodes}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        started = time.monotonic()
        ranks = [ctx.Process(target=rank_main, args=(cluster.address, model, r, steps, queue, replication)) for r in range(2)]
        for p in ranks:
            p.start()
        # the peak of the steps after the first WARM_STEPS (the job's creation and initial sync are once)
        warm = []
        deadline = time.monotonic() + 900
        while len(warm) < len(ranks):
            failed = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"a rank exited with {failed} (or none warmed up within 900 s)")
            try:
                warm.append(queue.get(timeout=1.0))
            except Exception:  # noqa: BLE001 - queue.Empty: look at the ranks again
                continue
        assert all(kind == "warm" for kind, _ in warm), warm
        peaks_reset = all([reset_peak_rss(n.pid) for n in nodes])
        sampler = Sampler(nodes)
        sampler.start()
        for p in ranks:
            p.join(timeout=900)
        sampler.stop()
        for p in ranks:
            if p.exitcode != 0:
                raise RuntimeError(f"rank process exited with {p.exitcode}")
        seconds = time.monotonic() - started
        time.sleep(SETTLE_SECONDS)   # the steady state: a heartbeat drops read frozen pages from the resident set
        out = {"variant": name, "env": env, "seconds": round(seconds, 1), "nodes": {}}
        for n in nodes:
            report = scrape(n.metrics)
            params = report["parameters"]
            anon_mib = status_mib(n.pid, "RssAnon")
            above_idle = (anon_mib - idle[n.node_id]) * 2 ** 20
            rss_above_idle = (status_mib(n.pid, "VmRSS") - idle_rss[n.node_id]) * 2 ** 20
            accounted = in_memory(report["kinds"])
            out["nodes"][n.node_id] = {
                "parameters_held": int(params), "idle_anon_mib": round(idle[n.node_id], 1),
                "anon_mib": round(anon_mib, 1), "peak_rss_mib": round(status_mib(n.pid, "VmHWM"), 1),
                "peak_rss_after_warm_up": peaks_reset,
                # the largest each kind was at any sample during the steps after the warm-up, and
                # the largest anonymous memory above idle a sample saw with the accounting then
                "sampled_max_kinds_mib": {k: round(v / 2 ** 20, 1) for k, v in sampler.max_kinds[n.node_id].items()
                                          if v},
                "sampled_max_anon_above_idle_mib": round(sampler.max_anon[n.node_id] - idle[n.node_id], 1),
                "sampled_accounted_at_max_anon_mib": round(sampler.accounted_at_max[n.node_id] / 2 ** 20, 1),
                # resident shared memory (the workers' regions the node reads pushes from and places
                # pulls into, the shm rings): in the peak RSS, not the node's own
                "sampled_max_shmem_mib": round(sampler.max_shmem[n.node_id], 1),
                "accounted_mib": round(accounted / 2 ** 20, 1),
                "receive_buffers_mib": round(report["receive_buffers"] / 2 ** 20, 1),
                "kinds_mib": {k: round(v / 2 ** 20, 1) for k, v in report["kinds"].items() if v},
                "accounted_bytes_per_parameter": round(accounted / params, 2) if params else None,
                "anon_above_idle_bytes_per_parameter": round(above_idle / params, 2) if params else None,
                # everything resident (anonymous, shared memory, mapped file pages) after the steps
                "rss_above_idle_bytes_per_parameter": round(rss_above_idle / params, 2) if params else None,
                "rss_file_mib": round(status_mib(n.pid, "RssFile"), 1),
                "idle_rss_file_mib": round(idle_file[n.node_id], 1),
                "rss_shmem_mib": round(status_mib(n.pid, "RssShmem"), 1),
                "peak_rss_above_idle_bytes_per_parameter": round(
                    (status_mib(n.pid, "VmHWM") - idle_rss[n.node_id]) * 2 ** 20 / params, 2) if params else None,
            }
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=(*MODELS, "lora"), default="tiny")
    ap.add_argument("--steps", type=int, default=6, help=f"steps per rank (the peak RSS: after the first {WARM_STEPS})")
    ap.add_argument("--malloc", default="bounded,system", help="comma-separated, from " + ", ".join(MALLOC_VARIANTS))
    ap.add_argument("--replication", type=int, choices=(1, 2), default=None,
                    help="the job's replication (default: the cluster's, 2)")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args(argv)
    variants = [v for v in args.malloc.split(",") if v]
    unknown = [v for v in variants if v not in MALLOC_VARIANTS]
    if unknown:
        ap.error(f"--malloc: unknown variant(s) {unknown}; known: {sorted(MALLOC_VARIANTS)}")
    results = [run_variant(v, MALLOC_VARIANTS[v], args.model, args.steps, args.replication) for v in variants]
    result = {"bench": "ps_memory", "model": args.model, "steps": args.steps, "replication": args.replication,
              "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "runs": results}
    for run in results:
        for node, r in run["nodes"].items():
            print(f"{run['variant']:8s} {node}: {r['parameters_held']:,} parameters held, accounted "
                  f"{r['accounted_bytes_per_parameter']} B/param, anonymous above idle "
                  f"{r['anon_above_idle_bytes_per_parameter']} B/param, RSS above idle "
                  f"{r['rss_above_idle_bytes_per_parameter']} B/param (file pages {r['idle_rss_file_mib']} -> "
                  f"{r['rss_file_mib']} MiB, shared memory {r['rss_shmem_mib']} MiB; idle {r['idle_anon_mib']} MiB, now "
                  f"{r['anon_mib']} MiB, peak RSS {r['peak_rss_mib']} MiB = "
                  f"{r['peak_rss_above_idle_bytes_per_parameter']} B/param above idle, receive buffers "
                  f"{r['receive_buffers_mib']} MiB) {r['kinds_mib']}; during the steps, at most "
                  f"{r['sampled_max_anon_above_idle_mib']} MiB anonymous above idle (accounted then "
                  f"{r['sampled_accounted_at_max_anon_mib']} MiB), shared memory mapped at most "
                  f"{r['sampled_max_shmem_mib']} MiB, kinds at most {r['sampled_max_kinds_mib']}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
