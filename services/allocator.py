"""How a daemon's C allocator gives freed memory back (glibc malloc, through ``mallopt``).

By default glibc's malloc maps an allocation of 128 KiB or more on its own, but raises that
threshold to the size of every such block freed (up to 32 MiB): after one step of a PS node the
transient buffers of a step (payload decoding, clones for a handover, pooled gradients) come from
the heap, and a freed heap block stays in the process. It also keeps an arena per thread that
ever allocated (up to 8 per core), each holding its own freed blocks. ``bound_freed_memory``
fixes the threshold (a freed large block goes back to the kernel at once) and caps the arenas;
bench/ps_memory.py measures what it saves (docs/operations.md, "Memory").

A user's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_ARENA_MAX`` wins: those settings are left as
glibc read them from the environment.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("shardline.allocator")

M_MMAP_THRESHOLD = -3   # glibc's malloc.h
M_ARENA_MAX = -8
MMAP_THRESHOLD_BYTES = 128 * 1024
ARENA_MAX = 2


def bound_freed_memory(environ=None) -> dict[str, int]:
    """Set glibc malloc's mmap threshold and arena cap unless the environment set them; returns
    what was set ({} where the C library is not glibc or refused)."""
    environ = os.environ if environ is None else environ
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):   # not glibc (musl, macOS): its allocator is its own
        log.debug("no mallopt in this C library: the allocator's defaults stay")
        return {}
    applied = {}
    for env, param, value in (("MALLOC_MMAP_THRESHOLD_", M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                              ("MALLOC_ARENA_MAX", M_ARENA_MAX, ARENA_MAX)):
        if env in environ:
            continue
        if mallopt(param, value) == 1:
            applied[env] = value
        else:
            log.warning("mallopt refused %s=%d: the allocator keeps its default", env, value)
    return applied
