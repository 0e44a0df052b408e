"""One-copy pulls over shm: the node copies a pull's blocks straight into the client's shared
region (BlockRef.dest_region / dest_offset; the reply flags them ``placed``). A PSNode served over
a real ShmConnection pair; the values are checked against what was initialized."""

import socket
import threading
import time

import pytest
import torch
from job_specs import one_tensor_spec

from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
from shardline.ps_server.node import PSNode
from shardline.services import frame
from shardline.services.errors import FrameError
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.transport import shm

pytestmark = pytest.mark.timeout(60)
BLOCK = 1000


def spec() -> common_pb2.JobSpec:
    return one_tensor_spec(1, "sgd", BLOCK, lr=1.0)


class ServedOverShm:
    """A node (routing: itself alone) serving one shm connection; ``client`` is the other end.
    ``node``: serve that one (another connection to it) instead of a new node."""

    def __init__(self, node: PSNode | None = None):
        if node is None:
            table = common_pb2.RoutingTable(epoch=1)
            table.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)
            node = PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=spec(), uid="u", ready=True), lambda: table)
            node.refresh_routing()
        self.node = node
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.client, server = shm.ShmConnection(a), shm.ShmConnection(b)
        self.client.settimeout(10)
        self.thread = threading.Thread(target=serve_connection, daemon=True,
                                       args=(server, "local(shm):1", self.node, ConnectionPolicy(payload_timeout=5.0)))
        self.thread.start()

    def ask(self, header, payloads=()):
        frame.send_frame(self.client, header, list(payloads))
        reply = frame.recv_header(self.client)
        body = bytearray(reply.payload_bytes)
        frame.recv_exactly_into(self.client, memoryview(body))
        return reply, body

    def init(self, values: torch.Tensor) -> frame.FrameHeader:
        """Initialize tensor "w" (both blocks) with ``values``; the reply."""
        parts = [values[i * BLOCK:(i + 1) * BLOCK] for i in (0, 1)]
        header = frame.FrameHeader(op=dp.OP_INIT, request_id=1, job="j", epoch=1)
        header.blocks.extend([frame.block_ref("w", i, p) for i, p in enumerate(parts)])
        return self.ask(header, [frame.tensor_bytes(p) for p in parts])[0]

    def close(self):
        self.client.close()
        self.thread.join(10)


def pull(request_id: int, places: dict) -> frame.FrameHeader:
    header = frame.FrameHeader(op=dp.OP_PULL, request_id=request_id, job="j", epoch=1)
    for index in (0, 1):
        ref = dp.BlockRef(tensor="w", index=index)
        if index in places:
            ref.dest_region, ref.dest_offset = places[index]
        header.blocks.append(ref)
    return header


def test_a_pull_places_the_blocks_asked_in_the_region_and_sends_the_rest():
    served, region = ServedOverShm(), shm.SharedRegion(2 * BLOCK * 4 + 64)
    try:
        init = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(0))
        assert served.init(init).op == dp.OP_REPLY
        served.client.share_region(region)
        reply, body = served.ask(pull(2, {1: (region.id, 64)}))   # block 1 placed, block 0 in the payload
        assert reply.op == dp.OP_REPLY, reply.message
        assert [(r.index, r.placed) for r in reply.blocks] == [(0, False), (1, True)]
        assert reply.payload_bytes == BLOCK * 4
        assert torch.equal(torch.frombuffer(body, dtype=torch.float32), init[:BLOCK])
        assert torch.equal(region.tensor(torch.float32, 64, BLOCK), init[BLOCK:])
    finally:
        served.close()
        region.close()


@pytest.mark.parametrize("bad, message", [
    ({0: (99, 0)}, "did not share"),
    ({0: ("region", 2 * BLOCK * 4 - 8)}, "do not fit"),
    ({0: ("region", 2)}, "aligned"),
])
def test_a_placement_that_does_not_fit_is_refused_and_the_connection_serves_on(bad, message):
    served, region = ServedOverShm(), shm.SharedRegion(2 * BLOCK * 4)
    try:
        served.init(torch.zeros(2 * BLOCK))
        served.client.share_region(region)
        places = {i: (region.id if r == "region" else r, off) for i, (r, off) in bad.items()}
        reply, _ = served.ask(pull(2, places))
        assert reply.op == dp.OP_ERROR and reply.code == dp.INVALID_ARGUMENT and message in reply.message
        assert not region.tensor(torch.float32, 0, 2 * BLOCK).any()
        reply, _ = served.ask(pull(3, {}))
        assert reply.op == dp.OP_REPLY and reply.payload_bytes == 2 * BLOCK * 4
    finally:
        served.close()
        region.close()


