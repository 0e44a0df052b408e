"""The etcd state store's contract (state_store.py) and fencing, against a real etcd on 127.0.0.1
(the ``etcd`` fixture of tests/conftest.py); and the servicer of a leader whose writes are fenced."""

from __future__ import annotations

import itertools
import time

import grpc
import pytest

from shardline.dispatcher.jobs import JobRegistry
from shardline.dispatcher.membership import Membership
from shardline.dispatcher.server import DispatcherServicer
from shardline.dispatcher.state_etcd import EtcdElectionBackend, EtcdStateStore, parse_etcd_url, validate_prefix
from shardline.dispatcher.state_store import Fence, FencedError, StateStoreError, open_state_store, state_backend
from shardline.services.daemon import create_grpc_server, grpc_channel
from shardline.services.dispatcher_client import LEADER_METADATA_KEY
from shardline.services.errors import ShardlineConfigError, ShardlineTimeoutError
from shardline.services.pb import dispatcher_pb2, dispatcher_pb2_grpc

pytestmark = pytest.mark.timeout(60)

_prefixes = itertools.count()


@pytest.fixture
def prefix():
    return f"/test-{next(_prefixes)}-{time.monotonic_ns()}"


def dead_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_parse_etcd_url():
    assert parse_etcd_url("etcd://a:2379, b:2379") == ["a:2379", "b:2379"]
    for bad in ["a:2379", "etcd://", "etcd://a", "etcd://a:0", "http://a:2379", "etcd://a:1,,b:2", None]:
        with pytest.raises(ShardlineConfigError, match="state_store"):
            parse_etcd_url(bad)


@pytest.mark.parametrize("bad", ["shardline", "/", "/a/", "/a b", "", None])
def test_validate_prefix(bad):
    with pytest.raises(ShardlineConfigError, match="state_prefix"):
        validate_prefix(bad)


def test_state_dir_and_state_store_are_mutually_exclusive(tmp_path):
    with pytest.raises(ShardlineConfigError) as err:
        open_state_store(str(tmp_path), "etcd://127.0.0.1:2379")
    assert "state_dir" in str(err.value) and "state_store" in str(err.value) and str(tmp_path) in str(err.value)
    assert state_backend(None, None) == "memory" and state_backend("d", None) == "sqlite"
    assert state_backend(None, "etcd://h:1") == "etcd"


def test_open_state_store_chooses_etcd(etcd, prefix):
    store = open_state_store(None, etcd.url, prefix=prefix)
    try:
        assert isinstance(store, EtcdStateStore) and store.location == etcd.url + prefix
    finally:
        store.close()


def test_unreachable_etcd_times_out_naming_the_address():
    address = dead_endpoint()
    started = time.monotonic()
    with pytest.raises(ShardlineTimeoutError) as err:
        EtcdStateStore([address], "/x", connect_timeout=0.5)
    assert address in str(err.value) and 0.4 < time.monotonic() - started < 5


def test_round_trip(etcd, prefix):
    store = EtcdStateStore([etcd.endpoint], prefix)
    try:
        assert store.load() == {}
        store.apply({"epoch": {"epoch": 3}, "node/a": {"rack": "r1", "capacity": 1.5}, "job/x": {"spec": {"n": [1]}}})
        state = store.load()
        assert state == {"epoch": {"epoch": 3}, "node/a": {"rack": "r1", "capacity": 1.5}, "job/x": {"spec": {"n": [1]}}}
        state["epoch"]["epoch"] = 99  # a private copy
        assert store.load()["epoch"] == {"epoch": 3}
        store.apply({"node/b": {"x": 1}}, deletes=["node/a", "node/b", "never/there"])  # the put wins
        assert set(store.load()) == {"epoch", "job/x", "node/b"}
        store.apply({}, deletes=[])
    finally:
        store.close()
    with pytest.raises(StateStoreError, match="closed"):
        store.load()
    store.close()  # idempotent


def test_prefixes_are_separate_clusters(etcd, prefix):
    one, two = EtcdStateStore([etcd.endpoint], prefix + "a"), EtcdStateStore([etcd.endpoint], prefix + "b")
    try:
        one.apply({"epoch": {"epoch": 1}})
        assert two.load() == {}
    finally:
        one.close()
        two.close()


