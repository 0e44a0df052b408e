"""Topology-aware placement: the reader-rack rule of services/placement.py and the dispatcher's
decision of dispatcher/reader_racks.py (docs/architecture.md, "Reader racks").

The placement properties are checked against their definition (R distinct owners, one per rack
without a preference, the primary is ring.owner, exactly one owner on the reader rack with one,
only blocks lacking a copy there move), over a few hundred blocks; the decision with a fake clock.
"""

from __future__ import annotations

import pytest

from shardline.dispatcher.reader_racks import ReaderRacks
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.services.placement import place
from shardline.services.blocks import block_hash
from shardline.services.errors import ShardlineConfigError, ShardlineStateError
from shardline.services.pb import common_pb2
from shardline.services.routing import RoutingView

RACKS = {"ps-0": "a", "ps-1": "a", "ps-2": "b", "ps-3": "b", "ps-4": "c", "ps-5": "c"}


def spec(name="job", replication=2) -> common_pb2.JobSpec:
    s = common_pb2.JobSpec(name=name, sync="bsp", world_size=1, block_elements=64, replication=replication)
    s.tensors.add(name="w", shape=[300, 64], dtype="float32", trainable=True)
    return s


def view(racks=RACKS, reader=None, pending_reader=None, pending=None) -> RoutingView:
    t = common_pb2.RoutingTable(epoch=3, default_replication=2)
    for n, rack in racks.items():
        t.nodes.add(node_id=n, rack=rack, grpc_address="x:1", data_address=f"{n}:1", vnodes=64)
    if reader:
        t.reader_racks.update(reader)
    if pending is not None:
        t.pending_epoch = 4
        for n, rack in pending.items():
            t.pending_nodes.add(node_id=n, rack=rack, grpc_address="x:1", data_address=f"{n}:1", vnodes=64)
        if pending_reader:
            t.pending_reader_racks.update(pending_reader)
    return RoutingView.from_proto(common_pb2.RoutingTable.FromString(t.SerializeToString()))


def racks_of(owners, racks=RACKS):
    return [racks[n] for n in owners]


@pytest.mark.parametrize("r", [2, 3])
def test_no_preference_keeps_rack_diversity(r):
    v = view()
    p = place(v, spec(replication=r))
    assert len(p.owners) == 300
    for key, owners in p.owners.items():
        assert len(set(owners)) == r
        assert len(set(racks_of(owners))) == r  # 3 racks, R <= 3: one copy per rack
        assert owners[0] == v.ring.owner(block_hash("job", *key))


@pytest.mark.parametrize("r", [2, 3])
def test_preference_puts_exactly_the_rule_on_the_reader_rack(r):
    base = place(view(), spec(replication=r)).owners
    v = view(reader={"job": "c"})
    p = place(v, spec(replication=r))
    moved = 0
    for key, owners in p.owners.items():
        before = base[key]
        assert len(set(owners)) == r and owners[0] == before[0] == v.ring.owner(block_hash("job", *key))
        assert "c" in racks_of(owners)
        if "c" in racks_of(before):
            assert owners == before  # minimal movement: it had a copy there already
        else:
            moved += 1
            assert owners[:-1] == before[:-1]  # one replica changes, the rest keep their racks
            assert racks_of(owners).count("c") == 1
    assert moved > 0 if r == 2 else moved == 0  # R = 3 on 3 racks: every rack has a copy already


def test_preference_is_deterministic_and_per_job():
    a = place(view(reader={"job": "a"}), spec()).owners
    b = place(view(reader={"job": "a"}), spec()).owners
    assert a == b
    other = place(view(reader={"job": "a"}), spec(name="other")).owners
    assert other == place(view(), spec(name="other")).owners  # no preference for that job


def test_replication_one_and_rack_without_nodes_are_untouched():
    assert place(view(reader={"job": "c"}), spec(replication=1)).owners == place(view(), spec(replication=1)).owners
    assert place(view(reader={"job": "z"}), spec()).owners == place(view(), spec()).owners


def test_pending_ring_uses_pending_preference():
    v = view(reader={}, pending=RACKS, pending_reader={"job": "b"})
    p = place(v, spec())
    assert p.owners == place(view(), spec()).owners
    for key, owners in p.pending_owners.items():
        assert "b" in racks_of(owners)
    # The copies to send while pending are exactly the new owners on rack b (learners).
    learners = {n for key in p.pending_owners for n in p.pending_owners[key] if n not in p.owners[key]}
    assert learners and {RACKS[n] for n in learners} == {"b"}


# -- the decision ------------------------------------------------------------------------------

def tracker(**kw) -> ReaderRacks:
    return ReaderRacks(10.0, warm_seconds=5.0, **kw)


def feed(t: ReaderRacks, start: float, end: float, per_rack: dict, job="job"):
    now = start
    while now < end:
        for rack, rate in per_rack.items():
            t.report(rack, {job: rate}, now)
        now += 1.0
    return now


