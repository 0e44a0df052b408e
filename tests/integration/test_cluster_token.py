"""A PS started with a cluster token admits only data-plane clients that hold it."""

import pytest
import torch

from services.errors import RemoteError, ShardlineConfigError
from services.local_cluster import LocalCluster
from worker import connect

TOKEN = b"integration-token-0123456789"


def test_token_protected_node(tmp_path):
    token_file = tmp_path / "cluster.token"
    token_file.write_bytes(TOKEN + b"\n")
    with LocalCluster(tmp_path / "cluster") as c:
        c.start_dispatcher()
        c.add_node(node_id="ps1", cluster_token_file=str(token_file))
        c.wait_for_nodes(1, timeout=30)
        good = connect(c.address, job="tok", cluster_token=TOKEN)
        w = torch.randn(100)
        good.init({"w": w}, optimizer="sgd", lr=0.5)
        good.push({"w": torch.ones(100)})
        torch.testing.assert_close(good.pull()["w"], w - 0.5)
        good.close()

        anonymous = connect(c.address, job="tok")
        with pytest.raises(ShardlineConfigError, match="requires the cluster token"):
            anonymous.pull()
        anonymous.close()

        wrong = connect(c.address, job="tok", cluster_token=b"not-the-token-0123456789")
        with pytest.raises(RemoteError, match="UNAUTHENTICATED"):
            wrong.pull()
        wrong.close()
