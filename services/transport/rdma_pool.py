"""Registered buffers of an RDMA connection and the credits that keep a sender within them.

``SlotRegion`` is one page-aligned anonymous mapping split into equal slots and registered once,
when the connection is set up (registration pins pages and costs a system call: never per frame).
Each connection has two: the receive ring (every slot posted as a receive buffer) and the send
slots (a chunk is copied into a free one, posted, and the slot is free again once its send
completed). The registrar is what pyverbs' MR is to a real device; tests pass a fake.

``Credits`` is the flow control: a sender may have at most ``data_slots`` chunks that the
receiver has not yet consumed and re-posted, so it never sends into a receive queue with no
buffer posted (an RC QP would stall in receiver-not-ready retries, or fail). The receiver returns
consumed slots in batches of ``batch``; a batch below ``data_slots`` keeps a blocked sender
live: with no credits left at least one chunk is still unconsumed, and consuming it completes
a batch.
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from typing import Callable, Protocol

from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError


class Registration(Protocol):
    lkey: int
    rkey: int

    def close(self) -> None: ...


# (address, length) -> Registration; pyverbs: MR(pd, length, IBV_ACCESS_LOCAL_WRITE, address=address)
Registrar = Callable[[int, int], Registration]


class SlotRegion:
    """``slots`` buffers of ``slot_bytes`` each in one mapping, registered once by ``register``."""

    def __init__(self, slots: int, slot_bytes: int, register: Registrar):
        if slots < 1:
            raise ShardlineConfigError(f"an RDMA buffer region needs at least one slot, got {slots!r}")
        if slot_bytes < 1 or slot_bytes % mmap.PAGESIZE:
            raise ShardlineConfigError(f"RDMA buffer size must be a positive multiple of {mmap.PAGESIZE}, "
                                       f"got {slot_bytes!r}")
        self.slots, self.slot_bytes = slots, slot_bytes
        self._map = mmap.mmap(-1, slots * slot_bytes)
        self._anchor = ctypes.c_char.from_buffer(self._map)  # pins the mapping while its address is used
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)
        try:
            self.registration = register(self.address, len(self._map))
        except BaseException:
            self._unmap()
            raise
        self._free = deque(range(slots))
        self._closed = False

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def lkey(self) -> int:
        return self.registration.lkey

    def slot_address(self, slot: int) -> int:
        return self.address + slot * self.slot_bytes

    def slot_view(self, slot: int, nbytes: int | None = None) -> memoryview:
        start = slot * self.slot_bytes
        return self.view[start:start + (self.slot_bytes if nbytes is None else nbytes)]

    # Send slots only: which ones no posted send still reads.
    def take(self) -> int | None:
        return self._free.popleft() if self._free else None

    def give_back(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ShardlineConnectionError(f"RDMA completion for slot {slot} that is not in flight")
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def _unmap(self) -> None:
        self.view.release()
        del self._anchor
        try:
            self._map.close()
        except BufferError:  # a slot view is still being copied from (close from another thread):
            pass             # the mapping goes with the last view, never before

    def close(self) -> None:
        """Deregister, then unmap (the device must stop using the pages before they go)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.registration.close()
        finally:
            self._unmap()


class Credits:
    """Both directions' accounting of one connection's data slots (see the module docstring)."""

    def __init__(self, peer_data_slots: int, own_data_slots: int):
        self.available = peer_data_slots     # chunks this side may still send
        self._peer_slots = peer_data_slots
        self.unreturned = 0                  # slots this side consumed and re-posted, not yet announced
        self.batch = max(1, own_data_slots // 2)
        self._own_slots = own_data_slots

    def take(self) -> bool:
        if self.available == 0:
            return False
        self.available -= 1
        return True

    def grant(self, n: int) -> None:
        """The peer returned ``n`` slots; more than this side has outstanding is a protocol error."""
        if n < 1 or self.available + n > self._peer_slots:
            raise ShardlineConnectionError(f"peer returned {n} RDMA credits with {self._peer_slots - self.available} "
                                           f"outstanding")
        self.available += n

    def consumed(self) -> int:
        """Note one consumed receive slot; return how many to announce now (0 until a batch is full)."""
        self.unreturned += 1
        if self.unreturned > self._own_slots:
            raise ShardlineConnectionError(f"peer sent more RDMA chunks than the {self._own_slots} credits it had")
        if self.unreturned < self.batch:
            return 0
        n, self.unreturned = self.unreturned, 0
        return n


def spare_slots(data_slots: int) -> int:
    """Receive buffers posted besides the data slots, for the peer's credit-return messages.

    Between two polls of its completion queue a sender posts at most ``data_slots`` chunks, and
    the receiver answers each ``batch`` of them with one message, so that many plus one for a
    batch straddling two polls, plus one of margin."""
    return data_slots // max(1, data_slots // 2) + 2