NODE_RACKS = ["a", "b"]
R2 = {"job": 2}


def test_enters_at_share_and_only_when_warm():
    t = tracker()
    feed(t, 0, 3, {"a": 700, "b": 300})
    assert t.decide({}, R2, NODE_RACKS, 3) == {}  # not warm yet
    now = feed(t, 3, 10, {"a": 700, "b": 300})
    assert t.shares("job", now)["a"] == pytest.approx(0.7)
    assert t.decide({}, R2, NODE_RACKS, now) == {"job": "a"}
    assert t.decide({}, {"job": 1}, NODE_RACKS, now) == {}  # nothing to move with R = 1


def test_hysteresis_keeps_then_drops():
    t = tracker()
    now = feed(t, 0, 10, {"a": 500, "b": 500})
    assert t.decide({}, R2, NODE_RACKS, now) == {}  # 50 % is below enter
    assert t.decide({"job": "a"}, R2, NODE_RACKS, now) == {"job": "a"}  # but above leave: kept
    now = feed(t, now, now + 60, {"a": 200, "b": 800})
    assert t.decide({"job": "a"}, R2, NODE_RACKS, now) == {"job": "b"}


def test_rack_that_stops_reading_is_dropped():
    t = tracker()
    now = feed(t, 0, 10, {"a": 1000})
    assert t.decide({}, R2, NODE_RACKS, now) == {"job": "a"}
    # No reads at all for many half-lives: the rate falls below the floor.
    assert t.decide({"job": "a"}, R2, NODE_RACKS, now + 300) == {}


def test_rack_without_nodes_is_never_chosen():
    t = tracker()
    now = feed(t, 0, 10, {"z": 900, "a": 100})
    assert t.decide({}, R2, NODE_RACKS, now) == {}
    assert t.decide({"job": "z"}, R2, NODE_RACKS, now) == {}


def test_bounded_racks_and_forget():
    t = tracker(max_racks=2)
    now = feed(t, 0, 10, {"a": 10, "b": 100, "c": 1000})
    assert set(t.shares("job", now)) == {"b", "c"}
    t.forget(["job"])
    assert t.shares("job", now) == {}
    assert t.decide({"job": "c"}, {}, NODE_RACKS, now) == {}  # a deleted job keeps nothing


@pytest.mark.parametrize("kw", [{"enter_share": 0}, {"enter_share": 1.5}, {"leave_share": 0.9},
                                {"max_racks": 0}, {"min_bytes_per_second": -1}])
def test_bad_options_quote_the_value(kw):
    with pytest.raises(ShardlineConfigError):
        ReaderRacks(**kw)
    with pytest.raises(ShardlineConfigError, match="-5"):
        ReaderRacks().report("a", {"job": -5}, 0.0)


def test_status_shows_a_jobs_reader_rack():
    from shardline.cli import render_status, status_dict
    from shardline.services.pb import dispatcher_pb2

    status = dispatcher_pb2.ClusterStatus()
    status.routing.epoch, status.routing.pending_epoch = 3, 4
    status.routing.reader_racks["job"] = "a"
    status.routing.pending_reader_racks["job"] = "b"
    status.routing.reader_racks["steady"] = "a"
    status.routing.pending_reader_racks["steady"] = "a"
    for name in ("job", "steady", "plain"):
        status.jobs.add(spec=spec(name=name), ready=True)
    text = render_status(status_dict(status, "127.0.0.1:1"))
    assert "job job: reader rack a (moving to b)" in text
    assert "job steady: reader rack a\n" in text + "\n"
    assert "job plain:" not in text


# -- the change: a two-phase ring change of the membership ------------------------------------

def membership(store=None):
    from shardline.dispatcher.membership import Membership

    m = Membership(5.0, 16, store=store, isolation_share=1.0)   # a death with a clock that jumps: no isolation guard
    for i, rack in enumerate(["a", "a", "b", "b"]):
        m.register(f"ps-{i}", rack, f"127.0.0.1:{7000 + 2 * i}", f"127.0.0.1:{7001 + 2 * i}", 1.0, now=0.0)
    return m


def ready_all(m, epoch):
    return [m.report_ready(f"ps-{i}", epoch) for i in range(4)][-1]


def test_reader_rack_change_is_pending_then_switches():
    m = membership()
    before = m.snapshot()
    pending = m.set_reader_racks({"job": "b"})
    snap = m.snapshot()
    assert pending == snap.pending_epoch == snap.epoch > before.epoch
    assert snap.reader_racks == {} and snap.pending_reader_racks == {"job": "b"}
    assert [n.node_id for n in snap.pending] == [n.node_id for n in snap.serving]  # same ring, new placement
    with pytest.raises(ShardlineStateError, match="in progress"):
        m.set_reader_racks({"job": "a"})
    assert ready_all(m, pending)
    snap = m.snapshot()
    assert snap.pending_epoch == 0 and snap.reader_racks == {"job": "b"} and snap.epoch > pending
    assert m.set_reader_racks({"job": "b"}) == 0  # the map in use: nothing to do
    with pytest.raises(ShardlineConfigError, match="bad rack!"):
        m.set_reader_racks({"job": "bad rack!"})


