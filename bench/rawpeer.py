"""Raw-TCP baseline peer for bench/run.py: plain Python sockets, no framing library, no torch.

Runs as its own process (like a PS node) so the baseline crosses the same process boundary as a
Shardline pull or push. It listens on 127.0.0.1 (port 0), writes ``{"pid", "addr"}`` to
``--ready-file`` and serves each connection on a thread. A connection starts with a 9-byte hello,
``struct(">cQ")`` = (mode, size), and then loops in that mode until the peer closes:

* ``G`` (get, the pull baseline): each 1-byte request is answered with ``size`` bytes sent by one
  ``sendall`` from a buffer preallocated at hello time.
* ``C`` (chunked get): as ``G`` but sent as 1 MiB ``sendall`` calls; the baseline is the faster
  of ``G`` and ``C`` in each repetition, so framing into blocks is not what makes Shardline look good.
* ``P`` (put, the push baseline): ``size`` bytes are received with ``recv_into`` into a
  preallocated buffer, then a 1-byte ack is sent.
* ``E`` (echo, the latency baseline): ``size`` bytes are received into a preallocated buffer and
  sent back (request/response ping-pong of equal sizes).

Sockets get TCP_NODELAY, as Shardline's TCP transport sets; other options are kernel defaults
unless ``--sockbuf`` sets SO_SNDBUF/SO_RCVBUF. SIGTERM ends the process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import struct
import sys
import threading

HELLO = struct.Struct(">cQ")
CHUNK = 1 << 20  # mode C sends in 1 MiB sendalls, as a PS sends 1 MiB blocks
MAX_SIZE = 1 << 30


def tune(sock: socket.socket, sockbuf: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sockbuf:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, sockbuf)


def recv_exactly_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill ``view``; False if the peer closed first."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            return False
        got += r
    return True


def serve(conn: socket.socket) -> None:
    hello = bytearray(HELLO.size)
    if not recv_exactly_into(conn, memoryview(hello)):
        return
    mode, size = HELLO.unpack(hello)
    if not 0 < size <= MAX_SIZE or mode not in (b"G", b"C", b"P", b"E"):
        return
    buf = bytearray(size)
    view = memoryview(buf)
    if mode in (b"G", b"C"):
        for i in range(0, size, 4096):  # touch the pages once, outside any timed transfer
            buf[i] = i & 0xFF
        req = bytearray(1)
        chunks = [view] if mode == b"G" else [view[i:i + CHUNK] for i in range(0, size, CHUNK)]
        while recv_exactly_into(conn, memoryview(req)):
            for chunk in chunks:
                conn.sendall(chunk)
    elif mode == b"P":
        while recv_exactly_into(conn, view):
            conn.sendall(b"k")
    else:
        while recv_exactly_into(conn, view):
            conn.sendall(view)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ready-file", required=True)
    p.add_argument("--sockbuf", type=int, default=0, help="SO_SNDBUF/SO_RCVBUF bytes (0 = kernel default)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    from shardline.services.daemon import arm_parent_death_signal  # noqa: PLC0415 - the project's, not a framing helper

    arm_parent_death_signal()
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(16)
    host, port = lsock.getsockname()
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"pid": os.getpid(), "addr": f"{host}:{port}"}, fh)
    os.replace(tmp, args.ready_file)

    def run(conn):
        try:
            tune(conn, args.sockbuf)
            serve(conn)
        except OSError:
            pass
        finally:
            conn.close()

    while True:
        conn, _ = lsock.accept()
        threading.Thread(target=run, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
