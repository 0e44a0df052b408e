"""Delta pulls and routing refresh against live daemons."""

import torch

import train_model
from shardline import connect


def test_frozen_tensor_is_transferred_once(cluster, tmp_path):
    addr = cluster.address
    creator = connect(addr, job="delta")
    frozen = torch.randn(300)
    w = torch.randn(300)
    untouched = torch.randn(300)
    creator.init({"w": w, "frozen": frozen, "untouched": untouched}, optimizer="sgd", lr=0.5, block_elements=64,
                 trainable={"w": True, "frozen": False, "untouched": True})
    reader = connect(addr, job="delta")
    first = reader.pull()
    assert torch.equal(first["frozen"], frozen) and torch.equal(first["w"], w)
    assert reader.stats.pulled_bytes == 3 * 300 * 4
    g = torch.zeros(300)
    g[:10] = 1.0  # touches block 0 of w only
    for step in range(3):
        creator.push({"w": g, "untouched": None})
        before = reader.stats.pulled_bytes
        got = reader.pull(min_step=step + 1)
        # Every block of w was stepped (its zero blocks went as flags and still count as a step, as
        # in torch.optim), so all of w moves; "untouched" had no gradient and frozen none: nothing.
        assert reader.stats.pulled_bytes - before == 300 * 4
        assert torch.equal(got["frozen"], frozen) and torch.equal(got["untouched"], untouched)
    expected = w.clone()
    expected -= 3 * 0.5 * g
    torch.testing.assert_close(reader.pull()["w"], expected)
    creator.close(), reader.close()


def test_workers_pull_frozen_parameters_once(cluster, tmp_path):
    steps = 4
    results = train_model.run_workers(cluster.address, "delta-train", "adamw", "bsp", tmp_path, steps=steps)
    model = train_model.SmallModel()
    blocks_of = {n: -(-p.numel() // 16) for n, p in model.named_parameters()}
    trainable_blocks = sum(b for n, b in blocks_of.items() if n not in ("scale", "unused"))
    # rank 1 pulls everything once; afterwards per step only blocks that changed: frozen "scale" and
    # never-stepped "unused" are never sent again.
    pulled = int(results[1]["_pulled_blocks"])
    assert pulled <= sum(blocks_of.values()) + steps * trainable_blocks
    assert pulled >= sum(blocks_of.values())
    # rank 0 created the job from its own parameters, so it never pulls the frozen ones at all
    pulled0 = int(results[0]["_pulled_blocks"])
    assert pulled0 <= steps * trainable_blocks


def wait_nodes_at_epoch(cluster, epoch, timeout=15.0):
    """Wait until every PS routes with ``epoch`` (they learn it from heartbeat replies)."""
    import time


    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2, ps_pb2_grpc

    deadline = time.monotonic() + timeout
    for node in cluster.nodes:
        with grpc_channel(node.grpc) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            while stub.GetNodeStatus(ps_pb2.GetNodeStatusRequest(), timeout=5).epoch < epoch:
                assert time.monotonic() < deadline, f"{node.name} did not reach epoch {epoch}"
                time.sleep(0.1)


def test_not_owner_makes_client_refresh_routing(cluster):
    addr = cluster.address
    client = connect(addr, job="reroute")  # routing fetched now: 2 nodes
    old_epoch = client.routing.epoch
    node = cluster.add_node(node_id="ps3")
    try:
        cluster.wait_for_nodes(3, timeout=30)
        new_epoch = cluster.wait_until(lambda st: st.routing.epoch > old_epoch, timeout=10, what="epoch bump").routing.epoch
        wait_nodes_at_epoch(cluster, new_epoch)
        w = torch.randn(4096)
        client.init({"w": w}, optimizer="sgd", lr=1.0, block_elements=64)  # sent with the stale epoch
        assert client.routing.epoch > old_epoch, "client did not refresh routing after NOT_OWNER"
        owners = {client.routing.owner("reroute", "w", i) for i in range(64)}
        assert "ps3" in owners
        other = connect(addr, job="reroute")
        assert torch.equal(other.pull()["w"], w)
        other.close()
    finally:
        client.close()
        cluster.stop(node)
        cluster.wait_for_nodes(2, timeout=30)


def test_pull_into_the_callers_tensors(cluster):
    """pull(out=...) fills the caller's tensors (reused from pull to pull) and returns them; a wrong
    name, shape or dtype is refused before anything is pulled."""
    import pytest

    from shardline.services.errors import ShardlineConfigError

    creator = connect(cluster.address, job="pull-out")
    w, b = torch.randn(4, 50), torch.randn(7)
    creator.init({"w": w, "b": b}, optimizer="sgd", lr=0.5, block_elements=64)
    reader = connect(cluster.address, job="pull-out")
    out = {"w": torch.empty(4, 50), "b": torch.empty(7, dtype=torch.bfloat16)}
    ptrs = {k: v.data_ptr() for k, v in out.items()}
    got = reader.pull(out=out)
    assert got["w"] is out["w"] and torch.equal(out["w"], w)
    assert torch.equal(out["b"], b.to(torch.bfloat16))
    creator.push({"w": torch.ones(4, 50), "b": None})
    reader.pull(min_step=1, out=out)
    assert torch.equal(out["w"], w - 0.5) and {k: v.data_ptr() for k, v in out.items()} == ptrs
    before = reader.stats.pulled_bytes
    for bad, match in (({"w": torch.empty(4, 51), "b": out["b"]}, "shape"),
                       ({"w": torch.empty(4, 50, dtype=torch.int64), "b": out["b"]}, "floating-point"),
                       ({"w": out["w"]}, None), ({"nope": torch.empty(1)}, "no tensor")):
        with pytest.raises(ShardlineConfigError, match=match or "exactly"):
            reader.pull(["w", "b"] if match is None else None, out=bad)
    assert reader.stats.pulled_bytes == before, "a refused out= pulls nothing"
    reader.close()
    creator.close()
