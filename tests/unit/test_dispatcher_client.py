"""DispatcherClient with several addresses: parsing, and following the leader across fake
dispatchers on 127.0.0.1 (a leader, a follower answering not-leader with the metadata, a dead
address, a paused one)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from shardline.services.daemon import create_grpc_server
from shardline.services.dispatcher_client import LEADER_METADATA_KEY, DispatcherClient
from shardline.services.errors import (
    NotLeaderError,
    ShardlineConfigError,
    ShardlineConnectionError,
    ShardlineTimeoutError,
)
from shardline.services.pb import common_pb2, dispatcher_pb2_grpc

pytestmark = pytest.mark.timeout(60)


class FakeDispatcher(dispatcher_pb2_grpc.DispatcherServicer):
    """``role``: "leader" answers GetRouting with ``epoch``; "follower" names ``leader``; "paused"
    never answers in time."""

    def __init__(self, role: str, epoch: int = 0, leader: str = ""):
        self.role, self.epoch, self.leader = role, epoch, leader
        self.calls = 0
        self.release = threading.Event()

    def GetRouting(self, request, context):
        self.calls += 1
        if self.role == "follower":
            context.set_trailing_metadata(((LEADER_METADATA_KEY, self.leader),))
            context.abort(grpc.StatusCode.UNAVAILABLE, f"not the leader; the leader is {self.leader}")
        if self.role == "paused":
            self.release.wait(10)
        return common_pb2.RoutingTable(epoch=self.epoch)


class Servers:
    """Fake dispatchers behind real gRPC servers; ``start`` returns the address."""

    def __init__(self):
        self.started: dict[str, tuple[grpc.Server, FakeDispatcher]] = {}

    def __call__(self, fake: FakeDispatcher) -> str:
        server, port, health = create_grpc_server(
            "127.0.0.1:0", [lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(fake, s)])
        if fake.role != "leader":
            health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"127.0.0.1:{port}"
        self.started[address] = (server, fake)
        return address

    def stop(self, address: str) -> None:
        server, fake = self.started.pop(address)
        fake.release.set()
        server.stop(0).wait(5)


@pytest.fixture
def servers():
    s = Servers()
    yield s
    for address in list(s.started):
        s.stop(address)


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_address_lists_are_parsed_and_normalized():
    client = DispatcherClient(" 127.0.0.1:7000 ,127.0.0.1:7001")
    assert client.addresses == ["127.0.0.1:7000", "127.0.0.1:7001"] and client.address == "127.0.0.1:7000,127.0.0.1:7001"
    assert client.leader == "127.0.0.1:7000"
    client.close()
    for bad in ["", "127.0.0.1", "a:1,,b:2", "a:1,a:1", "a:1,b"]:
        with pytest.raises(ShardlineConfigError, match="cluster"):
            DispatcherClient(bad)


def test_a_closed_client_opens_no_channel_again(servers):
    client = DispatcherClient(servers(FakeDispatcher("leader", epoch=1)))
    assert client.get_routing().epoch == 1
    client.close()
    with pytest.raises(ShardlineConnectionError, match="closed"):
        client.get_routing()


def test_a_follower_redirects_to_the_leader_it_names(servers):
    leader = FakeDispatcher("leader", epoch=7)
    leader_address = servers(leader)
    follower = FakeDispatcher("follower", leader=leader_address)
    client = DispatcherClient(f"{servers(follower)},{leader_address}", rpc_timeout=5)
    try:
        assert client.get_routing().epoch == 7 and client.leader == leader_address
        assert client.get_routing().epoch == 7
        assert follower.calls == 1 and leader.calls == 2  # the leader is remembered
    finally:
        client.close()


def test_a_leader_known_only_from_a_follower_is_learned(servers):
    leader_address = servers(FakeDispatcher("leader", epoch=3))
    follower_address = servers(FakeDispatcher("follower", leader=leader_address))
    client = DispatcherClient(follower_address, rpc_timeout=5)
    try:
        assert client.get_routing().epoch == 3
        assert client.addresses == [follower_address, leader_address] and client.leader == leader_address
    finally:
        client.close()


def test_a_dead_address_is_skipped(servers):
    leader_address = servers(FakeDispatcher("leader", epoch=4))
    client = DispatcherClient(f"{dead_address()},{leader_address}", rpc_timeout=5)
    try:
        started = time.monotonic()
        assert client.get_routing().epoch == 4 and time.monotonic() - started < 3
    finally:
        client.close()


def test_a_paused_dispatcher_is_left_after_the_attempt_timeout(servers):
    paused = FakeDispatcher("paused", epoch=1)
    leader_address = servers(FakeDispatcher("leader", epoch=9))
    client = DispatcherClient(f"{servers(paused)},{leader_address}", rpc_timeout=5, attempt_timeout=0.3)
    try:
        started = time.monotonic()
        assert client.get_routing().epoch == 9
        assert time.monotonic() - started < 2
    finally:
        client.close()


def test_one_dead_address_fails_at_once_as_before():
    client = DispatcherClient(dead_address(), rpc_timeout=5)
    try:
        started = time.monotonic()
        with pytest.raises(ShardlineConnectionError) as err:
            client.get_routing()
        assert time.monotonic() - started < 2 and "GetRouting" in str(err.value)
    finally:
        client.close()


def test_followers_without_a_leader_fail_with_not_leader_after_the_rpc_timeout(servers):
    a = servers(FakeDispatcher("follower", leader=""))
    b = servers(FakeDispatcher("follower", leader=""))
    client = DispatcherClient(f"{a},{b}", rpc_timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(NotLeaderError) as err:
            client.get_routing()
        assert 0.8 < time.monotonic() - started < 3 and err.value.leader == ""
    finally:
        client.close()


def test_calls_fail_over_when_the_leader_dies(servers):
    old = FakeDispatcher("leader", epoch=5)
    old_address = servers(old)
    new = FakeDispatcher("follower", leader=old_address)
    client = DispatcherClient(f"{old_address},{servers(new)}", rpc_timeout=5)
    try:
        assert client.get_routing().epoch == 5
        servers.stop(old_address)  # killed; the follower still names it until it takes over
        takeover = threading.Timer(0.7, lambda: (setattr(new, "epoch", 6), setattr(new, "role", "leader")))
        takeover.start()
        started = time.monotonic()
        assert client.get_routing().epoch == 6  # one call, retried across the takeover
        assert 0.6 < time.monotonic() - started < 3
        takeover.join()
    finally:
        client.close()


def test_wait_until_reachable_finds_the_leader_by_its_health(servers):
    leader_address = servers(FakeDispatcher("leader", epoch=2))
    follower_address = servers(FakeDispatcher("follower", leader=leader_address))
    client = DispatcherClient(f"{dead_address()},{follower_address},{leader_address}")
    try:
        client.wait_until_reachable(10)
        assert client.leader == leader_address
    finally:
        client.close()


def test_wait_until_reachable_learns_the_leader_from_a_follower(servers):
    leader_address = servers(FakeDispatcher("leader", epoch=2))
    client = DispatcherClient(servers(FakeDispatcher("follower", leader=leader_address)))
    try:
        client.wait_until_reachable(10)
        assert client.leader == leader_address and leader_address in client.addresses
    finally:
        client.close()


def test_wait_until_reachable_times_out_naming_the_addresses(servers):
    follower_address = servers(FakeDispatcher("follower", leader=""))
    dead = dead_address()
    client = DispatcherClient(f"{dead},{follower_address}")
    try:
        started = time.monotonic()
        with pytest.raises(ShardlineTimeoutError) as err:
            client.wait_until_reachable(1.0)
        assert dead in str(err.value) and follower_address in str(err.value)
        assert time.monotonic() - started < 4
    finally:
        client.close()


def test_a_call_whose_channel_another_thread_reconnects_is_made_again_on_the_new_one(servers):
    """A PS heartbeat that failed dials afresh (reconnect); a routing call another thread has in
    flight on the old channel is cancelled by it, and made again instead of failing."""
    fake = FakeDispatcher("paused", epoch=9)   # answers once released
    client = DispatcherClient(servers(fake), rpc_timeout=10)
    got: list = []
    caller = threading.Thread(target=lambda: got.append(client.get_routing()))
    caller.start()
    deadline = time.monotonic() + 5
    while fake.calls == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    client.reconnect()
    fake.release.set()
    caller.join(10)
    assert [t.epoch for t in got] == [9] and fake.calls == 2
    client.close()
