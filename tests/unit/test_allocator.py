"""services/allocator.py: with the PS's default ``malloc: bounded`` the buffers a step frees go
back to the kernel; with glibc's defaults they stay in the process (what the kernel counts as the
process's anonymous memory is the reference). Each case runs in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardline.services.allocator import bound_freed_memory

MIB = 1024 * 1024


def freed_but_kept(bounded: bool) -> float:
    """In this process: MiB of anonymous memory still held after a step-like pattern of large
    buffers (a 16 MiB one, then 64 buffers of 1 MiB) was allocated, written and freed while a
    small block allocated after each lives on."""
    import torch

    from shardline.ps_server.memory_report import process_memory

    if bounded:
        assert bound_freed_memory({}) == {"MALLOC_MMAP_THRESHOLD_": 128 * 1024, "MALLOC_ARENA_MAX": 2}
    before = process_memory()[1]
    big = torch.ones(16 * MIB // 4)
    del big                                  # glibc by default raises its mmap threshold to 16 MiB here
    buffers, pinned = [], []
    for _ in range(64):
        buffers.append(torch.ones(MIB // 4))
        pinned.append(torch.ones(16 * 1024))  # small records that live on, between them in the heap
    del buffers
    kept = (process_memory()[1] - before) / MIB
    del pinned
    return kept


@pytest.mark.parametrize("bounded", [True, False])
def test_freed_step_buffers_go_back_to_the_kernel_only_when_bounded(bounded):
    out = subprocess.run([sys.executable, __file__, json.dumps(bounded)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kept = json.loads(out.stdout)
    if bounded:
        assert kept < 8, kept
    else:
        assert kept > 16, kept               # the 1 MiB buffers came from the heap, and most stayed


def test_the_environment_wins_over_the_option():
    script = ("import json; from shardline.services.allocator import bound_freed_memory; "
              "print(json.dumps(bound_freed_memory({'MALLOC_ARENA_MAX': '4'})))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"MALLOC_MMAP_THRESHOLD_": 128 * 1024}


if __name__ == "__main__":
    print(json.dumps(freed_but_kept(json.loads(sys.argv[1]))))
