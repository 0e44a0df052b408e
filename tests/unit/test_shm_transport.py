"""The shm transport over socketpairs and forks: framing, ring wrap-around, a peer that lies about
offsets, lengths, credits or its segment, and cleanup when a side closes or dies."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import threading
import time

import pytest
import torch

from shardline.services import frame
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError
from shardline.services.transport import get_transport, shm, tcp
from shardline.services.transport.shm import MESSAGE, ShmConnection, ShmProtocolError

pytestmark = pytest.mark.timeout(60)
RING = 4 * shm.MIN_RING_BYTES  # sends of more than shm.INLINE_MAX_BYTES go through it


def shm_mappings(pid: int | str = "self") -> int:
    """Mappings of shm segments (ours or a peer's) in process ``pid``."""
    with open(f"/proc/{pid}/maps") as fh:
        return sum("memfd:shardline-shm" in line for line in fh)


def pair(ring: int = RING) -> tuple[ShmConnection, ShmConnection]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return ShmConnection(a, ring_bytes=ring), ShmConnection(b, ring_bytes=ring)


def in_thread(fn, *args):
    errors: list[BaseException] = []

    def run():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join()
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join():
        t.join(30)
        assert not t.is_alive(), "sender did not finish"
        if errors:
            raise errors[0]
    return join


def test_frames_with_payloads_larger_than_the_ring_arrive_intact():
    a, b = pair()
    try:
        # odd sizes: chunks end at every offset of the ring, so writes wrap around it
        tensors = [torch.randn(n) for n in (3 * RING // 4 + 7, 1, 5 * RING // 4 + 3, 17_000 * 13)]
        header = frame.FrameHeader(op=frame.Op.OP_PUSH, job="j")
        for i, t in enumerate(tensors):
            header.blocks.append(frame.block_ref("w", i, t))
        join = in_thread(frame.send_frame, a, header, [frame.tensor_bytes(t) for t in tensors])
        got = frame.recv_header(b)
        assert got.payload_bytes == sum(t.numel() * 4 for t in tensors) and len(got.blocks) == 4
        for ref, t in zip(got.blocks, tensors):
            out = torch.empty(ref.numel)
            frame.recv_exactly_into(b, frame.tensor_bytes(out))
            assert torch.equal(out, t)
        join()
        # the reply the other way, small (inline) then large (the other direction's ring)
        b.sendall(b"ok")
        buf = bytearray(2)
        assert a.recv_into(buf) == 2 and buf == b"ok"
        big = torch.arange(RING, dtype=torch.float32)
        join = in_thread(b.sendall, frame.tensor_bytes(big))
        out = torch.empty_like(big)
        frame.recv_exactly_into(a, frame.tensor_bytes(out))
        join()
        assert torch.equal(out, big)
        assert shm_mappings() == 4  # each side: its own ring and its peer's, reused across frames
    finally:
        a.close()
        b.close()
    assert shm_mappings() == 0


def test_ring_and_region_copies_use_the_copy_that_lets_other_threads_run(monkeypatch):
    """With the C module built (make test builds it), the ring's and the regions' plain copies go
    through its copy, which releases the GIL for large ones: a node's threads placing two ranks'
    pulls copy at once. Every such copy of this frame goes through it."""
    from shardline.services import _copycheck

    assert shm._copy is _copycheck.copy
    sizes = []

    def counted(dst, src):
        sizes.append(len(dst))
        _copycheck.copy(dst, src)

    monkeypatch.setattr(shm, "_copy", counted)
    a, b = pair()
    try:
        big = torch.arange(RING // 2, dtype=torch.float32)   # through the ring, not inline
        join = in_thread(a.sendall, frame.tensor_bytes(big))
        out = torch.empty_like(big)
        frame.recv_exactly_into(b, frame.tensor_bytes(out))
        join()
        assert torch.equal(out, big) and sum(sizes) == 2 * big.numel() * 4   # into the ring and out of it
    finally:
        a.close()
        b.close()


def test_a_frames_blocks_share_doorbells_and_arrive_intact(monkeypatch):
    """send_frame hands a frame's blocks to sendall_many: consecutive blocks are announced together
    (chunks of up to CHUNK_BYTES that never cross the ring's end), yet each block arrives intact."""
    monkeypatch.setattr(shm, "CHUNK_BYTES", 3 * shm.INLINE_MAX_BYTES)
    kinds: list[int] = []
    pump = ShmConnection._pump

    def counting_pump(self):
        alive = pump(self)
        if self is b and alive:
            kinds.append(MESSAGE.unpack(self._message)[0])
        return alive

    monkeypatch.setattr(ShmConnection, "_pump", counting_pump)
    a, b = pair(ring=32 * shm.MIN_RING_BYTES)  # 2 MiB: the two frames wrap it once
    try:
        # 12 blocks just over the inline limit (each would be a doorbell of its own), about three
        # to a chunk
        blocks = [torch.full(((shm.INLINE_MAX_BYTES + 64) // 4,), float(i)) for i in range(12)]
        header = frame.FrameHeader(op=frame.Op.OP_PUSH, job="j")
        for i, t in enumerate(blocks):
            header.blocks.append(frame.block_ref("w", i, t))
        for _ in range(2):  # twice: the second frame starts mid-ring
            join = in_thread(frame.send_frame, a, header, [frame.tensor_bytes(t) for t in blocks])
            assert frame.recv_header(b).payload_bytes == sum(t.numel() * 4 for t in blocks)
            for t in blocks:
                out = torch.empty_like(t)
                frame.recv_exactly_into(b, frame.tensor_bytes(out))
                assert torch.equal(out, t)
            join()
        chunks = kinds.count(shm.CHUNK)
        assert chunks <= 24 // 2, f"{chunks} doorbells for 24 blocks"
    finally:
        a.close()
        b.close()


def test_end_of_stream_reads_zero_and_timeouts_raise():
    a, b = pair()
    a.settimeout(0.2)
    with pytest.raises(TimeoutError):
        a.recv_into(bytearray(4))
    b.close()
    assert a.recv_into(bytearray(4)) == 0
    a.close()


def test_pending_credits_are_not_mistaken_for_a_frame():
    a, b = pair()
    try:
        join = in_thread(a.sendall, bytes(RING // 2))
        frame.recv_exactly_into(b, memoryview(bytearray(RING // 2)))
        join()
        # a now has a CREDIT queued on its socket: not a frame
        assert a.wait_readable(0.2) is False
        b.sendall(b"x")
        assert a.wait_readable(1.0) is True and a.recv_into(bytearray(1)) == 1
    finally:
        a.close()
        b.close()


# --- a peer that lies ---------------------------------------------------------------------------
def sealed_memfd(size: int, seal: bool = True) -> int:
    fd = os.memfd_create("shardline-shm", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def send_segment(raw: socket.socket, size: int, fd: int, announced: int | None = None) -> None:
    socket.send_fds(raw, [MESSAGE.pack(shm.SEGMENT, 0, size if announced is None else announced)], [fd])
    os.close(fd)


@pytest.mark.parametrize("lie", [
    "chunk before any segment", "chunk past the end", "chunk not where the last ended", "window overrun",
    "zero-length chunk", "credit never owed", "inline too large", "unknown kind", "unsealed segment",
    "segment size differs from the file", "second segment", "fd with a chunk"])
def test_a_lying_peer_is_refused_and_nothing_is_read_outside_the_segment(lie):
    before = len(os.listdir("/proc/self/fd"))
    raw, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ShmConnection(mine, ring_bytes=RING)
    try:
        if lie not in ("chunk before any segment", "fd with a chunk"):
            send_segment(raw, RING, sealed_memfd(RING, seal=lie != "unsealed segment"),
                         announced=RING * 2 if lie == "segment size differs from the file" else None)
        messages = {
            "chunk before any segment": [(shm.CHUNK, 16, 0)],
            "chunk past the end": [(shm.CHUNK, 32, RING - 16)],
            "chunk not where the last ended": [(shm.CHUNK, 16, 0), (shm.CHUNK, 16, 64)],
            "window overrun": [(shm.CHUNK, RING, 0), (shm.CHUNK, 1, 0)],
            "zero-length chunk": [(shm.CHUNK, 0, 0)],
            "credit never owed": [(shm.CREDIT, 1, 0)],
            "inline too large": [(shm.INLINE, shm.INLINE_MAX_BYTES + 1, 0)],
            "unknown kind": [(99, 0, 0)],
            "unsealed segment": [],
            "segment size differs from the file": [],
            "second segment": [],
            "fd with a chunk": [],
        }[lie]
        for kind, length, offset in messages:
            raw.sendall(MESSAGE.pack(kind, length, offset))
        if lie == "second segment":
            send_segment(raw, RING, sealed_memfd(RING))
        if lie == "fd with a chunk":
            fd = sealed_memfd(RING)
            socket.send_fds(raw, [MESSAGE.pack(shm.CHUNK, 16, 0)], [fd])
            os.close(fd)
        conn.settimeout(5)
        got = 0
        with pytest.raises(ShmProtocolError):
            for _ in range(8):
                if lie == "window overrun":  # a side queues the peer's chunks while it waits for credit
                    conn.sendall(bytes(2 * RING))
                elif lie == "unknown kind":  # met between frames (the PS loop's wait): the next read raises it
                    assert conn.wait_readable(5)
                    conn.recv_into(bytearray(RING))
                else:
                    got += conn.recv_into(bytearray(RING))
        assert got == (16 if lie == "chunk not where the last ended" else 0)  # only what was legitimately sent
    finally:
        conn.close()
        raw.close()
    assert shm_mappings() == 0
    assert len(os.listdir("/proc/self/fd")) == before  # fds that came with a lie are closed


def test_inline_bytes_buffered_while_waiting_for_credit_are_bounded():
    raw, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ShmConnection(mine, ring_bytes=RING)
    chunk = MESSAGE.pack(shm.INLINE, shm.INLINE_MAX_BYTES, 0) + bytes(shm.INLINE_MAX_BYTES)
    stop = threading.Event()

    def flood():
        try:
            while not stop.is_set():
                raw.sendall(chunk)
        except OSError:
            pass

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        with pytest.raises(ShmProtocolError, match="already buffered"):
            conn.sendall(bytes(2 * RING))  # the ring fills; it waits for credit that never comes
    finally:
        stop.set()
        conn.close()
        raw.close()
        t.join(5)


# --- a peer that dies ---------------------------------------------------------------------------
@pytest.mark.parametrize("victim", ["sender", "receiver"])
def test_a_killed_peer_ends_the_connection_and_its_segments_are_released(victim):
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a peer that maps both rings, then stalls until it is killed
        try:
            parent_end.close()
            conn = ShmConnection(child_end, ring_bytes=RING)
            if victim == "sender":
                conn.sendall(bytes(RING // 2))  # its ring, mapped by the parent
                conn.recv_into(bytearray(RING // 2))  # maps the parent's ring too
                os.write(ready_w, b"1")
                conn.sendall(bytes(4 * RING))  # dies mid-payload
            else:
                conn.recv_into(bytearray(1))
                os.write(ready_w, b"1")
                threading.Event().wait()
        finally:
            os._exit(0)
    child_end.close()
    os.close(ready_w)
    conn = ShmConnection(parent_end, ring_bytes=RING)
    try:
        if victim == "sender":
            frame.recv_exactly_into(conn, memoryview(bytearray(RING // 2)))
            conn.sendall(bytes(RING // 2))
            assert os.read(ready_r, 1) == b"1"
            assert shm_mappings(pid) == 2
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ConnectionError):
                frame.recv_exactly_into(conn, memoryview(bytearray(4 * RING)))
        else:
            join = in_thread(conn.sendall, bytes(8 * RING))  # blocks for credit once the ring is full
            assert os.read(ready_r, 1) == b"1"
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ConnectionError):
                join()
    finally:
        os.waitpid(pid, 0)
        os.close(ready_r)
        conn.close()
    assert shm_mappings() == 0
    assert not [n for n in os.listdir("/dev/shm") if "shardline" in n]


# --- choosing the transport ---------------------------------------------------------------------
def test_explicit_shm_to_a_remote_peer_is_a_config_error():
    with pytest.raises(ShardlineConfigError, match="'192.0.2.1:7100' is not a local address"):
        get_transport("shm").connect("192.0.2.1:7100", 1.0)
    assert shm.is_local_host("127.0.0.1") and shm.is_local_host("localhost")
    assert not shm.is_local_host("192.0.2.1") and not shm.is_local_host("0.0.0.0")


def test_without_sealed_memfds_auto_uses_tcp_and_shm_is_a_config_error(monkeypatch):
    monkeypatch.setattr(shm, "shm_supported", lambda: (False, "memfd_create is not available (sandbox)"))
    plain = tcp.listen("127.0.0.1", 0, lambda sock, peer: None)
    listener = get_transport("auto").listen("127.0.0.1", 0, lambda sock, peer: None)
    try:
        assert not listener.shm_endpoint  # the PS offers no endpoint: local peers use its TCP
        assert isinstance(get_transport("auto").connect(plain.address, 5.0), socket.socket)
        with pytest.raises(ShardlineConfigError, match="memfd_create is not available"):
            get_transport("shm").connect(plain.address, 5.0)
    finally:
        listener.close()
        plain.close()


def test_bad_ring_size_is_a_config_error_quoting_it():
    with pytest.raises(ShardlineConfigError, match="got 1024"):
        get_transport("auto", shm_ring_bytes=1024)


def test_auto_picks_shm_for_a_local_listener_and_tcp_otherwise(monkeypatch):
    def echo(sock, peer):
        buf = bytearray(RING * 2)
        frame.recv_exactly_into(sock, memoryview(buf))
        sock.sendall(buf)
        sock.recv_into(bytearray(1))  # hold the connection (and its slot) until the peer closes it

    assert shm.shm_supported() == (True, "")  # this host has sealed memfds: shm must be used, not skipped
    auto = get_transport("auto")
    listener = auto.listen("127.0.0.1", 0, echo, max_connections=1,
                           refuse=lambda sock, peer: sock.sendall(b"full"))
    try:
        assert listener.shm_endpoint
        conn = auto.connect(listener.address, 5.0)
        assert isinstance(conn, ShmConnection)
        data = os.urandom(RING * 2)
        conn.sendall(data)
        out = bytearray(len(data))
        frame.recv_exactly_into(conn, memoryview(out))
        assert out == data
        # one connection limit for both: a TCP peer is turned away meanwhile
        second = tcp.connect(listener.address, 5.0)
        assert second.recv(4) == b"full"
        second.close()
        conn.close()
        # a local address without a shm endpoint (a TCP-only PS): TCP
        plain = tcp.listen("127.0.0.1", 0, lambda sock, peer: None)
        try:
            assert isinstance(auto.connect(plain.address, 5.0), socket.socket)
            with pytest.raises(ShardlineConnectionError):  # explicit shm: no fallback
                get_transport("shm").connect(plain.address, 5.0)
        finally:
            plain.close()
        # a remote address: TCP without trying shm
        calls = []
        monkeypatch.setattr(tcp, "connect", lambda address, timeout: calls.append(address) or "tcp")
        assert auto.connect("192.0.2.1:7100", 1.0) == "tcp" and calls == ["192.0.2.1:7100"]
    finally:
        listener.close()


def test_the_hello_challenge_runs_over_shm_and_the_node_maps_nothing_of_its_own_before_it():
    from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
    from shardline.services.dataplane_client import DataPlaneConnection
    from shardline.services.pb import dataplane_pb2 as dp

    token = b"t" * 32
    policy = ConnectionPolicy(cluster_token=token)

    def serve(sock, peer):  # the node is never reached: these peers send no frame past the handshake
        serve_connection(sock, peer, None, policy)

    listener = get_transport("shm").listen("127.0.0.1", 0, serve)
    try:
        conn = DataPlaneConnection(listener.address, get_transport("shm"), 5.0, token)  # HELLO, nonce, proof
        assert isinstance(conn.sock, ShmConnection)
        conn.close()
        with pytest.raises(Exception, match="UNAUTHENTICATED|wrong cluster token"):
            DataPlaneConnection(listener.address, get_transport("shm"), 5.0, b"w" * 32)
        # before proving the token a peer gets no payload in: a large HELLO is refused, and the node
        # never created a segment of its own for it (its replies are small)
        raw = get_transport("shm").connect(listener.address, 5.0)
        try:
            frame.send_frame(raw, frame.FrameHeader(op=dp.OP_HELLO), [bytes(2 * RING)])
        except BrokenPipeError:
            pass  # refused on its header, while the payload was still going out
        reply = frame.recv_header(raw)
        assert reply.op == dp.OP_ERROR and reply.code == dp.UNAUTHENTICATED, reply
        assert raw._rx is None
        raw.close()
    finally:
        listener.close()


# --- regions: memory the peer writes into (one-copy pulls) ----------------------------------------
def share_with_node(client, node, region) -> None:
    """Share ``region`` on the connection; the node takes it on its way to the next frame bytes."""
    client.share_region(region)
    client.sendall(b"x")
    node.settimeout(5)
    assert node.recv_into(bytearray(1)) == 1


def test_a_shared_region_takes_the_peers_copies_in_place_and_is_shared_once():
    client, node = pair()
    region = shm.SharedRegion(4096)
    try:
        cache = region.tensor(torch.float32, 0, 1024)
        client.share_region(region)
        share_with_node(client, node, region)   # the second share sends nothing: once per connection
        assert node.region_size(region.id) == 4096 and node.region_size(region.id + 1) == 0
        value = torch.arange(16, dtype=torch.float32)
        node.place(region.id, 64, value)
        assert torch.equal(cache[16:32], value) and not cache[:16].any() and not cache[32:].any()
        with pytest.raises(ValueError, match="do not fit"):
            node.place(region.id, 4096 - 32, value)
        with pytest.raises(ValueError, match="aligned"):
            node.place(region.id, 2, value)
        assert not cache[32:].any()
    finally:
        client.close()
        node.close()
        region.close()
    assert shm_mappings_of("region") == 1   # the node's mapping went with its connection; ours lives in `cache`
    del cache


@pytest.mark.parametrize("stream", [False, True])
def test_place_many_copies_every_block_or_none_if_one_does_not_fit(stream):
    client, node = pair()
    region = shm.SharedRegion(4096)
    try:
        cache = region.tensor(torch.float32, 0, 1024)
        share_with_node(client, node, region)
        blocks = [torch.full((n,), float(i + 1)) for i, n in enumerate((3, 0, 16, 1))]
        offsets = [0, 12, 12, 4092]
        node.place_many([(region.id, o, v) for o, v in zip(offsets, blocks)], stream=stream)
        assert torch.equal(cache[:3], blocks[0]) and torch.equal(cache[3:19], blocks[2])
        assert float(cache[1023]) == 4.0 and not cache[19:1023].any()
        with pytest.raises(ValueError, match="do not fit"):   # checked before anything moves
            node.place_many([(region.id, 400, torch.full((4,), 9.0)), (region.id, 4090, torch.ones(4))], stream=stream)
        assert not cache[100:104].any()
        with pytest.raises(OSError):
            node.place_many([(region.id + 1, 0, torch.ones(1))])
    finally:
        client.close()
        node.close()
        region.close()
    del cache


@pytest.mark.parametrize("stream", [False, True])
def test_placed_and_taken_blocks_keep_their_exact_bytes_in_every_wire_dtype(stream):
    client, node = pair()
    region = shm.SharedRegion(8192)
    try:
        share_with_node(client, node, region)
        g = torch.Generator().manual_seed(3)
        values = [torch.randn(5, 3, generator=g),                       # a 2-D block: its bytes in order
                  torch.randn(7, generator=g).to(torch.bfloat16),       # no numpy type of its own
                  torch.randn(9, generator=g).to(torch.float16),
                  torch.tensor([float("nan"), -0.0, float("inf")])]     # bytes, not values: NaN stays NaN
        offsets = [0, 64, 80, 104]
        node.place_many([(region.id, o, v) for o, v in zip(offsets, values)], stream=stream)
        for o, v in zip(offsets, values):
            placed = region.tensor(v.dtype, o, v.numel())
            assert torch.equal(placed.view(torch.uint8), v.reshape(-1).view(torch.uint8))
        taken = [torch.empty_like(v) for v in values]
        assert node.take_many([(region.id, o, t) for o, t in zip(offsets, taken)]) is None
        assert all(torch.equal(t.view(torch.uint8), v.view(torch.uint8)) for t, v in zip(taken, values))
        strided = torch.zeros(6, 2)[:, 0]   # not one span of bytes: refused before anything moves
        with pytest.raises(ValueError, match="contiguous"):
            node.take_many([(region.id, 0, taken[2]), (region.id, 0, strided)])
        with pytest.raises(ValueError, match="contiguous"):
            node.place_many([(region.id, 0, strided)])
        assert not strided.any() and torch.equal(region.tensor(torch.float32, 0, 15), values[0].reshape(-1))
        del placed   # our own view of the region
    finally:
        client.close()
        node.close()
        region.close()
    assert shm_mappings_of("region") == 1   # the node's went with its connection (no byte view outlived a copy)


@pytest.mark.parametrize("lie", ["unsealed", "size differs from the file", "id 0", "same id twice", "too many",
                                 "no fd", "two fds"])
def test_a_lying_region_is_refused_and_leaves_no_fd_or_mapping(lie, monkeypatch):
    monkeypatch.setattr(shm, "MAX_PEER_REGIONS", 1)
    before = len(os.listdir("/proc/self/fd"))
    raw, mine = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = ShmConnection(mine, ring_bytes=RING)

    def send_region(region_id: int, size: int, fds) -> None:
        raw.sendall(MESSAGE.pack(shm.REGION, region_id, size))
        if fds:
            socket.send_fds(raw, [b"\0"], fds)
        else:
            raw.sendall(b"\0")
        for fd in fds:
            os.close(fd)

    try:
        if lie in ("same id twice", "too many"):
            send_region(7, 4096, [sealed_memfd(4096)])
        region_id = {"id 0": 0, "too many": 8}.get(lie, 7)
        fds = {"no fd": lambda: [], "two fds": lambda: [sealed_memfd(4096), sealed_memfd(4096)],
               "unsealed": lambda: [sealed_memfd(4096, seal=False)]}.get(lie, lambda: [sealed_memfd(4096)])()
        send_region(region_id, 8192 if lie == "size differs from the file" else 4096, fds)
        conn.settimeout(5)
        with pytest.raises(ShmProtocolError):
            for _ in range(4):
                conn.recv_into(bytearray(16))
    finally:
        conn.close()
        raw.close()
    assert shm_mappings() == 0
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_close_during_a_copy_into_a_region_unmaps_only_after_it():
    client, node = pair()
    region = shm.SharedRegion(4096)
    try:
        share_with_node(client, node, region)
        started, release = threading.Event(), threading.Event()

        class SlowValue:   # a tensor whose bytes take until `release` to arrive
            dtype = torch.float32

            def numel(self):
                return 16

            def element_size(self):
                return 4

            def is_contiguous(self):
                return True

            def view(self, *_):
                started.set()
                assert release.wait(10)
                return torch.ones(16)

            def numpy(self):   # the byte copy's way to the bytes
                return self.view().numpy()

        join = in_thread(node.place, region.id, 0, SlowValue())
        assert started.wait(10)
        node.close()
        assert shm_mappings_of("region") == 2   # ours and the node's, still mapped under the copy
        release.set()
        join()
        assert shm_mappings_of("region") == 1 and torch.equal(region.tensor(torch.float32, 0, 16), torch.ones(16))
    finally:
        client.close()
        node.close()
        region.close()


def shm_mappings_of(kind: str) -> int:
    with open("/proc/self/maps") as fh:
        return sum(f"memfd:shardline-{kind}" in line for line in fh)


def test_a_revoked_region_keeps_its_contents_and_the_peer_unmaps_the_old_memory():
    client, node = pair()
    region = shm.SharedRegion(4096)
    try:
        cache = region.tensor(torch.float32, 0, 1024)
        cache.copy_(torch.arange(1024, dtype=torch.float32))
        share_with_node(client, node, region)
        old = region.revoke()
        assert region.id != old and torch.equal(cache, torch.arange(1024, dtype=torch.float32))
        node.place(old, 0, torch.full((16,), -1.0))   # into the old memory: nobody reads it
        assert cache[0] == 0
        client.unshare_region(old)
        client.share_region(region)                    # the new memory, under its new id
        client.sendall(b"y")
        assert node.recv_into(bytearray(1)) == 1
        assert node.region_size(old) == 0 and node.region_size(region.id) == 4096
        assert shm_mappings_of("region") == 2   # ours and the node's, both of the new memory
        node.place(region.id, 0, torch.full((16,), 5.0))
        assert torch.equal(cache[:16], torch.full((16,), 5.0))
    finally:
        client.close()
        node.close()
        region.close()


def test_a_float32_block_through_the_ring_is_checked_as_it_is_copied_cut_values_included():
    """frame.recv_checked_into over shm: the bytes arrive exactly, and a NaN anywhere is found:
    in a value wholly inside one copy (checked in the copy out of the ring), or in a value a copy
    cut in two (an inline item's end, a ring wrap), checked in the receiver's copy once whole."""
    from shardline.services import frame

    client, node = pair()
    cuts_seen = []

    class Recording:  # the node's connection, recording where its copies cut values
        def settimeout(self, t):
            node.settimeout(t)

        def recv_checked_into(self, *args):
            got, finite, cuts = node.recv_checked_into(*args)
            cuts_seen.extend(cuts)
            return got, finite, cuts

    values = torch.arange(1.0, 40_001.0)
    try:
        for bad in (None, 0, 1, 2, 20_000, 39_999, None, 1):
            data = bytearray(values.numpy().tobytes())
            if bad is not None:
                data[4 * bad:4 * bad + 4] = torch.tensor([float("nan")]).numpy().tobytes()
            # 5 bytes inline, the rest through the ring: value 1 is cut; the ring's offset moves on
            # by a length that is not a multiple of 4, so later wraps cut values too
            join = in_thread(lambda: (client.sendall(data[:5]), client.sendall(data[5:])))
            got = bytearray(len(data))
            finite = frame.recv_checked_into(Recording(), memoryview(got), time.monotonic() + 10)
            join()
            assert got == data
            assert finite is (bad is None), bad
        assert any(c % 4 for c in cuts_seen) and len(set(cuts_seen)) > 1   # values were cut, in several places
    finally:
        client.close()
        node.close()
