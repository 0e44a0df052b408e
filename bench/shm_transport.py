"""The bare shm transport: 64 MiB through one ShmConnection between two processes, no Shardline above it.

    .venv/bin/python bench/shm_transport.py [--reps 20]

A forked child and this process share a Unix socketpair wrapped in ``ShmConnection`` on each
side. "pull": a 1-byte request, 64 MiB back as one frame's 64 blocks of 1 MiB (``sendall_many``,
as services/frame.py sends them); "push": the same blocks the other way, then a 1-byte ack.
Both are received block by block with ``recv_exactly_into`` into preallocated tensors. Also
timed: an in-process ``torch`` copy of 64 MiB (one memcpy; a shm transfer takes two). Prints
median ms and GB/s; compare with bench/run.py's shm rows (Shardline on top) in the same period.
The child exits when its socket closes, and gets SIGTERM if this process dies.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch

from shardline.services import frame
from shardline.services.daemon import PARENT_PID_ENV, arm_parent_death_signal
from shardline.services.transport.shm import ShmConnection

TOTAL = 64 << 20
BLOCK = 1 << 20


def blocks_of(t: torch.Tensor) -> list[memoryview]:
    view = frame.tensor_bytes(t)
    return [view[i:i + BLOCK] for i in range(0, TOTAL, BLOCK)]


def receive(conn: ShmConnection, dests: list[memoryview]) -> None:
    for d in dests:
        frame.recv_exactly_into(conn, d)


def child(conn: ShmConnection, reps: int) -> None:
    src = blocks_of(torch.randn(TOTAL // 4))
    dst = blocks_of(torch.empty(TOTAL // 4))
    one = memoryview(bytearray(1))
    for _ in range(reps):  # pulls: answer each request with the 64 blocks
        frame.recv_exactly_into(conn, one)
        conn.sendall_many(src)
    for _ in range(reps):  # pushes: take the blocks, ack
        receive(conn, dst)
        conn.sendall(b"k")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    reps = args.reps + 2  # the first two warm the rings and the pages up, untimed
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        a.close()
        try:
            os.environ[PARENT_PID_ENV] = str(os.getppid())
            arm_parent_death_signal()
            b.settimeout(60)
            child(ShmConnection(b), reps)
        finally:
            os._exit(0)
    b.close()
    a.settimeout(60)
    conn = ShmConnection(a)
    try:
        dst = blocks_of(torch.empty(TOTAL // 4))
        src = blocks_of(torch.randn(TOTAL // 4))
        one = memoryview(bytearray(1))
        pull, push = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall(b"g")
            receive(conn, dst)
            pull.append(time.perf_counter() - t0)
        for _ in range(reps):
            t0 = time.perf_counter()
            conn.sendall_many(src)
            frame.recv_exactly_into(conn, one)
            push.append(time.perf_counter() - t0)
    finally:
        conn.close()
        os.waitpid(pid, 0)
    x, y = torch.empty(TOTAL // 4), torch.randn(TOTAL // 4)
    x.copy_(y)
    copy = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        x.copy_(y)
        copy.append(time.perf_counter() - t0)
    for name, times in (("shm pull", pull[2:]), ("shm push", push[2:]), ("in-process torch copy_", copy)):
        med = statistics.median(times)
        print(f"{name:24s} 64 MiB: median {med * 1e3:6.2f} ms = {TOTAL / med / 1e9:5.2f} GB/s ({len(times)} reps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
