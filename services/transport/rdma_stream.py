"""A byte stream over one RDMA connection, with the socket methods the frame codec and server loop use.

The TCP connection the exchange ran on stays open and carries the stream's order: every
``sendall`` is one record on it, ``INLINE`` (the bytes follow on TCP; small writes, whose latency
is the TCP round trip either way) or ``BULK`` (only the length; the bytes follow as chunks of at
most one slot, sent on the QP from registered send slots into the peer's posted receive ring).
So the TCP socket turns readable exactly when a new record starts: ``fileno()`` is its
descriptor, and the server's poll for the next frame and the hang-up watcher
(services/disconnects.py) work unchanged. Records and chunks keep the sender's order (one TCP
stream, one RC QP), a chunk never spans two records, and credits (rdma_pool.Credits) come back
as send-with-immediate messages on the QP, never on TCP, so an idle peer is not woken by them.

The frame protocol is request/reply: one side sends a bulk record at a time while the other
reads it. Both sides sending bulk records at once would wait on each other's credits; that
ends in the ``settimeout`` timeout, not a hang.

Completions are polled (pyverbs has no completion-channel descriptor to wait on): a short spin
that yields the GIL, then sleeps growing to ``MAX_SLEEP_SECONDS``, checking the TCP socket for a hang-up every
``HANGUP_CHECK_SECONDS`` and the timeout set by ``settimeout``.
"""

from __future__ import annotations

import select
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from shardline.services.errors import ShardlineConnectionError
from shardline.services.transport.base import Capabilities
from shardline.services.transport.rdma_pool import Credits, SlotRegion

RECORD = struct.Struct(">BQ")
INLINE, BULK = 1, 2
# A peer's inline records are read into the caller's buffer, but bound them all the same.
MAX_INLINE_BYTES = 1 << 20
MAX_RECORD_BYTES = 1 << 48

# Completion kinds a backend reports.
SEND_DONE, CREDIT_SENT, DATA, CREDIT = "send_done", "credit_sent", "data", "credit"

SPIN_POLLS = 50
MAX_SLEEP_SECONDS = 0.001
HANGUP_CHECK_SECONDS = 0.01
_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)


@dataclass(frozen=True)
class Completion:
    """One work completion: ``slot`` is the send or receive slot (unused for CREDIT_SENT),
    ``nbytes`` a DATA chunk's length, ``credits`` a CREDIT message's count, ``error`` a failed
    completion's status (the QP is in error then: the connection is over)."""

    kind: str
    slot: int = -1
    nbytes: int = 0
    credits: int = 0
    error: str | None = None


class Verbs(Protocol):
    """One connected RC QP and its two registered regions (rdma_verbs.VerbsEndpoint on a device)."""

    recv_region: SlotRegion
    send_region: SlotRegion

    def post_recv(self, slot: int) -> None: ...
    def post_send(self, slot: int, nbytes: int) -> None: ...
    def post_credit(self, credits: int) -> None: ...
    def poll(self, max_entries: int) -> list[Completion]: ...
    def close(self) -> None: ...


class _Waiter:
    """Spin, then back off, until ``deadline``; checks the TCP socket for a hang-up now and then."""

    def __init__(self, conn: "RdmaConnection", what: str):
        self.conn, self.what = conn, what
        timeout = conn.gettimeout()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.polls = 0
        self.sleep = 0.00002
        self.next_check = time.monotonic() + HANGUP_CHECK_SECONDS

    def reset(self) -> None:
        self.polls, self.sleep = 0, 0.00002

    def pause(self) -> None:
        self.polls += 1
        if self.polls < SPIN_POLLS:
            time.sleep(0)  # gives up the GIL: a spinning thread must not starve the one it waits for
            return
        now = time.monotonic()
        if self.deadline is not None and now >= self.deadline:
            raise TimeoutError(f"RDMA {self.what} from {self.conn.peer} did not arrive within "
                               f"{self.conn.gettimeout()} s")
        if now >= self.next_check:
            self.next_check = now + HANGUP_CHECK_SECONDS
            self.conn._check_hangup()
        time.sleep(self.sleep)
        self.sleep = min(self.sleep * 2, MAX_SLEEP_SECONDS)