def test_a_pull_over_tcp_cannot_ask_for_placement_and_only_pulls_name_regions():
    node = PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=spec(), uid="u", ready=True),
                  lambda: common_pb2.RoutingTable(epoch=1))
    from shardline.ps_server import node as node_module
    with pytest.raises(Exception, match="did not share"):
        node_module._placements(node.add_job(spec(), "u"), pull(1, {0: (1, 0)}), None)
    push = frame.FrameHeader(op=dp.OP_PUSH, request_id=1, job="j")
    push.blocks.append(dp.BlockRef(tensor="w", index=0, dest_region=1, zero=True))
    with pytest.raises(FrameError, match="destination region"):
        frame.validate_header(push)
    reply = frame.FrameHeader(op=dp.OP_PULL, request_id=1, job="j")
    reply.blocks.append(dp.BlockRef(tensor="w", index=0, dtype=dp.FLOAT32, numel=4, nbytes=16, placed=True))
    with pytest.raises(FrameError, match="placed"):
        frame.validate_header(reply)


def test_a_large_placement_shared_with_the_helper_thread_lands_whole(monkeypatch):
    from shardline.ps_server import node as node_module

    monkeypatch.setattr(node_module, "PARALLEL_PLACE_BYTES", 0)   # every pull of two pieces or more is shared
    monkeypatch.setattr(node_module, "COPY_PIECE_BYTES", 1)       # a piece per block
    served, region = ServedOverShm(), shm.SharedRegion(2 * BLOCK * 4)
    try:
        init = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(2))
        served.init(init)
        served.client.share_region(region)
        for request_id in range(2, 12):
            region.tensor(torch.float32, 0, 2 * BLOCK).zero_()
            reply, _ = served.ask(pull(request_id, {0: (region.id, 0), 1: (region.id, BLOCK * 4)}))
            assert reply.op == dp.OP_REPLY and reply.payload_bytes == 0 and all(r.placed for r in reply.blocks)
            assert torch.equal(region.tensor(torch.float32, 0, 2 * BLOCK), init)
        assert served.node._place_pool is not None
    finally:
        served.close()
        region.close()


