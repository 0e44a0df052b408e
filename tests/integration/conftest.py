import sys
from pathlib import Path

import pytest

from shardline.services.local_cluster import LocalCluster

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A dispatcher and two PS nodes, real processes on 127.0.0.1, shared by a test module
    (tests use distinct job names); everything is reaped afterwards."""
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        c.start_dispatcher()
        c.add_node(node_id="ps1")
        c.add_node(node_id="ps2")
        c.wait_for_nodes(2, timeout=30)
        yield c
