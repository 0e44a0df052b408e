"""A BSP commit that carries the pull of the step it may complete (FrameHeader.pull_applied): the
commit that applies the step is answered with the step's blocks, placed in the client's region
or in the payload, as a pull at the new step would be; a commit that does not apply it is answered
as before, with no block. A PSNode served over a real shm connection; the values are checked
against torch.optim.SGD run on the mean gradient."""

import pytest
import torch
from job_specs import one_tensor_spec
from test_pull_placement import BLOCK, ServedOverShm

from shardline.ps_server.node import PSNode
from shardline.services import frame
from shardline.services.errors import FrameError
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.transport import shm

pytestmark = pytest.mark.timeout(60)
LR = 0.5


def two_rank_node(sync: str = "bsp") -> PSNode:
    spec = one_tensor_spec(2, "sgd", BLOCK, lr=LR)
    spec.sync = sync
    if sync == "ssp":
        spec.staleness = 1
    table = common_pb2.RoutingTable(epoch=1)
    table.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)
    node = PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=spec, uid="u", ready=True), lambda: table)
    node.refresh_routing()
    return node


def push(rank: int, grad: torch.Tensor) -> tuple[frame.FrameHeader, list]:
    header = frame.FrameHeader(op=dp.OP_PUSH, request_id=10 + rank, job="j", epoch=1, step=0, rank=rank, weight=1.0,
                               commit_follows=True)
    parts = [grad[i * BLOCK:(i + 1) * BLOCK] for i in (0, 1)]
    header.blocks.extend([frame.block_ref("w", i, p) for i, p in enumerate(parts)])
    return header, [frame.tensor_bytes(p) for p in parts]


def commit(rank: int, places: dict | None) -> frame.FrameHeader:
    """Rank ``rank``'s commit of step 0; ``places`` (index -> (region, offset)): carry a pull of both
    blocks (held at version 0), placing those named; None: a plain commit."""
    header = frame.FrameHeader(op=dp.OP_COMMIT, request_id=20 + rank, job="j", epoch=1, step=0, rank=rank, weight=1.0)
    if places is not None:
        header.pull_applied = True
        for index in (0, 1):
            ref = dp.BlockRef(tensor="w", index=index, version=0, has=True)
            if index in places:
                ref.dest_region, ref.dest_offset = places[index]
            header.blocks.append(ref)
    return header


