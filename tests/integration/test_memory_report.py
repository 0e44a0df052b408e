"""Where a PS node's memory goes, as `shardline status` and the metrics report it, against the
arithmetic of the defaults: two nodes, replication 2 (each holds every block), an AdamW BSP job
(exact restarts and gradient replay: a primary keeps its value from before the step and the
step's mean gradient)."""

from __future__ import annotations

import re
import subprocess
import urllib.request

import pytest
import torch

from test_local_cluster import kill_leftovers, shardline_cmd, start_nodes, status_json

from shardline import connect
from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

PARAMS = {"w": 100_000, "b": 3_000}
BLOCK = 10_000
BLOCKS = 10 + 1


def metric(text: str, name: str, **labels) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    match = re.search(rf"^{name}{re.escape(want)} (\S+)$", text, re.M)
    assert match, f"no {name}{want} in the metrics"
    return float(match.group(1))


def test_status_and_metrics_account_for_every_kind_of_a_jobs_bytes(tmp_path):
    workdir = tmp_path / "cluster"
    cluster = LocalCluster(workdir, start_timeout=60)
    try:
        start_nodes(cluster)
        client = connect(cluster.address, job="mem-job")
        client.init({k: torch.zeros(n) for k, n in PARAMS.items()}, optimizer="adamw", lr=0.01, block_elements=BLOCK)
        for _ in range(3):
            client.push({k: torch.ones(n) for k, n in PARAMS.items()})
            client.pull()
        client.close()

        params = sum(PARAMS.values())
        memory = status_json(cluster.address)["memory"]
        assert set(memory) == {"ps-0", "ps-1"}
        jobs = {node: report["jobs"]["mem-job"] for node, report in memory.items()}
        for node, job in jobs.items():
            assert job["parameters"] == params, node               # both copies of every block
            assert job["bytes"]["values"] == 4 * params, node
            assert job["bytes"]["optimizer_state"] == 8 * params + 4 * BLOCKS, node   # moments, step counters
            assert memory[node]["rss_bytes"] >= memory[node]["anon_bytes"] > sum(job["bytes"].values())
        # one primary per block: it collects the gradients, keeps the value before the step and the
        # mean gradient its copy holder replays
        for kind in ("gradients", "kept_values", "replay_spares"):
            assert sum(job["bytes"][kind] for job in jobs.values()) == 4 * params, kind
        for kind in ("parked_gradients", "staging", "held_copies", "delta_history"):
            assert all(job["bytes"][kind] == 0 for job in jobs.values()), kind

        for node in cluster.nodes:
            text = urllib.request.urlopen(f"http://{node.metrics}/metrics", timeout=10).read().decode()
            for kind, value in jobs[node.node_id]["bytes"].items():
                assert metric(text, "shardline_ps_memory_bytes", job_name="mem-job", kind=kind) == value
            assert metric(text, "shardline_ps_memory_parameters", job_name="mem-job") == params
            assert metric(text, "shardline_ps_process_anon_bytes") >= memory[node.node_id]["anon_bytes"] / 2

        table = subprocess.run([*shardline_cmd(), "status", "--cluster", cluster.address],
                               capture_output=True, text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        assert "memory:" in table.stdout and "B/PARAM" in table.stdout, table.stdout
        per_param = {node: sum(job["bytes"].values()) / params for node, job in jobs.items()}
        for node, value in per_param.items():
            assert re.search(rf"^{node}\s+mem-job\s+103,000\s.*\s{value:.1f}$", table.stdout, re.M), table.stdout
    finally:
        cluster.shutdown()
        kill_leftovers(str(workdir))