def test_apply_is_all_or_nothing(etcd, prefix):
    store = EtcdStateStore([etcd.endpoint], prefix)
    try:
        store.apply({"epoch": {"epoch": 1}})
        with pytest.raises(StateStoreError, match="not JSON"):  # refused before anything is sent
            store.apply({"node/a": {"ok": 1}, "node/b": {"bad": float("nan")}})
        # etcd refuses a transaction of more operations than --max-txn-ops (128) as a whole
        with pytest.raises(StateStoreError, match="too many operations"):
            store.apply({f"node/n{i}": {"i": i} for i in range(200)}, deletes=["epoch"])
        assert store.load() == {"epoch": {"epoch": 1}}
    finally:
        store.close()


def test_a_dead_endpoint_in_the_list_is_skipped(etcd, prefix):
    store = EtcdStateStore([dead_endpoint(), etcd.endpoint], prefix, connect_timeout=5)
    try:
        store.apply({"epoch": {"epoch": 2}})
        assert store.load() == {"epoch": {"epoch": 2}}
    finally:
        store.close()


def test_membership_and_jobs_survive_a_new_leader_with_the_epoch_plus_one(etcd, prefix):
    store = EtcdStateStore([etcd.endpoint], prefix)
    try:
        membership = Membership(5.0, store=store)
        assert membership.register("ps-0", "r1", "127.0.0.1:9000", "127.0.0.1:9001", 1.0, now=0.0) == 2
    finally:
        store.close()
    store = EtcdStateStore([etcd.endpoint], prefix)
    try:
        again = Membership(5.0, store=store, now=10.0)
        assert again.recovered_epoch == 2 and again.epoch == 3
        assert [n.node_id for n in again.routing_table()[1]] == ["ps-0"]
        assert JobRegistry(store=store).list() == []
    finally:
        store.close()


class Campaign:
    """A real election round through EtcdElectionBackend: ``win(address)`` takes the leader key."""

    def __init__(self, etcd, prefix):
        self.backend = EtcdElectionBackend([etcd.endpoint], prefix)
        self.leases = []

    def win(self, address: str):
        lease = self.backend.grant(5)
        self.leases.append(lease)
        self.backend.announce(lease, address)
        holder = self.backend.campaign(lease, address)
        assert holder.lease == lease and holder.address == address
        return holder

    def close(self):
        for lease in self.leases:
            self.backend.revoke(lease)
        self.backend.close()


@pytest.fixture
def campaign(etcd, prefix):
    c = Campaign(etcd, prefix)
    yield c
    c.close()


def test_election_backend_round(campaign):
    first = campaign.win("127.0.0.1:7001")
    lease = campaign.backend.grant(5)
    campaign.leases.append(lease)
    assert campaign.backend.campaign(lease, "127.0.0.1:7002") == first  # taken: the holder comes back
    campaign.backend.announce(lease, "127.0.0.1:7002")
    seen = campaign.backend.observe()
    assert seen.leader == first and seen.dispatchers == ("127.0.0.1:7001", "127.0.0.1:7002")
    assert campaign.backend.keepalive(first.lease) and not campaign.backend.keepalive(123456789)
    campaign.backend.revoke(first.lease)  # a dead leader's lease runs out: its keys go with it
    seen = campaign.backend.observe()
    assert seen.leader is None and seen.dispatchers == ("127.0.0.1:7002",)
    assert campaign.backend.campaign(lease, "127.0.0.1:7002").token > first.token
    campaign.backend.revoke(first.lease)  # revoking a gone lease is not an error


def test_a_write_after_losing_the_leader_key_fails_and_changes_nothing(etcd, prefix, campaign):
    term = campaign.win("127.0.0.1:7001")
    lost = []
    fenced = EtcdStateStore([etcd.endpoint], prefix, fence=Fence(term.token, lost.append))
    plain = EtcdStateStore([etcd.endpoint], prefix)
    try:
        fenced.apply({"epoch": {"epoch": 5}, "job/a": {"v": 1}})
        assert fenced.load()["epoch"] == {"epoch": 5}
        campaign.backend.revoke(term.lease)  # its lease expired (a paused leader) ...
        campaign.win("127.0.0.1:7002")       # ... and another dispatcher won
        before = plain.load()
        with pytest.raises(FencedError, match="no longer the leader key"):
            fenced.apply({"epoch": {"epoch": 6}}, deletes=["job/a"])
        assert plain.load() == before == {"epoch": {"epoch": 5}, "job/a": {"v": 1}}
        assert len(lost) == 1 and "another dispatcher leads" in lost[0]
        with pytest.raises(FencedError):
            fenced.load()  # not even a read under a lost term
    finally:
        fenced.close()
        plain.close()


