"""The rack cache's logic (rack_cache/cache.py) against a fake PS node whose job keeps stepping:
version correctness under concurrent writes, miss coalescing, the byte bound; subscriber pulls:
the node's checksums forwarded, deltas applied and checked, a corrupted entry caught by the reader."""

import random
import threading
import time

import pytest
import torch

from shardline.rack_cache.cache import BlockCache, Fetched, Want
from shardline.services.errors import ShardlineConfigError, ShardlineTimeoutError

F32 = 1  # dataplane FLOAT32


class FakeNode:
    """A PS node's pull semantics: wait for min_step, then blocks newer than the version named,
    all from one step (a consistent snapshot). Keeps every block's history to check replies."""

    def __init__(self, blocks: int, size: int = 16):
        self.size = size
        self.step = 0
        self.history = {("w", i): [(0, 0)] for i in range(blocks)}   # key -> [(from step, version)]
        self.cond = threading.Condition()
        self.fetches = []

    def value(self, key, version) -> bytes:
        return f"{key[0]}{key[1]}@{version}".encode().ljust(self.size, b".")

    def version(self, key) -> int:
        return self.history[key][-1][1]

    def version_at(self, key, step) -> int:
        return [v for since, v in self.history[key] if since <= step][-1]

    def advance(self, changed) -> None:
        with self.cond:
            self.step += 1
            for key in changed:
                self.history[key].append((self.step, self.step))
            self.cond.notify_all()

    def fetch(self, job, node, epoch, min_step, asks, timeout):
        self.fetches.append((min_step, [(t, i, have) for t, i, have, _ in asks]))
        with self.cond:
            if not self.cond.wait_for(lambda: self.step >= min_step, timeout):
                raise TimeoutError("step not reached")
            blocks = {}
            for tensor, index, have, _dtype in asks:
                v = self.version((tensor, index))
                if have is None or v > have:
                    blocks[(tensor, index)] = (v, self.value((tensor, index), v))
            return Fetched(self.step, blocks)


def wants(held: dict, keys):
    return [Want(t, i, held.get((t, i)), F32) for t, i in keys]


