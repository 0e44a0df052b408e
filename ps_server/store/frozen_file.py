"""Frozen tensors' values off the heap: one unnamed file per job, mapped into the process, whose
pages the kernel keeps in its page cache (issue: a LoRA job's base, 99 % of its parameters, is
read once by each worker and never changes; in the process heap it costs its full size on every
node that holds it).

A job's frozen blocks get one slot each in a file in the node's ``spill_dir``, laid out when the
job (or a revision adding frozen tensors) is created: one ``posix_fallocate`` of the region (a
full disk fails here, with a WARNING and the values kept in the heap, not later as a SIGBUS on a
write into a sparse page) and one shared mapping of it. ``store`` copies a block's value into its
slot and returns the slot (a tensor view of the mapping), which becomes the block's value: reads,
copies and checkpoints read it as any value. A frozen value is never written in place (a step
never touches it; unfreezing replaces it with a heap copy), so the mapping's pages are clean page
cache once written back; ``release_pages`` drops them from the process's resident set (the page
cache keeps them, or rereads them from the file).

The file is unnamed (``O_TMPFILE``, else created and unlinked at once): it is freed when the
process exits, however it exits, and no later process ever reads it. There is nothing to load
after a crash, so nothing torn can be loaded: a restarted node gets its blocks from checkpoints
and its peers, as always. docs/operations.md, "Memory".
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile

import torch

log = logging.getLogger("shardline.ps.store")

ALIGN = 64   # bytes: each slot starts aligned for any dtype's vector loads


class FrozenFile:
    """The slots of one job's frozen blocks in one unnamed file under ``directory``."""

    def __init__(self, directory: str, job: str):
        self.directory = directory
        self.job = job
        self._file = tempfile.TemporaryFile(dir=directory, prefix=f"shardline-frozen-{job}-")
        self._size = 0                  # bytes of the file laid out so far (a multiple of the page size)
        self._maps: list[mmap.mmap] = []
        self._slots: dict[tuple[str, int], torch.Tensor] = {}
        self._storages: set[int] = set()   # data pointers of the mappings' storages (memory accounting)
        self.nbytes = 0                 # bytes of the slots

    def reserve(self, blocks: list[tuple[tuple[str, int], int, torch.dtype]]) -> bool:
        """Lay out slots for ``blocks`` ((key, numel, dtype), keys without one) in one new region of
        the file and map it. False (nothing reserved, a WARNING) if the disk cannot hold it."""
        blocks = [b for b in blocks if b[0] not in self._slots]
        if not blocks:
            return True
        offsets, size = [], 0
        for _key, numel, dtype in blocks:
            offsets.append(size)
            size += -(-numel * dtype.itemsize // ALIGN) * ALIGN
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = self._file.fileno()
        try:
            os.posix_fallocate(fd, self._size, size)
            region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE,
                               offset=self._size)
        except OSError as exc:
            log.warning("job %s: cannot keep %d MiB of frozen values in a file in %s (%s): they stay in memory",
                        self.job, size >> 20, self.directory, exc)
            return False
        raw = torch.frombuffer(region, dtype=torch.uint8)
        self._storages.add(raw.untyped_storage().data_ptr())
        for (key, numel, dtype), offset in zip(blocks, offsets):
            self._slots[key] = raw[offset:offset + numel * dtype.itemsize].view(dtype)
            self.nbytes += numel * dtype.itemsize
        self._maps.append(region)
        self._size += size
        return True

    def store(self, key: tuple[str, int], value: torch.Tensor) -> torch.Tensor:
        """``value`` in ``key``'s slot (copied there), or ``value`` itself where the block has no
        slot of its size and dtype."""
        slot = self._slots.get(key)
        if slot is None or slot.dtype != value.dtype or slot.numel() != value.numel():
            return value
        if slot.data_ptr() != value.data_ptr():
            slot.copy_(value.reshape(-1))
        return slot

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a slot of this file (its storage is one of the mappings)."""
        return tensor.untyped_storage().data_ptr() in self._storages

    def release_pages(self) -> None:
        """Drop the mappings' pages from the process's resident set (MADV_DONTNEED on a shared
        file mapping: the next access maps them again from the page cache, or the file)."""
        for region in self._maps:
            region.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Close the file (its mappings stay while tensors view them; the space is freed with the last)."""
        self._slots.clear()
        self._file.close()
