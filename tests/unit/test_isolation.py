"""The dispatcher's failure detection under partitions, with a fake clock: the isolation guard
(dispatcher/isolation.py), silent nodes kept for the blocks only they hold (dispatcher/holders.py,
Membership), and the servicer's leases and metrics while it suspects its own isolation."""

from __future__ import annotations

import types

import pytest

from shardline.dispatcher.holders import SoleHolders, sole_holders
from shardline.dispatcher.isolation import CONNECTED, ISOLATED, IsolationGuard
from shardline.dispatcher.jobs import JobRegistry
from shardline.dispatcher.membership import ALIVE, DEAD, JOINING, SERVING, Membership
from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2
from shardline.services.placement import place
from shardline.services.routing import RoutingView

TIMEOUT, INTERVAL = 5.0, 1.0


def beat(m: Membership, nodes, now: float) -> None:
    for node in nodes:
        assert m.heartbeat(node, now)


def register(m: Membership, node: str, now: float, *, incarnation: str = "a") -> None:
    port = 9000 + 10 * int(node[-1])
    m.register(node, "r", f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", 1.0, now, incarnation=incarnation)


# --- the guard alone ------------------------------------------------------------------------------

def test_one_silent_node_of_three_is_declared_dead_after_the_timeout():
    guard = IsolationGuard(TIMEOUT, INTERVAL)
    assert guard.dead({"a": 0.5, "b": 0.9, "c": 5.0}, 10.0) == []      # exactly at the timeout: not yet
    assert guard.dead({"a": 0.1, "b": 0.6, "c": 5.1}, 10.1) == ["c"]
    assert guard.state == CONNECTED


def test_every_node_silent_together_is_isolation_and_nobody_is_declared_dead_until_they_return():
    guard = IsolationGuard(TIMEOUT, INTERVAL)
    # the dispatcher's link went down at t=0: heartbeats stopped within one interval of each other
    for t in (5.2, 6.0, 9.0, 30.0):
        assert guard.dead({"a": t, "b": t - 0.4, "c": t - 0.9}, t) == []
    assert guard.state == ISOLATED and guard.late == ["a", "b", "c"]
    # back at t=31: two answered, "c" not yet; it gets a whole timeout from now before it is dead
    assert guard.dead({"a": 0.1, "b": 0.2, "c": 31.0}, 31.0) == []
    assert guard.state == CONNECTED
    assert guard.dead({"a": 0.1, "b": 0.2, "c": 31.9}, 31.9) == []     # "c" answered late: nothing lost
    assert guard.dead({"a": 0.1, "b": 0.2, "c": 36.1}, 36.1) == ["c"]  # or it really is gone


def test_more_than_half_silent_is_isolation_half_is_not():
    guard = IsolationGuard(TIMEOUT, INTERVAL)
    assert guard.dead({"a": 6.0, "b": 0.2, "c": 0.3, "d": 5.8}, 10.0) == ["a", "d"]   # 2 of 4: nodes failed
    guard = IsolationGuard(TIMEOUT, INTERVAL)
    assert guard.dead({"a": 6.0, "b": 0.2, "c": 5.9, "d": 5.8}, 10.0) == []          # 3 of 4: isolated
    assert guard.isolated
    guard = IsolationGuard(TIMEOUT, INTERVAL)
    assert guard.dead({"a": 6.0, "b": 0.2}, 10.0) == ["a"]       # the default cluster: one of two dies
    assert guard.dead({"a": 6.0}, 10.0) == []                    # the only node: isolation (k8s: full disruption)


def test_the_isolation_timeout_declares_the_silent_nodes_dead():
    guard = IsolationGuard(TIMEOUT, INTERVAL, isolation_timeout=60.0)
    assert guard.dead({"a": 5.5, "b": 5.2}, 100.0) == [] and guard.since == 100.0
    assert guard.dead({"a": 65.4, "b": 65.1}, 159.9) == []
    assert guard.dead({"a": 65.5, "b": 65.2}, 160.0) == ["a", "b"]
    assert guard.state == CONNECTED
    never = IsolationGuard(TIMEOUT, INTERVAL, isolation_timeout=0)
    never.dead({"a": 6.0}, 0.0)
    assert never.dead({"a": 1e6}, 1e6) == [] and never.isolated


def test_a_share_of_one_never_suspects_isolation():
    guard = IsolationGuard(TIMEOUT, INTERVAL, share=1.0)
    assert guard.dead({"a": 6.0, "b": 6.0}, 10.0) == ["a", "b"]


def test_with_an_interval_close_to_the_timeout_a_death_waits_until_a_node_cut_at_the_same_moment_is_late():
    # interval 1, timeout 2: when the first node passes the timeout, one cut an interval later has
    # an age of 1, no different from a healthy node's; the declaration waits until it is late
    guard = IsolationGuard(2.0, 1.0)
    assert guard.decide_after == 2.5
    assert guard.dead({"a": 2.1, "b": 1.1, "c": 1.05}, 10.0) == []
    assert guard.dead({"a": 2.6, "b": 1.6, "c": 1.55}, 10.5) == [] and guard.isolated
    healthy = IsolationGuard(2.0, 1.0)
    assert healthy.dead({"a": 2.6, "b": 0.6, "c": 0.1}, 10.5) == ["a"]


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, True, "half"])
def test_a_bad_share_is_refused_with_the_value(bad):
    with pytest.raises(ShardlineConfigError, match="isolation_share"):
        IsolationGuard(TIMEOUT, INTERVAL, share=bad)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), "60"])
