"""Membership driven with a fake clock: registration, heartbeats, expiry, epoch bumps and restarts."""

from __future__ import annotations

import threading

import pytest

from shardline.services.errors import ShardlineStateError

from shardline.dispatcher.membership import ALIVE, DEAD, Membership
from shardline.dispatcher.state_store import StateStoreError
from shardline.services.errors import ShardlineConfigError
from shardline.services.ring import HashRing

# Expiry itself, with a clock that jumps: no isolation guard (a share of 1 never suspects isolation;
# tests/unit/test_isolation.py drives the guard).
NO_GUARD = {"isolation_share": 1.0}


def register(m: Membership, node_id: str, now: float, *, rack="r1", port=9000, capacity=1.0) -> int:
    return m.register(node_id, rack, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", capacity, now)


@pytest.fixture
def m() -> Membership:
    return Membership(heartbeat_timeout=5.0, vnodes_per_capacity=128, **NO_GUARD)


def test_epoch_starts_at_one_with_no_nodes(m):
    assert m.epoch == 1
    assert m.routing_table() == (1, [])
    assert m.all_nodes(0.0) == []


def test_register_adds_alive_nodes_and_bumps_epoch(m):
    assert register(m, "ps-0", 0.0) == 2
    assert register(m, "ps-1", 0.0, port=9100, rack="r2", capacity=2) == 3
    epoch, nodes = m.routing_table()
    assert epoch == 3
    assert [(n.node_id, n.rack, n.state, n.vnodes) for n in nodes] == [
        ("ps-0", "r1", ALIVE, 128),
        ("ps-1", "r2", ALIVE, 256),
    ]
    assert nodes[1].grpc_address == "127.0.0.1:9100" and nodes[1].data_address == "127.0.0.1:9101"
    assert m.alive_count == 2


def test_reregister_with_same_fields_only_refreshes(m):
    register(m, "ps-0", 0.0)
    assert register(m, "ps-0", 4.0) == 2
    # The refresh counts as a heartbeat: at t=8 the node is 4 s silent, under the 5 s timeout.
    assert m.expire(8.0) == []
    assert m.all_nodes(8.0)[0].heartbeat_age_seconds == pytest.approx(4.0)


@pytest.mark.parametrize(
    "change",
    [
        {"port": 9200},       # restarted on other ports
        {"capacity": 3.0},    # different weight on the ring
        {"rack": "r9"},       # different replica placement
    ],
)
def test_reregister_with_changed_fields_bumps_epoch(m, change):
    register(m, "ps-0", 0.0)
    assert register(m, "ps-0", 1.0, **change) == 3
    node = m.routing_table()[1][0]
    if "capacity" in change:
        assert node.vnodes == 384
    if "rack" in change:
        assert node.rack == "r9"


def test_heartbeat_keeps_node_alive_and_records_storage(m):
    register(m, "ps-0", 0.0)
    for t in (3.0, 6.0, 9.0, 12.0):
        assert m.heartbeat("ps-0", t, blocks=7, bytes=1024)
        assert m.expire(t + 4.9) == []
    node = m.all_nodes(13.0)[0]
    assert (node.blocks, node.bytes, node.state) == (7, 1024, ALIVE)
    assert node.heartbeat_age_seconds == pytest.approx(1.0)
    assert m.epoch == 2  # heartbeats never bump the epoch


def test_heartbeat_from_unknown_node_asks_to_register(m):
    assert m.heartbeat("ghost", 0.0) is False


def test_silent_node_is_declared_dead_after_timeout(m):
    register(m, "ps-0", 0.0)
    register(m, "ps-1", 0.0, port=9100)
    m.heartbeat("ps-1", 4.0)
    assert m.expire(5.0) == []            # exactly at the timeout: still alive
    assert m.expire(5.5) == ["ps-0"]
    assert m.epoch == 4
    assert m.expire(6.0) == []            # already dead: no second bump
    assert m.epoch == 4
    epoch, alive = m.routing_table()
    assert [n.node_id for n in alive] == ["ps-1"]
    states = {n.node_id: (n.state, n.vnodes) for n in m.all_nodes(6.0)}
    assert states == {"ps-0": (DEAD, 0), "ps-1": (ALIVE, 128)}
    assert m.alive_count == 1


def test_dead_node_heartbeat_is_refused_until_it_registers_again(m):
    register(m, "ps-0", 0.0)
    m.expire(10.0)
    assert m.heartbeat("ps-0", 10.5) is False
    assert register(m, "ps-0", 11.0) == 4  # revived: the alive set changed
    assert m.heartbeat("ps-0", 11.5) is True
    assert [n.state for n in m.all_nodes(12.0)] == [ALIVE]


def test_several_nodes_expiring_together_bump_once(m):
    for i in range(3):
        register(m, f"ps-{i}", 0.0, port=9000 + 10 * i)
    assert m.expire(100.0) == ["ps-0", "ps-1", "ps-2"]
    assert m.epoch == 5


def test_routing_table_builds_the_same_ring_everywhere(m):
    register(m, "ps-0", 0.0)
    register(m, "ps-1", 0.0, port=9100, capacity=0.5)
    _epoch, nodes = m.routing_table()
    ring = HashRing({n.node_id: n.vnodes for n in nodes})
    again = HashRing({n.node_id: n.vnodes for n in m.routing_table()[1]})
    assert ring.share() == again.share()
    assert ring.vnodes == {"ps-0": 128, "ps-1": 64}


@pytest.mark.parametrize(
    "field, args, fragment",
    [
        ("node_id", ("", "r1", "h:1", "h:2", 1.0), "''"),
        ("node_id", ("ps 0", "r1", "h:1", "h:2", 1.0), "'ps 0'"),
        ("node_id", ("x" * 129, "r1", "h:1", "h:2", 1.0), "xxxx"),
        ("rack", ("ps-0", "rack/1", "h:1", "h:2", 1.0), "'rack/1'"),
        ("grpc_address", ("ps-0", "r1", "nohost", "h:2", 1.0), "'nohost'"),
        ("grpc_address", ("ps-0", "r1", "h:0", "h:2", 1.0), "'h:0'"),
        ("data_address", ("ps-0", "r1", "h:1", "h:99999", 1.0), "'h:99999'"),
        ("capacity", ("ps-0", "r1", "h:1", "h:2", 0.0), "0.0"),
        ("capacity", ("ps-0", "r1", "h:1", "h:2", float("nan")), "nan"),
    ],
)
def test_register_rejects_bad_fields_quoting_them(m, field, args, fragment):
    with pytest.raises(ShardlineConfigError) as err:
        m.register(*args, now=0.0)
    assert fragment in str(err.value)
    assert field.split("_")[0] in str(err.value)
    assert m.epoch == 1 and m.all_nodes(0.0) == []


def test_ipv6_addresses_are_accepted(m):
    assert m.register("ps-6", "r1", "[::1]:7001", "[::1]:7002", 1.0, now=0.0) == 2


def test_heartbeat_rejects_negative_counts(m):
    register(m, "ps-0", 0.0)
    with pytest.raises(ShardlineConfigError, match="-1"):
        m.heartbeat("ps-0", 1.0, blocks=-1)


@pytest.mark.parametrize("timeout", [0, -1.0, float("inf"), float("nan")])
def test_bad_heartbeat_timeout_is_rejected(timeout):
    with pytest.raises(ShardlineConfigError, match="heartbeat_timeout"):
        Membership(timeout, 128)


def test_bad_vnode_density_is_rejected():
    with pytest.raises(ShardlineConfigError, match="vnodes_per_capacity"):
        Membership(5.0, 0)


def test_concurrent_registration_counts_every_change_once(m):
    barrier = threading.Barrier(8)

    def join(i: int) -> None:
        barrier.wait()
        for _ in range(50):
            register(m, f"ps-{i}", 0.0, port=9000 + 10 * i)

    threads = [threading.Thread(target=join, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert m.epoch == 1 + 8
    assert m.alive_count == 8


def test_wildcard_registrations_take_the_peer_host():
    from shardline.dispatcher.membership import reachable_address

    assert reachable_address("0.0.0.0:7200", "ipv4:10.1.2.3:51234") == "10.1.2.3:7200"
    assert reachable_address("[::]:7200", "ipv6:[fd00::7]:51234") == "[fd00::7]:7200"
    assert reachable_address(":7200", "ipv4:127.0.0.1:1") == "127.0.0.1:7200"
    assert reachable_address("10.9.9.9:7200", "ipv4:10.1.2.3:51234") == "10.9.9.9:7200"
    assert reachable_address("ps-a1.example:7200", "ipv4:10.1.2.3:51234") == "ps-a1.example:7200"
    assert reachable_address("0.0.0.0:7200", "unix:/run/x.sock") == "0.0.0.0:7200"


# --- durable state: restarts over the same store ------------------------------------------------

def restart(store, now: float = 100.0) -> Membership:
    return Membership(heartbeat_timeout=5.0, vnodes_per_capacity=128, store=store, now=now, **NO_GUARD)


def test_restart_raises_the_epoch_and_brings_the_nodes_back(recording_store):
    m = restart(recording_store, now=0.0)
    assert m.recovered_epoch is None and m.epoch == 1
    register(m, "ps-0", 0.0, rack="r1")
    register(m, "ps-1", 0.0, port=9100, rack="r2", capacity=2.0)
    register(m, "ps-2", 0.0, port=9200)
    m.heartbeat("ps-0", 4.0)
    m.heartbeat("ps-1", 4.0)
    assert m.expire(5.5) == ["ps-2"]
    before = m.epoch

    again = restart(recording_store, now=100.0)
    assert again.recovered_epoch == before and again.epoch == before + 1
    assert [(n.node_id, n.rack, n.state, n.vnodes, n.grpc_address, n.capacity) for n in again.all_nodes(100.0)] == [
        ("ps-0", "r1", ALIVE, 128, "127.0.0.1:9000", 1.0),
        ("ps-1", "r2", ALIVE, 256, "127.0.0.1:9100", 2.0),
        ("ps-2", "r1", DEAD, 0, "127.0.0.1:9200", 1.0),  # dead stays dead
    ]
    # Alive nodes get one heartbeat timeout of grace from the restart, then expire as usual.
    assert again.heartbeat("ps-0", 104.0) is True
    assert again.expire(105.0) == []
    assert again.expire(105.5) == ["ps-1"]
    assert again.heartbeat("ps-2", 105.5) is False  # the dead node must register again
    assert restart(recording_store).epoch > again.epoch  # every restart, every bump: never backwards


def test_a_restart_with_another_vnode_density_recomputes_the_ring(recording_store):
    register(restart(recording_store, now=0.0), "ps-0", 0.0, capacity=2.0)
    again = Membership(heartbeat_timeout=5.0, vnodes_per_capacity=16, store=recording_store, now=0.0)
    assert [n.vnodes for n in again.routing_table()[1]] == [32]


def test_only_routing_changes_are_written(recording_store):
    m = restart(recording_store, now=0.0)
    assert recording_store.applies == [({"epoch": {"epoch": 1}}, [])]  # durable before serving
    register(m, "ps-0", 0.0)
    assert recording_store.applies[-1][0] == {
        "epoch": {"epoch": 2},
        "node/ps-0": {"rack": "r1", "grpc_address": "127.0.0.1:9000", "data_address": "127.0.0.1:9001",
                      "capacity": 1.0, "state": ALIVE, "member": "serving"},
    }
    writes = len(recording_store.applies)
    register(m, "ps-0", 1.0)              # refresh only
    for t in (2.0, 3.0, 4.0):
        m.heartbeat("ps-0", t, blocks=5, bytes=50, epoch=2)
    m.expire(4.5)                         # nobody expires
    assert len(recording_store.applies) == writes
    m.expire(20.0)
    dead = {**recording_store.load()["node/ps-0"], "state": DEAD}
    assert recording_store.applies[-1][0] == {"epoch": {"epoch": 3}, "node/ps-0": dead}


def test_a_failed_write_changes_nothing(recording_store):
    m = restart(recording_store, now=0.0)
    register(m, "ps-0", 0.0)
    recording_store.failing = True
    with pytest.raises(StateStoreError, match="/state/dispatcher.db"):
        register(m, "ps-1", 0.0, port=9100)
    with pytest.raises(StateStoreError):
        m.expire(10.0)
    with pytest.raises(StateStoreError):
        m.heartbeat("ps-0", 1.0, epoch=50)
    assert m.epoch == 2
    assert [(n.node_id, n.state) for n in m.all_nodes(10.0)] == [("ps-0", ALIVE)]
    recording_store.failing = False
    assert m.expire(10.0) == ["ps-0"] and m.epoch == 3


def test_a_heartbeat_with_a_higher_epoch_moves_the_epoch_past_it(recording_store):
    m = restart(recording_store, now=0.0)            # a dispatcher that lost its state starts at 1 ...
    register(m, "ps-0", 0.0)
    assert m.heartbeat("ps-0", 1.0, epoch=2) is True and m.epoch == 2   # equal: nothing to do
    assert m.heartbeat("ps-0", 1.0, epoch=1) is True and m.epoch == 2   # lower: the node catches up
    # ... and meets nodes that routed with epoch 40 under its predecessor, registered or not.
    assert m.heartbeat("ghost", 2.0, epoch=40) is False
    assert m.epoch == 41 and m.routing_table()[0] == 41
    assert recording_store.load()["epoch"] == {"epoch": 41}
    assert restart(recording_store).epoch == 42


@pytest.mark.parametrize("epoch, fragment", [(-1, "-1"), (2**63, str(2**63)), (True, "True")])
def test_heartbeat_rejects_bad_epochs(m, epoch, fragment):
    with pytest.raises(ShardlineConfigError, match="epoch") as err:
        m.heartbeat("ps-0", 0.0, epoch=epoch)
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("epoch", {"epoch": 0}, "'epoch'"),
        ("epoch", {"epoch": "7"}, "'epoch'"),
        ("node/ps-0", {"rack": "r1"}, "'node/ps-0'"),
        ("node/ps-0", {"rack": "r1", "grpc_address": "nowhere", "data_address": "h:2", "capacity": 1.0,
                       "state": ALIVE}, "'nowhere'"),
        ("node/ps 0", {"rack": "r1", "grpc_address": "h:1", "data_address": "h:2", "capacity": 1.0,
                       "state": ALIVE}, "'node/ps 0'"),
        ("node/ps-0", {"rack": "r1", "grpc_address": "h:1", "data_address": "h:2", "capacity": 1.0,
                       "state": "zombie"}, "'zombie'"),
    ],
)
def test_a_bad_stored_record_is_named(recording_store, key, value, fragment):
    recording_store.apply({key: value})
    with pytest.raises(StateStoreError) as err:
        restart(recording_store)
    assert fragment in str(err.value) and "memory" in str(err.value)


def test_restart_over_sqlite(tmp_path):
    from shardline.dispatcher.state_sqlite import SqliteStateStore

    store = SqliteStateStore(str(tmp_path))
    m = restart(store, now=0.0)
    register(m, "ps-0", 0.0)
    epoch = m.epoch
    store.close()
    store = SqliteStateStore(str(tmp_path))
    try:
        again = restart(store)
        assert again.epoch == epoch + 1 and [n.node_id for n in again.routing_table()[1]] == ["ps-0"]
    finally:
        store.close()


# -- two-phase ring changes -------------------------------------------------------------------------

def _members(m):
    return {n.node_id: n.member for n in m.all_nodes(0.0)}


def two_phase(nodes=("ps-0", "ps-1")):
    m = Membership(5.0, has_data=lambda: True, **NO_GUARD)
    for i, node_id in enumerate(nodes):
        m.register(node_id, "r", f"127.0.0.1:{9000 + 2 * i}", f"127.0.0.1:{9001 + 2 * i}", 1.0, now=0.0)
    return m


def test_a_node_joining_a_cluster_with_data_serves_only_after_every_node_is_in_sync():
    m = two_phase()
    snap = m.snapshot()
    assert [n.node_id for n in snap.serving] == ["ps-0"] and _members(m)["ps-1"] == "joining"
    assert [n.node_id for n in snap.pending] == ["ps-0", "ps-1"] and snap.pending_epoch == snap.epoch
    assert not m.report_ready("ps-1", snap.pending_epoch)      # ps-0 has not synced yet
    assert not m.report_ready("ps-0", snap.pending_epoch - 1)  # an older pending ring does not count
    assert m.report_ready("ps-0", snap.pending_epoch)          # switch
    after = m.snapshot()
    assert [n.node_id for n in after.serving] == ["ps-0", "ps-1"] and after.pending_epoch == 0
    assert after.epoch == snap.epoch + 1 and _members(m) == {"ps-0": "serving", "ps-1": "serving"}


def test_a_second_join_restarts_the_sync_and_a_death_leaves_at_once():
    m = two_phase()
    first = m.snapshot().pending_epoch
    m.register("ps-2", "r", "127.0.0.1:9100", "127.0.0.1:9101", 1.0, now=0.0)
    second = m.snapshot()
    assert second.pending_epoch > first and [n.node_id for n in second.pending] == ["ps-0", "ps-1", "ps-2"]
    for node in ("ps-0", "ps-1", "ps-2"):
        m.report_ready(node, first)  # ready for the first pending ring only: no switch
    assert _members(m)["ps-1"] == "joining"
    m.heartbeat("ps-0", 4.0)
    m.heartbeat("ps-1", 4.0)
    assert m.expire(now=6.0) == ["ps-2"]                # ps-2 dies while joining: out of the pending ring
    third = m.snapshot()
    assert [n.node_id for n in third.pending] == ["ps-0", "ps-1"] and third.pending_epoch > second.pending_epoch
    m.report_ready("ps-0", third.pending_epoch)
    assert m.report_ready("ps-1", third.pending_epoch)
    assert [n.node_id for n in m.snapshot().serving] == ["ps-0", "ps-1"]


def test_drain_moves_a_node_out_and_refuses_the_last_one():
    m = two_phase()
    m.report_ready("ps-0", m.snapshot().pending_epoch)
    m.report_ready("ps-1", m.snapshot().pending_epoch)
    pending = m.drain("ps-1")
    snap = m.snapshot()
    assert [n.node_id for n in snap.serving] == ["ps-0", "ps-1"]  # still serving while its blocks move
    assert [n.node_id for n in snap.pending] == ["ps-0"] and snap.pending_epoch == pending
    m.report_ready("ps-0", pending)
    assert m.report_ready("ps-1", pending)
    assert [n.node_id for n in m.snapshot().serving] == ["ps-0"] and _members(m)["ps-1"] == "drained"
    with pytest.raises(ShardlineStateError, match="only serving node"):
        m.drain("ps-0")
    with pytest.raises(ShardlineStateError, match="drained"):
        m.drain("ps-1")
    # a drained node that registers again (restarted) joins again
    m.register("ps-1", "r", "127.0.0.1:9300", "127.0.0.1:9301", 1.0, now=1.0)
    assert _members(m)["ps-1"] == "joining"


def test_nodes_all_leaving_at_once_call_the_drains_off():
    m = two_phase(("ps-0", "ps-1", "ps-2"))
    for _ in range(2):
        for node in ("ps-0", "ps-1", "ps-2"):
            m.report_ready(node, m.snapshot().pending_epoch)
    assert set(_members(m).values()) == {"serving"}
    m.drain("ps-0", leaving=True)
    with pytest.raises(ShardlineStateError, match="stops without draining"):
        m.drain("ps-1", leaving=True)
    assert _members(m)["ps-0"] == "serving" and m.snapshot().pending_epoch == 0


def test_member_roles_survive_a_restart(recording_store):
    m = Membership(5.0, store=recording_store, has_data=lambda: True)
    m.register("ps-0", "r", "127.0.0.1:9000", "127.0.0.1:9001", 1.0, now=0.0)
    m.register("ps-1", "r", "127.0.0.1:9002", "127.0.0.1:9003", 1.0, now=0.0)
    again = Membership(5.0, store=recording_store, now=10.0, has_data=lambda: True)
    assert _members(again) == {"ps-0": "serving", "ps-1": "joining"}
    assert again.snapshot().pending_epoch == again.epoch


def test_a_member_that_restarted_rejoins_through_a_sync():
    """kill -9 and back before it was declared dead: a new incarnation, so its blocks may be older
    than its replicas'; it leaves the serving ring at once and rejoins."""
    m = two_phase()
    m.report_ready("ps-0", m.snapshot().pending_epoch)
    m.report_ready("ps-1", m.snapshot().pending_epoch)
    m.register("ps-1", "r", "127.0.0.1:9002", "127.0.0.1:9003", 1.0, now=1.0, incarnation="first")
    assert _members(m)["ps-1"] == "serving"  # the first incarnation the dispatcher learns of
    m.register("ps-1", "r", "127.0.0.1:9002", "127.0.0.1:9003", 1.0, now=2.0, incarnation="first")
    assert _members(m)["ps-1"] == "serving"  # a retry of the same process
    m.register("ps-1", "r", "127.0.0.1:9002", "127.0.0.1:9003", 1.0, now=3.0, incarnation="second")
    assert _members(m)["ps-1"] == "joining" and [n.node_id for n in m.snapshot().serving] == ["ps-0"]


# --- rebalancing: pending virtual-node counts ------------------------------------------------------

def _serving_three(store=None) -> Membership:
    data = []   # the nodes serve at once (no job data yet); later joins sync first
    m = Membership(heartbeat_timeout=5.0, vnodes_per_capacity=128, store=store, now=0.0, has_data=lambda: bool(data),
                   **NO_GUARD)
    for i in range(3):
        register(m, f"ps-{i}", 0.0, port=9000 + 10 * i)
    data.append(True)
    return m


def test_rebalance_is_a_pending_ring_change_that_switches_when_every_node_is_ready():
    m = _serving_three()
    pending = m.rebalance({"ps-0": 64, "ps-1": 128, "ps-2": 192})
    snap = m.snapshot()
    assert pending == snap.pending_epoch == snap.epoch
    assert [n.vnodes for n in snap.serving] == [128, 128, 128]            # serving stays until the switch
    assert [n.vnodes for n in snap.pending] == [64, 128, 192]
    with pytest.raises(ShardlineStateError, match="in progress"):
        m.rebalance({"ps-0": 100, "ps-1": 128, "ps-2": 128})
    assert not m.report_ready("ps-0", pending) and not m.report_ready("ps-1", pending)
    assert m.report_ready("ps-2", pending)
    snap = m.snapshot()
    assert snap.pending_epoch == 0 and [n.vnodes for n in snap.serving] == [64, 128, 192]
    assert m.rebalance({"ps-0": 64, "ps-1": 128, "ps-2": 192}) == 0          # the counts in use: nothing to do
    with pytest.raises(ShardlineStateError, match="exactly the serving nodes"):
        m.rebalance({"ps-0": 64})


def test_a_death_or_a_join_calls_a_pending_rebalance_off():
    m = _serving_three()
    m.rebalance({"ps-0": 64, "ps-1": 128, "ps-2": 192})
    m.heartbeat("ps-0", 4.0)
    m.heartbeat("ps-1", 4.0)
    assert m.expire(5.5) == ["ps-2"]
    assert not m.rebalancing() and m.snapshot().pending_epoch == 0
    assert [n.vnodes for n in m.snapshot().serving] == [128, 128]
    m.rebalance({"ps-0": 64, "ps-1": 192})
    register(m, "ps-3", 6.0, port=9300)                                     # a join
    snap = m.snapshot()
    assert not m.rebalancing() and [(n.node_id, n.vnodes) for n in snap.pending] == [
        ("ps-0", 128), ("ps-1", 128), ("ps-3", 128)]


def test_a_restarted_dispatcher_serves_the_rebalanced_ring_and_resumes_the_change(recording_store):
    m = _serving_three(recording_store)
    m.rebalance({"ps-0": 64, "ps-1": 128, "ps-2": 192})
    for i in range(3):
        m.report_ready(f"ps-{i}", m.snapshot().pending_epoch)
    m.rebalance({"ps-0": 96, "ps-1": 128, "ps-2": 192})                     # a second one, left pending
    again = restart(recording_store)
    snap = again.snapshot()
    assert [n.vnodes for n in snap.serving] == [64, 128, 192]
    assert snap.pending_epoch == snap.epoch and [n.vnodes for n in snap.pending] == [96, 128, 192]
    register(again, "ps-0", 100.0, port=9000)  # same fields                                    # a retry keeps the counts
    assert [n.vnodes for n in again.snapshot().serving] == [64, 128, 192]


def test_a_drain_calls_a_pending_rebalance_off_and_a_stopping_node_still_drains():
    m = _serving_three()
    m.rebalance({"ps-0": 64, "ps-1": 128, "ps-2": 192})
    pending = m.drain("ps-2", leaving=True)        # SIGTERM during a rebalance: drain, not refused
    snap = m.snapshot()
    assert not m.rebalancing() and pending == snap.pending_epoch
    assert [(n.node_id, n.vnodes) for n in snap.pending] == [("ps-0", 128), ("ps-1", 128)]
    with pytest.raises(ShardlineStateError, match="in progress"):
        m.rebalance({"ps-0": 64, "ps-1": 192, "ps-2": 128})


def test_a_heartbeat_that_is_no_longer_in_sync_takes_the_nodes_readiness_back(grpc_context):
    """A node that reported the pending ring ready and then reports 0 (another sync began) does
    not count: the ring switches only once every node's latest heartbeat reports it."""
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.dispatcher.server import DispatcherServicer
    from shardline.services.pb import dispatcher_pb2

    m = two_phase()
    servicer = DispatcherServicer(m, JobRegistry(), heartbeat_interval=0.5, clock=lambda: 0.0)
    pending = m.snapshot().pending_epoch

    def beat(node_id, ready):
        return servicer.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id=node_id, ready_epoch=ready), grpc_context)

    beat("ps-1", pending)
    beat("ps-1", 0)                     # the joining node started another sync
    beat("ps-0", pending)
    assert m.snapshot().pending_epoch == pending, "switched while ps-1 was syncing"
    beat("ps-1", pending)
    assert m.snapshot().pending_epoch == 0 and _members(m) == {"ps-0": "serving", "ps-1": "serving"}


