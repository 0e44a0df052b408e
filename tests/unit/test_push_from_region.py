"""One-copy pushes over shm: a push's blocks may stay in the client's shared region
(BlockRef.src_region / src_offset, a gradient_buffer): the node copies them out itself and checks
its copy. A PSNode served over real ShmConnection pairs; SGD with lr 1 on one rank, so every
result is checked against init - grad."""

import threading

import pytest
import torch
from test_pull_placement import BLOCK, ServedOverShm, shm_client, spec  # noqa: F401 - a fixture

from shardline.ps_server import node as node_module
from shardline.services import frame
from shardline.services.errors import FrameError, FrameTooLargeError
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.transport import shm

pytestmark = pytest.mark.timeout(60)


def push(request_id: int, grad: torch.Tensor, sources: dict) -> tuple[frame.FrameHeader, list]:
    """A PUSH of both blocks of "w" at step 0: block i from ``sources[i]`` = (region id, offset), the
    others' bytes (``grad``) in the payload."""
    header = frame.FrameHeader(op=dp.OP_PUSH, request_id=request_id, job="j", epoch=1, step=0, rank=0, weight=1.0,
                               has_lr=True, lr=1.0)
    payloads = []
    for i in (0, 1):
        ref = frame.block_ref("w", i, grad[i * BLOCK:(i + 1) * BLOCK])
        if i in sources:
            ref.src_region, ref.src_offset = sources[i]
        else:
            payloads.append(frame.tensor_bytes(grad[i * BLOCK:(i + 1) * BLOCK]))
        header.blocks.append(ref)
    return header, payloads


def commit_and_pull(served) -> torch.Tensor:
    commit = frame.FrameHeader(op=dp.OP_COMMIT, request_id=90, job="j", epoch=1, step=0, rank=0, weight=1.0,
                               has_lr=True, lr=1.0)
    reply, _ = served.ask(commit)
    assert reply.op == dp.OP_REPLY, reply.message
    reply, body = served.ask(frame.FrameHeader(op=dp.OP_PULL, request_id=91, job="j", epoch=1, min_step=1,
                                               blocks=[dp.BlockRef(tensor="w", index=i) for i in (0, 1)]))
    assert reply.op == dp.OP_REPLY and reply.step == 1, reply.message
    return torch.frombuffer(body, dtype=torch.float32)


@pytest.fixture
def served():
    """(served node, init values, a 2-block gradient in a shared region at offset 64, that region)."""
    served, region = ServedOverShm(), shm.SharedRegion(2 * BLOCK * 4 + 64)
    try:
        init = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(0))
        assert served.init(init).op == dp.OP_REPLY
        grad = region.tensor(torch.float32, 64, 2 * BLOCK)
        grad.copy_(torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(1)))
        served.client.share_region(region)
        yield served, init, grad, region
    finally:
        served.close()
        region.close()