def test_copies_are_cut_into_pieces_in_order():
    from shardline.ps_server.node import COPY_PIECE_BYTES, _pieces

    mib = COPY_PIECE_BYTES
    sizes = {"a": mib // 2, "b": mib // 2, "c": 3 * mib, "d": mib // 4, "e": 0}
    assert _pieces(list(sizes), sizes.__getitem__) == ([["a", "b"], ["c"], ["d", "e"]], False)
    assert _pieces([], sizes.__getitem__) == ([], False)
    # large: two pieces or more, PARALLEL_PLACE_BYTES in all
    assert _pieces(["x", "y"], lambda item: 4 * mib) == ([["x"], ["y"]], True)
    assert _pieces(["x"], lambda item: 9 * mib) == ([["x"]], False)


def test_the_two_copy_threads_take_pieces_in_turn_and_stop_after_the_first_bad_one():
    """PSNode._share: each piece is done once, by whichever thread is free (both take part when the
    pieces take a while); once a piece reports a value no new one starts, and every piece before
    the least reported one was done (a push's first bad block is found)."""
    node = PSNode("n1", lambda name: None, lambda: common_pb2.RoutingTable(epoch=1))
    done, lock = {}, threading.Lock()

    def work(piece, bad=()):
        time.sleep(0.005)
        with lock:
            done[piece] = threading.current_thread().name
        return piece if piece in bad else None

    assert node._share(work, list(range(20))) == []
    assert sorted(done) == list(range(20))
    assert len(set(done.values())) == 2, done   # this thread and the helper
    for bad in ((7,), (3, 4, 12), (0,), (19,)):
        done.clear()
        found = node._share(lambda piece: work(piece, bad), list(range(20)))
        assert min(found) == bad[0] and set(range(bad[0] + 1)) <= set(done), (bad, found, sorted(done))
        # no new piece once it is known: the other thread's piece under way, and perhaps one it took
        # while the value was being recorded
        assert len(done) <= bad[0] + 3, (bad, sorted(done))


def test_with_the_helper_busy_this_thread_does_every_piece():
    node = PSNode("n1", lambda name: None, lambda: common_pb2.RoutingTable(epoch=1))
    node._share(lambda piece: None, [1, 2])   # starts the helper pool
    release = threading.Event()
    busy = node._place_pool.submit(release.wait, 10)
    try:
        names = []
        assert node._share(lambda piece: names.append(threading.current_thread().name), list(range(5))) == []
        assert names == [threading.current_thread().name] * 5
    finally:
        release.set()
        busy.result()


# --- the client's caches ---------------------------------------------------------------------------
@pytest.fixture
def shm_client(offline_client, monkeypatch):
    """``shm_client(spec)``: an offline Client whose transport is ``auto`` (shm for local nodes)."""
    import shardline.worker.client as client_module

    real_load = client_module.Client._load_spec

    def load_with_shm(self, spec, uid=""):
        self._transport = shm.Transport(auto=True)
        return real_load(self, spec, uid)
    monkeypatch.setattr(client_module.Client, "_load_spec", load_with_shm)
    return offline_client


def test_caches_live_in_one_shared_region_and_bind_keeps_or_drops_it(shm_client):
    s = spec()
    s.tensors.add(name="b", shape=[3], dtype="float32", trainable=True)
    client = shm_client(s)
    region, offset_b = client._shm.placement["b"]
    assert client._shm.placement["w"][0] is region and client._shm.placement["w"][1] == 0
    assert offset_b == 2 * BLOCK * 4 and offset_b % 64 == 0   # each tensor on a cache line
    shared = client.shared_cache("w")
    assert shared.shape == (2 * BLOCK,) and shared.data_ptr() == client._values["w"].data_ptr()
    client._versions[("w", 0)] = 3
    client.bind("w", shared, same_contents=True)          # its own shared cache: stays shared
    assert client.shared_cache("w") is not None and client._versions[("w", 0)] == 3
    own = torch.zeros(3)
    client.bind("b", own)                                  # the caller's memory: pulled through the ring
    assert client.shared_cache("b") is None and client._values["b"].data_ptr() == own.data_ptr()


def test_without_memfds_the_caches_are_ordinary_memory(shm_client, monkeypatch):
    def refused(size):
        raise OSError(38, "Function not implemented")
    monkeypatch.setattr(shm, "SharedRegion", refused)
    client = shm_client(spec())
    assert client.shared_cache("w") is None and not client._shm.placement
    assert client._values["w"].shape == (2 * BLOCK,) and not client._values["w"].any()


def test_a_node_given_up_on_mid_pull_cannot_write_into_the_cache_later(shm_client, monkeypatch):
    """The node takes the pull, stalls (SIGSTOP, swapping), the client gives up after its I/O
    timeout and moves on; when the node resumes it copies its stale blocks where the pull asked.
    The caches moved to fresh memory meanwhile: they keep their values, the late write goes
    nowhere, and the pull's blocks are pulled whole next time."""
    import itertools
    import types

    import shardline.worker.client as client_module
    from shardline.services.errors import ShardlineConnectionError

    monkeypatch.setattr(client_module, "IO_TIMEOUT_SECONDS", 0.3)
    client = shm_client(spec())
    client._request_ids, client.incarnation, client._commit_follows, client.lr = itertools.count(1), "i", False, None
    client._pulling_at_step = False
    client._reads, client.stats, client._oldest = types.SimpleNamespace(rack=None), client_module.TransferStats(), {}
    client._conns, client.routing.data_address = {}, lambda node: "x:2"
    cache = client.shared_cache("w")
    held = torch.arange(2 * BLOCK, dtype=torch.float32)
    cache.copy_(held)
    client._versions = {("w", 0): 3, ("w", 1): 3}
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine, node_end = shm.ShmConnection(a), shm.ShmConnection(b)
    client._conns["n1"] = types.SimpleNamespace(sock=mine, lock=threading.Lock(), address="x:2", close=mine.close)
    taken = {}

    def stalled_node():
        node_end.settimeout(5)
        taken["pull"] = frame.recv_header(node_end)   # ... and no answer
    node = threading.Thread(target=stalled_node, daemon=True)
    node.start()
    with pytest.raises(ShardlineConnectionError):
        client._exchange_once("n1", [("w", 0), ("w", 1)], dp.OP_PULL, 0, 1.0, None, 0, 0.0)
    node.join(5)
    refs = taken["pull"].blocks
    assert [bool(r.dest_region) for r in refs] == [True, True]
    for ref in refs:   # the node resumes
        node_end.place(ref.dest_region, ref.dest_offset, torch.full((BLOCK,), -7.0))
    assert torch.equal(cache, held) and client.shared_cache("w").data_ptr() == cache.data_ptr()
    assert not client._versions and not client._shm.revoke_pending
    node_end.close()
    client._shm.cache_regions[0].close()