def test_a_bad_isolation_timeout_is_refused_with_the_value(bad):
    with pytest.raises(ShardlineConfigError, match="isolation_timeout"):
        IsolationGuard(TIMEOUT, INTERVAL, isolation_timeout=bad)


# --- which nodes hold blocks alone ----------------------------------------------------------------

def job(name="j", replication=0, blocks=64) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name=name, block_elements=1, replication=replication, sync="bsp", world_size=1,
                              optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1))
    spec.tensors.add(name="w", shape=[blocks], dtype="float32", trainable=True)
    return spec


def nodes(*ids, rack="r"):
    return [common_pb2.NodeInfo(node_id=i, rack=rack, vnodes=128) for i in ids]


def owners(ids, spec, replication=2):
    table = common_pb2.RoutingTable(nodes=nodes(*ids), default_replication=replication)
    return place(RoutingView.from_proto(table), spec).owners


def test_sole_holders_are_the_leaving_nodes_whose_blocks_have_no_holder_staying():
    spec = job()
    serving = nodes("a", "b", "c")
    assert sole_holders(serving, {}, {"a"}, [spec], 2) == {}        # two copies: b or c holds each of a's
    alone = sole_holders(serving, {}, {"a", "b"}, [spec], 2)
    both = [key for key, o in owners("abc", spec).items() if set(o) == {"a", "b"}]
    assert set(alone) == {"a", "b"} and both
    assert f"{len(both)} block(s) of job 'j', e.g. w[{both[0][1]}]" == alone["a"]
    assert set(sole_holders(serving, {}, {"a"}, [job(replication=1)], 2)) == {"a"}   # one copy: a's own
    assert set(sole_holders(serving, {}, {"a", "b", "c"}, [spec], 2)) == {"a", "b", "c"}
    assert sole_holders(serving, {}, {"a", "b", "c"}, [], 2) == {}                    # no job: nothing held


def test_the_registry_form_counts_ready_jobs_and_remembers_its_answer():
    jobs = JobRegistry(default_replication=1)
    jobs.create(job())
    holders = SoleHolders(jobs)
    serving = nodes("a", "b")
    assert holders(serving, {}, {"a"}) == {}       # created, not initialized: nobody holds its blocks yet
    jobs.mark_ready("j")
    assert set(holders(serving, {}, {"a"})) == {"a"}
    assert holders(serving, {}, {"a"}) == holders(serving, {}, {"a"})


# --- in the membership --------------------------------------------------------------------------