def test_a_push_takes_its_blocks_from_the_region_and_the_payload(served):
    served, init, grad, region = served
    header, payloads = push(2, grad, {1: (region.id, 64 + BLOCK * 4)})   # block 0 in the payload
    reply, _ = served.ask(header, payloads)
    assert reply.op == dp.OP_REPLY, reply.message
    assert header.payload_bytes == BLOCK * 4
    torch.testing.assert_close(commit_and_pull(served), init - grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("source, message", [
    ((99, 64), "did not share"),
    (("region", 64 + BLOCK * 4 + 8), "do not fit"),
    (("region", 66), "aligned"),
])
def test_a_source_outside_a_shared_region_is_refused_and_the_connection_serves_on(served, source, message):
    served, init, grad, region = served
    bad = (region.id if source[0] == "region" else source[0], source[1])
    reply, _ = served.ask(*push(2, grad, {0: (region.id, 64), 1: bad}))
    assert reply.op == dp.OP_ERROR and reply.code == dp.INVALID_ARGUMENT and message in reply.message
    reply, _ = served.ask(*push(3, grad, {0: (region.id, 64), 1: (region.id, 64 + BLOCK * 4)}))
    assert reply.op == dp.OP_REPLY, reply.message   # nothing of the refused push was kept: not a resend
    torch.testing.assert_close(commit_and_pull(served), init - grad, rtol=0, atol=1e-6)


def test_a_nan_in_the_region_refuses_the_whole_push(served):
    served, init, grad, region = served
    clean = grad.clone()
    grad[BLOCK + 5] = float("nan")
    reply, _ = served.ask(*push(2, grad, {0: (region.id, 64), 1: (region.id, 64 + BLOCK * 4)}))
    assert reply.op == dp.OP_ERROR and reply.code == dp.NONFINITE and "block 1" in reply.message
    grad.copy_(clean)
    reply, _ = served.ask(*push(3, grad, {0: (region.id, 64), 1: (region.id, 64 + BLOCK * 4)}))
    assert reply.op == dp.OP_REPLY, reply.message
    torch.testing.assert_close(commit_and_pull(served), init - grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad_block", [0, 3])
def test_a_large_take_shared_with_the_helper_thread_lands_whole_and_finds_the_first_nan(monkeypatch, bad_block):
    """Pieces of one block each, taken in turn by the connection's thread and the helper: the values
    land whole; a NaN in any piece refuses the push and is named."""
    monkeypatch.setattr(node_module, "PARALLEL_PLACE_BYTES", 0)
    monkeypatch.setattr(node_module, "COPY_PIECE_BYTES", 1)
    job_spec = spec()
    job_spec.tensors[0].shape[0] = 4 * BLOCK
    table = common_pb2.RoutingTable(epoch=1)
    table.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)
    node = node_module.PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=job_spec, uid="u", ready=True),
                              lambda: table)
    node.refresh_routing()
    served = ServedOverShm(node)
    region = shm.SharedRegion(4 * BLOCK * 4)
    try:
        init = torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(3))
        header = frame.FrameHeader(op=dp.OP_INIT, request_id=1, job="j", epoch=1)
        header.blocks.extend([frame.block_ref("w", i, init[i * BLOCK:(i + 1) * BLOCK]) for i in range(4)])
        assert served.ask(header, [frame.tensor_bytes(init[i * BLOCK:(i + 1) * BLOCK]) for i in range(4)])[0].op == dp.OP_REPLY
        grad = region.tensor(torch.float32, 0, 4 * BLOCK)
        grad.copy_(torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(4)))
        served.client.share_region(region)

        def push4(request_id):
            h = frame.FrameHeader(op=dp.OP_PUSH, request_id=request_id, job="j", epoch=1, step=0, rank=0, weight=1.0,
                                  has_lr=True, lr=1.0)
            for i in range(4):
                ref = frame.block_ref("w", i, grad[i * BLOCK:(i + 1) * BLOCK])
                ref.src_region, ref.src_offset = region.id, i * BLOCK * 4
                h.blocks.append(ref)
            return served.ask(h)[0]
        clean = grad.clone()
        grad[bad_block * BLOCK] = float("inf")
        reply = push4(2)
        assert reply.code == dp.NONFINITE and f"block {bad_block})" in reply.message
        grad.copy_(clean)
        assert push4(3).op == dp.OP_REPLY
        assert served.node._place_pool is not None
        commit = frame.FrameHeader(op=dp.OP_COMMIT, request_id=4, job="j", epoch=1, step=0, rank=0, weight=1.0,
                                   has_lr=True, lr=1.0)
        assert served.ask(commit)[0].op == dp.OP_REPLY
        reply, body = served.ask(frame.FrameHeader(op=dp.OP_PULL, request_id=5, job="j", epoch=1, min_step=1,
                                                   blocks=[dp.BlockRef(tensor="w", index=i) for i in range(4)]))
        torch.testing.assert_close(torch.frombuffer(body, dtype=torch.float32), init - clean, rtol=0, atol=1e-6)
    finally:
        served.close()
        region.close()


