"""gRPC over TLS: a cluster whose daemons serve TLS (certificates made at test time with openssl)
trains, its daemons call each other over TLS, and clients without the CA fail with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from shardline import connect
from shardline.services.errors import ShardlineTimeoutError
from shardline.local_cluster import LocalCluster
from test_demo import DEMO_SHORT, shardline_cmd
from tls_helpers import make_tls_files

pytestmark = pytest.mark.timeout(240)

TOKEN = b"tls-integration-token-0123456789"


def test_tls_cluster_trains_and_refuses_clients_without_the_ca(tmp_path, monkeypatch):
    tls = make_tls_files(tmp_path / "tls")
    token_file = tmp_path / "cluster.token"
    token_file.write_bytes(TOKEN + b"\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}
    with LocalCluster(tmp_path / "cluster", cluster_token_file=str(token_file), tls_cert_file=str(tls.cert),
                      tls_key_file=str(tls.key), tls_ca_file=str(tls.ca), env=env) as c:
        c.start_dispatcher()
        for node in [c.add_node(node_id=node_id, wait=False) for node_id in ("ps1", "ps2")]:
            c.wait_ready(node)
        c.wait_for_nodes(2, timeout=60)

        # A worker daemon trains a BSP job to the end over the TLS control plane.
        result = tmp_path / "worker.json"
        worker = c.add_worker(DEMO_SHORT, 0, 1, steps=4, result_file=str(result), progress="off")
        assert worker.proc.wait(timeout=120) == 0, worker.log_tail()
        assert json.loads(result.read_text())["status"] == "completed"

        # A training script reads the token and the CA from the environment.
        monkeypatch.setenv("SHARDLINE_CLUSTER_TOKEN_FILE", str(token_file))
        monkeypatch.setenv("SHARDLINE_TLS_CA_FILE", str(tls.ca))
        script = connect(c.address, job="tls-job")
        script.init({"w": torch.zeros(8)}, optimizer="sgd", lr=0.5)
        script.push({"w": torch.ones(8)})
        torch.testing.assert_close(script.pull()["w"], torch.full((8,), -0.5))
        script.close()

        # Without the CA (plaintext), or with a CA that did not sign the servers' certificates: refused, saying why
        # (the first try fails so on loopback: a connect_timeout of 1 s is waited out, not needed).
        monkeypatch.delenv("SHARDLINE_TLS_CA_FILE")
        with pytest.raises(ShardlineTimeoutError, match="if the cluster uses TLS, set tls_ca_file"):
            connect(c.address, job="tls-job", connect_timeout=1)
        with pytest.raises(ShardlineTimeoutError, match="TLS handshake failed"):
            connect(c.address, job="tls-job", tls_ca=tls.other_cert.read_bytes(), connect_timeout=1)

        # The CLI: status over TLS shows it; the dispatcher's calls to the PS nodes (job delete) go over TLS.
        cli_env = {**env, "SHARDLINE_CLUSTER_TOKEN_FILE": str(token_file)}
        res = subprocess.run([*shardline_cmd(), "status", "--cluster", c.address, "--tls-ca-file", str(tls.ca)],
                             capture_output=True, text=True, timeout=60, env=cli_env)
        assert res.returncode == 0, res.stderr
        assert "security: authentication cluster token, gRPC TLS" in res.stdout
        res = subprocess.run([*shardline_cmd(), "job", "delete", "--cluster", c.address, "tls-job"],
                             capture_output=True, text=True, timeout=60,
                             env={**cli_env, "SHARDLINE_TLS_CA_FILE": str(tls.ca)})
        assert res.returncode == 0 and "dropped on ps1, ps2" in res.stdout, res.stdout + res.stderr
        res = subprocess.run([*shardline_cmd(), "status", "--cluster", c.address, "--timeout", "1"],
                             capture_output=True, text=True, timeout=60, env=cli_env)
        assert res.returncode == 1 and "set tls_ca_file" in res.stderr, res.stderr


@pytest.mark.parametrize("flags,fragment", [
    (("--tls-cert-file", "{cert}"), "tls_cert_file is set ('{cert}') but tls_key_file is not"),
    (("--tls-key-file", "{key}"), "tls_key_file is set ('{key}') but tls_cert_file is not"),
    (("--tls-cert-file", "{cert}", "--tls-key-file", "{missing}", "--tls-ca-file", "{ca}"),
     "cannot read tls_key_file '{missing}'"),
    (("--tls-cert-file", "{cert}", "--tls-key-file", "{key}"), "but tls_ca_file is not"),
    (("--tls-ca-file", "{missing}"), "cannot read tls_ca_file '{missing}'"),
])
def test_bad_tls_configuration_exits_2_naming_the_option(tmp_path, flags, fragment):
    tls = make_tls_files(tmp_path / "tls")
    names = {"cert": tls.cert, "key": tls.key, "ca": tls.ca, "missing": tmp_path / "missing.pem"}
    argv = [a.format(**names) for a in flags]
    res = subprocess.run([sys.executable, "-m", "shardline.dispatcher.main", "--listen", "127.0.0.1:0", *argv],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert fragment.format(**names) in res.stderr, res.stderr