def test_a_job_created_during_a_ring_change_takes_every_readiness_report_back():
    """Reports made before a job existed say nothing of its blocks: after ``jobs_changed`` the
    ring switches only once every node reported again, checked against the new job list."""
    m = two_phase()
    pending = m.snapshot().pending_epoch
    before = m.jobs_version
    assert not m.report_ready("ps-1", pending, jobs_version=before)   # the joining node, before the job
    m.jobs_changed()
    assert not m.report_ready("ps-0", pending, jobs_version=m.jobs_version)
    assert m.snapshot().pending_epoch == pending, "switched on ps-1's report from before the job existed"
    # a report checked against the job list read before the job was created counts as not ready
    assert not m.report_ready("ps-1", pending, jobs_version=before)
    assert m.snapshot().pending_epoch == pending
    assert m.report_ready("ps-1", pending, jobs_version=m.jobs_version)
    assert m.snapshot().pending_epoch == 0 and _members(m) == {"ps-0": "serving", "ps-1": "serving"}


def test_a_node_reports_the_pending_ring_ready_only_while_it_holds_every_job(grpc_context):
    """The dispatcher counts a heartbeat's ``ready_epoch`` only if the jobs it lists hold every
    job the dispatcher has (that incarnation): a node without a job has none of its blocks in sync,
    and a handover sent to it for them would be lost. A job created while the ring change is
    pending takes the reports made before it back."""
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.dispatcher.server import DispatcherServicer
    from shardline.services.pb import common_pb2, dispatcher_pb2

    m = two_phase()
    servicer = DispatcherServicer(m, JobRegistry(), heartbeat_interval=0.5, clock=lambda: 0.0)
    pending = m.snapshot().pending_epoch

    def create(name):
        spec = common_pb2.JobSpec(name=name, optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync="bsp",
                                  world_size=1, tensors=[common_pb2.TensorSpec(name="w", shape=[4])])
        return servicer.CreateJob(dispatcher_pb2.CreateJobRequest(spec=spec), grpc_context).job.uid

    def beat(node_id, held):
        jobs = [dispatcher_pb2.HeldJob(job=name, uid=uid) for name, uid in held.items()]
        return servicer.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id=node_id, ready_epoch=pending, jobs=jobs),
                                  grpc_context)

    uid_a = create("a")
    beat("ps-0", {"a": uid_a})
    reply = beat("ps-1", {})                           # ps-1 has not learnt job "a" yet
    assert m.snapshot().pending_epoch == pending, "switched while ps-1 held none of job a's blocks"
    assert list(reply.jobs) == ["a"]                   # what it is told to hold
    beat("ps-1", {"a": "another-incarnation"})
    assert m.snapshot().pending_epoch == pending, "switched while ps-1 held another incarnation of job a"
    uid_b = create("b")                                # takes ps-0's report back
    beat("ps-1", {"a": uid_a, "b": uid_b})
    assert m.snapshot().pending_epoch == pending, "switched on ps-0's report from before job b existed"
    beat("ps-0", {"a": uid_a})
    assert m.snapshot().pending_epoch == pending, "switched while ps-0 held none of job b's blocks"
    beat("ps-0", {"a": uid_a, "b": uid_b})
    assert m.snapshot().pending_epoch == 0 and _members(m) == {"ps-0": "serving", "ps-1": "serving"}