def test_a_push_whose_client_hung_up_during_the_copy_is_dropped(served, monkeypatch):
    """The node stalls mid-copy, its client gives up (it closes the connection first), then writes
    the region again; the node resumes and finds the hang-up: its copy may be torn, so nothing of
    the push is kept, and the client's resend on a new connection is taken in full (not ignored
    as a push of this rank already received)."""
    served, init, grad, region = served
    clean = grad.clone()
    real_take = node_module.PSNode.take_push
    gave_up = threading.Event()

    def stalled(self, *args):
        served.client.close()       # meanwhile the client gave up and moved on ...
        grad.fill_(1e30)
        real_take(self, *args)      # ... so the copy takes what it wrote after the push
        gave_up.set()
    monkeypatch.setattr(node_module.PSNode, "take_push", stalled)
    header, payloads = push(2, grad, {0: (region.id, 64), 1: (region.id, 64 + BLOCK * 4)})
    frame.send_frame(served.client, header, payloads)
    assert gave_up.wait(10)
    served.thread.join(10)
    assert not served.thread.is_alive()   # the connection ended there
    monkeypatch.setattr(node_module.PSNode, "take_push", real_take)
    grad.copy_(clean)
    again = ServedOverShm(served.node)
    try:
        again.client.share_region(region)
        reply, _ = again.ask(*push(3, grad, {0: (region.id, 64), 1: (region.id, 64 + BLOCK * 4)}))
        assert reply.op == dp.OP_REPLY, reply.message
        torch.testing.assert_close(commit_and_pull(again), init - clean, rtol=0, atol=1e-6)
    finally:
        again.close()


def test_a_push_over_tcp_cannot_name_a_source_region():
    with pytest.raises(Exception, match="did not share"):
        node_module._check_sources(push(1, torch.zeros(2 * BLOCK), {0: (1, 0)})[0], None)


# --- the client's gradient buffers ---------------------------------------------------------------------
def test_gradient_buffers_share_one_region_and_pushes_of_them_name_it(shm_client):  # noqa: F811 - the fixture
    import types

    from shardline.services.errors import ShardlineConfigError
    from shardline.worker.shm_exchange import region_holding, share_region

    s = spec()
    s.tensors.add(name="b", shape=[3], dtype="float32", trainable=True)
    s.tensors.add(name="frozen", shape=[2], dtype="float32", trainable=False)
    client = shm_client(s)
    w = client.gradient_buffer("w")
    assert w.shape == (2 * BLOCK,) and w.dtype == torch.float32 and not w.any()
    assert client.gradient_buffer("w") is w and len(client._shm.grad_regions) == 1
    region = client._shm.grad_regions[0]
    assert region.offset_of(w) == 0 and region.offset_of(client.gradient_buffer("b")) == 2 * BLOCK * 4
    with pytest.raises(ShardlineConfigError, match="no trainable tensor 'frozen'"):
        client.gradient_buffer("frozen")
    shared = []
    conn = types.SimpleNamespace(sock=types.SimpleNamespace(share_region=shared.append))
    assert region_holding(client._shm.grad_regions, w[BLOCK:].data_ptr(), BLOCK * 4) == (region, BLOCK * 4)
    assert region_holding(client._shm.grad_regions, torch.zeros(BLOCK).data_ptr(), BLOCK * 4) is None
    assert region_holding(client._shm.grad_regions, region.address + region.size - 4, 8) is None   # runs past its end
    assert region_holding(client._shm.grad_regions, region.address - 4, 8) is None                 # starts before it
    noted = set()
    share_region(conn, region, noted)
    assert shared == [region] and noted == {region.id}
    region.close()


def test_without_shm_the_gradient_buffers_are_ordinary_memory(offline_client):
    client = offline_client(spec())
    w = client.gradient_buffer("w")
    assert w.shape == (2 * BLOCK,) and not w.any() and not client._shm.grad_regions


# --- the frame rules ---------------------------------------------------------------------------------
def _sourced(op=dp.OP_PUSH, **fields) -> frame.FrameHeader:
    header = frame.FrameHeader(op=op, request_id=1, job="j")
    ref = dp.BlockRef(tensor="w", index=0, dtype=dp.FLOAT32, numel=4, nbytes=16, src_region=1, src_offset=0)
    for key, value in fields.items():
        setattr(ref, key, value)
    header.blocks.append(ref)
    return header


