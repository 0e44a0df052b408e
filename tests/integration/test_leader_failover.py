"""Several dispatchers on a real etcd (127.0.0.1): one leads, the others redirect to it. kill -9
of the leader mid-training and SIGSTOP of the leader; the daemon's start-up errors.

Takeover times are printed (``pytest -s`` shows them) and land in the dispatchers' logs.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

import train_model
from test_checkpoint_restart import free_port
from train_model import assert_equals_reference, wait_for_steps
from shardline.dispatcher.state_etcd import EtcdStateStore
from shardline.services.daemon import grpc_channel
from shardline.services.dispatcher_client import LEADER_METADATA_KEY
from shardline.local_cluster import LocalCluster
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
LEASE = 2           # seconds: etcd's shortest lease with its default timing
STEPS = 20


def start_dispatchers(cluster: LocalCluster, etcd, prefix: str, *, heartbeat_timeout: float, n: int = 2):
    handles = [cluster.add_dispatcher(state_store=etcd.url, state_prefix=prefix, leader_lease_timeout=LEASE,
                                      heartbeat_timeout=heartbeat_timeout, wait=False) for _ in range(n)]
    for h in handles:
        cluster.wait_ready(h)
    return handles


def job_spec(name: str) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name=name, optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync="bsp",
                              world_size=1, tensors=[common_pb2.TensorSpec(name="w", shape=[4, 4])])


def without_holders(state: dict) -> dict:
    return {key: ({k: v for k, v in value.items() if k != "holders"} if key.startswith("job/") else value)
            for key, value in state.items()}


def wait_for_log(handle, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in handle.log_tail(400):
        assert time.monotonic() < deadline, f"{handle.name} never logged {text!r}:\n{handle.log_tail()}"
        time.sleep(0.05)


def test_kill_9_of_the_leader_while_workers_train(tmp_path, etcd):
    """The other dispatcher takes over; PS heartbeats, the workers' routing refreshes (the new
    leader's epoch makes every PS answer NOT_OWNER to the old one, so the workers must ask it) and
    a new job all go through it; training ends equal to single-process torch.optim."""
    heartbeat_timeout = 4
    with LocalCluster(tmp_path / "c") as cluster:
        dispatchers = start_dispatchers(cluster, etcd, "/kill9", heartbeat_timeout=heartbeat_timeout)
        leader = cluster.leader()
        nodes = [cluster.add_node(node_id=f"ps{i}", wait=False) for i in range(2)]
        for h in nodes:
            cluster.wait_ready(h)
        before = cluster.wait_until(
            lambda s: sum(n.state == "alive" for n in s.all_nodes) == 2 and len(s.dispatchers) == 2, 30,
            "2 PS nodes and 2 dispatchers")
        assert before.leader == leader.grpc
        assert {(d.address, d.role) for d in before.dispatchers} == {
            (h.grpc, "leader" if h is leader else "follower") for h in dispatchers}

        workers = train_model.start_workers(cluster.address, "failover", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.2)
        wait_for_steps(workers, 3)
        killed_at = time.monotonic()
        cluster.kill(leader)
        at_kill = min(train_model.steps_done(progress) for _, _, progress in workers)
        new = cluster.leader(timeout=30)
        takeover = time.monotonic() - killed_at
        assert new is not leader and at_kill < STEPS

        # Storage reports are not persisted: blocks > 0 at the new leader means heartbeats reach it.
        status = cluster.wait_until(
            lambda s: s.leader == new.grpc and len(s.all_nodes) == 2
            and all(n.state == "alive" and n.blocks > 0 for n in s.all_nodes), 20, "heartbeats at the new leader")
        assert status.routing.epoch > before.routing.epoch
        client = cluster.client()
        try:
            assert client.get_routing().epoch >= status.routing.epoch
            assert client.create_job(job_spec("after-takeover")).created
            assert client.get_job("after-takeover").spec.name == "after-takeover"
        finally:
            client.close()
        results = train_model.finish_workers(workers)
        assert_equals_reference(results, steps=STEPS)
        # Past a heartbeat timeout since the takeover, both nodes are still alive: heartbeats go on.
        time.sleep(max(0.0, killed_at + takeover + heartbeat_timeout + 0.5 - time.monotonic()))
        after = cluster.cluster_status()
        assert [n.state for n in after.all_nodes] == ["alive", "alive"]
        assert after.routing.epoch >= status.routing.epoch and "failover" in {j.spec.name for j in after.jobs}
        # the killed one comes back on its address, as a follower
        address = cluster.address
        cluster.restart(leader)
        assert cluster.address == address and cluster.leader() is new
        cluster.wait_until(lambda s: (leader.grpc, "follower") in {(d.address, d.role) for d in s.dispatchers}, 10,
                           "the restarted dispatcher to follow")
    print(f"\ntakeover after kill -9 of the leader: {takeover:.2f} s (lease {LEASE} s), workers at step {at_kill}")


def test_a_paused_leader_wakes_up_fenced_and_follows(tmp_path, etcd):
    """SIGSTOP the leader until its lease expires and the other takes over; change the ring through
    the new leader; SIGCONT: the old leader changes neither the ring nor a job, and follows."""
    prefix = "/pause"
    with LocalCluster(tmp_path / "c") as cluster:
        dispatchers = start_dispatchers(cluster, etcd, prefix, heartbeat_timeout=20)
        old = cluster.leader()
        other = next(h for h in dispatchers if h is not old)
        cluster.add_node(node_id="ps0")
        cluster.wait_for_nodes(1, timeout=30)
        client = cluster.client()
        raw = EtcdStateStore([etcd.endpoint], prefix)
        try:
            assert client.create_job(job_spec("kept")).created
            before = client.cluster_status()

            cluster.kill(old, signal.SIGSTOP)
            paused_at = time.monotonic()
            assert cluster.leader(timeout=30) is other
            takeover = time.monotonic() - paused_at
            taken = client.cluster_status()
            assert taken.leader == other.grpc and taken.routing.epoch > before.routing.epoch

            # change the ring and the jobs through the new leader
            reply = client.register_node(node_id="extra", rack="r2", grpc_address=f"127.0.0.1:{free_port()}",
                                         data_address=f"127.0.0.1:{free_port()}", capacity=1.0)
            assert reply.epoch > taken.routing.epoch
            assert client.create_job(job_spec("created-by-new-leader")).created
            changed = client.cluster_status()
            stored = raw.load()

            cluster.kill(old, signal.SIGCONT)
            wait_for_log(old, "no longer the leader", timeout=10)
            time.sleep(1.5)  # time for anything the woken leader might still try
            # Nothing the old leader could write changed (nodes, epoch, jobs); the new leader may
            # meanwhile record which nodes hold which job (heartbeats), so holders are left out.
            assert without_holders(raw.load()) == without_holders(stored)
            now = client.cluster_status()
            assert now.leader == other.grpc and now.routing.epoch == changed.routing.epoch
            # "extra" joined a cluster holding job data: it is brought in sync before it serves
            assert [(n.node_id, n.state) for n in now.all_nodes] == [("extra", "alive"), ("ps0", "alive")]
            assert [n.node_id for n in now.routing.nodes] == [n.node_id for n in changed.routing.nodes]
            assert sorted(j.spec.name for j in now.jobs) == ["created-by-new-leader", "kept"]
            assert "node extra registered" not in old.log_tail(400)
        finally:
            client.close()
            raw.close()

        # the woken one is a follower: it redirects to the new leader
        with grpc_channel(old.grpc) as channel:
            with pytest.raises(grpc.RpcError) as err:
                dispatcher_pb2_grpc.DispatcherStub(channel).GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and other.grpc in err.value.details()
        assert (LEADER_METADATA_KEY, other.grpc) in tuple(err.value.trailing_metadata())

        # the operator's view through the list, old leader first
        out = subprocess.run([sys.executable, "-m", "shardline.cli", "status", "--cluster",
                              f"{old.grpc},{other.grpc}"], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert f"leader {other.grpc}" in out.stdout and f"{old.grpc} (follower)" in out.stdout
    print(f"\ntakeover after SIGSTOP of the leader: {takeover:.2f} s (lease {LEASE} s)")


def run_dispatcher(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardline.dispatcher.main", "--listen", "127.0.0.1:0",
                           "--metrics-port", "0", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_state_dir_and_state_store_together_exit_2_naming_both(tmp_path):
    out = run_dispatcher("--state-dir", str(tmp_path / "state"), "--state-store", "etcd://127.0.0.1:2379")
    assert out.returncode == 2, out.stderr
    assert "state_dir" in out.stderr and "state_store" in out.stderr and "mutually exclusive" in out.stderr
    assert not (tmp_path / "state").exists()


def test_a_lease_timeout_that_is_no_etcd_ttl_exits_2(tmp_path):
    out = run_dispatcher("--state-store", "etcd://127.0.0.1:2379", "--leader-lease-timeout", "0.5")
    assert out.returncode == 2 and "leader_lease_timeout" in out.stderr, out.stderr


def test_an_unreachable_etcd_at_start_exits_1_naming_it_after_the_connect_timeout():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    out = run_dispatcher("--state-store", f"etcd://{address}", "--connect-timeout", "1")
    elapsed = time.monotonic() - started
    assert out.returncode == 1, out.stderr
    assert address in out.stderr and "not reachable within 1 s" in out.stderr
    assert elapsed >= 1
