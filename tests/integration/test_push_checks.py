"""A NaN/Inf gradient is refused whole, also when the client finds it while the push is already
on the wire (over shm a push to one node is checked block by block as it is sent; over TCP before
it is sent): the frame is cut short, the node keeps nothing of it, and the next push of the same
step counts, equal to torch.optim."""

from __future__ import annotations

import pytest
import torch

from shardline.services.errors import ShardlineConfigError
from shardline.services.local_cluster import LocalCluster
from shardline.worker.client import connect

pytestmark = pytest.mark.timeout(120)
BLOCK = 65_536  # 256 KiB blocks: the frame is sent block by block, not in one small write
LR = 0.5


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("push-checks")) as c:
        c.start_dispatcher()
        c.add_node(node_id="ps1", transport="auto")
        c.wait_for_nodes(1, timeout=30)
        yield c


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_bad_block_found_mid_frame_leaves_nothing_behind(one_node, transport):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(8 * BLOCK, generator=gen)
    client = connect(one_node.address, job=f"checks-{transport}", transport=transport)
    try:
        client.init({"w": w0}, optimizer="sgd", lr=LR, block_elements=BLOCK)
        bad = torch.randn(8 * BLOCK, generator=gen)
        bad[-1] = float("nan")  # in the last block: over shm the seven before it are on the wire already
        with pytest.raises(ShardlineConfigError, match="'w'.*NaN or Inf"):
            client.push({"w": bad})
        assert client.step == 0
        good = torch.randn(8 * BLOCK, generator=gen)
        client.push({"w": good})  # the same step again: counted, not taken for a resend
        got = client.pull(["w"])["w"]
    finally:
        client.close()
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([p], lr=LR)
    p.grad = good.clone()
    opt.step()
    torch.testing.assert_close(got, p.detach(), rtol=1e-6, atol=1e-7)
    assert client.step == 1
