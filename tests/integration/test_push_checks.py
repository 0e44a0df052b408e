"""A NaN/Inf gradient in a push to one node is found by the node (the client leaves the check to
it): the node refuses the whole push and keeps nothing of it, the client raises naming the tensor
and the node, and the next push of the same step counts, equal to torch.optim."""

from __future__ import annotations

import pytest
import torch

from shardline.services.errors import ShardlineConfigError
from shardline.local_cluster import LocalCluster
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
def test_a_bad_block_in_a_push_to_one_node_is_refused_by_the_node_which_keeps_nothing(one_node, transport):
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(8 * BLOCK, generator=gen)
    client = connect(one_node.address, job=f"checks-{transport}", transport=transport)
    try:
        client.init({"w": w0}, optimizer="sgd", lr=LR, block_elements=BLOCK)
        bad = torch.randn(8 * BLOCK, generator=gen)
        bad[-1] = float("nan")  # in the last block: the seven before it reached the node already
        with pytest.raises(ShardlineConfigError, match="'w'.*NaN or Inf.*refused by node 'ps1'"):
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


def test_a_push_spread_over_two_nodes_is_checked_by_the_client_before_any_byte(tmp_path):
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(8 * BLOCK, generator=gen)
    with LocalCluster(tmp_path) as c:
        c.start_dispatcher()
        for node in ("ps1", "ps2"):
            c.add_node(node_id=node)
        c.wait_for_nodes(2, timeout=30)
        client = connect(c.address, job="checks-spread", transport="tcp")
        try:
            client.init({"w": w0}, optimizer="sgd", lr=LR, block_elements=BLOCK)
            owners = {client.routing.owner(client.job, "w", i) for i in range(8)}
            assert len(owners) == 2, owners  # else this proves nothing about a spread push
            bad = torch.randn(8 * BLOCK, generator=gen)
            bad[-1] = float("inf")
            with pytest.raises(ShardlineConfigError, match="'w' contains NaN or Inf; not pushed$"):
                client.push({"w": bad})
            assert client.step == 0 and client.stats.pushed_bytes == 0  # nothing went out
            good = torch.randn(8 * BLOCK, generator=gen)
            client.push({"w": good})
            got = client.pull(["w"])["w"]
        finally:
            client.close()
    torch.testing.assert_close(got, w0 - LR * good, rtol=1e-6, atol=1e-7)
    assert client.step == 1


def test_a_nan_push_that_fails_on_a_dead_node_is_not_resent_after_the_node_is_back(tmp_path):
    """The node that should have checked the push died before it could: the client checks the
    push itself then, so the record its replay resends never keeps the NaN, and the step goes on
    once the node is back (restored from its checkpoint)."""
    gen = torch.Generator().manual_seed(2)
    w0, g1 = torch.randn(4 * BLOCK, generator=gen), torch.randn(4 * BLOCK, generator=gen)
    with LocalCluster(tmp_path) as c:
        c.start_dispatcher(heartbeat_timeout=1, heartbeat_interval=0.2)
        node = c.add_node(node_id="ps1", checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every_steps=1)
        c.wait_for_nodes(1, timeout=30)
        client = connect(c.address, job="checks-dead", transport="tcp", recovery_timeout=2.0)
        try:
            client.init({"w": w0}, optimizer="sgd", lr=LR, block_elements=BLOCK)
            client.push({"w": g1})
            assert client.pull(["w"]) and client.step == 1
            c.wait_until(lambda st: any(j.spec.name == "checks-dead" and j.has_checkpoint and j.checkpoint_step >= 1
                                        for j in st.jobs), 30, "step 1 durable")
            c.kill(node)
            bad = torch.randn(4 * BLOCK, generator=gen)
            bad[0] = float("nan")
            with pytest.raises(ShardlineConfigError, match="'w' contains NaN or Inf; not pushed"):
                client.push({"w": bad})
            c.restart(node)
            c.wait_for_nodes(1, timeout=30)
            good = torch.randn(4 * BLOCK, generator=gen)
            client.push({"w": good})
            got = client.pull(["w"])["w"]
        finally:
            client.close()
    torch.testing.assert_close(got, w0 - LR * g1 - LR * good, rtol=1e-6, atol=1e-6)
    assert client.step == 2