class RdmaConnection:
    """Socket-like stream (``recv_into``, ``sendall``, ``settimeout``, ``fileno``, ``close``) over
    ``sock`` (the exchange's TCP connection) and ``verbs`` (its connected QP). Used by one thread
    at a time, like a socket under the callers' locks; ``close`` may come from another thread."""

    CAPABILITIES = Capabilities(registers_memory=True)

    def __init__(self, sock, verbs: Verbs, credits: Credits, *, peer: str, peer_spare_slots: int,
                 inline_max: int = 65536, chunk_bytes: int | None = None):
        self._sock, self._verbs, self._credits = sock, verbs, credits
        self.peer = peer
        self._peer_spare = peer_spare_slots
        self._inline_max = min(inline_max, MAX_INLINE_BYTES)
        # A chunk fills at most one of this side's send buffers and one of the peer's receive buffers.
        self._chunk_bytes = min(chunk_bytes or verbs.send_region.slot_bytes, verbs.send_region.slot_bytes)
        self._timeout: float | None = None
        self._arrived: deque[tuple[int, int]] = deque()   # data chunks polled, not yet read
        self._chunk: list[int] | None = None              # [slot, nbytes, offset] being read
        self._record_kind = 0
        self._record_left = 0
        self._credit_sends = 0
        self._lock = threading.Lock()                     # close() never frees the QP under a verbs call
        self._closed = False
        self.stats = {"inline_records": 0, "bulk_records": 0, "chunks_sent": 0, "chunks_received": 0,
                      "credit_messages": 0}

    # --- socket methods the codec and loops use -------------------------------------------------
    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._verbs.close()
            finally:
                self._sock.close()

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        n = len(view)
        if n == 0:
            return
        if n <= self._inline_max:
            self._sock.sendall(RECORD.pack(INLINE, n) + bytes(view))
            self.stats["inline_records"] += 1
            return
        self._sock.sendall(RECORD.pack(BULK, n))
        self.stats["bulk_records"] += 1
        step = self._chunk_bytes
        for offset in range(0, n, step):
            self._send_chunk(view[offset:offset + step])

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        view = view[:nbytes or len(view)]
        if len(view) == 0:
            return 0
        if self._record_left == 0 and not self._next_record():
            return 0  # the peer closed between records
        want = min(len(view), self._record_left)
        if self._record_kind == INLINE:
            got = self._sock.recv_into(view, want)
            if got == 0:
                return 0
        else:
            got = self._read_chunk(view[:want])
        self._record_left -= got
        return got

    # --- sending --------------------------------------------------------------------------------
    def _send_chunk(self, part: memoryview) -> None:
        region, credits = self._verbs.send_region, self._credits
        waiter = None
        while True:
            self._reap()
            if credits.available and region.free:
                break
            waiter = waiter or _Waiter(self, "credits" if region.free else "send completions")
            waiter.pause()
        credits.take()
        slot = region.take()
        region.slot_view(slot, len(part))[:] = part
        self._verb(self._verbs.post_send, slot, len(part))
        self.stats["chunks_sent"] += 1

    def _send_credit(self, n: int) -> None:
        waiter = None
        while self._credit_sends >= self._peer_spare:
            waiter = waiter or _Waiter(self, "credit-message completions")
            if not self._reap():
                waiter.pause()
        self._verb(self._verbs.post_credit, n)
        self._credit_sends += 1
        self.stats["credit_messages"] += 1

    # --- receiving ------------------------------------------------------------------------------
    def _next_record(self) -> bool:
        head = bytearray(RECORD.size)
        view = memoryview(head)
        got = 0
        while got < RECORD.size:
            r = self._sock.recv_into(view[got:], RECORD.size - got)
            if r == 0:
                if got == 0:
                    return False
                raise ConnectionError(f"{self.peer} closed the connection inside a record header")
            got += r
        kind, length = RECORD.unpack(head)
        if kind not in (INLINE, BULK) or not 0 < length < MAX_RECORD_BYTES or \
                (kind == INLINE and length > MAX_INLINE_BYTES):
            raise ShardlineConnectionError(f"malformed RDMA stream record from {self.peer}: kind {kind}, "
                                           f"{length} bytes")
        self._record_kind, self._record_left = kind, length
        return True

    def _read_chunk(self, view: memoryview) -> int:
        if self._chunk is None:
            waiter = None
            while not self._arrived:
                if not self._reap():
                    waiter = waiter or _Waiter(self, "data")
                    waiter.pause()
            slot, nbytes = self._arrived.popleft()
            if nbytes > self._record_left or nbytes == 0:
                raise ShardlineConnectionError(f"RDMA chunk of {nbytes} bytes from {self.peer} does not fit its "
                                               f"record ({self._record_left} bytes left)")
            self._chunk = [slot, nbytes, 0]
            self.stats["chunks_received"] += 1
        slot, nbytes, offset = self._chunk
        k = min(len(view), nbytes - offset)
        start = offset
        view[:k] = self._verbs.recv_region.slot_view(slot)[start:start + k]
        offset += k
        if offset < nbytes:
            self._chunk[2] = offset
            return k
        self._chunk = None
        self._verb(self._verbs.post_recv, slot)  # consumed: the slot takes the next chunk
        ret = self._credits.consumed()
        if ret:
            self._send_credit(ret)
        return k

    # --- completions ----------------------------------------------------------------------------
    def _verb(self, call, *args):
        """Every call into the QP goes through here: never after (or during) close."""
        with self._lock:
            if self._closed:
                raise ConnectionError(f"RDMA connection to {self.peer} is closed")
            return call(*args)

    def _reap(self) -> int:
        """Handle every completion ready now; return how many there were."""
        done = self._verb(self._verbs.poll, 64)
        for c in done:
            if c.error is not None:
                raise ShardlineConnectionError(f"RDMA connection to {self.peer} failed: {c.error}")
            if c.kind == SEND_DONE:
                self._verbs.send_region.give_back(c.slot)
            elif c.kind == CREDIT_SENT:
                self._credit_sends -= 1
            elif c.kind == DATA:
                self._arrived.append((c.slot, c.nbytes))
            elif c.kind == CREDIT:
                self._credits.grant(c.credits)
                self._verb(self._verbs.post_recv, c.slot)
            else:
                raise ShardlineConnectionError(f"unknown RDMA completion kind {c.kind!r}")
        return len(done)

    def _check_hangup(self) -> None:
        poller = select.poll()
        poller.register(self._sock, _HANGUP)
        if poller.poll(0):
            raise ConnectionError(f"{self.peer} closed the connection")