@pytest.mark.parametrize("header, message", [
    (_sourced(dp.OP_INIT), "only pushes"),
    (_sourced(src_region=0, src_offset=8), "no region"),
    (_sourced(zero=True, nbytes=0), "zero-flagged"),
    (_sourced(dtype=dp.SIGN1, scale=1.0, nbytes=1), "compressed"),
    (_sourced(nbytes=12), "!= nbytes"),
])
def test_only_a_push_names_source_regions_and_with_consistent_sizes(header, message):
    with pytest.raises(FrameError, match=message):
        frame.validate_header(header)


def test_bytes_taken_from_regions_count_against_the_payload_limit():
    header = _sourced()
    frame.validate_header(header)
    assert header.payload_bytes == 0 and frame.sourced_bytes(header) == 16
    with pytest.raises(FrameTooLargeError, match="shared region"):
        frame.validate_header(header, frame.FrameLimits(max_payload_bytes=15))


# --- the transport -------------------------------------------------------------------------------------
def test_take_many_checks_every_bound_before_copying_anything():
    from test_shm_transport import pair, share_with_node

    client, node = pair()
    region = shm.SharedRegion(64)
    try:
        region.tensor(torch.float32, 0, 16).copy_(torch.arange(16.0))
        share_with_node(client, node, region)
        first, second = torch.zeros(4), torch.zeros(4)
        with pytest.raises(ValueError, match="do not fit"):
            node.take_many([(region.id, 0, first), (region.id, 56, second)])
        assert not first.any()            # all or nothing
        node.take_many([(region.id, 0, first), (region.id, 48, second)])
        assert first.tolist() == [0, 1, 2, 3] and second.tolist() == [12, 13, 14, 15]
        with pytest.raises(OSError, match="no region"):
            node.take_many([(region.id + 1, 0, first)])
        assert region.offset_of(region.tensor(torch.float32, 8, 2)) == 8
        assert region.offset_of(torch.zeros(2)) is None
        assert region.offset_of(region.tensor(torch.float32, 0, 16)[::2]) is None   # not contiguous
    finally:
        client.close()
        node.close()
        region.close()


def test_take_many_checked_names_the_first_nonfinite_copy_and_stops_there():
    """checked=True: each copy is checked as it is made; the index of the first one holding
    NaN/Inf is returned and the items after it are not copied (the push is refused anyway). An
    empty item moves no bytes and is never the one named."""
    from test_shm_transport import pair, share_with_node

    client, node = pair()
    region = shm.SharedRegion(64)
    try:
        values = region.tensor(torch.float32, 0, 16)
        values.copy_(torch.arange(16.0))
        share_with_node(client, node, region)
        dests = [torch.zeros(4), torch.zeros(0), torch.zeros(4), torch.zeros(4)]
        items = [(region.id, 0, dests[0]), (region.id, 16, dests[1]), (region.id, 16, dests[2]),
                 (region.id, 32, dests[3])]
        assert node.take_many(items, checked=True) is None
        assert dests[2].tolist() == [4, 5, 6, 7] and dests[3].tolist() == [8, 9, 10, 11]
        values[6] = float("inf")
        dests[3].zero_()
        assert node.take_many(items, checked=True) == 2
        assert not dests[3].any()          # after the bad one: not copied
        assert node.take_many(items) is None   # unchecked: copies all
        assert dests[3].tolist() == [8, 9, 10, 11]
        for dtype in (torch.float16, torch.bfloat16):   # copied, then the copy checked
            halves = region.tensor(dtype, 0, 8)
            halves.copy_(torch.arange(8.0))
            dests = [torch.zeros(4, dtype=dtype), torch.zeros(4, dtype=dtype)]
            items = [(region.id, 0, dests[0]), (region.id, 8, dests[1])]
            assert node.take_many(items, checked=True) is None and dests[1].tolist() == [4, 5, 6, 7]
            halves[5] = float("nan")
            assert node.take_many(items, checked=True) == 1
            del halves
    finally:
        client.close()
        node.close()
        region.close()
