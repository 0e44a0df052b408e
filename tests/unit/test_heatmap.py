"""Access heat: the PS counters (ps_server/heat.py), the dispatcher's decayed heatmap
(dispatcher/heatmap.py) and the rebalance policy (dispatcher/rebalance.py), against known patterns."""

from __future__ import annotations

import math
import types

import pytest

from shardline.dispatcher.heatmap import Heatmap
from shardline.dispatcher.rebalance import LoadModel, imbalance, plan
from shardline.ps_server.heat import MAX_REPORTED, HeatCounter
from shardline.services.errors import ShardlineConfigError
from shardline.services.blocks import block_hash
from shardline.services.ring import HashRing, vnode_counts


def test_counts_are_exact_and_rates_cover_the_interval():
    heat = HeatCounter(clock=lambda: 0.0)
    # 10 pulls of block a0 (4 KiB each), 3 pushes of a0 and a1, one of a zero flag
    for _ in range(10):
        heat.record_reads("j", [("a", 0, 4096)], now=1.0)
    for _ in range(3):
        heat.record_writes("j", [("a", 0, 4096), ("a", 1, 4096)], now=1.5)
    heat.record_writes("j", [("b", 0, 0)], now=1.5)
    heat.record_apply(0.25)
    assert heat.totals("j", "a", 0) == (10, 3, 40960, 12288)
    assert heat.totals("j", "a", 1) == (0, 3, 0, 12288)
    assert heat.totals("j", "b", 0) == (0, 1, 0, 0)
    load, hot = heat.report(now=2.0)
    assert load.interval_seconds == 2.0
    assert load.bytes_out_per_second == 40960 / 2 and load.bytes_in_per_second == 24576 / 2
    assert load.pulls_per_second == 5 and load.pushes_per_second == 2 and load.apply_seconds_per_second == 0.125
    assert load.reads_per_second == 5 and load.writes_per_second == 3.5
    assert [(h.tensor, h.block, h.reads, h.writes) for h in hot] == [("a", 0, 10, 3), ("a", 1, 0, 3), ("b", 0, 0, 1)]
    load, hot = heat.report(now=3.0)          # nothing since: no blocks, zero rates
    assert hot == [] and load.bytes_out_per_second == 0 and load.interval_seconds == 1.0


def test_top_k_is_bounded_and_unreported_counts_carry_over():
    heat = HeatCounter(clock=lambda: 0.0)
    for i in range(MAX_REPORTED + 8):          # block i read i + 1 times
        for _ in range(i + 1):
            heat.record_reads("j", [("t", i, 100)], now=0.0)
    _load, hot = heat.report(now=0.0)
    assert len(hot) == MAX_REPORTED
    assert [h.block for h in hot] == list(range(MAX_REPORTED + 7, 7, -1))   # hottest first
    _load, rest = heat.report(now=0.0)
    assert sorted(h.block for h in rest) == list(range(8)) and all(h.reads == h.block + 1 for h in rest)
    # more busy blocks than k: the unreported ones' counts grow until they are reported too
    for _ in range(3):
        for i in range(MAX_REPORTED + 8):
            heat.record_reads("j", [("t", i, 100)], now=0.0)
        _load, hot = heat.report(now=0.0)
        assert len(hot) == MAX_REPORTED
    _load, last = heat.report(now=0.0)
    assert sum(h.reads for h in hot + last) <= 3 * (MAX_REPORTED + 8)   # reported at most once each
    with pytest.raises(ShardlineConfigError, match="got 33"):
        heat.report(k=33)


def test_memory_bound_keeps_the_load_exact():
    heat = HeatCounter(max_tracked=2, clock=lambda: 0.0)
    heat.record_reads("j", [("t", 0, 10), ("t", 1, 10), ("t", 2, 10)], now=0.0)
    assert heat.totals("j", "t", 2) is None and heat.untracked == 1
    load, hot = heat.report(now=1.0)
    assert load.bytes_out_per_second == 30 and len(hot) == 2
    heat.drop_job("j")
    assert heat.totals("j", "t", 0) is None


