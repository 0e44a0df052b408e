"""Dispatcher servicer over gRPC with fake PS nodes (in-process ParameterServer servicers on
127.0.0.1): DeleteJob, CheckpointJob, RestoreJob, heartbeat job reports, state-store failures."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from prometheus_client import REGISTRY

from shardline.dispatcher.fanout import CheckpointResult, GrpcNodeCaller, NodeCallError, Target, coordinate_checkpoint
from shardline.dispatcher.jobs import JobRegistry
from shardline.dispatcher.membership import Membership
from shardline.dispatcher.server import DispatcherServicer
from shardline.services.daemon import create_grpc_server, grpc_channel
from shardline.services.errors import ShardlineStateError
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc, ps_pb2, ps_pb2_grpc

pytestmark = pytest.mark.timeout(60)

RPC_TIMEOUT = 10.0
HEARTBEAT_TIMEOUT = 5.0
TOKEN = b"lifecycle-test-token-0123456789abcdef"


class FakePS(ps_pb2_grpc.ParameterServerServicer):
    """A PS node's control plane keeping the Checkpoint semantics of protos/ps.proto.

    ``jobs``: name -> (uid, step). ``advance_after_status``: steps each job makes right after a
    status reply (the job runs on while the dispatcher decides). ``stuck``: the node never reaches
    a later step, so a checkpoint ahead of it times out.
    """

    def __init__(self, node_id: str, jobs: dict[str, tuple[str, int]], *, advance_after_status: int = 0,
                 stuck: bool = False):
        self.node_id = node_id
        self.jobs = {name: {"uid": uid, "step": step} for name, (uid, step) in jobs.items()}
        self.advance_after_status = advance_after_status
        self.stuck = stuck
        self.asked: list[int] = []
        self.drops: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    def GetNodeStatus(self, request, context):
        with self.lock:
            reply = ps_pb2.NodeStatus(node_id=self.node_id, jobs=[
                ps_pb2.JobProgress(job=name, uid=job["uid"], step=job["step"]) for name, job in self.jobs.items()
            ])
            for job in self.jobs.values():
                job["step"] += self.advance_after_status
        return reply

    def Checkpoint(self, request, context):
        with self.lock:
            self.asked.append(request.step)
            job = self.jobs.get(request.job)
            if job is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no job {request.job!r} on {self.node_id}")
            if job["step"] > request.step:
                return ps_pb2.CheckpointReply(job=request.job, step=job["step"], past=True)
            if job["step"] == request.step or not self.stuck:
                job["step"] = request.step  # below T it waits until its workers get it there
                return ps_pb2.CheckpointReply(job=request.job, step=request.step, bytes_written=64)
        time.sleep(request.timeout_seconds)
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"job {request.job!r} did not reach step {request.step} within {request.timeout_seconds:g} s")

    def DropJob(self, request, context):
        with self.lock:
            self.drops.append((request.job, request.uid))
            job = self.jobs.get(request.job)
            dropped = job is not None and request.uid in ("", job["uid"])
            if dropped:
                del self.jobs[request.job]
        return ps_pb2.DropJobReply(dropped=dropped)


class Cluster:
    """A dispatcher servicer on a fake clock behind a real gRPC server, and fake PS nodes."""

    def __init__(self, store, token: bytes | None = None):
        self.now = 0.0
        self.token = token
        self.membership = Membership(HEARTBEAT_TIMEOUT, store=store)
        self.jobs = JobRegistry(store=store)
        self.servicer = DispatcherServicer(
            self.membership, self.jobs, heartbeat_interval=1.0, clock=lambda: self.now,
            node_caller=GrpcNodeCaller(token), drop_timeout=2.0, status_timeout=2.0,
        )
        self.server, port, _ = create_grpc_server(
            "127.0.0.1:0", [lambda s: dispatcher_pb2_grpc.add_DispatcherServicer_to_server(self.servicer, s)],
            cluster_token=token,
        )
        self.channel = grpc_channel(f"127.0.0.1:{port}", token)
        self.stub = dispatcher_pb2_grpc.DispatcherStub(self.channel)
        self.ps_servers: list[grpc.Server] = []

    def register(self, node_id: str, port: int) -> None:
        self.stub.RegisterNode(dispatcher_pb2.RegisterNodeRequest(
            node_id=node_id, rack="r1", grpc_address=f"127.0.0.1:{port}", data_address=f"127.0.0.1:{port}",
            capacity=1.0), timeout=RPC_TIMEOUT)

    def add_ps(self, ps: FakePS) -> FakePS:
        server, port, _ = create_grpc_server(
            "127.0.0.1:0", [lambda s: ps_pb2_grpc.add_ParameterServerServicer_to_server(ps, s)],
            cluster_token=self.token,
        )
        self.ps_servers.append(server)
        self.register(ps.node_id, port)
        return ps

    def create_job(self, name: str, sync: str = "bsp") -> str:
        spec = common_pb2.JobSpec(name=name, optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync=sync,
                                  world_size=1, tensors=[common_pb2.TensorSpec(name="w", shape=[4])])
        return self.stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=spec), timeout=RPC_TIMEOUT).job.uid

    def checkpoint(self, name: str, timeout: float = 5.0) -> dispatcher_pb2.CheckpointJobResponse:
        return self.stub.CheckpointJob(dispatcher_pb2.CheckpointJobRequest(name=name, timeout_seconds=timeout),
                                       timeout=timeout + RPC_TIMEOUT)

    def close(self) -> None:
        self.channel.close()
        for server in [self.server, *self.ps_servers]:
            server.stop(None)
        self.servicer.close()


@pytest.fixture
def cluster(recording_store):
    c = Cluster(recording_store)
    yield c
    c.close()


def rpc_error(call, request, timeout: float = RPC_TIMEOUT) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=timeout)
    return err.value


# --- DeleteJob -----------------------------------------------------------------------------------

def test_delete_job_drops_on_alive_nodes_and_leaves_the_rest_pending(recording_store, closed_port):
    c = Cluster(recording_store, token=TOKEN)  # calls to nodes carry the cluster token
    try:
        uid = c.create_job("gone")
        a = c.add_ps(FakePS("ps-a", {"gone": (uid, 3)}))
        b = c.add_ps(FakePS("ps-b", {}))
        c.register("ps-down", closed_port().port)   # alive by its heartbeats, but nothing listens
        c.register("ps-dead", closed_port().port)
        c.now = HEARTBEAT_TIMEOUT + 1
        for node_id in ("ps-a", "ps-b", "ps-down"):
            c.membership.heartbeat(node_id, c.now)
        assert c.servicer.expire() == ["ps-dead"]

        reply = c.stub.DeleteJob(dispatcher_pb2.DeleteJobRequest(name="gone"), timeout=RPC_TIMEOUT)
        assert reply.uid == uid
        assert list(reply.dropped_on) == ["ps-a", "ps-b"]
        assert list(reply.pending_on) == ["ps-dead", "ps-down"]
        assert a.drops == [("gone", uid)] and "gone" not in a.jobs and b.drops == [("gone", uid)]
        assert rpc_error(c.stub.GetJob, dispatcher_pb2.GetJobRequest(name="gone")).code() == grpc.StatusCode.NOT_FOUND

        # A pending node is told on its next heartbeat, the tombstone survives a restart.
        beat = c.stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(
            node_id="ps-down", jobs=[dispatcher_pb2.HeldJob(job="gone", uid=uid)]), timeout=RPC_TIMEOUT)
        assert list(beat.drop_jobs) == ["gone"]
        again = JobRegistry(store=recording_store)
        assert again.report_held("ps-dead", [dispatcher_pb2.HeldJob(job="gone", uid=uid)], record=False)[0] == ["gone"]
    finally:
        c.close()


def test_delete_unknown_job_is_not_found(cluster):
    err = rpc_error(cluster.stub.DeleteJob, dispatcher_pb2.DeleteJobRequest(name="missing"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "'missing'" in err.details()


# --- CheckpointJob -------------------------------------------------------------------------------

def test_checkpoint_bsp_retries_at_the_later_step_when_a_node_is_past(cluster):
    uid = cluster.create_job("bsp")
    a = cluster.add_ps(FakePS("ps-a", {"bsp": (uid, 5)}))
    b = cluster.add_ps(FakePS("ps-b", {"bsp": (uid, 5)}, advance_after_status=2))  # at 7 when asked for 5
    cluster.add_ps(FakePS("ps-other", {"other-job": ("0" * 16, 9)}))               # not a holder
    reply = cluster.checkpoint("bsp")
    assert reply.step == 7 and list(reply.nodes) == ["ps-a", "ps-b"]
    assert a.asked == [5, 7] and b.asked == [5, 7]
    assert a.jobs["bsp"]["step"] == 7


def test_checkpoint_asp_asks_each_node_for_its_own_step(cluster):
    uid = cluster.create_job("asp", sync="asp")
    a = cluster.add_ps(FakePS("ps-a", {"asp": (uid, 3)}))
    b = cluster.add_ps(FakePS("ps-b", {"asp": (uid, 10)}, advance_after_status=1))
    reply = cluster.checkpoint("asp")
    assert reply.step == 3 and list(reply.nodes) == ["ps-a", "ps-b"]
    assert a.asked == [3] and b.asked == [10, 11]  # only the node that was past is asked again


def test_checkpoint_timeout_names_the_nodes_not_durable(cluster):
    uid = cluster.create_job("slow")
    cluster.add_ps(FakePS("ps-a", {"slow": (uid, 5)}))
    cluster.add_ps(FakePS("ps-b", {"slow": (uid, 3)}, stuck=True))
    start = time.monotonic()
    err = rpc_error(cluster.stub.CheckpointJob, dispatcher_pb2.CheckpointJobRequest(name="slow", timeout_seconds=0.5))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "ps-b at step 3" in err.details() and "ps-a" not in err.details() and "'slow'" in err.details()
    assert time.monotonic() - start < 5.0


def test_checkpoint_without_holders_or_with_an_unreachable_node(cluster, closed_port):
    uid = cluster.create_job("nobody")
    err = rpc_error(cluster.stub.CheckpointJob, dispatcher_pb2.CheckpointJobRequest(name="nobody", timeout_seconds=2))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no PS node holds job 'nobody'" in err.details()
    cluster.add_ps(FakePS("ps-a", {"nobody": (uid, 1)}))
    cluster.register("ps-down", closed_port().port)
    err = rpc_error(cluster.stub.CheckpointJob, dispatcher_pb2.CheckpointJobRequest(name="nobody", timeout_seconds=2))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "ps-down" in err.details()


@pytest.mark.parametrize("request_, code", [
    (dispatcher_pb2.CheckpointJobRequest(name="missing", timeout_seconds=1), grpc.StatusCode.NOT_FOUND),
    (dispatcher_pb2.CheckpointJobRequest(name="missing", timeout_seconds=0), grpc.StatusCode.INVALID_ARGUMENT),
    (dispatcher_pb2.CheckpointJobRequest(name="missing", timeout_seconds=float("nan")), grpc.StatusCode.INVALID_ARGUMENT),
])
def test_checkpoint_bad_requests(cluster, request_, code):
    assert rpc_error(cluster.stub.CheckpointJob, request_).code() == code


# --- heartbeats, JobInfo, RestoreJob --------------------------------------------------------------

def test_heartbeats_feed_checkpoint_steps_into_job_info(cluster):
    uid = cluster.create_job("ck")
    cluster.register("ps-a", 9001)
    cluster.register("ps-b", 9002)

    def beat(node_id: str, durable: int | None):
        return cluster.stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id=node_id, jobs=[
            dispatcher_pb2.HeldJob(job="ck", uid=uid, step=20, has_durable=durable is not None,
                                   durable_step=durable or 0)]), timeout=RPC_TIMEOUT)

    assert [(s.job, s.step) for s in beat("ps-a", 12).checkpoint_steps] == [("ck", 12)]  # the only holder
    assert list(beat("ps-b", None).checkpoint_steps) == []  # a holder without a checkpoint yet
    assert [(s.job, s.step) for s in beat("ps-b", 10).checkpoint_steps] == [("ck", 10)]
    info = cluster.stub.GetJob(dispatcher_pb2.GetJobRequest(name="ck"), timeout=RPC_TIMEOUT)
    assert (info.uid, info.has_checkpoint, info.checkpoint_step, dict(info.durable_steps)) == (
        uid, True, 10, {"ps-a": 12, "ps-b": 10})
    status = cluster.stub.GetClusterStatus(dispatcher_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT)
    assert [(j.spec.name, j.uid, j.checkpoint_step) for j in status.jobs] == [("ck", uid, 10)]
    cluster.servicer.expire()  # republishes the gauges
    assert REGISTRY.get_sample_value("shardline_job_checkpoint_step", {"job_name": "ck"}) == 10
    cluster.stub.DeleteJob(dispatcher_pb2.DeleteJobRequest(name="ck"), timeout=RPC_TIMEOUT)
    assert REGISTRY.get_sample_value("shardline_job_checkpoint_step", {"job_name": "ck"}) is None


def test_heartbeat_with_a_higher_epoch_moves_the_dispatcher_past_it(cluster, caplog):
    with caplog.at_level(logging.WARNING, logger="shardline.dispatcher"):
        beat = cluster.stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="ps-x", epoch=50), timeout=RPC_TIMEOUT)
    assert beat.registered is False and beat.epoch == 51
    assert "epoch 50" in caplog.text


def test_restore_job(cluster, caplog):
    spec = common_pb2.JobSpec(name="back", optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync="bsp",
                              world_size=1, tensors=[common_pb2.TensorSpec(name="w", shape=[4])])
    with caplog.at_level(logging.WARNING, logger="shardline.dispatcher"):
        info = cluster.stub.RestoreJob(dispatcher_pb2.RestoreJobRequest(spec=spec, uid="abcdef0123456789",
                                                                        node_id="ps-a"), timeout=RPC_TIMEOUT)
    assert info.uid == "abcdef0123456789" and info.ready is True
    assert "back" in caplog.text and "ps-a" in caplog.text and "re-registered" in caplog.text
    # Known now: every later restore gets the registered job back, whatever uid it brings.
    again = cluster.stub.RestoreJob(dispatcher_pb2.RestoreJobRequest(spec=spec, uid="1" * 16, node_id="ps-b"),
                                    timeout=RPC_TIMEOUT)
    assert again.uid == "abcdef0123456789"
    cluster.stub.DeleteJob(dispatcher_pb2.DeleteJobRequest(name="back"), timeout=RPC_TIMEOUT)
    err = rpc_error(cluster.stub.RestoreJob, dispatcher_pb2.RestoreJobRequest(spec=spec, uid="abcdef0123456789",
                                                                              node_id="ps-a"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "'back'" in err.details() and "deleted" in err.details()
    assert rpc_error(cluster.stub.RestoreJob, dispatcher_pb2.RestoreJobRequest(uid="x", node_id="ps-a")).code() == \
        grpc.StatusCode.INVALID_ARGUMENT


def test_a_state_store_failure_fails_the_rpc_naming_the_path(cluster, recording_store):
    failures = REGISTRY.get_sample_value("shardline_state_store_write_failures_total") or 0.0
    recording_store.failing = True
    spec = common_pb2.JobSpec(name="nowrite", optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1), sync="bsp",
                              world_size=1)
    err = rpc_error(cluster.stub.CreateJob, dispatcher_pb2.CreateJobRequest(spec=spec))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "/state/dispatcher.db" in err.details()
    err = rpc_error(cluster.stub.RegisterNode, dispatcher_pb2.RegisterNodeRequest(
        node_id="ps-a", rack="r1", grpc_address="127.0.0.1:9001", data_address="127.0.0.1:9002", capacity=1.0))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert REGISTRY.get_sample_value("shardline_state_store_write_failures_total") == failures + 2
    recording_store.failing = False
    assert cluster.stub.GetClusterStatus(dispatcher_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT).jobs == []


# --- coordinate_checkpoint without a network ------------------------------------------------------

class ScriptedCaller:
    """NodeCaller whose checkpoint replies come from per-node scripts (a reply, or a status code)."""

    def __init__(self, steps: dict[str, int], scripts: dict[str, list]):
        self.steps, self.scripts = steps, scripts

    def status(self, node, timeout):
        progress = ps_pb2.JobProgress(job="j", uid="u", step=self.steps[node.node_id])
        return ps_pb2.NodeStatus(node_id=node.node_id, jobs=[progress])

    def checkpoint(self, node, job, step, timeout):
        item = self.scripts[node.node_id].pop(0)
        if isinstance(item, str):
            raise NodeCallError(node.node_id, item, "scripted")
        return item


def run(caller, nodes=("a", "b"), **kw):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        return coordinate_checkpoint(caller, pool, [Target(n, "127.0.0.1:1") for n in nodes], "j", "u",
                                     asp=False, timeout=5.0, sleep=lambda s: None, **kw)


def test_a_holder_answering_not_found_no_longer_counts():
    caller = ScriptedCaller({"a": 4, "b": 4}, {"a": [ps_pb2.CheckpointReply(step=4)], "b": ["NOT_FOUND"]})
    assert run(caller) == CheckpointResult(step=4, nodes=["a"])


def test_transient_failures_are_retried_and_permanent_ones_are_not():
    caller = ScriptedCaller({"a": 4, "b": 4}, {"a": [ps_pb2.CheckpointReply(step=4)],
                                                "b": ["UNAVAILABLE", ps_pb2.CheckpointReply(step=4)]})
    assert run(caller).step == 4
    caller = ScriptedCaller({"a": 4, "b": 4}, {"a": [ps_pb2.CheckpointReply(step=4)], "b": ["UNIMPLEMENTED"]})
    with pytest.raises(ShardlineStateError, match="UNIMPLEMENTED"):
        run(caller)
