"""The access heatmap and load-driven rebalancing against live daemons.

A known pull/push pattern shows up in GetHotShards and ``shardline status --hot``; a skewed BSP job
on 4 PS nodes is rebalanced while it trains (a pending ring change), with no step lost and the
parameters of single-process AdamW.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import skewed_model
from shardline import connect
from shardline.dispatcher.rebalance import imbalance
from shardline.local_cluster import LocalCluster

HOT_STEPS = 10


@pytest.fixture
def heat_cluster(tmp_path_factory):
    # One cluster per test (each test starts its own daemons).
    # A half-life far above the test's length: decay changes the rates by < 0.1 % here.
    with LocalCluster(tmp_path_factory.mktemp("heat")) as c:
        c.start_dispatcher(heartbeat_interval=0.2, heat_half_life=3600, rebalance_interval=0)
        for handle in [c.add_node(node_id="ps1", wait=False), c.add_node(node_id="ps2", wait=False)]:
            c.wait_ready(handle)
        c.wait_for_nodes(2, timeout=30)
        yield c


def _hot(cluster, **kw):
    client = cluster.client()
    try:
        return client.hot_shards(**kw)
    finally:
        client.close()


def test_a_known_access_pattern_shows_up_in_the_heatmap_and_status_hot(heat_cluster):
    creator = connect(heat_cluster.address, job="heat")
    creator.init({"hot": torch.randn(256), "cold": torch.randn(256)}, optimizer="sgd", lr=0.1, block_elements=64)
    reader = connect(heat_cluster.address, job="heat")
    reader.pull()                                   # 4 hot + 4 cold blocks, once
    g = torch.ones(256)
    for step in range(HOT_STEPS):                   # hot: 1 push (4 blocks) and 1 pull (4 blocks) per step
        creator.push({"hot": g, "cold": None})
        reader.pull(min_step=step + 1)
    creator.close(), reader.close()
    # hot blocks: 10 writes + 11 reads each; cold blocks: 1 read each; 4 * 21 + 4 = 88 accesses
    expected_total = 4 * (HOT_STEPS + HOT_STEPS + 1) + 4

    deadline = time.monotonic() + 20
    while True:
        heat = _hot(heat_cluster, limit=16, job="heat")
        if len(heat.shards) == 8 and all(s.tensor != "hot" or s.writes_per_second > 0 for s in heat.shards):
            break
        assert time.monotonic() < deadline, f"the heatmap did not show the 8 blocks: {heat}"
        time.sleep(0.2)
    time.sleep(0.6)                                 # every node's heartbeat after the last access
    heat = _hot(heat_cluster, limit=16, job="heat")
    hot = [s for s in heat.shards if s.tensor == "hot"]
    cold = [s for s in heat.shards if s.tensor == "cold"]
    assert [s.tensor for s in heat.shards[:4]] == ["hot"] * 4 and len(cold) == 4
    assert sorted(s.block for s in hot) == [0, 1, 2, 3] and {s.node for s in heat.shards} <= {"ps1", "ps2"}
    # Rates are counts over each node's window; a ratio on one node cancels the window.
    for s in hot:
        assert s.writes_per_second / s.reads_per_second == pytest.approx(HOT_STEPS / (HOT_STEPS + 1), rel=1e-3)
        assert s.bytes_per_second / s.reads_per_second == pytest.approx(256 * (2 * HOT_STEPS + 1) / (HOT_STEPS + 1),
                                                                         rel=1e-3)
        same_node = [c for c in cold if c.node == s.node]
        for c in same_node:
            assert c.writes_per_second == 0
            assert s.reads_per_second / c.reads_per_second == pytest.approx(HOT_STEPS + 1, rel=1e-3)
    # Shares: of every block access in the cluster (windows differ by a heartbeat between nodes).
    assert sum(s.share for s in heat.shards) == pytest.approx(1.0, rel=1e-6)
    assert sum(s.share for s in hot) == pytest.approx(4 * (2 * HOT_STEPS + 1) / expected_total, rel=0.1)
    assert {n.node_id for n in heat.nodes} == {"ps1", "ps2"}
    assert sum(n.share for n in heat.nodes) == pytest.approx(1.0)
    assert heat.half_life_seconds == 3600 and heat.rebalance_interval_seconds == 0

    env = {**os.environ, "SHARDLINE_CLUSTER_TOKEN_FILE": str(heat_cluster.cluster_token_file or "")}
    out = subprocess.run([sys.executable, "-m", "shardline.cli", "status", "--cluster", heat_cluster.address,
                          "--hot", "--job", "heat", "--json"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    # the same blocks (their order among equal rates may differ: nodes heartbeated since)
    assert sorted((s["tensor"], s["block"]) for s in data["shards"]) == sorted((s.tensor, s.block) for s in heat.shards)
    assert [s["tensor"] for s in data["shards"]] == ["hot"] * 4 + ["cold"] * 4
    assert data["rebalance_interval_seconds"] is None
    text = subprocess.run([sys.executable, "-m", "shardline.cli", "status", "--cluster", heat_cluster.address,
                           "--hot"], capture_output=True, text=True, timeout=60, env=env)
    assert text.returncode == 0, text.stderr
    assert "hottest shards:" in text.stdout and "node load:" in text.stdout and "rebalancing off" in text.stdout
    assert any(line.split()[:3] == ["heat", "hot", str(hot[0].block)] for line in text.stdout.splitlines())


MIN_STEPS, MAX_STEPS, HALF_LIFE = 100, 400, 1.0


def _settled(samples) -> list:
    """Max/mean node loads sampled three half-lives after the ring change before them (a later
    plan may follow; under load the first plan's ring can settle, then a smaller one be made)."""
    changes = [t for (t, e, p, _r, _n), prev in zip(samples[1:], samples) if (e, p) != prev[1:3]]
    return [r for t, _e, p, r, n in samples if changes and not p and n == 4
            and t >= max([c for c in changes if c <= t], default=float("inf")) + 3 * HALF_LIFE]


def test_a_skewed_job_is_rebalanced_while_it_trains_and_equals_torch_optim(tmp_path):
    """4 PS nodes, BSP, 2 workers (threads of this process); the hot table's 48 blocks land unevenly
    on the capacity ring. The dispatcher moves virtual nodes (rebalance_interval 1 s); the measured
    max/mean node load is reported before (what the first plan saw) and after (decayed load, three
    half-lives after the last ring change)."""
    with LocalCluster(tmp_path / "cluster") as c:
        c.start_dispatcher(heartbeat_interval=0.2, heartbeat_timeout=3, heat_half_life=HALF_LIFE,
                           rebalance_interval=1.0)
        for handle in [c.add_node(node_id=f"ps{i}", wait=False) for i in range(4)]:
            c.wait_ready(handle)
        c.wait_for_nodes(4, timeout=30)
        results, errors, stop_at = {}, [], {"step": None}

        def rank(r: int) -> None:
            try:
                results[r] = skewed_model.train(c.address, "embedding", r, 2, MAX_STEPS, step_sleep=0.05,
                                                stop_at=stop_at)
            except BaseException as exc:  # reported below, with the samples
                errors.append(exc)

        workers = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(2)]
        for w in workers:
            w.start()
        samples, plans = [], []
        deadline = time.monotonic() + 120
        while any(w.is_alive() for w in workers) and time.monotonic() < deadline:
            heat = _hot(c)
            status = c.cluster_status()
            ratio = imbalance({n.node_id: n.bytes_in_per_second + n.bytes_out_per_second for n in heat.nodes})
            samples.append((time.monotonic(), status.routing.epoch, bool(status.routing.pending_epoch), ratio,
                            len(heat.nodes)))
            if heat.last_rebalance and heat.last_rebalance not in plans:
                plans.append(heat.last_rebalance)
            # Train on until the load settled after a ring change (a machine under load steps
            # slower and plans later), then end every rank at the same step a few steps ahead.
            done = max([v for k, v in stop_at.items() if k != "step"], default=0)
            if stop_at["step"] is None and len(_settled(samples)) >= 5 and done >= MIN_STEPS:
                stop_at["step"] = done + 5
            time.sleep(0.2)
        for w in workers:
            w.join(timeout=30)
    assert not errors and len(results) == 2, f"a worker failed: {errors}"
    steps = stop_at["step"] or MAX_STEPS
    expected = skewed_model.reference(steps, world_size=2)
    for res in results.values():
        assert int(res["_version"]) == steps                            # no step lost
        for name, want in expected.items():
            diff = (res[name] - want).abs().max().item()
            assert diff <= 1e-5, f"{name}: max abs diff {diff}"
    assert plans, f"no rebalance happened; max/mean samples: {[round(s[3], 3) for s in samples]}"
    before = float(plans[0].split("max/mean load ")[1].split()[0])
    settled = _settled(samples)
    print(f"\nrebalance: max/mean node load before {before:.3f}; {len(plans)} plan(s): {plans}; "
          f"after (settled samples): {[round(r, 3) for r in settled]}")
    transitions = [(round(t - samples[0][0], 1), e, p, n) for (t, e, p, _r, n), prev in zip(samples[1:], samples)
                   if (e, p, n) != prev[1:3] + (prev[4],)]
    assert settled, (f"training ended before the load settled after a ring change; (seconds, epoch, pending, "
                     f"nodes in the heatmap) at each change: {samples[0][1:3] + (samples[0][4],)} then {transitions}")
    after = sorted(settled)[len(settled) // 2]
    assert before > 1.15, f"the capacity ring was already balanced ({before:.3f}): the test shows nothing"
    assert after <= 1.15, f"max/mean node load after rebalancing {after:.3f} (before {before:.3f})"