def expected_after_one_step(init: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    w = init.clone().requires_grad_()
    opt = torch.optim.SGD([w], lr=LR)
    w.grad = torch.stack(grads).mean(0)
    opt.step()
    return w.detach()


def test_the_commit_that_applies_the_step_brings_its_blocks_the_other_brings_none():
    node = two_rank_node()
    first, last, region = ServedOverShm(node), ServedOverShm(node), shm.SharedRegion(2 * BLOCK * 4)
    try:
        gen = torch.Generator().manual_seed(0)
        init = torch.randn(2 * BLOCK, generator=gen)
        grads = [torch.randn(2 * BLOCK, generator=gen) for _ in range(2)]
        assert first.init(init).op == dp.OP_REPLY
        for rank, served in ((0, first), (1, last)):
            reply, _ = served.ask(*push(rank, grads[rank]))
            assert reply.op == dp.OP_REPLY, reply.message
        reply, body = first.ask(commit(0, {}))   # rank 1 has not committed: nothing applied, nothing carried
        assert reply.op == dp.OP_REPLY and reply.step == 0, reply.message
        assert not reply.pull_applied and not reply.blocks and not body
        last.client.share_region(region)
        reply, body = last.ask(commit(1, {1: (region.id, 0)}))   # applies step 0: block 1 placed, block 0 sent
        assert reply.op == dp.OP_REPLY and reply.step == 1 and reply.pull_applied, reply.message
        assert [(r.index, r.version, r.placed) for r in reply.blocks] == [(0, 1, False), (1, 1, True)]
        want = expected_after_one_step(init, grads)
        torch.testing.assert_close(torch.frombuffer(body, dtype=torch.float32), want[:BLOCK], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(region.tensor(torch.float32, 0, BLOCK), want[BLOCK:], rtol=1e-6, atol=1e-6)
        # rank 0's own pull of step 1 gets the same values
        pull = frame.FrameHeader(op=dp.OP_PULL, request_id=30, job="j", epoch=1, min_step=1, wait_timeout_seconds=5)
        pull.blocks.extend([dp.BlockRef(tensor="w", index=i, version=0, has=True) for i in (0, 1)])
        reply, body = first.ask(pull)
        assert reply.op == dp.OP_REPLY and reply.step == 1
        torch.testing.assert_close(torch.frombuffer(body, dtype=torch.float32), want, rtol=1e-6, atol=1e-6)
    finally:
        first.close()
        last.close()
        region.close()


def test_a_carried_pull_of_blocks_held_at_the_new_step_brings_none():
    node = two_rank_node()
    first, last = ServedOverShm(node), ServedOverShm(node)
    try:
        first.init(torch.zeros(2 * BLOCK))
        for rank, served in ((0, first), (1, last)):
            served.ask(*push(rank, torch.ones(2 * BLOCK)))
        first.ask(commit(0, None))
        header = commit(1, {})
        for ref in header.blocks:
            ref.version = 1   # the worker already holds step 1 (as a resent commit's would)
        reply, body = last.ask(header)
        assert reply.op == dp.OP_REPLY and reply.step == 1 and reply.pull_applied and not reply.blocks and not body
    finally:
        first.close()
        last.close()


def test_a_region_that_does_not_fit_refuses_the_commit_before_it_counts():
    node = two_rank_node()
    first, last, region = ServedOverShm(node), ServedOverShm(node), shm.SharedRegion(BLOCK * 4)
    try:
        first.init(torch.zeros(2 * BLOCK))
        for rank, served in ((0, first), (1, last)):
            served.ask(*push(rank, torch.ones(2 * BLOCK)))
        first.ask(commit(0, None))
        last.client.share_region(region)
        reply, _ = last.ask(commit(1, {1: (region.id, 8)}))   # 8 bytes in, block 1 overruns the region
        assert reply.op == dp.OP_ERROR and reply.code == dp.INVALID_ARGUMENT and "do not fit" in reply.message
        assert node.store.get("j").step == 0   # the commit did not count: the step is not applied
        reply, _ = last.ask(commit(1, None))
        assert reply.op == dp.OP_REPLY and reply.step == 1
    finally:
        first.close()
        last.close()
        region.close()


def test_only_a_bsp_commit_carries_a_pull():
    node = two_rank_node("ssp")
    served = ServedOverShm(node)
    try:
        served.init(torch.zeros(2 * BLOCK))
        reply, _ = served.ask(commit(0, {}))
        assert reply.op == dp.OP_ERROR and reply.code == dp.INVALID_ARGUMENT and "BSP" in reply.message
    finally:
        served.close()
    # the frame format: pull refs and destination regions only where a pull is carried
    carried = commit(0, {0: (1, 0)})
    frame.validate_header(carried)
    carried.pull_applied = False
    with pytest.raises(FrameError, match="destination region"):
        frame.validate_header(carried)


def client_after_commit(answered: dict, node_steps: dict, nodes=("A", "B")):
    """A Client whose last commit made step 5 with these carried answers (what _commit leaves)."""
    import types

    from shardline.worker.client import Client, TransferStats
    from shardline.worker.recovery import Replay, StepsInFlight

    client = Client.__new__(Client)
    client.routing = types.SimpleNamespace(nodes={n: 0 for n in nodes})
    client._shapes = {"w": (3 * BLOCK,)}
    client._slices = {"w": [types.SimpleNamespace(index=i) for i in range(3)]}
    client._versions = {("w", i): 5 for i in range(3)}
    client.step, client.held_step, client.stats = 5, None, TransferStats()
    client._inflight = StepsInFlight()
    client._replay = Replay(client._inflight)
    client._carried = (5, answered, node_steps)
    return client


KEYS_A, KEYS_B = [("w", 0), ("w", 1)], [("w", 2)]


@pytest.mark.parametrize("answered, node_steps, nodes, took", [
    ({"A": KEYS_A, "B": KEYS_B}, {"A": 5, "B": 5}, ("A", "B"), True),
    # B died mid-reply and left the ring: A answered for its own blocks only (the chaos run that
    # found this skipped the pull with B's blocks never brought)
    ({"A": KEYS_A}, {"A": 5, "B": 5}, ("A",), False),
    # B's blocks moved to A and the commit was resent there for them: A answered for all of them
    ({"A": KEYS_A + KEYS_B}, {"A": 5}, ("A",), True),
    ({"A": KEYS_A, "B": KEYS_B}, {"A": 5, "B": 4}, ("A", "B"), False),   # B did not reach the step
    ({"A": KEYS_A, "B": KEYS_B}, {"A": 5, "B": 5}, ("A", "B", "C"), False),   # C's step unknown
])
def test_a_pull_is_skipped_only_when_every_block_came_and_every_node_reached_the_step(answered, node_steps, nodes,
                                                                                        took):
    client = client_after_commit(answered, node_steps, nodes)
    assert client._took_carried_pull() is took
    assert client._carried is None   # used once
    assert client.stats.carried_steps == int(took)
    client._carried = (5, {"A": KEYS_A, "B": KEYS_B}, {"A": 5, "B": 5})
    client._inflight.record(5, 1.0, 0)
    client._replay.epoch_moved()   # the routing moved during the step: its replay decides
    assert not client._took_carried_pull()


def test_caches_changed_after_the_commit_are_pulled():
    """A tensor bound after the commit (its bytes unknown: versions gone) or added to the job
    (a new revision) was not in what the replies brought."""
    import types

    everything = ({"A": KEYS_A, "B": KEYS_B}, {"A": 5, "B": 5})
    client = client_after_commit(*everything)
    del client._versions[("w", 1)]
    assert not client._took_carried_pull()
    client = client_after_commit(*everything)
    client._shapes["v"], client._slices["v"] = (4,), [types.SimpleNamespace(index=0)]
    client._versions[("v", 0)] = 0
    assert not client._took_carried_pull()
    assert client_after_commit(*everything)._took_carried_pull()
