"""The rack cache's logic (L2): entries, versions, coalesced fetches, eviction. No sockets here
(rack_cache/server.py is the glue).

Contract: a pull is answered exactly as the PS node the reader routes to would answer it. An
entry (job, tensor, block, dtype) is the block's value for every job step in ``[version, seen]``,
learned at one epoch; a reply names one step ``s`` with ``min_step <= s`` and
``version <= s <= seen`` for every block, and ``s`` is always a step a node replied with.
Concurrent misses of the same blocks at the same epoch and ``min_step`` make one fetch. Resident
bytes stay within ``capacity_bytes`` (LRU; a bigger block is passed through, not kept). Subscriber
pulls are answered only from entries carrying the node's checksum, which the reply forwards; a
delta that does not match it is never kept and fails the pull (ShardlineChecksumError). A
node's refusals reach the reader as the node gave them. ``BlockCache`` is thread-safe; fetches run
outside its lock.

Design: docs/architecture.md, "Rack caches (L2)".
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Callable

from shardline.services.errors import ShardlineChecksumError, ShardlineConfigError, ShardlineTimeoutError

@dataclass(frozen=True)
class Want:
    """One block of a reader's pull: what it holds (``have`` None: nothing) and the dtype it wants
    (a data-plane DType number)."""

    tensor: str
    index: int
    have: int | None
    dtype: int


@dataclass(frozen=True)
class Entry:
    version: int
    seen: int
    epoch: int
    data: bytes | memoryview
    checksum: int | None = None   # the node's checksum of ``data`` (a subscriber fetch learned it)


@dataclass(frozen=True)
class Fetched:
    """What a fetch from a node returned: its job step, and the blocks that changed since the
    versions the cache named: ``(tensor, index) -> (version, bytes)``; ``oldest_step``: what the
    node said a pull of min_step 0 resumes at (None: ``step``). A subscriber fetch also returns
    ``waited``, the step the node waited for, ``checksums`` ``(tensor, index) -> crc32`` of every
    block sent, and ``deltas`` ``(tensor, index) -> (base version, elements)`` for the blocks sent
    as BF16_DELTA (their bytes the delta payload)."""

    step: int
    blocks: dict
    oldest_step: int | None = None
    waited: int | None = None
    checksums: dict = field(default_factory=dict)
    deltas: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """The reply to one group: the step it is at, and the blocks to send
    ``[(tensor, index, version, dtype, bytes)]`` (only those newer than the reader's); a subscriber
    pull's ``checksums``: ``(tensor, index) -> the node's crc32`` of each block sent."""

    step: int
    blocks: list
    fetched: bool           # the node was asked (a miss or a pass-through)
    oldest_step: int = 0    # a pull of min_step 0: the node's answer; otherwise ``step``
    checksums: dict = field(default_factory=dict)


@dataclass
class CacheStats:
    hits: int = 0              # blocks answered from memory
    misses: int = 0            # blocks fetched by this request
    coalesced: int = 0         # blocks of a fetch another request had in flight
    bytes_served: int = 0
    bytes_fetched: int = 0
    evictions: int = 0
    passed_through: int = 0    # blocks bigger than the cache


# fetch(job, node, epoch, min_step, [(tensor, index, have version | None, dtype)], timeout) -> Fetched;
# a subscriber fetch is called with subscriber=True
FetchFn = Callable[[str, str, int, int, list, float], Fetched]


@dataclass
class _Flight:
    """A fetch in flight: waiters read ``entries`` (key -> Entry) once ``done`` is set."""

    epoch: int
    min_step: int
    subscriber: bool = False      # its entries carry the node's checksums
    done: threading.Event = field(default_factory=threading.Event)
    held: dict = field(default_factory=dict)        # key -> the Entry held when it started (or None)
    entries: dict = field(default_factory=dict)
    error: BaseException | None = None


class BlockCache:
    """Entries of every job a rack cache serves, bounded by ``capacity_bytes``.

    ``fetch`` asks a PS node (FetchFn above; raises what the node answered); ``fetch_timeout``
    bounds how long a request waits for a fetch of another request beyond its own pull wait.
    Thread-safe: each reader connection calls :meth:`answer` from its own thread; fetches run
    outside the lock.
    """

    def __init__(self, capacity_bytes: int, fetch: FetchFn, *, fetch_timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ShardlineConfigError(f"cache_bytes must be a whole number of bytes > 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.fetch_timeout = fetch_timeout
        self._fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict = OrderedDict()     # (job, tensor, index, dtype) -> Entry, LRU first
        self._flights: dict = {}                       # (job, tensor, index, dtype) -> _Flight
        self._uids: dict[str, str] = {}                # job -> the uid its entries belong to
        self.resident_bytes = 0
        self.stats = CacheStats()

    # --- the jobs that exist ------------------------------------------------------------------
    def retain_jobs(self, uids: dict[str, str]) -> list[str]:
        """Keep the entries of the jobs in ``uids`` (name -> uid, from the dispatcher); drop those of
        jobs that are gone or were created again under a new uid. Returns the jobs dropped."""
        with self._lock:
            held = {k[0] for k in self._entries} | set(self._uids)
            # "": entries stored before the cache learned the job's uid (taken to be the current one)
            dropped = sorted(job for job in held if job not in uids or self._uids.get(job, "") not in ("", uids[job]))
            for job in dropped:
                self._uids.pop(job, None)
            for key in [k for k in self._entries if k[0] in dropped]:
                self._remove(key)
            for job in held - set(dropped):
                self._uids[job] = uids[job]
            return dropped

    # --- answering ----------------------------------------------------------------------------
    def answer(self, job: str, node: str, epoch: int, min_step: int, wants: list[Want], timeout: float, *,
               subscriber: bool = False) -> Answer:
        """The reply to a pull of ``wants`` from ``node`` (see the module docstring). ``timeout``:
        how long the pull may wait for ``min_step`` (the reader's wait); ``subscriber``: a
        subscriber pull (answered with the node's checksums). Raises what a fetch raised (the
        node's error), ShardlineChecksumError if a fetched block fails the node's checksum, or
        ShardlineTimeoutError if another request's fetch does not end in time."""
        keys = [(job, w.tensor, w.index, w.dtype) for w in wants]
        if len(set(keys)) != len(keys):
            raise ShardlineConfigError("a pull names a block more than once")
        if not wants or min_step == 0:
            return self._answer_fetched(job, node, epoch, min_step, wants, keys, timeout, subscriber)
        got: dict = {}
        own: list[int] = []                 # indexes of wants this request fetches
        waits: list[tuple[int, _Flight]] = []
        with self._lock:
            for i, key in enumerate(keys):
                entry = self._entries.get(key)
                if entry is not None and entry.seen >= min_step and entry.epoch == epoch and (
                        not subscriber or entry.checksum is not None):
                    self._entries.move_to_end(key)
                    got[i] = entry
                    continue
                flight = self._flights.get(key)
                # only a fetch for this very step: one for a later step may wait for a commit that
                # this reader makes only once it has these blocks (BSP), a deadlock until it times out
                if flight is not None and flight.epoch == epoch and flight.min_step == min_step and (
                        flight.subscriber or not subscriber):
                    waits.append((i, flight))
                else:
                    own.append(i)
            hits = len(got)
            flight = self._start_flight([keys[i] for i in own], epoch, min_step, subscriber) if own else None
            self.stats.hits += hits
            self.stats.coalesced += len(waits)
            self.stats.misses += len(own)
        if flight is not None:
            self._run_fetch(flight, job, node, epoch, min_step, [wants[i] for i in own], [keys[i] for i in own],
                            timeout)
            for i in own:
                got[i] = flight.entries[keys[i]]
        for i, other in waits:
            if not other.done.wait(timeout + self.fetch_timeout):
                raise ShardlineTimeoutError(f"a fetch of {keys[i][1]}[{keys[i][2]}] from node {node!r} by another "
                                            f"reader did not end within {timeout + self.fetch_timeout:g} s "
                                            f"(pull wait + fetch_timeout)")
            if other.error is not None:
                raise other.error
            got[i] = other.entries[keys[i]]
        step = self._consistent_step(got, len(wants))
        if step is not None:
            return self._reply(step, wants, got, fetched=bool(own or waits), subscriber=subscriber)
        # entries learned at different steps: one snapshot of the whole group from the node
        target = max(e.version for e in got.values())
        return self._answer_fetched(job, node, epoch, max(min_step, target), wants, keys, timeout, subscriber)

    def _answer_fetched(self, job, node, epoch, min_step, wants, keys, timeout, subscriber=False) -> Answer:
        """Fetch the whole group from the node in one request (its consistent snapshot)."""
        with self._lock:
            flight = self._start_flight(keys, epoch, min_step, subscriber, register=False)
            if not subscriber:
                self.stats.misses += len(keys)
        result = self._run_fetch(flight, job, node, epoch, min_step, wants, keys, timeout)
        if subscriber:  # the node sent what changed since the entries held: the rest is answered from memory
            with self._lock:
                self.stats.misses += len(result.blocks)
                self.stats.hits += len(keys) - len(result.blocks)
        got = {i: flight.entries[key] for i, key in enumerate(keys)}
        oldest = result.step if result.oldest_step is None else result.oldest_step
        return self._reply(result.step, wants, got, fetched=True, oldest_step=oldest, subscriber=subscriber)

    @staticmethod
    def _consistent_step(got: dict, n: int) -> int | None:
        """The step every entry of ``got`` holds the block's value at: min(seen), if no version is
        newer than it."""
        if len(got) != n:
            return None
        step = min(e.seen for e in got.values())
        return step if all(e.version <= step for e in got.values()) else None

    def _reply(self, step: int, wants: list[Want], got: dict, *, fetched: bool, oldest_step: int | None = None,
               subscriber: bool = False) -> Answer:
        blocks = []
        checksums = {}
        served = 0
        for i, w in enumerate(wants):
            entry = got[i]
            if w.have is None or entry.version > w.have:
                blocks.append((w.tensor, w.index, entry.version, w.dtype, entry.data))
                served += len(entry.data)
                if subscriber:
                    checksums[(w.tensor, w.index)] = entry.checksum
        with self._lock:
            self.stats.bytes_served += served
        return Answer(step, blocks, fetched, step if oldest_step is None else oldest_step, checksums)

    # --- fetching -----------------------------------------------------------------------------
    def _start_flight(self, keys: list, epoch: int, min_step: int, subscriber: bool = False, *,
                      register: bool = True) -> _Flight:
        """Under the lock: a new fetch of ``keys`` that later requests may wait for."""
        flight = _Flight(epoch, min_step, subscriber)
        # what the fetch names as held: for a subscriber fetch only entries with the node's checksum
        # (the node's "unchanged" must leave the cache a checksum to forward)
        flight.held = {key: self._entries.get(key) for key in keys}
        if subscriber:
            flight.held = {key: e if e is not None and e.checksum is not None else None
                           for key, e in flight.held.items()}
        if register:
            for key in keys:
                self._flights[key] = flight
        return flight

    def _run_fetch(self, flight: _Flight, job: str, node: str, epoch: int, min_step: int, wants: list[Want],
                   keys: list, timeout: float) -> Fetched:
        """Ask the node for ``keys`` (naming the versions held), store what it says, wake the waiters."""
        try:
            held = flight.held
            asks = [(w.tensor, w.index, None if held[k] is None else held[k].version, w.dtype)
                    for w, k in zip(wants, keys)]
            result = self._fetch_from(job, node, epoch, min_step, asks, timeout, flight.subscriber)
            fetched = 0
            entries = []
            for w, key in zip(wants, keys):
                new = result.blocks.get((w.tensor, w.index))
                old = held[key]
                if new is not None:
                    version, data = new
                    fetched += len(data)
                    # the same version's value: the node's checksum of it still holds
                    checksum = old.checksum if old is not None and old.version == version else None
                    if flight.subscriber:  # checked here, before it is kept (not under the lock)
                        data, checksum = _verified(node, w, old, version, data, result)
                elif old is not None:       # unchanged since the version named
                    version, data, checksum = old.version, old.data, old.checksum
                else:
                    raise ShardlineConfigError(f"node {node!r} did not send block {w.tensor}[{w.index}] the "
                                               f"cache holds nothing of")
                if version > result.step:
                    raise ShardlineConfigError(f"node {node!r} sent block {w.tensor}[{w.index}] at version "
                                               f"{version}, above its step {result.step}")
                entries.append((key, Entry(version, result.step, epoch, data, checksum)))
            with self._lock:
                self.stats.bytes_fetched += fetched
                for key, entry in entries:
                    flight.entries[key] = entry
                    self._store(key, entry)
            return result
        except BaseException as exc:
            flight.error = exc
            raise
        finally:
            with self._lock:
                for key in keys:
                    if self._flights.get(key) is flight:
                        del self._flights[key]
            flight.done.set()

    def _fetch_from(self, job, node, epoch, min_step, asks, timeout, subscriber) -> Fetched:
        """One fetch; a subscriber fetch whose node replied at a later step than it waited for (its
        blocks not all visible at the step named) is made again at that step, within ``timeout``."""
        if not subscriber:
            return self._fetch(job, node, epoch, min_step, asks, timeout)
        deadline = self._clock() + timeout
        while True:
            result = self._fetch(job, node, epoch, min_step, asks, timeout, subscriber=True)
            if result.waited is None or result.waited == result.step:
                return result
            min_step, timeout = result.step, deadline - self._clock()
            if timeout <= 0:
                raise ShardlineTimeoutError(f"node {node!r} did not reply at a step it waited for within the pull's "
                                            f"wait (it replied at {result.step}, waited for {result.waited})")

    # --- the byte bound -----------------------------------------------------------------------
    def _store(self, key, entry: Entry) -> None:
        """Under the lock: keep ``entry`` (most recently used) and evict down to the bound; a block
        bigger than the whole cache is not kept."""
        old = self._entries.get(key)
        if old is not None and (old.epoch, old.version, old.seen) > (entry.epoch, entry.version, entry.seen):
            if old.checksum is not None or entry.checksum is None or (old.epoch, old.version) != (entry.epoch,
                                                                                                  entry.version):
                return  # what is kept knows more (a concurrent fetch at a later epoch or step ended first)
            entry = replace(entry, seen=old.seen)  # one value: what the kept entry knew, and the node's checksum
        size = len(entry.data)
        if size > self.capacity_bytes:
            self.stats.passed_through += 1
            if old is not None:
                self._remove(key)
            return
        if old is not None:
            self._remove(key)
        self._entries[key] = entry
        self.resident_bytes += size
        self._uids.setdefault(key[0], "")
        while self.resident_bytes > self.capacity_bytes:
            victim = next(iter(self._entries))
            self._remove(victim)
            self.stats.evictions += 1

    def _remove(self, key) -> None:
        entry = self._entries.pop(key)
        self.resident_bytes -= len(entry.data)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


def _verified(node: str, want: Want, old: Entry | None, version: int, data, result: Fetched):
    """``(bytes, checksum)`` of a block a subscriber fetch received: a BF16_DELTA applied to a
    copy of the entry held (its base), the result checked against the node's checksum.
    ShardlineChecksumError if it does not match (nothing is kept)."""
    import torch

    from shardline.services import delta

    key = (want.tensor, want.index)
    checksum = result.checksums.get(key)
    where = f"block {want.tensor}[{want.index}] at version {version} from node {node!r}"
    if checksum is None:
        raise ShardlineConfigError(f"{where} came without a checksum")
    if key in result.deltas:
        base_version, k = result.deltas[key]
        if old is None or old.version != base_version:
            raise ShardlineConfigError(f"{where} is a delta against version {base_version}, which the cache does not hold")
        block = bytearray(old.data)
        try:
            delta.apply_delta(torch.frombuffer(block, dtype=torch.bfloat16), k, data)
        except delta.DeltaError as exc:
            raise ShardlineChecksumError(f"{where}: {exc}") from None
        data = block
    if not data or delta.checksum(torch.frombuffer(data, dtype=torch.uint8)) != checksum:
        raise ShardlineChecksumError(f"{where} failed its checksum in the rack cache")
    return data, checksum
