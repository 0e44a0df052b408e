"""The bare shm transport: 64 MiB through one ShmConnection between two processes, no Shardline above it.

    .venv/bin/python bench/shm_transport.py [--reps 20]

A forked child and this process share a Unix socketpair wrapped in ``ShmConnection`` on each
side. "pull": a 1-byte request, 64 MiB back as one frame's 64 blocks of 1 MiB (``sendall_many``,
as services/frame.py sends them); "push": the same blocks the other way, then a 1-byte ack.
Both are received block by block with ``recv_exactly_into`` into preallocated tensors. Also
timed: an in-process ``torch`` copy of 64 MiB (one memcpy; a shm transfer takes two). Prints
median ms and GB/s; compare with bench/run.py's shm rows (Shardline on top) in the same period.
The child exits when its socket closes, and gets SIGTERM if this process dies.

``--kernel-copies`` also times what one copy through the kernel would give a push of memory the
receiver cannot map (a plain tensor, not a shared gradient buffer): the sender ``vmsplice``s
its pages into two pipes and the receiver's two threads read them into place (the kernel copies
once), and ``process_vm_readv`` by two threads of the receiver (this process; reading a child's
memory needs no ptrace grant under Yama's default scope). Each is checked once against the data.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np
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


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_F_SETPIPE_SZ = 1031
KERNEL_THREADS = 2


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.vmsplice.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint]
    libc.vmsplice.restype = ctypes.c_ssize_t
    libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                                      ctypes.c_ulong, ctypes.c_ulong]
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    return libc


def _halves() -> list[tuple[int, int]]:
    step = TOTAL // KERNEL_THREADS
    return [(i * step, (i + 1) * step) for i in range(KERNEL_THREADS)]


def _in_threads(work) -> None:
    threads = [threading.Thread(target=work, args=span) for span in _halves()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _fork(child_main) -> int:
    """Run ``child_main`` in a forked child that gets SIGTERM if this process dies; its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.environ[PARENT_PID_ENV] = str(os.getppid())
            arm_parent_death_signal()
            child_main()
        finally:
            os._exit(0)
    return pid


def _data() -> np.ndarray:
    """The kernel copies' 64 MiB, the same in every process. numpy, not torch: a child forked after
    this process ran torch's thread pool would hang in its first parallel torch call."""
    return np.random.default_rng(11).standard_normal(TOTAL // 4, dtype=np.float32)


def vmsplice_copies(reps: int) -> list[float]:
    """This process vmsplices 64 MiB into two pipes of 1 MiB, alternating; a child reads each pipe
    with a thread of its own into its half of a preallocated tensor (one copy, by the kernel).
    Timed here from the start byte to the child's done byte."""
    libc = _libc()
    pipes = [os.pipe() for _ in range(KERNEL_THREADS)]
    for _r, w in pipes:
        fcntl.fcntl(w, _F_SETPIPE_SZ, BLOCK)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()

    def child() -> None:
        dst = np.zeros(TOTAL // 4, dtype=np.float32)
        view = memoryview(dst).cast("B")
        expected = _data()

        def read(lo: int, hi: int) -> None:
            fd = pipes[lo * KERNEL_THREADS // TOTAL][0]
            while lo < hi:
                n = os.readv(fd, [view[lo:hi]])
                if n == 0:
                    raise EOFError("the sender closed its pipe")
                lo += n

        for rep in range(reps):
            if os.read(go_r, 1) != b"g":
                return
            _in_threads(read)
            os.write(done_w, b"k" if rep or np.array_equal(dst, expected) else b"x")

    pid = _fork(child)
    src = _data()
    base = src.ctypes.data
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            os.write(go_w, b"g")
            at = [lo for lo, _hi in _halves()]
            ends = [hi for _lo, hi in _halves()]
            while any(a < e for a, e in zip(at, ends)):
                for i, (_r, w) in enumerate(pipes):
                    if at[i] < ends[i]:
                        iov = _IoVec(base + at[i], min(BLOCK, ends[i] - at[i]))
                        n = libc.vmsplice(w, ctypes.byref(iov), 1, 0)
                        if n < 0:
                            raise OSError(ctypes.get_errno(), "vmsplice")
                        at[i] += n
            if os.read(done_r, 1) != b"k":
                raise AssertionError("vmsplice: the child's copy differs from the data")
            times.append(time.perf_counter() - t0)
    finally:
        for fd in (go_w, *(w for _r, w in pipes)):
            os.close(fd)
        os.waitpid(pid, 0)
    return times


def process_vm_readv_copies(reps: int) -> list[float] | str:
    """A child holds 64 MiB; two threads of this process copy it out with process_vm_readv, 1 MiB
    per call, into a preallocated tensor (one copy, by the kernel). Returns the reason instead of
    times where the kernel refuses (ptrace rules)."""
    libc = _libc()
    addr_r, addr_w = os.pipe()
    quit_r, quit_w = os.pipe()

    def child() -> None:
        src = _data()
        os.write(addr_w, src.ctypes.data.to_bytes(8, "little"))
        os.read(quit_r, 1)

    pid = _fork(child)
    try:
        base = int.from_bytes(os.read(addr_r, 8), "little")
        dst = np.zeros(TOTAL // 4, dtype=np.float32)
        into = dst.ctypes.data
        failed: list[int] = []

        def read(lo: int, hi: int) -> None:
            for at in range(lo, hi, BLOCK):
                local, remote = _IoVec(into + at, BLOCK), _IoVec(base + at, BLOCK)
                if libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) != BLOCK:
                    failed.append(ctypes.get_errno())
                    return

        times = []
        for rep in range(reps):
            t0 = time.perf_counter()
            _in_threads(read)
            times.append(time.perf_counter() - t0)
            if failed:
                return f"process_vm_readv refused: {os.strerror(failed[0])}"
            if rep == 0 and not np.array_equal(dst, _data()):
                raise AssertionError("process_vm_readv: the copy differs from the child's data")
        return times
    finally:
        os.write(quit_w, b"q")
        os.waitpid(pid, 0)


def print_row(name: str, times: list[float]) -> None:
    med = statistics.median(times)
    print(f"{name:24s} 64 MiB: median {med * 1e3:6.2f} ms = {TOTAL / med / 1e9:5.2f} GB/s ({len(times)} reps)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--kernel-copies", action="store_true",
                   help="also time one copy through the kernel: vmsplice into pipes, process_vm_readv")
    args = p.parse_args(argv)
    reps = args.reps + 2  # the first two warm the rings and the pages up, untimed
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def serve() -> None:
        a.close()
        b.settimeout(60)
        child(ShmConnection(b), reps)

    pid = _fork(serve)
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
        print_row(name, times)
    if args.kernel_copies:
        print_row("vmsplice, 2 pipes", vmsplice_copies(reps)[2:])
        readv = process_vm_readv_copies(reps)
        if isinstance(readv, str):
            print(f"{'process_vm_readv':24s} not measured: {readv}")
        else:
            print_row("process_vm_readv, 2 thr", readv[2:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
