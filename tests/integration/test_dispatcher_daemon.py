"""The dispatcher daemon as a real subprocess on 127.0.0.1, driven over gRPC and HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.services.daemon import grpc_channel
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from ports import free_port

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
RPC_TIMEOUT = 5.0
HEARTBEAT_TIMEOUT = 0.5


class Daemon:
    """A dispatcher subprocess; ``close`` always leaves no process behind."""

    def __init__(self, workdir: Path, *args: str, listen: str = "127.0.0.1:0"):
        workdir.mkdir(parents=True, exist_ok=True)
        self.ready_file = workdir / "ready.json"
        self.ready_file.unlink(missing_ok=True)  # a previous run's file would look ready at once
        self.log_path = workdir / "dispatcher.log"
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shardline.dispatcher.main", "--listen", listen, "--metrics-port", "0",
                 "--ready-file", str(self.ready_file), *args],
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.info = self._wait_ready(timeout=20.0)
        self.channel = grpc_channel(self.info["grpc"])
        self.stub = dispatcher_pb2_grpc.DispatcherStub(self.channel)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return json.loads(self.ready_file.read_text())
            if self.proc.poll() is not None:
                self.close()
                pytest.fail(f"dispatcher exited with {self.proc.returncode} before ready:\n{self.output()}")
            time.sleep(0.05)
        self.close()
        pytest.fail(f"dispatcher not ready within {timeout} s:\n{self.output()}")

    def close(self) -> None:
        """Close the channel and SIGKILL the daemon if it still runs (no clean shutdown)."""
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(
        tmp_path_factory.mktemp("dispatcher"),
        "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
        "--heartbeat-interval", "0.1",
        # its tests register nodes that never heartbeat, several at a time: without the isolation
        # guard (tests/unit/test_isolation.py), each is declared dead on its own timeout
        "--isolation-share", "1",
    )
    try:
        yield d
    finally:
        d.close()


def register(stub, node_id: str, port: int, rack: str = "r1", capacity: float = 1.0):
    return stub.RegisterNode(
        dispatcher_pb2.RegisterNodeRequest(
            node_id=node_id, rack=rack, grpc_address=f"127.0.0.1:{port}",
            data_address=f"127.0.0.1:{port + 1}", capacity=capacity,
        ),
        timeout=RPC_TIMEOUT,
    )


def job_spec(name: str, **overrides) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(
        name=name,
        optimizer=common_pb2.OptimizerSpec(kind="sgd", lr=0.1, momentum=0.9),
        sync="bsp",
        world_size=2,
        tensors=[common_pb2.TensorSpec(name="layers.0.weight", shape=[8, 4], trainable=True)],
    )
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, timeout=RPC_TIMEOUT, **kwargs)
    return err.value


def test_ready_file_and_health(daemon):
    assert daemon.info["pid"] == daemon.proc.pid
    assert daemon.info["grpc"].startswith("127.0.0.1:") and daemon.info["metrics"].startswith("127.0.0.1:")
    health = health_pb2_grpc.HealthStub(daemon.channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_register_heartbeat_and_routing(daemon):
    stub = daemon.stub
    first = register(stub, "reg-a", 9000, rack="r1")
    assert first.heartbeat_interval_seconds == pytest.approx(0.1)
    second = register(stub, "reg-b", 9010, rack="r2", capacity=2.0)
    assert second.epoch > first.epoch
    routing = stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT)
    assert routing.epoch >= second.epoch
    nodes = {n.node_id: n for n in routing.nodes}
    assert nodes["reg-a"].vnodes == 128 and nodes["reg-b"].vnodes == 256
    assert nodes["reg-b"].rack == "r2" and nodes["reg-b"].data_address == "127.0.0.1:9011"
    beat = stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="reg-a", blocks=3, bytes=300), timeout=RPC_TIMEOUT)
    assert beat.registered is True and beat.epoch >= second.epoch
    unknown = stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="never-registered"), timeout=RPC_TIMEOUT)
    assert unknown.registered is False


def test_silent_node_is_declared_dead_while_heartbeating_node_stays(daemon):
    stub = daemon.stub
    register(stub, "live-1", 9100)
    start_epoch = register(stub, "quiet-1", 9110).epoch
    stop = threading.Event()
    refused: list[bool] = []

    def heartbeat() -> None:  # as a PS node would, independently of the polling below
        while not stop.wait(0.05):
            reply = stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="live-1"), timeout=RPC_TIMEOUT)
            refused.append(not reply.registered)

    beater = threading.Thread(target=heartbeat)
    beater.start()
    try:
        deadline = time.monotonic() + 5.0
        alive: set[str] = {"quiet-1"}
        while "quiet-1" in alive and time.monotonic() < deadline:
            time.sleep(0.05)
            routing = stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT)
            alive = {n.node_id for n in routing.nodes}
    finally:
        stop.set()
        beater.join(timeout=10)
    assert "quiet-1" not in alive and "live-1" in alive
    assert refused and not any(refused)
    assert routing.epoch > start_epoch
    status = stub.GetClusterStatus(dispatcher_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT)
    states = {n.node_id: n for n in status.all_nodes}
    assert states["quiet-1"].state == "dead" and states["quiet-1"].vnodes == 0
    assert states["quiet-1"].heartbeat_age_seconds > HEARTBEAT_TIMEOUT
    # A dead node is told to register again, and registering revives it.
    beat = stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="quiet-1"), timeout=RPC_TIMEOUT)
    assert beat.registered is False
    revived = register(stub, "quiet-1", 9110)
    assert revived.epoch > routing.epoch


def test_job_lifecycle(daemon):
    stub = daemon.stub
    created = stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("life")), timeout=RPC_TIMEOUT)
    assert created.created is True
    assert created.job.spec.block_elements == 262_144 and created.job.ready is False
    again = stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("life")), timeout=RPC_TIMEOUT)
    assert again.created is False and again.job.created_unix_ms == created.job.created_unix_ms
    got = stub.GetJob(dispatcher_pb2.GetJobRequest(name="life"), timeout=RPC_TIMEOUT)
    assert got.spec == created.job.spec

    conflict = rpc_error(stub.CreateJob, dispatcher_pb2.CreateJobRequest(spec=job_spec("life", world_size=3)))
    assert conflict.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "world_size" in conflict.details()

    # A waiter is woken by MarkJobReady.
    woken: list = []
    waiter = threading.Thread(
        target=lambda: woken.append(
            stub.WaitJobReady(dispatcher_pb2.WaitJobReadyRequest(name="life", timeout_seconds=10), timeout=15)
        )
    )
    waiter.start()
    time.sleep(0.2)
    assert stub.MarkJobReady(dispatcher_pb2.MarkJobReadyRequest(name="life"), timeout=RPC_TIMEOUT).ready is True
    waiter.join(timeout=5)
    assert woken and woken[0].ready is True

    status = stub.GetClusterStatus(dispatcher_pb2.GetClusterStatusRequest(), timeout=RPC_TIMEOUT)
    assert "life" in {j.spec.name for j in status.jobs}


def test_wait_job_ready_times_out(daemon):
    stub = daemon.stub
    stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("never-ready")), timeout=RPC_TIMEOUT)
    start = time.monotonic()
    err = rpc_error(stub.WaitJobReady, dispatcher_pb2.WaitJobReadyRequest(name="never-ready", timeout_seconds=0.3))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "never-ready" in err.details()
    assert 0.25 <= time.monotonic() - start < 3.0


@pytest.mark.parametrize(
    "method, request_, fragment",
    [
        ("CreateJob", dispatcher_pb2.CreateJobRequest(spec=job_spec("bad", sync="gossip")), "'gossip'"),
        ("CreateJob", dispatcher_pb2.CreateJobRequest(spec=job_spec("bad job")), "'bad job'"),
        ("CreateJob", dispatcher_pb2.CreateJobRequest(), "spec"),
        ("RegisterNode", dispatcher_pb2.RegisterNodeRequest(
            node_id="x", rack="r", grpc_address="nowhere", data_address="h:1", capacity=1), "'nowhere'"),
        ("RegisterNode", dispatcher_pb2.RegisterNodeRequest(
            node_id="x", rack="r", grpc_address="h:1", data_address="h:2", capacity=0), "capacity"),
        ("WaitJobReady", dispatcher_pb2.WaitJobReadyRequest(name="life", timeout_seconds=-1), "-1"),
    ],
)
def test_bad_arguments_are_invalid_argument_with_a_reason(daemon, method, request_, fragment):
    err = rpc_error(getattr(daemon.stub, method), request_)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.details()


def test_unknown_job_is_not_found(daemon):
    for method, request_ in (
        ("GetJob", dispatcher_pb2.GetJobRequest(name="missing")),
        ("MarkJobReady", dispatcher_pb2.MarkJobReadyRequest(name="missing")),
        ("WaitJobReady", dispatcher_pb2.WaitJobReadyRequest(name="missing", timeout_seconds=1)),
    ):
        err = rpc_error(getattr(daemon.stub, method), request_)
        assert err.code() == grpc.StatusCode.NOT_FOUND, method
        assert "'missing'" in err.details()


def test_metrics_endpoint(daemon):
    epoch = daemon.stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT).epoch
    with urllib.request.urlopen(f"http://{daemon.info['metrics']}/metrics", timeout=RPC_TIMEOUT) as reply:
        text = reply.read().decode()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("shardline_") and " " in line
    }
    assert values["shardline_ring_epoch"] >= epoch
    assert "shardline_live_nodes" in values
    assert ('shardline_grpc_server_requests_total{code="OK",method="GetRouting",service="shardline.v1.Dispatcher"}'
            in values), sorted(values)


def test_config_file_with_flag_override(tmp_path):
    config = tmp_path / "dispatcher.yaml"
    config.write_text("heartbeat_interval: 0.25\nheartbeat_timeout: 3\nvnodes_per_capacity: 16\n")
    d = Daemon(tmp_path, "--config", str(config), "--heartbeat-interval", "0.5")
    try:
        reply = register(d.stub, "cfg-1", 9300)
        assert reply.heartbeat_interval_seconds == pytest.approx(0.5)  # the flag beats the file
        routing = d.stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT)
        assert [n.vnodes for n in routing.nodes] == [16]  # the file beats the default
    finally:
        d.close()


def test_shared_sectioned_config_with_env_override(tmp_path, monkeypatch):
    """One file for every daemon: the dispatcher reads common: and dispatcher:, validates ps:/worker:."""
    config = tmp_path / "shardline.yaml"
    config.write_text("common:\n  cluster: 127.0.0.1:7000\n  log_format: json\n"
                      "dispatcher:\n  heartbeat_timeout: 3\n  vnodes_per_capacity: 16\n"
                      "ps:\n  rack: a\nworker:\n  cache_bytes: 1GiB\n")
    monkeypatch.setenv("SHARDLINE_VNODES_PER_CAPACITY", "8")  # the environment beats the file
    d = Daemon(tmp_path, "--config", str(config))
    try:
        reply = register(d.stub, "shared-1", 9500)
        assert reply.heartbeat_interval_seconds == pytest.approx(1.0)  # min(1, 3 / 3)
        routing = d.stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT)
        assert [n.vnodes for n in routing.nodes] == [8]
        first = d.output().splitlines()[0]
        assert json.loads(first)["component"] == "dispatcher"  # log_format from common:
    finally:
        d.close()


@pytest.mark.parametrize(
    "config_text, args, fragment",
    [
        ("heartbeat_timeout: 3\nheartbeat_timout: 2\n", (), "'heartbeat_timout'"),
        ("- a\n- b\n", (), "mapping"),
        ("vnodes_per_capacity: many\n", (), "vnodes_per_capacity in --config"),
        ("heartbeat_timeout: yes\n", (), "must be a number, got True"),
        ("", ("--heartbeat-interval", "2", "--heartbeat-timeout", "1"), "heartbeat_interval"),
        ("", ("--heartbeat-timeout", "-1"), "heartbeat_timeout"),
        ("", ("--listen", "127.0.0.1"), "'127.0.0.1'"),
        ("dispatcher:\n  heartbeat_timeout: 3\nps:\n  capcity: 2\n", (), "'capcity'"),
        ("common:\n  log_format: xml\n", (), "common.log_format"),
        ("dispatcher:\n  metrics_port: 99999\n", (), "99999"),
    ],
)
def test_bad_configuration_exits_2_naming_the_problem(tmp_path, config_text, args, fragment):
    config = tmp_path / "bad.yaml"
    config.write_text(config_text)
    result = subprocess.run(
        [sys.executable, "-m", "shardline.dispatcher.main", "--listen", "127.0.0.1:0", "--config", str(config), *args],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr


def test_default_heartbeat_interval_fits_a_short_timeout(tmp_path):
    d = Daemon(tmp_path, "--heartbeat-timeout", "0.9")
    try:
        reply = register(d.stub, "short-1", 9400)
        assert reply.heartbeat_interval_seconds == pytest.approx(0.3)
    finally:
        d.close()


def test_sigterm_stops_cleanly_even_with_a_blocked_waiter(tmp_path):
    d = Daemon(tmp_path)
    try:
        d.stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("blocked")), timeout=RPC_TIMEOUT)
        errors: list = []

        def wait() -> None:
            try:
                d.stub.WaitJobReady(dispatcher_pb2.WaitJobReadyRequest(name="blocked", timeout_seconds=60), timeout=60)
            except grpc.RpcError as exc:
                errors.append(exc.code())

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
        start = time.monotonic()
        os.kill(d.proc.pid, signal.SIGTERM)
        assert d.proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 10
        waiter.join(timeout=10)
        assert errors and errors[0] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert "stopped" in d.output()
    finally:
        d.close()


def test_without_state_dir_a_warning_says_state_is_in_memory_only(daemon):
    lines = [line for line in daemon.output().splitlines() if " WARNING " in line and "memory only" in line]
    assert lines and "restart forgets every job" in lines[0]


def test_the_dispatcher_serves_jobs_without_loading_torch(daemon):
    """Every cluster start waits for its dispatcher: torch (seconds of imports) stays out of it,
    job specs and their compression option included."""
    daemon.stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("no-torch", compression="sign")),
                          timeout=RPC_TIMEOUT)
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, [line for line in maps.splitlines() if "torch" in line][:3]


def test_state_survives_kill_9_and_a_restart_on_the_same_port(tmp_path):
    state_dir = tmp_path / "state"
    listen = f"127.0.0.1:{free_port()}"
    first = Daemon(tmp_path / "run1", "--state-dir", str(state_dir), listen=listen)
    try:
        assert "no previous state in" in first.output()
        stub = first.stub
        register(stub, "ps-keep", 9600, rack="r2", capacity=2.0)
        ready = stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("kept-ready")), timeout=RPC_TIMEOUT).job
        stub.MarkJobReady(dispatcher_pb2.MarkJobReadyRequest(name="kept-ready"), timeout=RPC_TIMEOUT)
        waiting = stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("kept-waiting", sync="asp")),
                                 timeout=RPC_TIMEOUT).job
        deleted = stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("deleted")), timeout=RPC_TIMEOUT).job
        stub.DeleteJob(dispatcher_pb2.DeleteJobRequest(name="deleted"), timeout=RPC_TIMEOUT)
        stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="ps-keep", jobs=[
            dispatcher_pb2.HeldJob(job="kept-ready", uid=ready.uid, step=9, has_durable=True, durable_step=8)]),
            timeout=RPC_TIMEOUT)
        before = stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT)
        assert [n.node_id for n in before.nodes] == ["ps-keep"]
    finally:
        first.close()  # SIGKILL: no clean shutdown
    assert first.proc.returncode == -signal.SIGKILL

    second = Daemon(tmp_path / "run2", "--state-dir", str(state_dir), listen=listen)
    try:
        assert second.info["grpc"] == listen
        recovered = [line for line in second.output().splitlines() if "recovered state from" in line]
        assert recovered and str(state_dir) in recovered[0] and "nodes=1" in recovered[0] and "jobs=2" in recovered[0]
        stub = second.stub
        routing = stub.GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=RPC_TIMEOUT)
        assert routing.epoch > before.epoch
        assert [(n.node_id, n.rack, n.vnodes, n.grpc_address, n.state) for n in routing.nodes] == [
            ("ps-keep", "r2", 256, "127.0.0.1:9600", "alive")]
        beat = stub.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id="ps-keep", jobs=[
            dispatcher_pb2.HeldJob(job="kept-ready", uid=ready.uid, step=9, has_durable=True, durable_step=8),
            dispatcher_pb2.HeldJob(job="deleted", uid=deleted.uid)]), timeout=RPC_TIMEOUT)
        assert beat.registered is True and beat.epoch == routing.epoch
        assert list(beat.drop_jobs) == ["deleted"]  # the tombstone survived
        got = stub.GetJob(dispatcher_pb2.GetJobRequest(name="kept-ready"), timeout=RPC_TIMEOUT)
        assert (got.spec, got.ready, got.uid, got.created_unix_ms) == (ready.spec, True, ready.uid, ready.created_unix_ms)
        assert (got.has_checkpoint, got.checkpoint_step) == (True, 8)
        got = stub.GetJob(dispatcher_pb2.GetJobRequest(name="kept-waiting"), timeout=RPC_TIMEOUT)
        assert (got.spec, got.ready, got.uid) == (waiting.spec, False, waiting.uid)
        # The same CreateJob a worker retries after the restart finds the job, not a new one.
        again = stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec("kept-waiting", sync="asp")),
                               timeout=RPC_TIMEOUT)
        assert again.created is False and again.job.uid == waiting.uid
        assert rpc_error(stub.GetJob, dispatcher_pb2.GetJobRequest(name="deleted")).code() == grpc.StatusCode.NOT_FOUND
    finally:
        second.close()


def test_an_unusable_state_dir_exits_2_naming_it(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    result = subprocess.run(
        [sys.executable, "-m", "shardline.dispatcher.main", "--listen", "127.0.0.1:0", "--state-dir", str(blocker)],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2, result.stderr
    assert str(blocker) in result.stderr
