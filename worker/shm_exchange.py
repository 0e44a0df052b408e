"""The worker's side of the shared-memory exchange with PS nodes on its host (shm transport).

::

    the caches' revocation gate (SharedMemory.gate)

    OPEN --(a pull given up while its node may still copy into the caches)--> REVOKING
      ^                                                                          |
      +------(the last pull in flight moved the caches to fresh memory)----------+
               (new pulls wait in REVOKING; pushes never do)

The client's caches (one zeroed float32 tensor per job tensor) and its gradient buffers live in
shared regions when the transport can reach a node over shm: a pull asks the node to copy its
blocks straight into the cache (placement), and a push names blocks of a gradient buffer for the
node to copy out itself (no bytes through the ring or a socket). A node given up on mid-pull (it
stalled, it is not known dead) may still write; so the caches move to fresh memory at the same
addresses once no pull writes into them, and what it writes later lands where nobody reads.
Design: docs/architecture.md, "Shared-memory transport".
"""

from __future__ import annotations

import enum
import logging
import threading

import torch

from shardline.services.transport import capabilities_of, shm

log = logging.getLogger("shardline.worker")


class Gate(enum.Enum):
    OPEN = "open"           # pulls write into the caches
    REVOKING = "revoking"   # a pull was given up mid-copy: the caches move once no pull writes


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a cache line: each tensor of a shared cache region starts on one."""
    return (nbytes + 63) // 64 * 64


def shares_regions(conn) -> bool:
    """Whether ``conn``'s transport can share memory regions with the node (shm)."""
    return capabilities_of(conn.sock).shares_memory


def share_region(conn, region, shared: set) -> None:
    """Share ``region`` on ``conn`` and note its id in ``shared`` (the regions shared for one
    frame): a gradient buffer a push names blocks in (the node copies them out itself), or a cache
    a pull asks blocks placed in. Should a push then be given up on, the connection is closed
    before the caller can change the buffer again: the node drops a push whose client hung up
    during its copy."""
    conn.sock.share_region(region)
    shared.add(region.id)


def region_holding(regions, address: int, nbytes: int) -> tuple | None:
    """``(region, offset)`` of the one of ``regions`` (SharedRegion) holding all ``nbytes`` from
    ``address`` (a contiguous CPU block's ``data_ptr()``); None if none does."""
    for region in regions:
        offset = address - region.address
        if 0 <= offset <= region.size - nbytes:
            return region, offset
    return None


