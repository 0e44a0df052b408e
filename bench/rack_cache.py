"""PS egress with many readers in one rack: bytes out of the PS nodes per new version of a job,
with the rack's cache (L2) and without it, in the same run.

    .venv/bin/python bench/rack_cache.py --out bench/results/rack_cache.json     # 64 MiB job, 8 readers
    .venv/bin/python bench/rack_cache.py --quick                                # 4 MiB, a sanity run
    .venv/bin/python bench/rack_cache.py --subscribers --out bench/results/rack_cache_subscribers.json

A LocalCluster of one dispatcher, two PS nodes and a rack cache for rack ``r1`` on 127.0.0.1. One
trainer (BSP, world size 1, SGD lr 1, every block changed every step: its gradient is all ones)
creates the job; ``--readers`` reader clients (threads of this process) wait for each new version
(``pull(min_step=v)``) and must then hold exactly ``-v`` everywhere (the property checked, not a
number this code computed). Per version the bytes the PS nodes sent for pulls
(``shardline_ps_payload_bytes_total{op="PULL",direction="sent"}``, scraped from every node)
are divided by the job's bytes. The mode without the cache (``rack=None``: readers pull from the
nodes) is the baseline; modes alternate, each on a job of its own. The goal of issue 12: <= 1.2x
the job's bytes per version with the cache (the readers' count without it). Wall times are noisy on
this shared machine; the byte ratios are not. ``--subscribers``: the readers are WeightSubscribers
(bf16, ``wait_for(v)``, each checked to hold bf16 ``-v``) and ratios are over the job's bf16 bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from report import run_and_report  # noqa: E402

RACK = "r1"
PULL_SENT = "shardline_ps_payload_bytes_total"


def pull_bytes_sent(metrics_addresses) -> float:
    """Payload bytes every PS node of ``metrics_addresses`` sent for pulls, from their metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for address in metrics_addresses:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == PULL_SENT and s.labels.get("op") == "PULL" and s.labels.get("direction") == "sent":
                    total += s.value
    return total


def measure_egress(cluster_address: str, ps_metrics: list[str], job: str, *, job_bytes: int, readers: int,
                   versions: int, rack: str | None, timeout: float = 120.0, subscribers: bool = False) -> dict:
    """Train ``versions`` steps of a job of ``job_bytes`` (two fp32 tensors) while ``readers`` clients
    of ``rack`` (None: no cache) pull each version (``subscribers``: WeightSubscribers in bf16 wait
    for it); the PS nodes' pull bytes per version."""
    import torch

    from shardline import WeightSubscriber, connect

    n = job_bytes // 8
    trainer = connect(cluster_address, job)
    trainer.init({"a": torch.zeros(n), "b": torch.zeros(n)}, optimizer="sgd", lr=1.0)
    if subscribers:
        clients = [WeightSubscriber(cluster_address, job, rack=rack, pull_timeout=timeout) for _ in range(readers)]
    else:
        clients = [connect(cluster_address, job, rack=rack, pull_timeout=timeout) for _ in range(readers)]
    reader_bytes = 2 * n * (2 if subscribers else 4)   # what one reader holds: bf16 or fp32
    ones = {"a": torch.ones(n), "b": torch.ones(n)}
    per_version, seconds, errors = [], [], []
    try:
        for c in clients:   # version 0 everywhere first: every later version changes it all
            if subscribers:
                c.poll()
            else:
                c.pull(min_step=0, copy=False)
        for v in range(1, versions + 1):
            before = pull_bytes_sent(ps_metrics)
            got = [None] * readers

            def read(i, v=v):
                try:
                    if subscribers:
                        clients[i].wait_for(v)
                        got[i] = clients[i].current()
                    else:
                        got[i] = clients[i].pull(min_step=v, copy=False)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            trainer.push(ones)   # step v: applied at once (world size 1), every block changes
            for t in threads:
                t.join(timeout)
            seconds.append(time.perf_counter() - started)
            if errors or any(t.is_alive() for t in threads):
                raise RuntimeError(f"version {v}: a reader failed or hung: {errors[:1]}")
            for values in got:
                for name, t in values.items():
                    if not torch.equal(t.float(), torch.full((t.numel(),), -float(v))):
                        raise AssertionError(f"version {v}: a reader holds {name} != {-v}")
            # replies of the last reader may still be counted on the node when it returns: settle
            time.sleep(0.2)
            per_version.append(pull_bytes_sent(ps_metrics) - before)
    finally:
        for c in [trainer, *clients]:
            c.close()
    return {"job_bytes": 2 * n * 4, "reader_bytes": reader_bytes, "readers": readers, "versions": versions,
            "rack": rack, "subscribers": subscribers, "ps_pull_bytes_per_version": per_version,
            "ratio_per_version": [b / reader_bytes for b in per_version],
            "ratio_max": max(per_version) / reader_bytes,
            "seconds_per_version_median": statistics.median(seconds)}


