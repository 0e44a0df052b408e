"""A frozen bfloat16 tensor on a real cluster (two PS nodes, replication 2): stored as bfloat16
with no optimizer state on both copies (2 bytes per parameter, not 12 as fp32 with AdamW state),
in each node's unnamed frozen-value file (the page cache, not the heap),
read back bit for bit, still there bit for bit after its primary is killed, while the trainable
tensor beside it trains as torch.optim does."""

from __future__ import annotations

import pytest
import torch

from test_local_cluster import kill_leftovers, start_nodes, status_json

from shardline import connect
from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

BASE, ADAPTER, BLOCK = 200_000, 3_000, 10_000


def test_a_frozen_bfloat16_tensor_is_stored_as_bfloat16_read_back_exactly_and_survives_a_kill(tmp_path):
    workdir = tmp_path / "cluster"
    cluster = LocalCluster(workdir, start_timeout=60)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(BASE, generator=gen).to(torch.bfloat16)
    adapter = torch.randn(ADAPTER, generator=gen)
    grads = [torch.randn(ADAPTER, generator=gen) for _ in range(4)]
    try:
        nodes = start_nodes(cluster)
        client = connect(cluster.address, job="frozen-bf16")
        client.init({"base": base.clone(), "adapter": adapter.clone()}, trainable={"base": False}, optimizer="adamw",
                    lr=0.01, weight_decay=0.1, block_elements=BLOCK)
        for grad in grads[:2]:
            client.push({"adapter": grad.clone()})
            client.pull()

        memory = status_json(cluster.address)["memory"]
        for node, report in memory.items():
            job = report["jobs"]["frozen-bf16"]
            assert job["parameters"] == BASE + ADAPTER, node                 # both copies of every block
            assert job["bytes"]["values"] == 4 * ADAPTER, node                 # the heap: the adapter
            assert job["bytes"]["frozen_files"] == 2 * BASE, node              # the base: bfloat16, in a file
            assert job["bytes"]["optimizer_state"] == 8 * ADAPTER + 4, node    # moments and step count: adapter only
        assert torch.equal(client.pull(["base"])["base"], base)

        cluster.kill(nodes[0])                                              # a primary of half the base dies
        cluster.wait_for_nodes(1, timeout=30)
        fresh = connect(cluster.address, job="frozen-bf16")
        fresh.init({"base": torch.zeros(BASE, dtype=torch.bfloat16), "adapter": torch.zeros(ADAPTER)},
                   trainable={"base": False}, optimizer="adamw", lr=0.01, weight_decay=0.1, block_elements=BLOCK)
        got = fresh.pull(["base"])["base"]
        assert torch.equal(got, base.to(got.dtype))                          # the survivor's bf16 copies
        fresh.close()
        for grad in grads[2:]:
            client.push({"adapter": grad.clone()})
            trained = client.pull()["adapter"]
        client.close()

        param = adapter.clone().requires_grad_()
        opt = torch.optim.AdamW([param], lr=0.01, weight_decay=0.1)
        for grad in grads:
            param.grad = grad.clone()
            opt.step()
        torch.testing.assert_close(trained, param.detach(), rtol=1e-6, atol=1e-6)
    finally:
        cluster.shutdown()
        kill_leftovers(str(workdir))