def _load(interval, **rates):
    fields = ("bytes_in", "bytes_out", "pulls", "pushes", "apply_seconds", "reads", "writes")
    return types.SimpleNamespace(interval_seconds=interval, rack="r1",
                                 **{f"{f}_per_second": float(rates.get(f, 0.0)) for f in fields})


def _entry(tensor, block, reads=0, writes=0, nbytes=0):
    return types.SimpleNamespace(job="j", tensor=tensor, block=block, reads=reads, writes=writes,
                                 read_bytes=nbytes, write_bytes=0)


def test_heatmap_steady_rate_reads_as_itself_and_decays_by_half_life():
    hm = Heatmap(half_life=10.0)
    for t in range(1, 101):                   # 100 heartbeats, 1 s apart, 1000 B/s out, 5 reads/s of block 0
        hm.report("n1", "r1", _load(1.0, bytes_out=1000, reads=5), [_entry("w", 0, reads=5, nbytes=5000)], float(t))
    node, = hm.nodes(100.0)
    assert node.bytes_out_per_second == pytest.approx(1000, rel=1e-6) and node.share == 1.0
    shard, = hm.hottest(100.0)
    assert shard.reads_per_second == pytest.approx(5, rel=1e-6) and shard.share == pytest.approx(1.0)
    # rates are as of the node's last report: no dip between heartbeats
    assert hm.nodes(100.9)[0].bytes_out_per_second == node.bytes_out_per_second
    # an idle half-life (reported as such) halves the decayed sum (the window barely grows after 100 s)
    hm.report("n1", "r1", _load(10.0), [], 110.0)
    tau = 10 / math.log(2)
    window = lambda age: tau * -math.expm1(-age / tau)  # noqa: E731
    later, = hm.nodes(110.0)
    assert later.bytes_out_per_second == pytest.approx(1000 * 0.5 * window(100) / window(110), rel=1e-6)
    assert hm.hottest(110.0)[0].reads_per_second == pytest.approx(5 * 0.5 * window(100) / window(110), rel=1e-6)
    assert hm.covered(["n1"], 110.0, 100.0) and not hm.covered(["n1", "n2"], 110.0, 1.0)


def test_heatmap_shares_and_top_k_across_nodes():
    hm = Heatmap(half_life=30.0)
    hm.report("n1", "r1", _load(1.0, bytes_out=300, reads=30), [_entry("hot", 0, reads=20, nbytes=200),
                                                                _entry("cold", 0, reads=10, nbytes=100)], 1.0)
    hm.report("n2", "r2", _load(1.0, bytes_in=100, writes=10), [_entry("cold", 1, writes=10)], 1.0)
    rows = hm.hottest(1.0, limit=2)
    assert [(r.tensor, r.block, r.node) for r in rows] == [("hot", 0, "n1"), ("cold", 0, "n1")]
    assert rows[0].share == pytest.approx(20 / 40) and rows[1].share == pytest.approx(10 / 40)
    assert {n.node_id: n.share for n in hm.nodes(1.0)} == pytest.approx({"n1": 0.75, "n2": 0.25})
    hm.forget_node("n2")
    assert [n.node_id for n in hm.nodes(1.0)] == ["n1"]
    with pytest.raises(ShardlineConfigError, match="-1"):
        hm.report("n1", "r1", _load(1.0, bytes_out=-1), [], 2.0)


def _skewed(nodes=4, hot_blocks=32, rate=1000.0):
    base = vnode_counts({f"ps{i}": 1.0 for i in range(nodes)})
    blocks = {("j", "emb", i): rate for i in range(hot_blocks)}
    model = LoadModel({n: 0.0 for n in base}, blocks, base)   # no residual: all load is in known blocks
    load = model.predict(base)
    return base, blocks, load