def run(args) -> dict:
    from shardline.local_cluster import LocalCluster

    job_bytes = (4 if args.quick else args.job_mib) << 20
    results = {"with_cache": [], "without_cache": []}
    with tempfile.TemporaryDirectory(prefix="shardline-cachebench-") as work:
        with LocalCluster(Path(work)) as cluster:
            cluster.start_dispatcher(heartbeat_timeout=3)
            nodes = [cluster.add_node(node_id=f"ps{i}") for i in range(2)]
            cluster.wait_for_nodes(2, timeout=60)
            cluster.add_cache(RACK, args.cache_mib << 20)
            cluster.wait_until(lambda s: any(c.rack == RACK for c in s.routing.caches), 30, "the rack cache")
            metrics = [n.metrics for n in nodes]
            for rep in range(args.repeats):
                for mode, rack in (("without_cache", None), ("with_cache", RACK)):
                    results[mode].append(measure_egress(cluster.address, metrics, f"egress-{mode}-{rep}",
                                                        job_bytes=job_bytes, readers=args.readers,
                                                        versions=args.versions, rack=rack,
                                                        subscribers=args.subscribers))
    ratio = {mode: max(r["ratio_max"] for r in runs) for mode, runs in results.items()}
    return {"job_bytes": job_bytes, "readers": args.readers, "versions": args.versions, "runs": results,
            "subscribers": args.subscribers,
            "ps_egress_ratio_max": ratio,
            "with_vs_without": ratio["with_cache"] / ratio["without_cache"],
            "goal": "with_cache <= 1.2 (issue 12)", "goal_met": ratio["with_cache"] <= 1.2}


def print_table(result: dict) -> None:
    mib = result["job_bytes"] / 2 ** 20
    kind = "bf16 WeightSubscribers (ratios over the job's bf16 bytes)" if result["subscribers"] else "readers"
    print(f"PS pull egress per version, job {mib:g} MiB, {result['readers']} {kind}, {result['versions']} versions:")
    for mode in ("without_cache", "with_cache"):
        runs = result["runs"][mode]
        secs = statistics.median(r["seconds_per_version_median"] for r in runs)
        print(f"  {mode:14s} max {result['ps_egress_ratio_max'][mode]:.3f}x the job's bytes "
              f"(median {secs:.2f} s per version, noisy)")
    print(f"  with / without: {result['with_vs_without']:.3f}; goal <= 1.2x with the cache: "
          f"{'met' if result['goal_met'] else 'NOT met'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job-mib", type=int, default=64)
    ap.add_argument("--cache-mib", type=int, default=256)
    ap.add_argument("--readers", type=int, default=8)
    ap.add_argument("--versions", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="a 4 MiB job")
    ap.add_argument("--subscribers", action="store_true", help="the readers are WeightSubscribers (bf16)")
    ap.add_argument("--out", help="write the JSON here (e.g. bench/results/rack_cache.json)")
    args = ap.parse_args(argv)
    return run_and_report(run, print_table, args)


if __name__ == "__main__":
    sys.exit(main())