def test_readers_never_get_a_block_older_than_asked_nor_newer_than_the_step_they_are_told():
    node = FakeNode(blocks=12)
    cache = BlockCache(1 << 20, node.fetch)
    keys = sorted(node.history)
    stop = threading.Event()
    errors = []
    checked = [0]

    def writer():
        rng = random.Random(1)
        while not stop.is_set():
            node.advance(rng.sample(keys, rng.randint(1, 6)))
            time.sleep(0.002)

    def reader(seed):
        rng = random.Random(seed)
        held, values = {}, {}
        try:
            while not stop.is_set():
                group = rng.sample(keys, rng.randint(1, len(keys)))
                with node.cond:
                    now = node.step
                # some wait for the next step (a trainer), some for an old one (a slow subscriber)
                m = rng.choice([now + 1, now, max(0, now - 3), 0])
                try:
                    answer = cache.answer("job", "ps1", 1, m, wants(held, group), timeout=1.0)
                except TimeoutError:
                    assert stop.is_set(), "a pull timed out while the job kept stepping"
                    return  # the writer stopped: the step it waits for never comes
                with node.cond:
                    after = node.step
                assert m <= answer.step <= after, (m, answer.step, after)
                for tensor, index, version, _dtype, data in answer.blocks:
                    assert version > held.get((tensor, index), -1)
                    held[(tensor, index)] = version
                    values[(tensor, index)] = bytes(data)
                for key in group:  # what the reader holds now is exactly the block at answer.step
                    assert held[key] == node.version_at(key, answer.step), (key, held[key], answer.step)
                    assert values[key] == node.value(key, held[key])
                checked[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert checked[0] > 100
    assert cache.stats.hits > 0 and cache.stats.misses > 0


def test_concurrent_misses_of_the_same_blocks_make_one_fetch():
    node = FakeNode(blocks=4)
    release = threading.Event()
    calls = []

    def slow_fetch(*args):
        calls.append(args)
        release.wait(10)
        return node.fetch(*args)

    cache = BlockCache(1 << 20, slow_fetch)
    keys = sorted(node.history)
    answers, errors = [], []

    def reader():
        try:
            answers.append(cache.answer("job", "ps1", 1, 1, wants({}, keys), timeout=5.0))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while cache.stats.misses + cache.stats.coalesced < 8 * len(keys) and time.monotonic() < deadline:
        time.sleep(0.01)
    node.advance(keys)  # the step the readers wait for
    release.set()
    for t in threads:
        t.join(10)
    assert not errors, errors
    assert len(calls) == 1, f"{len(calls)} fetches for 8 concurrent misses"
    assert cache.stats.coalesced == 7 * len(keys) and cache.stats.misses == len(keys)
    for a in answers:
        assert a.step == 1 and sorted((t, i, v) for t, i, v, _, _ in a.blocks) == [("w", i, 1) for i in range(4)]
    # the next reader of the same step is served from memory
    before = len(calls)
    assert len(cache.answer("job", "ps1", 1, 1, wants({}, keys), timeout=1.0).blocks) == 4
    assert len(calls) == before


def test_a_fetch_names_the_versions_held_and_a_new_epoch_learns_blocks_again_as_a_delta():
    node = FakeNode(blocks=3)
    cache = BlockCache(1 << 20, node.fetch)
    keys = sorted(node.history)
    cache.answer("job", "ps1", 1, 0, wants({}, keys), timeout=1.0)
    node.advance([("w", 0)])
    a = cache.answer("job", "ps1", 1, 1, wants({}, keys), timeout=1.0)
    assert node.fetches[-1] == (1, [("w", 0, 0), ("w", 1, 0), ("w", 2, 0)])
    assert a.step == 1 and len(a.blocks) == 3
    assert cache.stats.bytes_fetched == 4 * node.size     # 3 blocks at first, then only w[0]
    # a routing change (epoch 2): the entries are learned again from the node, naming their versions
    a = cache.answer("job", "ps1", 2, 1, wants({k: node.version(k) for k in keys}, keys), timeout=1.0)
    assert a.blocks == [] and node.fetches[-1] == (1, [("w", 0, 1), ("w", 1, 0), ("w", 2, 0)])
    # min_step 0 (where is the job?) always asks the node
    n = len(node.fetches)
    cache.answer("job", "ps1", 2, 0, wants({}, keys), timeout=1.0)
    assert len(node.fetches) == n + 1


def test_resident_bytes_stay_within_the_bound_least_recently_used_first():
    node = FakeNode(blocks=6, size=100)
    cache = BlockCache(350, node.fetch)
    for i in range(6):
        cache.answer("job", "ps1", 1, 0, [Want("w", i, None, F32)], timeout=1.0)
        assert cache.resident_bytes <= 350
    assert len(cache) == 3 and cache.stats.evictions == 3
    cache.answer("job", "ps1", 1, 0, [Want("w", 3, None, F32)], timeout=1.0)   # w3 used again
    cache.answer("job", "ps1", 1, 0, [Want("w", 0, None, F32)], timeout=1.0)   # evicts w4, not w3
    n = len(node.fetches)
    cache.answer("job", "ps1", 1, 0 + 0, [Want("w", 3, None, F32)], timeout=1.0)
    assert cache.resident_bytes == 300 and cache.stats.evictions == 4
    # a block bigger than the cache is passed through: answered, not kept
    big = FakeNode(blocks=1, size=400)
    small = BlockCache(350, big.fetch)
    a = small.answer("job", "ps1", 1, 0, [Want("w", 0, None, F32)], timeout=1.0)
    assert len(a.blocks) == 1 and len(a.blocks[0][4]) == 400
    assert len(small) == 0 and small.resident_bytes == 0 and small.stats.passed_through == 1
    assert len(node.fetches) == n + 1


def test_jobs_deleted_or_created_again_lose_their_entries():
    node = FakeNode(blocks=2)
    cache = BlockCache(1 << 20, node.fetch)
    cache.answer("a", "ps1", 1, 0, wants({}, sorted(node.history)), timeout=1.0)
    cache.answer("b", "ps1", 1, 0, wants({}, sorted(node.history)), timeout=1.0)
    assert cache.retain_jobs({"a": "uid-a", "b": "uid-b"}) == []
    assert cache.retain_jobs({"a": "uid-a2"}) == ["a", "b"]      # a recreated, b deleted
    assert len(cache) == 0 and cache.resident_bytes == 0


def test_errors_reach_every_waiter_and_a_stuck_fetch_times_out():
    release = threading.Event()

    def failing(*args):
        release.wait(5)
        raise RuntimeError("node said no")

    cache = BlockCache(1 << 20, failing, fetch_timeout=0.2)
    errors = []

    def reader():
        try:
            cache.answer("job", "ps1", 1, 1, [Want("w", 0, None, F32)], timeout=0.1)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    release.set()
    for t in threads:
        t.join(5)
    assert len(errors) == 2 and all(isinstance(e, RuntimeError) for e in errors)
    stuck = BlockCache(1 << 20, lambda *a: time.sleep(1) or Fetched(1, {("w", 0): (1, b"abcd")}), fetch_timeout=0.2)
    first = threading.Thread(target=stuck.answer, args=("job", "ps1", 1, 1, [Want("w", 0, None, F32)], 0.1))
    first.start()
    time.sleep(0.05)
    with pytest.raises(ShardlineTimeoutError, match="fetch_timeout"):
        stuck.answer("job", "ps1", 1, 1, [Want("w", 0, None, F32)], timeout=0.1)
    first.join(5)


def test_bad_arguments():
    with pytest.raises(ShardlineConfigError, match="0"):
        BlockCache(0, lambda *a: None)
    cache = BlockCache(100, FakeNode(1).fetch)
    with pytest.raises(ShardlineConfigError, match="more than once"):
        cache.answer("job", "ps1", 1, 0, [Want("w", 0, None, F32)] * 2, timeout=1.0)


# --- the registry of the main dispatcher and the worker's read router ---------------------------

def _info(cache_id="c1", rack="r1", incarnation="i1"):
    from shardline.services.pb import common_pb2

    return common_pb2.CacheInfo(cache_id=cache_id, rack=rack, data_address="127.0.0.1:7300", incarnation=incarnation)


def test_a_cache_leaves_the_routing_when_its_lease_runs_out_and_a_restart_replaces_it():
    from shardline.dispatcher.cache_registry import CacheRegistry

    reg = CacheRegistry(lease_seconds=2.0)
    reg.register(_info(), now=0.0)
    assert reg.heartbeat("c1", "i1", now=1.5, hits=3) and [c.hits for c in reg.live(1.5)] == [3]
    assert not reg.heartbeat("c1", "other", now=1.6)          # another process of the cache: register
    assert [c.cache_id for c in reg.live(3.4)] == ["c1"]
    assert reg.live(3.6) == [] and not reg.heartbeat("c1", "i1", now=3.7)   # silent past the lease
    reg.register(_info(incarnation="i2"), now=4.0)               # e.g. with a new leader
    assert [c.incarnation for c in reg.live(4.0)] == ["i2"]
    with pytest.raises(ShardlineConfigError, match="rack"):
        reg.register(_info(rack=""), now=5.0)


def test_the_read_router_picks_its_racks_cache_and_rests_it_after_a_failure(monkeypatch):
    from types import SimpleNamespace

    from shardline.worker.read_router import ReadRouter, default_rack

    now = [0.0]
    routing = SimpleNamespace(caches=(_info("c0", "r0"), _info("c1", "r1")))
    router = ReadRouter("r1", retry_seconds=10.0, clock=lambda: now[0])
    assert router.cache_for(routing).cache_id == "c1"
    assert ReadRouter(None).cache_for(routing) is None and ReadRouter("r9").cache_for(routing) is None
    router.failed(routing.caches[1], OSError("refused"))
    now[0] = 9.9
    assert router.cache_for(routing) is None                    # the PS nodes meanwhile
    now[0] = 10.1
    assert router.cache_for(routing).cache_id == "c1"           # tried again
    monkeypatch.setenv("SHARDLINE_RACK", "r0")
    assert default_rack(None) == "r0" and default_rack("r1") == "r1" and default_rack("") is None


def test_a_pull_never_waits_in_a_fetch_for_a_later_step():
    """A reader ahead (waiting for step 2) must not hold back one that waits for step 1: under BSP
    step 1's reader commits what step 2 needs only after it got its blocks."""
    node = FakeNode(blocks=1)
    cache = BlockCache(1 << 20, node.fetch)
    node.advance([("w", 0)])                                     # the job is at step 1
    ahead = threading.Thread(target=cache.answer, args=("job", "ps1", 1, 2, [Want("w", 0, None, F32)], 5.0))
    ahead.start()
    time.sleep(0.1)                                              # its fetch waits for step 2
    began = time.monotonic()
    a = cache.answer("job", "ps1", 1, 1, [Want("w", 0, None, F32)], timeout=5.0)
    assert a.step == 1 and time.monotonic() - began < 1.0
    node.advance([("w", 0)])
    ahead.join(5)


# --- the cache role's glue (rack_cache/server.py, rack_cache/daemon.py), without a network ---------------------

def _frontend(fetch):
    from shardline.rack_cache.server import CacheFrontend

    frontend = CacheFrontend("cache-r1", 1 << 20, links=None, fetch_routing=lambda: None)
    frontend.cache = BlockCache(1 << 20, fetch)
    return frontend


def test_the_cache_answers_pulls_only_and_checks_them_before_anything_is_fetched():
    from shardline.services.errors import RequestError
    from shardline.services.pb import dataplane_pb2 as dp

    frontend = _frontend(lambda *a: pytest.fail("nothing may be fetched for a refused frame"))
    good = dict(op=dp.OP_PULL, job="j", via_node="ps1", blocks=[dp.BlockRef(tensor="w", index=0)])
    frontend.precheck(dp.FrameHeader(**good))
    for change, fragment in ((dict(op=dp.OP_PUSH), "pulls only"), (dict(payload_bytes=4), "no payload"),
                             (dict(via_node=""), "via_node"), (dict(job="../x"), "invalid job name"),
                             (dict(blocks=[dp.BlockRef(tensor="w"), dp.BlockRef(tensor="w")]), "more than once"),
                             (dict(blocks=[dp.BlockRef(tensor="w", want_dtype=dp.FLOAT16)]), "FLOAT32 or BFLOAT16"),
                             (dict(blocks=[dp.BlockRef(tensor="w", dest_region=1)]), "places no blocks")):
        with pytest.raises(RequestError, match=fragment):
            frontend.precheck(dp.FrameHeader(**{**good, **change}))


def test_the_cache_passes_the_nodes_refusals_on_and_replies_as_the_node_would():
    from shardline.services.errors import NotOwnerError, RemoteError, RequestError
    from shardline.services.pb import dataplane_pb2 as dp

    answers = [RemoteError("NOT_OWNER", "moved", epoch=7), RemoteError("TIMEOUT", "step 3 not reached"),
               Fetched(3, {("w", 0): (2, b"\0" * 8)}, oldest_step=1)]

    def fetch(*args):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    frontend = _frontend(fetch)
    header = dp.FrameHeader(op=dp.OP_PULL, request_id=9, job="j", epoch=5, via_node="ps1", min_step=0,
                            blocks=[dp.BlockRef(tensor="w", index=0, want_dtype=dp.BFLOAT16)])
    with pytest.raises(NotOwnerError) as refused:
        frontend.handle(header, memoryview(b""))
    assert refused.value.epoch == 7
    with pytest.raises(RequestError, match="step 3") as timed_out:
        frontend.handle(header, memoryview(b""))
    assert timed_out.value.code == "TIMEOUT"
    reply, payloads = frontend.handle(header, memoryview(b""))
    assert (reply.op, reply.request_id, reply.step, reply.oldest_step, reply.epoch) == (dp.OP_REPLY, 9, 3, 1, 5)
    ref, = reply.blocks
    assert (ref.dtype, ref.numel, ref.nbytes, ref.version) == (dp.BFLOAT16, 4, 8, 2) and payloads == [b"\0" * 8]


def test_a_cache_unknown_to_the_dispatcher_registers_again():
    from types import SimpleNamespace

    from shardline.rack_cache.daemon import CacheHeartbeats

    calls = []

    class Client:
        def register_cache(self, info):
            calls.append("register")
            return SimpleNamespace(heartbeat_interval_seconds=0.5, lease_seconds=2.0)

        def cache_heartbeat(self, **fields):
            calls.append("heartbeat")
            return SimpleNamespace(registered=len(calls) > 3, epoch=0, jobs=[])   # a new leader at first

    frontend = _frontend(FakeNode(1).fetch)
    beats = CacheHeartbeats(Client(), frontend, _info(), threading.Event())
    beats.register()
    beats.beat()
    beats.beat()
    assert calls == ["register", "heartbeat", "register", "heartbeat"]


# --- subscriber pulls through the cache: the node's checksums end to end ------------------------

BF16 = 3  # dataplane BFLOAT16


class SubscriberNode:
    """A PS node's subscriber pulls of bf16 blocks: the checksum of each block's value, and an
    element delta against the version the puller names when it sent that version before."""

    def __init__(self, blocks: int, numel: int = 64):
        self.step = 1
        self.values = {("w", i): (1, torch.randn(numel).to(torch.bfloat16)) for i in range(blocks)}
        self.sent = {}            # (key, version) -> the bf16 image sent (the node's delta history)
        self.fetches = []
        self.corrupt = False      # flip a byte of every payload on its way (the checksum stays right)

    def change(self, key, elements) -> None:
        self.step += 1
        value = self.values[key][1].clone()
        value[elements] += 1
        self.values[key] = (self.step, value)

    def fetch(self, job, node, epoch, min_step, asks, timeout, subscriber=False):
        from shardline.services import delta

        assert subscriber, "a subscriber's blocks are fetched as subscriber pulls"
        self.fetches.append((min_step, [(t, i, have) for t, i, have, _ in asks]))
        blocks, checksums, deltas = {}, {}, {}
        for tensor, index, have, _dtype in asks:
            key = (tensor, index)
            version, value = self.values[key]
            if have is not None and version <= have:
                continue
            base = self.sent.get((key, have))
            encoded = None if base is None else delta.encode_delta(base, value)
            if encoded is None:
                payload = bytearray(value.view(torch.int16).numpy().tobytes())
            else:
                deltas[key] = (have, encoded[0])
                payload = bytearray(encoded[1])
            if self.corrupt:
                payload[-1] ^= 0x40
            blocks[key] = (version, payload)
            checksums[key] = delta.checksum(value)
            self.sent[(key, version)] = value
        return Fetched(self.step, blocks, waited=self.step, checksums=checksums, deltas=deltas)


def test_the_cache_forwards_the_nodes_checksums_and_learns_changes_as_deltas():
    from shardline.services import delta

    node = SubscriberNode(blocks=3)
    cache = BlockCache(1 << 20, node.fetch)
    keys = sorted(node.values)
    first = cache.answer("job", "ps1", 1, 0, [Want(t, i, None, BF16) for t, i in keys], 5.0, subscriber=True)
    assert first.step == 1 and len(first.blocks) == 3
    for tensor, index, version, _, data in first.blocks:
        value = node.values[(tensor, index)][1]
        assert first.checksums[(tensor, index)] == delta.checksum(value)
        assert bytes(data) == value.view(torch.int16).numpy().tobytes()
    # a second subscriber at that step: from memory, the same checksums
    n = len(node.fetches)
    again = cache.answer("job", "ps1", 1, 1, [Want(t, i, None, BF16) for t, i in keys], 5.0, subscriber=True)
    assert len(node.fetches) == n and cache.stats.hits == 3 and again.checksums == first.checksums
    # one element of w[1] changes: the cache names what it holds, learns the delta, and forwards
    # the node's checksum of the result
    node.change(("w", 1), [5])
    fetched_before = cache.stats.bytes_fetched
    later = cache.answer("job", "ps1", 1, 2, [Want(t, i, 1, BF16) for t, i in keys], 5.0, subscriber=True)
    assert node.fetches[-1] == (2, [("w", 0, 1), ("w", 1, 1), ("w", 2, 1)])
    assert cache.stats.bytes_fetched - fetched_before == delta.DELTA_ELEMENT_BYTES
    (tensor, index, version, _, data), = later.blocks
    value = node.values[("w", 1)][1]
    assert (tensor, index, version, later.step) == ("w", 1, 2, 2)
    assert bytes(data) == value.view(torch.int16).numpy().tobytes()
    assert later.checksums == {("w", 1): delta.checksum(value)}
    # a worker's entry (no checksum) is not what a subscriber is answered from
    worker_only = BlockCache(1 << 20, lambda *a: Fetched(1, {("w", 0): (1, b"\0" * 128)}))
    worker_only.answer("job", "ps1", 1, 1, [Want("w", 0, None, BF16)], 5.0)
    worker_only._fetch = node.fetch
    sub = worker_only.answer("job", "ps1", 1, 1, [Want("w", 0, None, BF16)], 5.0, subscriber=True)
    assert node.fetches[-1] == (1, [("w", 0, None)]) and sub.checksums[("w", 0)] == delta.checksum(node.values[("w", 0)][1])
    # a worker's entry that knows a later step takes the node's checksum of the same version
    version, value = node.values[("w", 2)]
    worker_only._fetch = lambda *a: Fetched(5, {("w", 2): (version, value.view(torch.int16).numpy().tobytes())})
    worker_only.answer("job", "ps1", 1, 5, [Want("w", 2, None, BF16)], 5.0)
    worker_only._fetch = node.fetch
    worker_only.answer("job", "ps1", 1, 1, [Want("w", 2, None, BF16)], 5.0, subscriber=True)
    n = len(node.fetches)
    late = worker_only.answer("job", "ps1", 1, 5, [Want("w", 2, None, BF16)], 5.0, subscriber=True)
    assert len(node.fetches) == n and late.step == 5 and late.checksums[("w", 2)] == delta.checksum(value)


def test_a_block_corrupted_on_its_way_to_the_cache_is_never_kept():
    from shardline.services.errors import ShardlineChecksumError

    node = SubscriberNode(blocks=2)
    cache = BlockCache(1 << 20, node.fetch)
    node.corrupt = True
    with pytest.raises(ShardlineChecksumError, match="checksum"):
        cache.answer("job", "ps1", 1, 1, [Want("w", 0, None, BF16), Want("w", 1, None, BF16)], 5.0, subscriber=True)
    assert len(cache) == 0 and cache.resident_bytes == 0
    node.corrupt = False   # and a delta that does not produce the node's value either
    cache.answer("job", "ps1", 1, 1, [Want("w", 0, None, BF16)], 5.0, subscriber=True)
    node.change(("w", 0), [1, 2])
    node.corrupt = True
    with pytest.raises(ShardlineChecksumError):
        cache.answer("job", "ps1", 1, 2, [Want("w", 0, 1, BF16)], 5.0, subscriber=True)
    assert next(iter(cache._entries.values())).version == 1   # what it held, untouched


def test_a_corrupted_cached_entry_is_caught_by_the_subscriber_and_pulled_again_from_the_node():
    import socket
    from types import SimpleNamespace

    from shardline.services import frame
    from shardline.services.dataplane_client import REPLY_LIMITS
    from shardline.services.pb import dataplane_pb2 as dp
    from shardline.worker.client import TransferStats
    from shardline.worker.read_router import ReadRouter
    from shardline.worker.subscriber import SubscriberStats, _SubscriberClient

    node = SubscriberNode(blocks=2)
    frontend = _frontend(node.fetch)
    header = dp.FrameHeader(op=dp.OP_PULL, request_id=1, job="j", epoch=1, via_node="ps1", min_step=1, subscriber=True,
                            blocks=[dp.BlockRef(tensor="w", index=i, want_dtype=dp.BFLOAT16) for i in range(2)])
    frontend.handle(header, memoryview(b""))          # the cache holds both blocks
    for entry in frontend.cache._entries.values():
        entry.data[3] ^= 0x01                          # its copy of w[0] and w[1] goes bad in memory
    reply, payloads = frontend.handle(header, memoryview(b""))
    assert (reply.step, reply.min_step) == (1, 1) and frontend.cache.stats.hits == 2

    # the subscriber's side of the wire
    sub = _SubscriberClient.__new__(_SubscriberClient)
    numel = node.values[("w", 0)][1].numel()
    sub.job, sub.stats, sub.sub_stats, sub.failed, sub.replies, sub._conns = "j", TransferStats(), SubscriberStats(), {}, [], {}
    sub._values = {"w": torch.zeros(2 * numel, dtype=torch.bfloat16)}
    sub._versions = {}
    sub._reads = ReadRouter("r1")
    sub.routing = SimpleNamespace(caches=[_info()])
    expected = {("w", i): SimpleNamespace(start=i * numel, stop=(i + 1) * numel, numel=numel) for i in range(2)}
    a, b = socket.socketpair()
    try:
        frame.send_frame(a, reply, payloads)
        got = frame.recv_header(b, REPLY_LIMITS)
        sub._receive_blocks(SimpleNamespace(sock=b, close=lambda: None), "ps1", got, expected)
    finally:
        a.close()
        b.close()
    assert sub._versions == {} and sub.sub_stats.checksum_failures == 2, "a corrupted block was installed"
    assert sub.failed == {("w", 0): 1, ("w", 1): 1}
    # its next pull of those blocks goes to the node, the others still through the cache
    assert sub._pull_cache([("w", 0)]) is None and sub._pull_cache([("w", 1), ("x", 0)]) is None
    assert sub._pull_cache([("x", 0)]).cache_id == "c1"