def test_policy_balances_a_skewed_load_and_does_not_flap():
    base, blocks, load = _skewed()
    assert imbalance(load) > 1.15
    p = plan(base, base, load, blocks, now=100.0, last_change=None, cooldown=10.0, pending=False)
    assert p is not None and p.predicted_after < p.predicted_before and p.predicted_after <= 1.15
    # the same load again (as measured before the move, or predicted after it): nothing moves
    assert plan(base, p.vnodes, load, blocks, now=200.0, last_change=100.0, cooldown=10.0, pending=False) is None
    after = LoadModel(load, blocks, p.vnodes).predict(p.vnodes)
    assert plan(base, p.vnodes, after, blocks, now=200.0, last_change=100.0, cooldown=10.0, pending=False) is None


def test_a_move_must_improve_on_the_load_measured_not_only_on_the_models_prediction():
    """The model puts each block's rate on its primary under a ring; what nodes carry can differ
    (reads served by copy holders, replication). Measured 1.15 where the model says 1.25 for the
    ring in use and 1.125 after a move: the gain against what was measured is 0.025, less than
    min_improvement, so nothing moves (a marginal plan from a model off by more than its gain
    once took a cluster from 1.05 to 1.18: test_heat_cluster). Measured as predicted, it moves."""
    base, blocks, load = _skewed()
    kw = dict(now=100.0, last_change=None, cooldown=10.0, pending=False)
    moved = plan(base, base, load, blocks, **kw)
    assert moved is not None and moved.predicted_before == pytest.approx(1.25)
    assert moved.predicted_after == pytest.approx(1.125)
    nodes = sorted(load)
    total = sum(load.values())
    mean = total / len(nodes)
    measured = {nodes[0]: 1.15 * mean, **{n: (total - 1.15 * mean) / (len(nodes) - 1) for n in nodes[1:]}}
    assert imbalance(measured) == pytest.approx(1.15)
    assert plan(base, base, measured, blocks, **kw) is None


def test_policy_leaves_balanced_idle_cooling_and_pending_rings_alone():
    base, blocks, load = _skewed()
    kw = dict(now=100.0, cooldown=10.0)
    balanced = {n: 1000.0 for n in base}
    assert plan(base, base, balanced, {}, last_change=None, pending=False, **kw) is None
    assert plan(base, base, {n: 0.0 for n in base}, {}, last_change=None, pending=False, **kw) is None
    assert plan(base, base, load, blocks, last_change=95.0, pending=False, **kw) is None      # cool-down
    assert plan(base, base, load, blocks, last_change=None, pending=True, **kw) is None       # a change pending
    missing = dict(load)
    missing.pop("ps0")
    assert plan(base, base, missing, blocks, last_change=None, pending=False, **kw) is None   # not measured yet
    with pytest.raises(ShardlineConfigError, match="cooldown"):
        plan(base, base, load, blocks, now=1.0, last_change=None, cooldown=-1.0, pending=False)


def test_the_load_model_owns_blocks_like_the_ring():
    vnodes = {"a": 100, "b": 37, "c": 250}
    blocks = {("j", "t", i): float(i) for i in range(500)}
    model = LoadModel({n: 0.0 for n in vnodes}, blocks, vnodes)
    ring = HashRing(vnodes)
    assert model.owners_of(vnodes) == [ring.owner(block_hash(*key)) for key in sorted(blocks)]
    expected = dict.fromkeys(vnodes, 0.0)
    for key, rate in blocks.items():
        expected[ring.owner(block_hash(*key))] += rate
    assert model.predict(vnodes) == pytest.approx(expected)
    spread = LoadModel({"a": 1000.0, "b": 0.0, "c": 0.0}, {}, vnodes).predict(vnodes)   # all residual
    assert spread == pytest.approx({n: 1000.0 * f for n, f in ring.share().items()})


