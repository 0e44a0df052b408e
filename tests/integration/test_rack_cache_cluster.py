"""Rack caches (L2) as real daemons: a dispatcher, two PS nodes and caches for racks r1 and r2.

A cache SIGSTOPped is given up on within cache_timeout; eight readers of one rack make the PS nodes
send each new version once; bf16 readers through it hold the masters rounded; so do weight
subscribers polling through it, the nodes sending each version once for all; BSP training whose
pulls go through the cache equals single-process torch.optim across a PS failover and the cache's
SIGKILL (the last test: it kills a node and a cache)."""

import importlib.util
import signal
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import train_model
from shardline.local_cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
CACHE_BYTES = 64 << 20


def _load_bench():
    spec = importlib.util.spec_from_file_location("shardline_bench_rack_cache", ROOT / "bench" / "rack_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load_bench()


def cache_counter(handle, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{handle.metrics}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == f"shardline_cache_{name}_total")


@pytest.fixture(scope="module")
def racks(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("rack-cache")) as c:
        c.start_dispatcher(heartbeat_timeout=2)
        for node in [c.add_node(node_id=node_id, wait=False) for node_id in ("ps1", "ps2")]:  # in parallel
            c.wait_ready(node)
        c.wait_for_nodes(2, timeout=30)
        caches = {rack: c.add_cache(rack, CACHE_BYTES, wait=False) for rack in ("r1", "r2")}
        for handle in caches.values():
            c.wait_ready(handle)
        c.wait_until(lambda s: {x.rack for x in s.routing.caches} == set(caches), 30, "two rack caches")
        yield c, caches


def test_a_stalled_cache_is_given_up_on_within_cache_timeout(racks):
    from shardline import connect

    cluster, caches = racks
    trainer = connect(cluster.address, "rack-stall")
    trainer.init({"w": torch.zeros(1000)}, optimizer="sgd", lr=1.0)
    reader = connect(cluster.address, "rack-stall", rack="r2", cache_timeout=1.0, pull_timeout=60)
    try:
        reader.pull(min_step=0)
        assert cache_counter(caches["r2"], "misses") > 0
        cluster.kill(caches["r2"], signal.SIGSTOP)
        try:
            trainer.push({"w": torch.ones(1000)})
            began = time.monotonic()
            values = reader.pull(min_step=1, timeout=2.0)
            waited = time.monotonic() - began
            assert torch.equal(values["w"], torch.full((1000,), -1.0))
            # the pull's server-side wait (2 s) + cache_timeout (1 s), then the node answers at once
            assert waited < 6, f"the pull took {waited:.1f} s with the cache stopped"
            trainer.push({"w": torch.ones(1000)})
            began = time.monotonic()
            assert torch.equal(reader.pull(min_step=2)["w"], torch.full((1000,), -2.0))
            assert time.monotonic() - began < 2, "a pull after the failure still went to the stalled cache"
        finally:
            cluster.kill(caches["r2"], signal.SIGCONT)
    finally:
        trainer.close()
        reader.close()


def test_eight_readers_of_a_rack_make_the_ps_nodes_send_each_version_once(racks):
    cluster, _ = racks
    metrics = [n.metrics for n in cluster.nodes]
    result = bench.measure_egress(cluster.address, metrics, "rack-egress", job_bytes=4 << 20, readers=8,
                                  versions=3, rack="r1", timeout=60)
    # without the cache each of the 8 readers would pull every changed block from the nodes: 8x
    assert result["ratio_max"] <= 1.2, result["ratio_per_version"]
    # `shardline status` lists each cache on a line of its own, with what its heartbeats report
    from shardline.cli import render_status, status_dict

    status = cluster.wait_until(lambda s: any(c.rack == "r1" and c.misses for c in s.routing.caches), 10,
                                "the cache's heartbeat with its counts")
    lines = [line for line in render_status(status_dict(status, cluster.address)).splitlines()
             if line.startswith("rack cache ")]
    assert len(lines) == 2 and any("rack r1," in line and "% hits" in line for line in lines), lines


def test_bf16_readers_through_the_cache_hold_the_masters_rounded(racks):
    from shardline import connect

    cluster, caches = racks
    trainer = connect(cluster.address, "rack-bf16")
    trainer.init({"w": torch.randn(5000, generator=torch.Generator().manual_seed(3))}, optimizer="sgd", lr=0.1)
    direct = connect(cluster.address, "rack-bf16", rack="")          # "" : no rack cache, not $SHARDLINE_RACK
    readers = [connect(cluster.address, "rack-bf16", rack="r1") for _ in range(2)]
    try:
        trainer.push({"w": torch.randn(5000, generator=torch.Generator().manual_seed(4))})
        master = direct.pull(min_step=1)["w"]
        served = cache_counter(caches["r1"], "served_bytes")
        for reader in readers:   # fp32 and bf16 entries of the same blocks are kept apart
            held = torch.empty(5000, dtype=torch.bfloat16)
            reader.bind("w", held)
            reader.pull(min_step=1)
            assert torch.equal(held, master.to(torch.bfloat16))
        assert cache_counter(caches["r1"], "served_bytes") - served == 2 * 5000 * 2   # both from the cache
        assert torch.equal(readers[0].pull(min_step=1)["w"].float(), master.to(torch.bfloat16).float())
    finally:
        for c in (trainer, direct, *readers):
            c.close()


def test_subscribers_through_the_cache_hold_torch_optim_in_bf16_and_the_nodes_send_each_version_once(racks):
    """Three WeightSubscribers of rack r2 poll through its cache: the first to ask for a version
    makes the nodes send it (checked against their checksums), the others are answered from
    memory; every subscriber holds the torch.optim reference rounded to bf16. The last step
    changes three elements: the nodes send the cache only those (a delta against its copy)."""
    from shardline import WeightSubscriber, connect
    from test_subscriber import assert_bf16_of

    cluster, caches = racks
    cache = caches["r2"]
    metrics = [n.metrics for n in cluster.nodes]
    g = torch.Generator().manual_seed(11)
    w0 = torch.randn(16384, generator=g)
    trainer = connect(cluster.address, "rack-sub")
    trainer.init({"w": w0}, optimizer="sgd", lr=0.1, block_elements=2048)   # 8 blocks over both nodes
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([ref], lr=0.1)
    subs = [WeightSubscriber(cluster.address, "rack-sub", rack="r2", pull_timeout=30) for _ in range(3)]
    try:
        hits, served = cache_counter(cache, "hits"), cache_counter(cache, "served_bytes")
        for version in range(4):
            if version:
                grad = torch.randn(16384, generator=g)
                if version == 3:
                    grad = torch.zeros(16384)
                    grad[[7, 5000, 16000]] = 1.0
                trainer.push({"w": grad})
                ref.grad = grad
                opt.step()
            before = bench.pull_bytes_sent(metrics)
            egress = []
            for sub in subs:
                got, _ = sub.wait_for(version)
                assert got == version
                assert_bf16_of(sub.current(), {"w": ref.detach()}, f"version {version}")
                egress.append(bench.pull_bytes_sent(metrics) - before)
            # the first subscriber's pulls fetched the version (its changed blocks, dense or as
            # deltas against the cache's copy); the other two moved nothing more from the nodes
            assert 0 < egress[0] <= (16384 * 2 if version < 3 else 3 * 6) and egress[2] == egress[0], (version, egress)
        assert all(s.stats.checksum_failures == 0 and s.stats.dense_blocks >= 8 for s in subs)
        assert cache_counter(cache, "hits") - hits >= 2 * 4 * 8          # two subscribers x 4 versions x 8 blocks
        assert cache_counter(cache, "served_bytes") - served >= 3 * 4 * 16384 * 2
    finally:
        for c in (trainer, *subs):
            c.close()


def test_bsp_through_the_cache_equals_torch_optim_across_a_ps_failover_and_the_caches_death(racks, tmp_path):
    """Workers of rack r1 train through its cache; a PS node dies while the cache holds its blocks
    (replication 2: its replica takes over), later the cache is SIGKILLed (the workers pull from the
    nodes): no step is lost and the result equals torch.optim. Last: it kills a node and r1's cache."""
    cluster, caches = racks
    cache = caches["r1"]
    before = cache_counter(cache, "misses")
    started = train_model.start_workers(cluster.address, "rack-bsp", "adamw", "bsp", tmp_path, steps=12,
                                        step_sleep=0.1, env={"SHARDLINE_RACK": "r1"})
    try:
        train_model.wait_for_steps(started, 3)
        at_kill = cache_counter(cache, "misses")
        # The worker whose commit completes a step gets its values in that commit's reply; only the
        # other one pulls them, through the cache: two pulls of a version seldom meet there, and
        # this test's own pulls need not hit (hits: the readers' and subscribers' tests above).
        assert at_kill > before, "the workers' pulls did not go through the cache"
        cluster.kill(cluster.nodes[1])   # SIGKILL a PS node: the ring moves on without it
        train_model.wait_for_steps(started, 7)
        # the pulls went on through the cache: blocks learned again at the new epoch
        assert cache_counter(cache, "misses") > at_kill
        cluster.kill(cache)              # SIGKILL the cache: the workers pull from the nodes
    finally:
        results = train_model.finish_workers(started)
    train_model.assert_equals_reference(results, 12, tol=1e-5)