def test_a_pending_ring_change_names_the_nodes_it_waits_for_and_why(grpc_context, caplog, monkeypatch):
    """Status lists why a ring change still waits for each node, the dispatcher's gauges say how
    long and for how many, and it warns, naming them, once the change has been pending for
    RING_CHANGE_WARN_SECONDS (a sync has no deadline of its own: it takes as long as the bytes it
    moves)."""
    import logging

    from shardline.dispatcher import server as dispatcher_server
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.dispatcher.server import DispatcherServicer
    from shardline.cli import render_status, status_dict
    from shardline.services.pb import common_pb2, dispatcher_pb2

    # What this servicer publishes: the registry's gauges are the process's, and a dispatcher
    # server another test left in this process sets them from its own expiry thread.
    published, here = [], threading.get_ident()

    def record(seconds, nodes):
        if threading.get_ident() == here:
            published.append((seconds, nodes))

    monkeypatch.setattr(dispatcher_server.M, "ring_change", record)
    m = two_phase()
    clock = [0.0]
    servicer = DispatcherServicer(m, JobRegistry(), heartbeat_interval=0.5, clock=lambda: clock[0])
    pending = m.snapshot().pending_epoch
    spec = common_pb2.JobSpec(name="a", optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync="bsp",
                              world_size=1, tensors=[common_pb2.TensorSpec(name="w", shape=[4])])
    servicer.CreateJob(dispatcher_pb2.CreateJobRequest(spec=spec), grpc_context)
    uid = servicer.GetJob(dispatcher_pb2.GetJobRequest(name="a"), grpc_context).uid
    assert m.waiting_for() == (pending, {"ps-0": "has not reported ready since a job was created or extended",
                                         "ps-1": "has not reported ready since a job was created or extended"})

    def beat(node_id, ready, jobs):
        held = [dispatcher_pb2.HeldJob(job=name, uid=uid) for name in jobs]
        servicer.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id=node_id, ready_epoch=ready, jobs=held),
                           grpc_context)

    beat("ps-0", pending, ["a"])
    beat("ps-1", pending, [])
    assert m.waiting_for() == (pending, {"ps-1": "does not hold job(s) a yet"})
    beat("ps-1", 0, ["a"])
    assert m.waiting_for() == (pending, {"ps-1": "is bringing its blocks in sync"})
    assert all(not n.not_ready for n in m.snapshot().serving + m.snapshot().pending), "routing tables leave it out"
    text = render_status(status_dict(servicer.GetClusterStatus(dispatcher_pb2.GetClusterStatusRequest(), grpc_context),
                                     "127.0.0.1:1"))
    assert "waiting for: ps-1 is bringing its blocks in sync" in text

    caplog.set_level(logging.WARNING, logger="shardline.dispatcher")
    servicer.expire()                                            # the change is first seen at 0 s

    def later(seconds):  # both nodes keep beating (ps-1 still syncing), then an expiry pass
        clock[0] = seconds
        beat("ps-0", pending, ["a"])
        beat("ps-1", 0, ["a"])
        servicer.expire()

    later(dispatcher_server.RING_CHANGE_WARN_SECONDS - 1)
    assert "pending for" not in caplog.text
    later(dispatcher_server.RING_CHANGE_WARN_SECONDS)
    later(dispatcher_server.RING_CHANGE_WARN_SECONDS + 1)        # once per period, not per pass
    warnings = [r.getMessage() for r in caplog.records if "pending for" in r.getMessage()]
    assert warnings == [f"the ring change to epoch {pending} has been pending for 60 s; it waits for ps-1 (is "
                        f"bringing its blocks in sync)"]
    assert published[-1] == (dispatcher_server.RING_CHANGE_WARN_SECONDS + 1, 1)
    beat("ps-1", pending, ["a"])
    assert m.waiting_for() == (0, {}) and m.snapshot().pending_epoch == 0
    servicer.expire()
    assert published[-1] == (0, 0)