def test_the_dispatcher_plans_from_heartbeats_and_serves_the_heatmap(grpc_context):
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.dispatcher.membership import Membership
    from shardline.dispatcher.server import DispatcherServicer
    from shardline.services.pb import dispatcher_pb2

    now = [0.0]
    servicer = DispatcherServicer(Membership(heartbeat_timeout=5.0), JobRegistry(), heartbeat_interval=0.5,
                                  clock=lambda: now[0], heat_half_life=1.0, rebalance_interval=1.0)
    nodes = [f"ps{i}" for i in range(4)]
    for i, n in enumerate(nodes):
        servicer.membership.register(n, "r1", f"127.0.0.1:{9000 + 2 * i}", f"127.0.0.1:{9001 + 2 * i}", 1.0, 0.0)
    base, _, _ = servicer.membership.ring_counts()
    blocks = {("j", "emb", i): 1e4 for i in range(48)}
    model = LoadModel({n: 0.0 for n in nodes}, blocks, base)
    owners = model.owners_of(base)
    load = model.predict(base)
    assert imbalance(load) > 1.15
    for t in range(1, 31):                           # 3 s of heartbeats, every 0.1 s
        now[0] = t / 10
        assert servicer.rebalance() is None or t >= 20   # not before two half-lives of load
        for n in nodes:
            hot = [dispatcher_pb2.HeatEntry(job="j", tensor="emb", block=key[2], reads=1, read_bytes=int(rate / 10))
                   for key, rate, owner in zip(sorted(blocks), [blocks[k] for k in sorted(blocks)], owners)
                   if owner == n]
            servicer.Heartbeat(dispatcher_pb2.HeartbeatRequest(
                node_id=n, load=dispatcher_pb2.NodeLoad(node_id=n, rack="r1", interval_seconds=0.1,
                                                        bytes_out_per_second=load[n]), hot=hot), grpc_context)
        if servicer.membership.rebalancing():
            break
    assert servicer.membership.rebalancing(), "no rebalance was planned"
    heat = servicer.GetHotShards(dispatcher_pb2.HeatRequest(limit=5), grpc_context)
    assert len(heat.shards) == 5 and {n.node_id for n in heat.nodes} == set(nodes)
    assert heat.last_rebalance.startswith("max/mean load") and heat.rebalance_interval_seconds == 1.0
    assert sum(n.bytes_out_per_second for n in heat.nodes) == pytest.approx(sum(load.values()), rel=1e-6)
    assert servicer.rebalance() is None              # a change is pending


def test_a_plan_prefers_the_readers_rack_within_the_balance_band():
    """Racks a (ps0, ps1) and b (ps2, ps3); job "j" is read from rack a. The plan with the
    preference keeps the predicted max/mean within the band of the plan without it and puts at
    least as many of j's bytes on rack a (strictly more here); a job without a reader rack, or no
    racks known, plans exactly as before."""
    from shardline.dispatcher.rebalance import rack_local_bytes

    base, blocks, load = _skewed(hot_blocks=48)
    racks = {"ps0": "a", "ps1": "a", "ps2": "b", "ps3": "b"}
    kw = dict(now=100.0, last_change=None, cooldown=10.0, pending=False)
    plain = plan(base, base, load, blocks, **kw)
    local = plan(base, base, load, blocks, node_racks=racks, reader_racks={"j": "a"}, **kw)
    assert plain is not None and local is not None
    model = LoadModel(load, blocks, base)
    wanted = [{"ps0", "ps1"}] * len(model.blocks)
    assert local.predicted_after <= max(plain.predicted_after, 1.05) + 1e-9
    assert rack_local_bytes(model, local.vnodes, wanted) > rack_local_bytes(model, plain.vnodes, wanted)
    assert plan(base, base, load, blocks, node_racks=racks, reader_racks={"other": "a"}, **kw) == plain
    assert plan(base, base, load, blocks, node_racks=None, reader_racks={"j": "a"}, **kw) == plain
