"""A cluster started with a token admits only callers that hold it: data plane (HMAC challenge)
and gRPC (bearer metadata), except the health service; `shardline up` starts such a cluster."""

import json
import os
import re
import signal
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.services.daemon import grpc_channel
from shardline.services.dispatcher_client import DispatcherClient
from shardline.services.errors import RemoteError, ShardlineConfigError
from shardline.local_cluster import LocalCluster
from shardline.services.pb import ps_pb2, ps_pb2_grpc
from shardline import connect

from intruder import Intruder
from test_demo import DEMO_SHORT, processes_mentioning, shardline_cmd

TOKEN = b"integration-token-0123456789"


def test_token_protected_cluster(tmp_path):
    token_file = tmp_path / "cluster.token"
    token_file.write_bytes(TOKEN + b"\n")
    with LocalCluster(tmp_path / "cluster", cluster_token_file=str(token_file)) as c:
        c.start_dispatcher()
        node = c.add_node(node_id="ps1")
        c.wait_for_nodes(1, timeout=30)  # the PS registered: it holds the token too

        good = connect(c.address, job="tok", cluster_token=TOKEN)
        w = torch.randn(100)
        good.init({"w": w}, optimizer="sgd", lr=0.5)
        good.push({"w": torch.ones(100)})
        torch.testing.assert_close(good.pull()["w"], w - 0.5)
        good.close()

        # gRPC without the token: refused, on the dispatcher and on the PS; health stays open.
        with pytest.raises(ShardlineConfigError, match="UNAUTHENTICATED"):
            connect(c.address, job="tok")
        anonymous = DispatcherClient(c.address, rpc_timeout=5, cluster_token=b"not-the-token-0123456789")
        with pytest.raises(ShardlineConfigError, match="UNAUTHENTICATED"):
            anonymous.get_routing()
        anonymous.close()
        with grpc_channel(node.grpc) as channel:
            with pytest.raises(grpc.RpcError) as e:
                ps_pb2_grpc.ParameterServerStub(channel).GetNodeStatus(ps_pb2.GetNodeStatusRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING

        # Data plane: a client with the control-plane token but a wrong data-plane answer is refused.
        wrong = connect(c.address, job="tok", cluster_token=TOKEN)
        wrong.cluster_token = b"not-the-token-0123456789"
        with pytest.raises(RemoteError, match="UNAUTHENTICATED"):
            wrong.pull()
        wrong.cluster_token = None
        with pytest.raises(ShardlineConfigError, match="requires the cluster token"):
            wrong.pull()
        wrong.close()

        # The operator CLI with the token shows the job's step.
        res = subprocess.run([*shardline_cmd(), "status", "--cluster", c.address, "--json",
                              "--cluster-token-file", str(token_file)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        assert next(j for j in json.loads(res.stdout)["jobs"] if j["name"] == "tok")["step"] == 1
        res = subprocess.run([*shardline_cmd(), "status", "--cluster", c.address], capture_output=True, text=True,
                             timeout=30, env={k: v for k, v in __import__("os").environ.items()
                                              if k != "SHARDLINE_CLUSTER_TOKEN_FILE"})
        assert res.returncode != 0 and "UNAUTHENTICATED" in res.stderr


# -- the attack of issue "Safe by default", against the cluster `shardline up` starts -------------

SECRET_TENSOR = "victim_secret_projection_weight"


class UpCluster:
    """`shardline up` as a subprocess training a long job; its stdout lines are collected as they come."""

    def __init__(self, workdir: Path, env: dict):
        import threading

        self.workdir = workdir
        self.proc = subprocess.Popen([*shardline_cmd(), "up", "--workdir", str(workdir), "--ps", "2", "--workers", "2",
                                      "--job", str(DEMO_SHORT), "--steps", "100000", "--timeout", "240"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    def wait_line(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        pytest.fail(f"`shardline up` printed no line matching {pattern!r}:\n{''.join(self.lines)}")

    def close(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)   # the CLI shuts its cluster down on SIGINT
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=5)
        for pid in processes_mentioning(str(self.workdir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.proc.returncode


@pytest.mark.timeout(300)
def test_attack_fails_against_shardline_up(tmp_path, monkeypatch):
    """A process that knows only the dispatcher address (and the PS data ports a scan finds) can
    neither read, change nor join anything of a `shardline up` cluster; the owner's script, given
    only the token file `up` printed, works; metrics show no tensor name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    up = UpCluster(tmp_path / "up", env)
    try:
        address = up.wait_line(r"cluster at (\S+);").group(1)
        token_file = Path(up.wait_line(r"cluster token in (\S+): connect with SHARDLINE_CLUSTER_TOKEN_FILE=").group(1))
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and token_file.parent == tmp_path / "up"
        assert len(token_file.read_bytes().strip()) >= 43  # >= 32 random bytes, urlsafe
        up.wait_line(r"step \d+/100000")  # the BSP job trains
        nodes = [json.loads((tmp_path / "up" / f"ps-{i}.json").read_text()) for i in (0, 1)]
        dispatcher_metrics = json.loads((tmp_path / "up" / "dispatcher.json").read_text())["metrics"]

        # The owner's own script: nothing but the environment variable `up` printed.
        monkeypatch.setenv("SHARDLINE_CLUSTER_TOKEN_FILE", str(token_file))
        owner = connect(address, job="victim")
        owner.init({SECRET_TENSOR: torch.zeros(4)}, optimizer="sgd", lr=1.0, sync="bsp", world_size=1)
        owner.push({SECRET_TENSOR: torch.ones(4)})     # a step: the value goes to -1
        before = owner.pull()[SECRET_TENSOR].clone()
        torch.testing.assert_close(before, -torch.ones(4))
        epoch, step = owner.routing.epoch, owner.step

        intruder = Intruder(address)
        assert intruder.list_jobs() == "UNAUTHENTICATED"
        assert intruder.get_routing() == "UNAUTHENTICATED"
        assert intruder.get_job("victim") == "UNAUTHENTICATED"
        assert intruder.create_job("intruder-job") == "UNAUTHENTICATED"
        assert intruder.delete_job("victim") == "UNAUTHENTICATED"
        assert intruder.impersonate_rank("demo-short", 1) == "UNAUTHENTICATED"
        assert intruder.register_fake_node() == "UNAUTHENTICATED"
        for node in nodes:
            assert intruder.node_status(node["grpc"]) == "UNAUTHENTICATED"
            # Even knowing the epoch and step, frames without the HMAC handshake are refused.
            assert intruder.pull(node["data"], "victim", SECRET_TENSOR, epoch=epoch) == "UNAUTHENTICATED"
            assert intruder.push(node["data"], "victim", SECRET_TENSOR, torch.full((4,), -5.0), step=step,
                                 epoch=epoch) == "UNAUTHENTICATED"
            assert intruder.commit(node["data"], "victim", step=step, epoch=epoch) == "UNAUTHENTICATED"
            assert intruder.commit(node["data"], "demo-short", rank=1, epoch=epoch) == "UNAUTHENTICATED"
        monkeypatch.delenv("SHARDLINE_CLUSTER_TOKEN_FILE")
        with pytest.raises(ShardlineConfigError, match="UNAUTHENTICATED"):
            connect(address, job="victim", connect_timeout=10)  # the worker library without the token
        res = subprocess.run([*shardline_cmd(), "status", "--cluster", address], capture_output=True, text=True,
                             timeout=30, env=env)
        assert res.returncode != 0 and "UNAUTHENTICATED" in res.stderr

        # Nothing changed: the owner's value and step, the members, the BSP job's ranks.
        after = owner.pull()[SECRET_TENSOR]
        torch.testing.assert_close(after, before)
        assert owner.step == step
        res = subprocess.run([*shardline_cmd(), "status", "--cluster", address, "--json"], capture_output=True,
                             text=True, timeout=30, env={**env, "SHARDLINE_CLUSTER_TOKEN_FILE": str(token_file)})
        assert res.returncode == 0, res.stderr
        status = json.loads(res.stdout)
        assert sorted(n["node_id"] for n in status["nodes"]) == ["ps-0", "ps-1"]
        assert sorted(j["name"] for j in status["jobs"]) == ["demo-short", "victim"]
        demo = next(j for j in status["jobs"] if j["name"] == "demo-short")
        assert all(w["incarnation"] != "intruder" for w in demo["workers"]), demo["workers"]
        assert status["security"] == {"insecure": False, "cluster_token": True, "tls": False, "insecure_nodes": []}

        # Metrics stay readable without the token, and name no tensor of a job.
        for metrics in [dispatcher_metrics, *(n["metrics"] for n in nodes)]:
            text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
            assert "shardline_" in text and SECRET_TENSOR not in text, metrics
        owner.close()
    finally:
        code = up.close()
    assert code == 130, "".join(up.lines)[-3000:]
