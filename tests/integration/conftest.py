import sys
from pathlib import Path

import pytest

from shardline.local_cluster import LocalCluster

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


@pytest.fixture(autouse=True)
def no_worker_left_behind():
    """Worker processes a test started (train_model.start_workers) do not outlive it: one that
    failed midway may have left them running, e.g. paused at a failpoint it never released."""
    yield
    train_model = sys.modules.get("train_model")
    if train_model is not None:
        train_model.kill_started()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A dispatcher and two PS nodes, real processes on 127.0.0.1, shared by a test module
    (tests use distinct job names); everything is reaped afterwards."""
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        c.start_dispatcher()
        nodes = [c.add_node(node_id=node_id, wait=False) for node_id in ("ps1", "ps2")]  # they start in parallel
        for node in nodes:
            c.wait_ready(node)
        c.wait_for_nodes(2, timeout=30)
        yield c
