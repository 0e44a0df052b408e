"""Membership driven with a fake clock: registration, heartbeats, expiry and epoch bumps."""

from __future__ import annotations

import threading

import pytest

from shardline.dispatcher.membership import ALIVE, DEAD, Membership
from shardline.services.errors import ShardlineConfigError
from shardline.services.ring import HashRing


def register(m: Membership, node_id: str, now: float, *, rack="r1", port=9000, capacity=1.0) -> int:
    return m.register(node_id, rack, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}", capacity, now)


@pytest.fixture
def m() -> Membership:
    return Membership(heartbeat_timeout=5.0, vnodes_per_capacity=128)


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
