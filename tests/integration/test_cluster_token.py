"""A cluster started with a token admits only callers that hold it: data plane (HMAC challenge)
and gRPC (bearer metadata), except the health service."""

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.services.daemon import grpc_channel
from shardline.services.dispatcher_client import DispatcherClient
from shardline.services.errors import RemoteError, ShardlineConfigError
from shardline.services.local_cluster import LocalCluster
from shardline.services.pb import ps_pb2, ps_pb2_grpc
from shardline import connect

TOKEN = b"integration-token-0123456789"


def shardline_cmd():
    script = Path(sys.executable).parent / "shardline"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardline.services.cli"]


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