def three_nodes(replication=2, **kw) -> Membership:
    jobs = JobRegistry(default_replication=replication)
    jobs.create(job())
    jobs.mark_ready("j")
    data = []   # the nodes serve before the job holds data (no join syncs)
    m = Membership(TIMEOUT, has_data=lambda: bool(data), sole_holders=SoleHolders(jobs), heartbeat_interval=INTERVAL,
                   **kw)
    for node in ("ps0", "ps1", "ps2"):
        register(m, node, 0.0)
    data.append(True)
    return m


def states(m: Membership, now: float) -> dict:
    return {n.node_id: (n.state, n.member) for n in m.all_nodes(now)}


def test_a_node_whose_blocks_all_have_live_holders_leaves_the_ring():
    m = three_nodes()
    beat(m, ("ps0", "ps1"), 4.5)
    assert m.expire(5.5) == ["ps2"] and m.kept() == {}
    assert [n.node_id for n in m.snapshot().serving] == ["ps0", "ps1"]


def test_two_silent_nodes_of_three_with_two_copies_stay_in_the_ring_until_one_answers():
    m = three_nodes(isolation_share=1.0)        # the guard off: this rule holds on its own
    epoch = m.epoch
    beat(m, ("ps0",), 4.5)
    assert m.expire(5.5) == [] and set(m.kept()) == {"ps1", "ps2"}
    assert m.epoch == epoch and [n.node_id for n in m.snapshot().serving] == ["ps0", "ps1", "ps2"]
    beat(m, ("ps0", "ps1"), 7.0)                # ps1 answers: ps2's blocks have a live holder again
    assert m.expire(7.5) == ["ps2"] and m.kept() == {}
    assert states(m, 7.5)["ps2"] == (DEAD, "")


def test_every_node_silent_with_the_guard_off_leaves_the_ring_as_it_was():
    m = three_nodes(isolation_share=1.0)
    epoch = m.epoch
    assert m.expire(30.0) == [] and set(m.kept()) == {"ps0", "ps1", "ps2"} and m.epoch == epoch
    # they come back, in any order, and serve what they hold: no node serves alone
    for node in ("ps2", "ps0", "ps1"):
        register(m, node, 31.0)
        assert {n.node_id for n in m.snapshot().serving} == {"ps0", "ps1", "ps2"}
    assert m.epoch == epoch and all(s == (ALIVE, SERVING) for s in states(m, 31.0).values())


def test_a_kept_node_that_restarted_serves_on_and_one_with_live_copies_joins():
    m = three_nodes(isolation_share=1.0)
    beat(m, ("ps0",), 4.5)
    assert m.expire(5.5) == []                  # ps1 and ps2 kept
    register(m, "ps1", 6.0, incarnation="b")    # restarted (its checkpoint): nobody else holds its blocks
    assert states(m, 6.0)["ps1"] == (ALIVE, SERVING)
    m = three_nodes()
    beat(m, ("ps0", "ps2"), 4.0)
    register(m, "ps1", 4.0, incarnation="b")    # restarted before it was declared dead; copies elsewhere
    assert states(m, 4.0)["ps1"] == (ALIVE, JOINING)


def test_the_guard_keeps_every_node_alive_in_the_membership():
    m = three_nodes()
    assert m.expire(5.5) == [] and m.isolation.isolated and m.kept() == {}
    beat(m, ("ps0", "ps1", "ps2"), 8.0)
    assert m.expire(8.1) == [] and not m.isolation.isolated
    assert all(s == (ALIVE, SERVING) for s in states(m, 8.1).values())