class StaleElection:
    """An election that still believes it leads (the instant between its check and its write)."""

    address = "127.0.0.1:7001"
    leader = address
    dispatchers = (address,)

    def __init__(self):
        self.steps_down = []

    def holds(self, term):
        return True

    def step_down(self, reason):
        self.steps_down.append(reason)


def test_a_deposed_leader_that_still_thinks_it_leads_cannot_change_the_ring_or_a_job(etcd, prefix, campaign):
    """Fencing alone protects the state: the servicer's writes fail, nothing in etcd or in memory changes."""
    term = campaign.win("127.0.0.1:7001")
    election = StaleElection()
    store = EtcdStateStore([etcd.endpoint], prefix, fence=Fence(term.token, election.step_down))
    servicer = DispatcherServicer(None, None, heartbeat_interval=1.0, election=election)
    membership, jobs = Membership(5.0, store=store), JobRegistry(store=store)
    servicer.install(membership, jobs, term)
    server, port, _ = create_grpc_server("127.0.0.1:0", [
        lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(servicer, s)])
    channel = grpc_channel(f"127.0.0.1:{port}")
    stub = dispatcher_pb2_grpc.DispatcherStub(channel)
    plain = EtcdStateStore([etcd.endpoint], prefix)
    try:
        stub.RegisterNode(dispatcher_pb2.RegisterNodeRequest(
            node_id="ps-0", rack="r", grpc_address="127.0.0.1:9000", data_address="127.0.0.1:9001", capacity=1),
            timeout=10)
        campaign.backend.revoke(term.lease)
        campaign.win("127.0.0.1:7002")
        before, epoch = plain.load(), membership.epoch
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterNode(dispatcher_pb2.RegisterNodeRequest(
                node_id="ps-1", rack="r", grpc_address="127.0.0.1:9010", data_address="127.0.0.1:9011", capacity=1),
                timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no longer the leader key" in err.value.details()
        with pytest.raises(grpc.RpcError):
            stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=_spec("j")), timeout=10)
        assert plain.load() == before and membership.epoch == epoch
        assert [n.node_id for n in membership.all_nodes(0.0)] == ["ps-0"] and jobs.list() == []
        assert election.steps_down  # the leader was told to stop at once
    finally:
        channel.close()
        server.stop(0)
        servicer.close()
        plain.close()


def test_a_follower_answers_unavailable_naming_the_leader():
    class Following:
        address = "127.0.0.1:7002"
        leader = "127.0.0.1:7001"
        dispatchers = (address, leader)

        def holds(self, term):
            return False

    servicer = DispatcherServicer(None, None, heartbeat_interval=1.0, election=Following())
    server, port, _ = create_grpc_server("127.0.0.1:0", [
        lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(servicer, s)])
    channel = grpc_channel(f"127.0.0.1:{port}")
    stub = dispatcher_pb2_grpc.DispatcherStub(channel)
    try:
        assert servicer.expire() == [] and servicer.membership is None
        for call, request in [(stub.GetRouting, dispatcher_pb2.GetRoutingRequest()),
                              (stub.Heartbeat, dispatcher_pb2.HeartbeatRequest(node_id="ps-0")),
                              (stub.CreateJob, dispatcher_pb2.CreateJobRequest(spec=_spec("j"))),
                              (stub.GetClusterStatus, dispatcher_pb2.GetClusterStatusRequest())]:
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "not the leader; the leader is 127.0.0.1:7001"
            assert (LEADER_METADATA_KEY, "127.0.0.1:7001") in tuple(err.value.trailing_metadata())
    finally:
        channel.close()
        server.stop(0)
        servicer.close()


def _spec(name: str):
    from shardline.services.pb import common_pb2

    return common_pb2.JobSpec(name=name, optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync="bsp",
                              world_size=1, tensors=[common_pb2.TensorSpec(name="w", shape=[4])])


def test_the_test_etcd_starts_again_on_other_ports_when_its_port_was_taken(monkeypatch):
    """etcd cannot bind port 0: a picked port taken meanwhile (here on purpose) means another try."""
    import socket

    import etcd_server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = etcd_server.free_port
    monkeypatch.setattr(etcd_server, "free_port", lambda: next(picks, None) or real())
    try:
        with etcd_server.EtcdServer() as server:
            assert server.client_port != taken.getsockname()[1] and server.proc.poll() is None
            EtcdStateStore(parse_etcd_url(server.url), "/retry").load()   # it answers
    finally:
        taken.close()