class SharedMemory:
    """The shared regions of one client: its caches (``placement``: tensor name -> (region, byte
    offset), an entry exactly while the client's cache of that name is in it) and its gradient
    buffers, and the gate that moves the caches when a node may still write into them."""

    def __init__(self) -> None:
        self.cache_regions: list = []
        self.grad_regions: list = []
        self.placement: dict[str, tuple] = {}
        self.gate = Gate.OPEN
        self._gate_changed = threading.Condition()
        self._pulls_writing = 0

    @property
    def revoke_pending(self) -> bool:
        return self.gate is Gate.REVOKING

    @staticmethod
    def layout(transport, tensors: list[tuple[str, int]], what: str, otherwise: str):
        """One shared region laid out for zeroed float32 ``tensors`` (name, numel), each on its own
        cache lines, and each one's byte offset in it; (None, {}) unless ``transport`` can reach
        a node over shm (or memfds are refused here: a sandbox)."""
        total = sum(aligned(numel * 4) for _name, numel in tensors)
        if not total or not transport.capabilities.shares_memory:
            return None, {}
        try:
            region = shm.SharedRegion(total)
        except OSError as exc:
            log.info("no shared-memory %s (%s): %s", what, exc, otherwise)
            return None, {}
        offsets, offset = {}, 0
        for name, numel in tensors:
            offsets[name] = offset
            offset += aligned(numel * 4)
        return region, offsets

    def allocate(self, transport, tensors: list[tuple[str, int]], kind: str) -> dict[str, torch.Tensor]:
        """Zeroed float32 tensors for ``tensors`` (name, numel) of ``kind`` ("cache" or "gradient
        buffer"): in one shared region when the transport can reach a node over shm, else ordinary
        memory. Caches in a region are noted in ``placement``."""
        cache = kind == "cache"
        region, offsets = self.layout(transport, tensors, kind,
                                      "pulls go through the ring" if cache else "pushes go through the ring")
        if region is not None:
            (self.cache_regions if cache else self.grad_regions).append(region)
        out = {}
        for name, numel in tensors:
            if region is None:
                out[name] = torch.zeros(numel, dtype=torch.float32)
                continue
            out[name] = region.tensor(torch.float32, offsets[name], numel)
            if cache:
                self.placement[name] = (region, offsets[name])
        return out

    def in_grad_region(self, tensor: torch.Tensor) -> bool:
        """Whether all of ``tensor`` (contiguous, on the CPU) lies in one of the gradient buffers' regions."""
        return region_holding(self.grad_regions, tensor.data_ptr(), tensor.numel() * tensor.element_size()) is not None

    def push_sources(self, conn) -> list:
        """The regions a push on ``conn`` may name blocks in (none unless it shares memory)."""
        return self.grad_regions if shares_regions(conn) else []

    def ask_placement(self, conn, header, slices: dict) -> set:
        """Over shm, ask the node to copy the pull's blocks whose cache is in a shared region
        straight into it (sharing the region on this connection first). Returns their keys."""
        if header.subscriber or not shares_regions(conn):
            return set()
        placed, shared = set(), set()
        for ref in header.blocks:
            tensor = ref.tensor
            place = self.placement.get(tensor)
            if place is None or ref.want_dtype:
                continue
            region, base = place
            if region.id not in shared:
                share_region(conn, region, shared)
            index = ref.index
            ref.dest_region, ref.dest_offset = region.id, base + slices[tensor][index].start * 4
            placed.add((tensor, index))
        return placed

    def begin_cache_write(self) -> None:
        """A pull is about to write into the caches: wait while they move to fresh memory."""
        with self._gate_changed:
            while self.gate is Gate.REVOKING:   # the pulls in flight end, then the last one revokes
                self._gate_changed.wait()
            self._pulls_writing += 1

    def end_cache_write(self, conns, job: str) -> None:
        """A pull stopped writing into the caches; the last one out moves them if a node given up
        on may still write (``conns``: the client's connections, told to unmap the old memory)."""
        with self._gate_changed:
            self._pulls_writing -= 1
            if not (self.gate is Gate.REVOKING and self._pulls_writing == 0):
                return
        try:
            self._revoke_regions(conns, job)
        finally:
            with self._gate_changed:
                self.gate = Gate.OPEN
                self._gate_changed.notify_all()

    def given_up_mid_pull(self) -> None:
        """A pull was given up on while its node may still copy into the caches (OPEN -> REVOKING)."""
        with self._gate_changed:
            self.gate = Gate.REVOKING

    def _revoke_regions(self, conns, job: str) -> None:
        """Move the caches to fresh memory at the same addresses (the caches and the parameters
        viewing them keep their values), so whatever a node given up on writes later lands where
        nobody reads; the live nodes are told to unmap the old memory. No pull runs meanwhile."""
        for region in self.cache_regions:
            old = region.revoke()
            for conn in list(conns):
                if not shares_regions(conn):
                    continue
                unshare = conn.sock.unshare_region
                with conn.lock:
                    try:
                        unshare(old)
                    except OSError as exc:  # that connection is broken: its next use finds out
                        log.debug("unsharing region %d failed: %s", old, exc)
        log.warning("job %s: a pull into the shared caches was given up on (its node may still write); the caches "
                    "moved to fresh shared memory", job)

    def close(self) -> None:
        for region in [*self.cache_regions, *self.grad_regions]:
            region.close()
