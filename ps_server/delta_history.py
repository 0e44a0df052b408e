"""The bf16 images of blocks a PS node sent to subscribers: the bases of element-level deltas.

A subscriber names the version of each block it holds; the node can send only the elements that
changed since then if it still has that version's bf16 image. Images are recorded lazily, when a
subscriber pull sends a block (the reply's own bf16 copy is kept, so recording copies nothing and
the BSP apply path does no extra work for any job): a version some subscriber holds is exactly a
version some subscriber was sent. Bounded: at most ``max_versions`` images per block and
``max_bytes`` in all, the least recently recorded or used dropped first. A base the history lacks
(older than what it keeps, or a node that took the block over and never sent it) gets the dense
block. ``max_bytes`` 0 keeps nothing (every subscriber block dense).

Keys carry the job's uid, so a job deleted and created again under its name never meets the
images of the old one. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from shardline.services import delta, frame
from shardline.services.pb import dataplane_pb2 as dp

DEFAULT_MAX_VERSIONS = 4
DEFAULT_MAX_BYTES = 256 * 1024 ** 2   # the delta_history_bytes option's default


class DeltaHistory:
    def __init__(self, max_bytes: int, max_versions: int = DEFAULT_MAX_VERSIONS):
        if max_bytes < 0 or max_versions < 1:
            raise ValueError(f"DeltaHistory needs max_bytes >= 0 and max_versions >= 1, got {max_bytes!r}, "
                             f"{max_versions!r}")
        self.max_bytes = max_bytes
        self.max_versions = max_versions
        self.bytes = 0
        self._images: OrderedDict[tuple, torch.Tensor] = OrderedDict()   # (block key, version) -> bf16, LRU order
        self._versions: dict[tuple, list[int]] = {}                      # block key -> versions held
        self._lock = threading.Lock()

    def get(self, key: tuple, version: int) -> torch.Tensor | None:
        """The bf16 image of block ``key`` (job uid, job, tensor, index) at ``version``, if held."""
        with self._lock:
            image = self._images.get((key, version))
            if image is not None:
                self._images.move_to_end((key, version))
            return image

    def record(self, key: tuple, version: int, image: torch.Tensor) -> None:
        """Keep ``image`` (a bf16 tensor nobody writes to again) as block ``key`` at ``version``."""
        nbytes = image.numel() * image.element_size()
        if nbytes > self.max_bytes:
            return
        with self._lock:
            if (key, version) in self._images:
                self._images.move_to_end((key, version))
                return
            held = self._versions.setdefault(key, [])
            while len(held) >= self.max_versions:
                self._drop(key, min(held))
            self._images[(key, version)] = image
            held.append(version)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                (old_key, old_version), _ = next(iter(self._images.items()))
                self._drop(old_key, old_version)

    def forget_job(self, uid: str, job: str) -> None:
        """Drop every image of one job incarnation (deleted, or dropped from this node)."""
        with self._lock:
            for key in [k for k in self._versions if k[:2] == (uid, job)]:
                for version in list(self._versions[key]):
                    self._drop(key, version)

    def job_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes of the images held, by job incarnation (uid, job)."""
        totals: dict[tuple[str, str], int] = {}
        with self._lock:
            for (key, _version), image in self._images.items():
                totals[key[:2]] = totals.get(key[:2], 0) + image.numel() * image.element_size()
        return totals

    def __len__(self) -> int:
        return len(self._images)

    def _drop(self, key: tuple, version: int) -> None:
        image = self._images.pop((key, version))
        self.bytes -= image.numel() * image.element_size()
        held = self._versions[key]
        held.remove(version)
        if not held:
            del self._versions[key]


def subscriber_blocks(history: DeltaHistory, job_key: tuple[str, str], blocks, bases: dict) -> list:
    """The reply blocks of a subscriber pull: ``[(BlockRef, payload)]`` for ``blocks`` as
    JobStore.changed_blocks returns them (copies made under the job's lock, so each is the block's
    value at its version), ``bases`` the version the subscriber holds of each (tensor, index), or
    None. A bf16 block goes as a BF16_DELTA against its base where the history holds the base and
    the delta is smaller; each block's image is recorded for the next pull."""
    out = []
    for tensor, index, version, value in blocks:
        ref = frame.block_ref(tensor, index, value, version=version)
        ref.checksum = delta.checksum(value)
        payload = frame.tensor_bytes(value)
        if value.dtype == torch.bfloat16:
            key = (*job_key, tensor, index)
            base_version = bases.get((tensor, index))
            base = None if base_version is None else history.get(key, base_version)
            encoded = None if base is None else delta.encode_delta(base, value)
            if encoded is not None:
                k, payload = encoded
                ref.dtype, ref.delta_elements, ref.base_version, ref.nbytes = dp.BF16_DELTA, k, base_version, len(payload)
            history.record(key, version, value)
        out.append((ref, payload))
    return out