def test_a_death_calls_off_a_pending_reader_rack_change():
    m = membership()
    m.set_reader_racks({"job": "b"})
    for i in range(3):
        m.heartbeat(f"ps-{i}", 4.0)
    assert m.expire(6.0) == ["ps-3"]
    snap = m.snapshot()
    assert snap.pending_epoch == 0 and snap.reader_racks == {}


def test_reader_racks_survive_a_new_leader(tmp_path):
    from shardline.dispatcher.state_store import open_state_store

    store = open_state_store(str(tmp_path))
    m = membership(store)
    pending = m.set_reader_racks({"job": "b"})
    ready_all(m, pending)
    m.set_reader_racks({"job": "a"})
    store.close()
    again = membership(open_state_store(str(tmp_path)))  # a restarted (or newly elected) dispatcher
    snap = again.snapshot()
    again.store.close()
    assert snap.reader_racks == {"job": "b"} and snap.pending_reader_racks == {"job": "a"} and snap.pending_epoch


def test_routing_table_carries_the_reader_racks():
    m = membership()
    m.set_reader_racks({"job": "b"})
    snap = m.snapshot()
    table = common_pb2.RoutingTable(epoch=snap.epoch, pending_epoch=snap.pending_epoch,
                                    reader_racks=snap.reader_racks, pending_reader_racks=snap.pending_reader_racks)
    for n in snap.serving:
        table.nodes.add(node_id=n.node_id, rack=n.rack, data_address=n.data_address, vnodes=n.vnodes)
        table.pending_nodes.add(node_id=n.node_id, rack=n.rack, data_address=n.data_address, vnodes=n.vnodes)
    p = place(RoutingView.from_proto(table), spec())
    racks = {n.node_id: n.rack for n in snap.serving}
    assert all("b" in [racks[o] for o in owners] for owners in p.pending_owners.values())


# -- the source: the PS counts bytes per reader rack; the leader decides from heartbeats -------

def test_ps_counts_bytes_by_reader_rack_bounded():
    from shardline.ps_server.heat import MAX_RACK_READS, HeatCounter, rack_reads_report

    heat = HeatCounter(clock=lambda: 0.0)
    heat.record_reads("job", [("w", 0, 100), ("w", 1, 50)], rack="a")
    heat.record_reads("job", [("w", 0, 10)])                # no rack named: load only
    heat.record_rack_read("job", "b", 7)                     # a subscriber pull
    assert [(r.job, r.rack, r.bytes) for r in rack_reads_report(heat)] == [("job", "a", 150), ("job", "b", 7)]
    assert heat.rack_reads() == {}                           # sums restart
    for i in range(MAX_RACK_READS + 5):
        heat.record_rack_read(f"j{i}", "a", 1)
    assert len(heat.rack_reads()) == MAX_RACK_READS


def test_leader_moves_a_jobs_reader_rack_from_heartbeats(grpc_context):
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.dispatcher.membership import Membership
    from shardline.dispatcher.server import DispatcherServicer
    from shardline.services.pb import dispatcher_pb2

    now = [0.0]
    servicer = DispatcherServicer(Membership(heartbeat_timeout=5.0), JobRegistry(), heartbeat_interval=0.5,
                                  clock=lambda: now[0], heat_half_life=1.0, rebalance_interval=1.0, reader_racks=True)
    for i, rack in enumerate(["a", "a", "b", "b"]):
        servicer.membership.register(f"ps{i}", rack, f"127.0.0.1:{9000 + 2 * i}", f"127.0.0.1:{9001 + 2 * i}", 1.0, 0.0)
    job = spec()
    job.optimizer.CopyFrom(OptimizerConfig.from_kwargs("sgd", lr=0.1).to_proto())
    servicer.jobs.create(job)
    pending = 0
    for t in range(1, 31):
        now[0] = t / 10
        for i in range(4):
            servicer.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id=f"ps{i}", rack_reads=[
                dispatcher_pb2.RackReads(job="job", rack="b", bytes=9000),
                dispatcher_pb2.RackReads(job="job", rack="a", bytes=1000)]), grpc_context)
        pending = pending or servicer.update_reader_racks()
        assert not pending or t >= 10  # not before a half-life of reports
    assert pending and servicer.membership.snapshot().pending_reader_racks == {"job": "b"}
    for i in range(4):
        servicer.membership.report_ready(f"ps{i}", pending)
    assert servicer.membership.reader_racks() == ({"job": "b"}, False)
    assert servicer.update_reader_racks() == 0  # decided again: the same map, nothing moves
    off = DispatcherServicer(Membership(heartbeat_timeout=5.0), JobRegistry(), heartbeat_interval=0.5)
    assert off.update_reader_racks() == 0 and not off.reader_racks