def test_a_dispatcher_without_its_state_takes_the_ring_back_from_the_first_node_that_remembers_it():
    old = three_nodes()
    remembered = (old.epoch, [common_pb2.NodeInfo(node_id=n.node_id, rack=n.rack, grpc_address=n.grpc_address,
                                                  data_address=n.data_address, capacity=n.capacity, vnodes=n.vnodes)
                              for n in old.snapshot().serving])
    jobs = JobRegistry(default_replication=2)   # restarted in memory: no node, no job (the nodes restore them)
    fresh = Membership(TIMEOUT, has_data=lambda: bool(jobs.list()), sole_holders=SoleHolders(jobs),
                       heartbeat_interval=INTERVAL)
    fresh.register("ps1", "r", "127.0.0.1:9010", "127.0.0.1:9011", 1.0, 100.0, incarnation="a", remembered=remembered)
    snap = fresh.snapshot()
    assert [n.node_id for n in snap.serving] == ["ps0", "ps1", "ps2"] and snap.epoch == old.epoch + 1
    assert [n.vnodes for n in snap.serving] == [n.vnodes for n in old.snapshot().serving]
    assert fresh.heartbeat("ps0", 101.0) and fresh.heartbeat("ps2", 101.0)   # they need not register again
    # a ring is served now: another node's memory changes nothing (a node that was away syncs as usual)
    before = fresh.epoch
    fresh.register("ps2", "r", "127.0.0.1:9020", "127.0.0.1:9021", 1.0, 101.5, remembered=(1, remembered[1][:1]))
    assert fresh.epoch == before and states(fresh, 101.5)["ps2"] == (ALIVE, SERVING)
    # a node that is not in the ring it names takes nothing back
    other = Membership(TIMEOUT, heartbeat_interval=INTERVAL)
    other.register("ps9", "r", "127.0.0.1:9090", "127.0.0.1:9091", 1.0, 0.0, remembered=remembered)
    assert [n.node_id for n in other.snapshot().serving] == ["ps9"]


# --- the servicer: leases, metrics, the routing watch ----------------------------------------------

def isolated_servicer():
    from shardline.dispatcher.server import DispatcherServicer

    now = [0.0]
    jobs = JobRegistry()
    record, _ = jobs.create(job())
    m = Membership(TIMEOUT, has_data=lambda: False, heartbeat_interval=INTERVAL)
    for node in ("ps0", "ps1", "ps2"):
        register(m, node, 0.0)
    servicer = DispatcherServicer(m, jobs, heartbeat_interval=INTERVAL, clock=lambda: now[0])
    servicer._state.leases.heartbeat("j", 0, "inc", 0, now=0.0)
    return servicer, now


def test_an_isolated_dispatcher_loses_no_worker_and_gives_their_leases_a_timeout_when_it_hears_again():
    from prometheus_client import REGISTRY

    from shardline.dispatcher.leases import DEFAULT_LEASE_TIMEOUT_SECONDS

    servicer, now = isolated_servicer()
    leases = servicer._state.leases
    now[0] = 5.5
    assert servicer.expire() == [] and REGISTRY.get_sample_value("shardline_dispatcher_isolated") == 1
    now[0] = DEFAULT_LEASE_TIMEOUT_SECONDS + 20       # the worker's renewals cannot arrive either
    assert servicer.expire() == [] and not [lo for lo in leases.of_job("j") if lo.lost_at is not None]
    beat(servicer.membership, ("ps0", "ps1", "ps2"), now[0])
    assert servicer.expire() == [] and REGISTRY.get_sample_value("shardline_dispatcher_isolated") == 0
    now[0] += DEFAULT_LEASE_TIMEOUT_SECONDS - 1       # a whole lease timeout to check in, from the return
    beat(servicer.membership, ("ps0", "ps1", "ps2"), now[0])
    assert servicer.expire() == [] and not [lo for lo in leases.of_job("j") if lo.lost_at is not None]


def test_a_routing_watch_asking_with_the_current_epochs_gets_one_flag():
    from shardline.services.pb import dispatcher_pb2

    servicer, _ = isolated_servicer()
    epoch = servicer.membership.epoch
    context = types.SimpleNamespace(abort=None, peer=lambda: "ipv4:127.0.0.1:1")
    same = servicer.GetRouting(dispatcher_pb2.GetRoutingRequest(known_epoch=epoch, known_pending_epoch=0), context)
    assert same.unchanged and same.epoch == epoch and not same.nodes
    moved = servicer.GetRouting(dispatcher_pb2.GetRoutingRequest(known_epoch=epoch - 1), context)
    assert not moved.unchanged and [n.node_id for n in moved.nodes] == ["ps0", "ps1", "ps2"]
