"""Shared-memory transport for peers on the same host: frame bytes through a ring of a sealed
memfd, not a socket; ``ShmConnection`` has the socket methods the frame codec, the client and the
PS loop use (``recv_into``, ``sendall``, ``settimeout``, ``fileno``, ``shutdown``, ``close``).

The 16-byte messages on a connection's Unix socket (``MESSAGE``: kind, length, offset):
``INLINE`` (bytes follow on the socket), ``CHUNK`` (a doorbell: bytes at ``offset`` of the
sender's segment), ``CREDIT`` (the receiver copied out more bytes, in order), ``SEGMENT`` (the
sender's ring, fd attached), ``REGION`` (a client's shared region, fd on the byte that follows),
``UNSHARE`` (unmap a region). States: per direction, a ring segment *none* -> *shared* (on the
first large send); per client region *private* -> *shared* (``REGION``, once per connection) ->
*revoked* (moved to a fresh memfd, old id ``UNSHARE``d) -> shared again under a new id.

Contract: a peer can never make the other side fault (segments and regions are sealed against
resizing, mapped read-only by the receiver where only read, at most MAX_PEER_RING_BYTES); every
CHUNK and CREDIT is checked against what was sent and the window, buffered inline bytes are
bounded, and any violation raises ``ShmProtocolError`` (a ConnectionError) and closes the
connection. Nothing is created in /dev/shm; a killed process leaves no socket file.

Design: docs/architecture.md, "Shared-memory transport".
"""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import ipaddress
import logging
import mmap
import os
import select
import socket
import stat
import struct
import threading
import time

from shardline.services.daemon import parse_host_port
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError
from shardline.services.transport import tcp
from shardline.services.transport.base import PLAIN, Capabilities

try:  # services/_copycheck.c, built by the install; without it a pull's placement is a cached copy
    from shardline.services import _copycheck
except ImportError:  # pragma: no cover - tests/unit/test_tensor_checks.py fails where it is missing
    _copycheck = None

log = logging.getLogger("shardline.transport.shm")


def _slice_copy(dst, src) -> None:
    dst[:] = src


# A plain copy of bytes: the C module's lets other threads run while it copies (two node threads
# placing two ranks' pulls, a client's sender and its training thread); slice assignment holds the GIL.
_copy = _copycheck.copy if _copycheck is not None else _slice_copy

NAME = "shm"
MESSAGE = struct.Struct("<B3xIQ")
INLINE, CHUNK, CREDIT, SEGMENT, REGION, UNSHARE = 1, 2, 3, 4, 5, 6
# Sends up to this size travel inline on the socket (one syscall beats a ring copy + doorbell).
INLINE_MAX_BYTES = 64 * 1024
# Inline bytes a side may buffer while it waits for credit (a legit peer sends one error reply).
MAX_BUFFERED_INLINE_BYTES = 1024 * 1024
# Largest piece one doorbell announces: small enough that the two copies overlap.
CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_RING_BYTES = 16 * 1024 * 1024
MIN_RING_BYTES = 64 * 1024
# Largest segment a side maps from its peer (it costs the mapping side address space only).
MAX_PEER_RING_BYTES = 1024 ** 3
# Regions a side maps from its peer, and their bytes in all (address space, not memory: the
# pages are the peer's).
MAX_PEER_REGIONS = 64
MAX_PEER_REGION_BYTES = 1 << 40
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_ANCILLARY_BYTES = socket.CMSG_SPACE(4 * array.array("i").itemsize)
# plain ints: IntFlag arithmetic costs microseconds per message
_MSG_CTRUNC, _SOL_SOCKET, _SCM_RIGHTS = int(socket.MSG_CTRUNC), int(socket.SOL_SOCKET), int(socket.SCM_RIGHTS)


class ShmProtocolError(ShardlineConnectionError):
    """The peer broke the shm protocol (bad offset, length, credit or segment): the connection closes."""


def check_ring_bytes(value) -> int:
    """``value`` as a ring size in bytes; ShardlineConfigError quoting it when out of bounds."""
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_RING_BYTES <= value <= MAX_PEER_RING_BYTES:
        raise ShardlineConfigError(f"shm_ring_bytes must be an integer in [{MIN_RING_BYTES}, {MAX_PEER_RING_BYTES}], "
                                   f"got {value!r}")
    return value


def endpoint_name(address: str) -> bytes:
    """The abstract Unix socket name of the shm endpoint of the PS advertising data ``address``."""
    return b"\0shardline-dataplane/" + address.encode()


@functools.lru_cache(maxsize=1)
def shm_supported() -> tuple[bool, str]:
    """(True, "") if this kernel gives sealed memfds (a sandbox may refuse memfd_create), else (False, why)."""
    try:
        fd = os.memfd_create("shardline-shm-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as exc:
        return False, f"memfd_create is not available ({exc})"
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return True, ""
    except OSError as exc:
        return False, f"memfds cannot be sealed here ({exc})"
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """True if ``host`` (a data-plane address host) is loopback or one of this host's addresses:
    only an address assigned here can be bound."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except (OSError, ValueError):
            return False
    if ip.is_loopback:
        return True
    if ip.is_unspecified:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


class ShmConnection:
    """One end of a shm connection over the connected Unix stream socket ``sock`` (see the module
    docstring). Used by one thread at a time, like a socket; ``close`` may come from another."""

    CAPABILITIES = Capabilities(shares_memory=True, checks_on_copy=True, signals_between_frames=True,
                                gathers_sends=True)

    def __init__(self, sock: socket.socket, *, ring_bytes: int = DEFAULT_RING_BYTES):
        self._sock = sock
        self._ring_bytes = ring_bytes
        self._message = bytearray(MESSAGE.size)
        self._map_lock = threading.Lock()   # a mapping is never unmapped mid-copy
        self._closed = False
        self._broken: BaseException | None = None  # what wait_readable ran into, raised by the next read
        # our segment (what we send): bytes written in all and bytes the peer gave back
        self._tx: mmap.mmap | None = None
        self._tx_view: memoryview | None = None
        self._tx_head = 0
        self._tx_freed = 0
        # the peer's segment (what we receive), read-only
        self._rx: mmap.mmap | None = None
        self._rx_view: memoryview | None = None
        self._rx_next = 0         # offset the next CHUNK must start at
        self._rx_unacked = 0      # bytes of announced chunks not yet given back
        self._inline_buffered = 0
        # received, not yet consumed: [kind, source, position, length]; source is bytes (INLINE) or an offset
        self._pending: collections.deque = collections.deque()
        self._shared: set[int] = set()              # ids of our regions the peer has
        self._peer_regions: dict[int, mmap.mmap] = {}   # the peer's regions, mapped writable
        self._copying = 0   # copies to or from them in progress (they may run in parallel, outside the lock)
        self._retired: list[mmap.mmap] = []   # unshared while copies ran: unmapped after the last

    # --- socket-like surface ------------------------------------------------------------------
    def fileno(self) -> int:
        return self._sock.fileno()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        with self._map_lock:
            if self._closed:
                return
            self._closed = True
            self._pending.clear()
            for view, segment in ((self._tx_view, self._tx), (self._rx_view, self._rx)):
                if view is not None:
                    view.release()
                if segment is not None:
                    segment.close()
            self._tx_view = self._tx = self._rx_view = self._rx = None
            if not self._copying:  # else the last copy still running unmaps them
                self._unmap_regions()
        _drain(self._sock)
        self._sock.close()

    def sendall(self, data, flags: int = 0) -> None:
        self._raise_broken()
        src = _byte_view(data)
        n = len(src)
        if n <= INLINE_MAX_BYTES:
            if n:
                self._sock.sendall(MESSAGE.pack(INLINE, n, 0) + src.tobytes())
            return
        self._send_through_ring([src])

    def sendall_many(self, buffers) -> None:
        """``sendall`` of each of ``buffers`` in turn (a frame's payload blocks), with fewer
        doorbells: consecutive buffers are announced together in chunks of up to CHUNK_BYTES, so
        64 blocks of 1 MiB cost 16 CHUNK and 16 CREDIT messages (and peer wake-ups), not 64 each."""
        self._raise_broken()
        views = [v for v in map(_byte_view, buffers) if len(v)]
        if sum(len(v) for v in views) <= INLINE_MAX_BYTES:
            for v in views:
                self.sendall(v)
            return
        self._send_through_ring(views)

    def _send_through_ring(self, views: list) -> None:
        """Copy ``views`` into our segment in order, announcing them in CHUNKs of at most
        CHUNK_BYTES that never cross the ring's end; waits for credit when the ring is full
        (after announcing what it wrote, so the peer can free it)."""
        if self._tx is None:
            self._create_segment()
        size, total, done = self._ring_bytes, sum(len(v) for v in views), 0
        announced = self._tx_head  # bytes before this offset (of all ever written) are announced
        for src in views:
            n, sent = len(src), 0
            while sent < n:
                at = self._tx_head % size
                pending = self._tx_head - announced
                if pending and (pending >= CHUNK_BYTES or at == 0):  # full chunk, or the ring wrapped
                    announced = self._doorbell(announced)
                    continue
                k = min(n - sent, size - (self._tx_head - self._tx_freed), size - at, CHUNK_BYTES - pending)
                if k == 0:
                    if pending:
                        announced = self._doorbell(announced)
                    elif not self._pump():
                        raise ConnectionError(f"peer closed the connection after {done} of {total} bytes")
                    continue
                with self._map_lock:
                    if self._closed:
                        raise OSError(errno.EBADF, "shm connection is closed")
                    _copy(self._tx_view[at:at + k], src[sent:sent + k])
                self._tx_head += k
                sent += k
                done += k
        if self._tx_head > announced:
            self._doorbell(announced)

    def _doorbell(self, announced: int) -> int:
        """Announce our segment's bytes from ``announced`` to the head as one CHUNK; the new mark."""
        self._sock.sendall(MESSAGE.pack(CHUNK, self._tx_head - announced, announced % self._ring_bytes))
        return self._tx_head

    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        """Copy up to ``nbytes`` (default: all of ``buffer``) received bytes into ``buffer``; 0 once
        the peer closed the connection, like a socket."""
        return self._receive(buffer, nbytes, None)[0]

    def recv_checked_into(self, buffer, nbytes: int = 0, start: int = 0) -> tuple[int, bool, list[int]]:
        """``recv_into`` for bytes of a float32 array, ``buffer`` holding them from the array's byte
        ``start``: each value is checked for NaN/Inf as it is copied out of the ring
        (tensor_checks.copy_span_checked), so what is checked is the receiver's copy, never the
        ring the peer could still write. Returns (bytes copied, True if every value lying wholly
        in one copy is finite, the array offsets at which a copy ended inside a value: the caller
        checks those values in its own copy once they are whole; frame.recv_checked_into)."""
        return self._receive(buffer, nbytes, start)

    def _receive(self, buffer, nbytes: int, start: int | None) -> tuple[int, bool, list[int]]:
        self._raise_broken()
        dst = _byte_view(buffer)
        want = min(nbytes or len(dst), len(dst))
        finite, cuts = True, []
        if want == 0:
            return 0, finite, cuts
        while not self._pending:
            if not self._pump():
                return 0, finite, cuts
        got = 0
        while got < want and self._pending:
            item = self._pending[0]
            kind, source, pos, length = item
            k = min(want - got, length - pos)
            if kind == INLINE:
                finite = self._copy_out(dst[got:got + k], source[pos:pos + k], start, got) and finite
            else:
                with self._map_lock:
                    if self._closed:
                        raise OSError(errno.EBADF, "shm connection is closed")
                    finite = self._copy_out(dst[got:got + k], self._rx_view[source + pos:source + pos + k], start,
                                            got) and finite
            got += k
            if start is not None and (start + got) % 4:
                cuts.append(start + got)
            item[2] = pos + k
            if item[2] == length:
                self._pending.popleft()
                if kind == INLINE:
                    self._inline_buffered -= length
                else:
                    self._rx_unacked -= length
                    try:
                        self._sock.sendall(MESSAGE.pack(CREDIT, length, 0))
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the peer finished and left: what it sent is here, the next read says it ended
        return got, finite, cuts

    @staticmethod
    def _copy_out(dst, src, start: int | None, got: int) -> bool:
        if start is None:
            _copy(dst, src)
            return True
        *_, copy_span_checked = _tensor_helpers()   # imported once, not per chunk
        return copy_span_checked(dst, src, start + got)

    def wait_readable(self, timeout: float | None) -> bool:
        """True once frame bytes are pending (or the connection ended or broke: the next read says
        which); False after ``timeout``. Credits arriving meanwhile are taken, not mistaken for a
        frame (the PS loop waits here between frames)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = select.poll()
        poller.register(self._sock, select.POLLIN | select.POLLPRI)
        while not self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not poller.poll(None if left is None else int(left * 1000)):
                return False
            try:
                if not self._pump():
                    return True
            except (OSError, ConnectionError) as exc:
                self._broken = exc  # the stream cannot be trusted past this: every later call raises it
                return True
        return True

    def _raise_broken(self) -> None:
        if self._broken is not None:
            raise self._broken

    # --- regions: memory the peer writes into -------------------------------------------------
    def share_region(self, region: "SharedRegion") -> None:
        """Give the peer ``region`` (once per connection; later calls do nothing)."""
        if region.id in self._shared:
            return
        self._raise_broken()
        self._sock.sendall(MESSAGE.pack(REGION, region.id, region.size))
        socket.send_fds(self._sock, [b"\0"], [region.fd])
        self._shared.add(region.id)

    def unshare_region(self, region_id: int) -> None:
        """Tell the peer to unmap our region ``region_id`` (if it has it)."""
        if region_id not in self._shared:
            return
        self._shared.discard(region_id)
        self._sock.sendall(MESSAGE.pack(UNSHARE, region_id, 0))

    def region_size(self, region_id: int) -> int:
        """The size of the peer's region ``region_id``; 0 if the peer shared none by that id."""
        region = self._peer_regions.get(region_id)
        return 0 if region is None else len(region)

    def place(self, region_id: int, offset: int, value) -> None:
        """Copy tensor ``value`` (contiguous) to ``offset`` of the peer's region ``region_id``. The
        caller checked the bounds (``region_size``); they are checked again here. Several threads
        may place at once; a ``close`` meanwhile unmaps once the last of them is done."""
        self.place_many([(region_id, offset, value)])

    def place_many(self, items, *, stream: bool = False) -> None:
        """``place`` of each ``(region_id, offset, value)``: one lock round for all of them, then
        byte copies through byte views (_copy_bytes: cheap per block, for a pull of many small ones).

        ``stream``: the copies bypass this process's caches (for a large pull, which the caches
        would not keep: about two thirds of the time of a cached copy; a small one is better left
        in the shared cache, where the peer reads it next)."""
        self._copy_regions(items, into_region=True, stream=stream)

    def take_many(self, items, *, checked: bool = False) -> int | None:
        """Copy into each ``(region_id, offset, dest)``'s tensor ``dest`` (contiguous) its bytes at
        ``offset`` of the peer's region ``region_id`` (a push's blocks the peer left in its memory):
        bounds checked first, then byte copies (_copy_bytes). What the peer writes there meanwhile may
        tear the copy; the caller checks the copy, never the region.

        ``checked``: a copy per item instead, each checked for NaN/Inf as it is made
        (tensor_checks.copy_span_checked), and the index of the first item whose copy holds one is
        returned (the items after it are left uncopied); None means every copy is finite."""
        return self._copy_regions(items, into_region=False, checked=checked)

    def _copy_regions(self, items, *, into_region: bool, checked: bool = False, stream: bool = False) -> int | None:
        """Check every ``(region_id, offset, tensor)`` against its region (all or nothing), then
        copy the tensors into the regions or the regions into the tensors (``checked``: see
        take_many). Several threads may copy at once; a ``close`` or unshare meanwhile unmaps once
        the last of them is done."""
        targets = []  # (item index, region, offset, tensor) of the copies that move bytes
        with self._map_lock:
            for i, (region_id, offset, tensor) in enumerate(items):
                region = self._peer_regions.get(region_id)
                if self._closed or region is None:
                    raise OSError(errno.EBADF, f"no region {region_id} on this shm connection")
                nbytes = tensor.numel() * tensor.element_size()
                if not tensor.is_contiguous():  # its bytes are not one span: a byte copy would miss them
                    raise ValueError(f"a block copied to or from region {region_id} must be contiguous")
                if offset < 0 or offset + nbytes > len(region) or offset % tensor.element_size():
                    raise ValueError(f"{nbytes} bytes at offset {offset} do not fit region {region_id} "
                                     f"of {len(region)} bytes (aligned to {tensor.element_size()})")
                if nbytes:
                    targets.append((i, region, offset, tensor))
            self._copying += 1
        try:
            return _copy_bytes(targets, into_region, stream=stream, checked=checked) if targets else None
        finally:
            with self._map_lock:
                self._copying -= 1
                if not self._copying:
                    if self._closed:
                        self._unmap_regions()
                    for region in self._retired:
                        region.close()
                    self._retired.clear()

    def _unmap_regions(self) -> None:
        """Call with the map lock held, no copy into a region running."""
        for region in [*self._peer_regions.values(), *self._retired]:
            region.close()
        self._peer_regions.clear()
        self._retired.clear()

    def _unshare_peer_region(self, region_id: int) -> None:
        with self._map_lock:
            region = self._peer_regions.pop(region_id, None)
            if region is None:
                return  # never shared, or unshared already: nothing mapped
            if self._copying:
                self._retired.append(region)
            else:
                region.close()

    # --- the protocol -------------------------------------------------------------------------
    def _create_segment(self) -> None:
        fd = _sealed_memfd("shardline-shm", self._ring_bytes)
        try:
            segment = mmap.mmap(fd, self._ring_bytes)
            try:
                socket.send_fds(self._sock, [MESSAGE.pack(SEGMENT, 0, self._ring_bytes)], [fd])
            except BaseException:
                segment.close()
                raise
        finally:
            os.close(fd)
        with self._installing(segment):
            self._tx, self._tx_view = segment, memoryview(segment)

    def _read_message(self) -> tuple[tuple[int, int, int], list[int]] | None:
        """One message header and the fds that came with it; None at a clean end of stream. Once the
        peer's segment is mapped no fd is expected: plain reads, and the kernel drops any fd sent."""
        view, got, fds = memoryview(self._message), 0, []
        if self._rx is not None:
            while got < MESSAGE.size:
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    if got == 0:
                        return None
                    raise ConnectionError(f"peer closed the connection mid-message ({got} of {MESSAGE.size} bytes)")
                got += n
            return MESSAGE.unpack(self._message), fds
        try:
            while got < MESSAGE.size:
                n, ancillary, msg_flags, _ = self._sock.recvmsg_into([view[got:]], _ANCILLARY_BYTES)
                fds.extend(_fds_in(ancillary))
                if msg_flags & _MSG_CTRUNC:
                    raise ShmProtocolError("peer sent more file descriptors than a message carries")
                if n == 0:
                    if got == 0 and not fds:
                        return None
                    raise ConnectionError(f"peer closed the connection mid-message ({got} of {MESSAGE.size} bytes)")
                got += n
        except BaseException:
            _close_fds(fds)
            raise
        return MESSAGE.unpack(self._message), fds

    def _pump(self) -> bool:
        """Read and act on one message (blocking, under the socket's timeout); False at end of stream."""
        read = self._read_message()
        if read is None:
            return False
        (kind, length, offset), fds = read
        if fds and kind != SEGMENT:
            _close_fds(fds)
            raise ShmProtocolError(f"peer sent a file descriptor with message kind {kind}")
        if kind == INLINE:
            if not 0 < length <= INLINE_MAX_BYTES or self._inline_buffered + length > MAX_BUFFERED_INLINE_BYTES:
                raise ShmProtocolError(f"inline message of {length} bytes (limit {INLINE_MAX_BYTES}, "
                                       f"{self._inline_buffered} bytes already buffered)")
            data = bytearray(length)
            _recv_exactly(self._sock, memoryview(data))
            self._pending.append([INLINE, data, 0, length])
            self._inline_buffered += length
        elif kind == CHUNK:
            size = len(self._rx_view) if self._rx_view is not None else 0
            if not size or length == 0 or offset != self._rx_next or offset + length > size \
                    or self._rx_unacked + length > size:
                raise ShmProtocolError(f"chunk of {length} bytes at offset {offset} is outside the peer's segment "
                                       f"(size {size}, next offset {self._rx_next}, {self._rx_unacked} unacknowledged)")
            self._pending.append([CHUNK, offset, 0, length])
            self._rx_unacked += length
            self._rx_next = (offset + length) % size
        elif kind == CREDIT:
            if not 0 < length <= self._tx_head - self._tx_freed:
                raise ShmProtocolError(f"credit of {length} bytes, {self._tx_head - self._tx_freed} outstanding")
            self._tx_freed += length
        elif kind == SEGMENT:
            self._map_peer_segment(offset, fds)
        elif kind == REGION:
            self._map_peer_region(length, offset)
        elif kind == UNSHARE:
            self._unshare_peer_region(length)
        else:
            raise ShmProtocolError(f"unknown shm message kind {kind}")
        return True

    def _map_peer_segment(self, size: int, fds: list[int]) -> None:
        try:
            if len(fds) != 1 or self._rx is not None:
                raise ShmProtocolError(f"segment message with {len(fds)} fds (one segment per direction, once)")
            if not MIN_RING_BYTES <= size <= MAX_PEER_RING_BYTES:
                raise ShmProtocolError(f"peer segment of {size} bytes is not a ring of "
                                       f"[{MIN_RING_BYTES}, {MAX_PEER_RING_BYTES}] bytes")
            check_sealed_file(fds[0], size, "segment")
            segment = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
        finally:
            _close_fds(fds)
        with self._installing(segment):
            self._rx, self._rx_view = segment, memoryview(segment)

    @contextlib.contextmanager
    def _installing(self, mapping: mmap.mmap):
        """Under the map lock, unless the connection closed meanwhile (then ``mapping`` is closed
        and OSError EBADF raised): the body keeps ``mapping``."""
        with self._map_lock:
            if self._closed:
                mapping.close()
                raise OSError(errno.EBADF, "shm connection is closed")
            yield

    def _map_peer_region(self, region_id: int, size: int) -> None:
        """Map the peer's region ``region_id`` of ``size`` bytes, whose fd comes on the next byte."""
        byte, fds = bytearray(1), []
        try:
            n, ancillary, msg_flags, _ = self._sock.recvmsg_into([byte], _ANCILLARY_BYTES)
            fds.extend(_fds_in(ancillary))
            if n == 0:
                raise ConnectionError("peer closed the connection before its region's file descriptor")
            if msg_flags & _MSG_CTRUNC or len(fds) != 1:
                raise ShmProtocolError(f"region message with {len(fds)} file descriptors, not one")
            mapped = sum(len(r) for r in self._peer_regions.values())
            if not region_id or region_id in self._peer_regions or len(self._peer_regions) >= MAX_PEER_REGIONS \
                    or not 0 < size <= MAX_PEER_REGION_BYTES - mapped:
                raise ShmProtocolError(f"region {region_id} of {size} bytes refused ({len(self._peer_regions)} "
                                       f"regions of {mapped} bytes mapped; at most {MAX_PEER_REGIONS} of "
                                       f"{MAX_PEER_REGION_BYTES} bytes, ids unique and > 0)")
            check_sealed_file(fds[0], size, "region")
            region = mmap.mmap(fds[0], size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            _close_fds(fds)
        with self._installing(region):
            self._peer_regions[region_id] = region


@functools.lru_cache(maxsize=1)
def _tensor_helpers() -> tuple:
    """What the copies to and from a region use of torch and the frame and check helpers,
    imported on the first copy (the transport itself moves bytes: importing it imports no torch)
    and then kept: a copy is made per piece of a large transfer, and import statements cost
    microseconds each time, under the interpreter lock the other copy thread waits for."""
    import torch

    from shardline.services.frame import tensor_bytes
    from shardline.services.tensor_checks import all_finite, copy_span_checked

    return torch, tensor_bytes, all_finite, copy_span_checked


def _copy_bytes(targets, into_region: bool, *, stream: bool = False, checked: bool = False) -> int | None:
    """Copy each ``(i, region, offset, tensor)``'s bytes into its region at ``offset`` (or out of
    it), through byte memoryviews: a torch view (or a numpy array) per block costs several times
    the copy of a small block (a pull of a model's many norms and biases), and with two threads
    copying, whatever either does while holding the GIL delays the other; the copies themselves
    (``_copy`` and the C module's others) let other threads run while they copy a large block.
    ``stream``: copies into a region bypass this process's caches (``_copycheck.copy_stream``;
    without the C module, cached copies).
    ``checked`` (out of a region): each copy is checked for NaN/Inf as it is made, and the ``i``
    of the first copy holding one is returned, the targets after it left uncopied; None: all
    finite. The views are gone when this returns, so the caller may unmap the regions."""
    torch, tensor_bytes, all_finite, copy_span_checked = _tensor_helpers()
    wholes: dict = {}
    whole = data = None
    copy_streaming = _copycheck.copy_stream if stream and into_region and _copycheck is not None else None
    try:
        for i, region, offset, tensor in targets:
            whole = wholes.get(id(region))
            if whole is None:
                whole = wholes[id(region)] = memoryview(region).cast("B")
            data = tensor_bytes(tensor)   # writable: the tensor's own bytes
            span = whole[offset:offset + len(data)]
            if checked:
                if tensor.dtype == torch.float32:
                    finite = copy_span_checked(data, span)
                else:
                    _copy(data, span)
                    finite = all_finite(tensor)
                if not finite:
                    return i
            elif copy_streaming:
                copy_streaming(span, data)
            elif into_region:
                _copy(span, data)
            else:
                _copy(data, span)
        return None
    finally:
        for view in wholes.values():
            view.release()
        wholes.clear()
        whole = data = span = None


class SharedRegion:
    """Memory of this process a local peer may write into or read from: a sealed memfd (it can
    neither shrink under the peer's mapping nor grow), mapped here read-write. ``tensor`` views it;
    the fd stays open (for connections made later) until ``close``, the memory until the last view
    is gone."""

    _ids = itertools.count(1)

    def __init__(self, size: int):
        if size <= 0:
            raise ValueError(f"a shared region needs a size > 0, got {size!r}")
        self.id, self.size = next(SharedRegion._ids), size
        self.fd = _sealed_memfd("shardline-region", size)
        try:
            self.memory = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.address = _address_of(self.memory)   # revoke keeps it

    def tensor(self, dtype, offset: int, numel: int):
        import torch

        return torch.frombuffer(self.memory, dtype=dtype, count=numel, offset=offset)

    def offset_of(self, tensor) -> int | None:
        """The offset in this region of contiguous CPU ``tensor``'s bytes; None unless they all lie in it."""
        if not tensor.is_cpu or not tensor.is_contiguous():
            return None
        offset = tensor.data_ptr() - self.address
        return offset if 0 <= offset and offset + tensor.numel() * tensor.element_size() <= self.size else None

    def revoke(self) -> int:
        """Move this region to fresh memory at the same addresses (every view keeps its contents
        and its address) under a new id, so that a peer that still maps the old memory (one that
        stalled mid-copy and that this process gave up on) writes where nobody reads. Returns the
        old id (peers still holding it are told to unshare it). The caller guarantees no copy into
        the region is running (a write into the old memory meanwhile would be lost)."""
        fd = _sealed_memfd("shardline-region", self.size)
        try:
            fresh = mmap.mmap(fd, self.size)
            try:
                fresh[:] = self.memory
            finally:
                fresh.close()
            address = self.address
            mapped = _libc_mmap(address, self.size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                                fd, 0)
            if mapped != address:
                raise OSError(ctypes.get_errno(), f"mmap(MAP_FIXED) of a fresh region failed: {os.strerror(ctypes.get_errno())}")
        except BaseException:
            os.close(fd)
            raise
        old, self.id = self.id, next(SharedRegion._ids)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd = fd
        return old

    def close(self) -> None:
        """Close the fd (no connection gets the region after this); the mapping lives on in its views."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)


def _address_of(memory: mmap.mmap) -> int:
    """The address of ``memory``'s first byte (the export is released again: it would pin the map)."""
    view = ctypes.c_char.from_buffer(memory)
    try:
        return ctypes.addressof(view)
    finally:
        del view


def _sealed_memfd(name: str, size: int) -> int:
    """A memfd of ``size`` bytes sealed against shrinking and growing (the fd; the caller closes it)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fds_in(ancillary) -> list[int]:
    """The file descriptors of SCM_RIGHTS messages in recvmsg's ``ancillary`` data."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
    return fds


def _libc_mmap(address: int, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    result = libc.mmap(address, size, prot, flags, fd, offset)
    return -1 if result is None or result == ctypes.c_void_p(-1).value else result


def check_sealed_file(fd: int, size: int, what: str) -> None:
    """``fd`` is a regular file of ``size`` bytes sealed against resizing: a mapping of it can
    never fault on pages the peer took away."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        raise ShmProtocolError(f"peer {what} of {st.st_size} bytes (announced {size}) is not a file of that size")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SEALS != _SEALS:
        raise ShmProtocolError(f"peer {what} is not sealed against resizing")


def _byte_view(data) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection mid-message ({got} of {len(view)} bytes)")
        got += n


def _drain(sock: socket.socket) -> None:
    """Discard what is already queued (credits the peer sent for our last chunks): a Unix socket
    closed with unread bytes makes the peer's next read fail with ECONNRESET instead of reading
    what we sent it last (an error reply, say)."""
    try:
        sock.setblocking(False)
        for _ in range(16):
            if not sock.recv(65536):
                break
    except OSError:
        pass


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _peer_pid(sock: socket.socket) -> int:
    try:
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return pid
    except OSError:
        return 0


# --- endpoints ---------------------------------------------------------------------------------
class _UnixListener(tcp.Listener):
    """Accepts shm connections on the abstract Unix socket ``name``, counted against ``share``'s limit."""

    def __init__(self, name: bytes, serve_connection, *, max_connections: int, refuse, share: tcp.Listener,
                 ring_bytes: int):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(name)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self._ring_bytes = ring_bytes
        self._start(sock, serve_connection, max_connections, refuse, share=share)

    def _accepted(self, conn: socket.socket, addr) -> tuple[ShmConnection, str]:
        return ShmConnection(conn, ring_bytes=self._ring_bytes), f"local(shm):{_peer_pid(conn)}"


class Listener:
    """The PS data-plane listener: TCP on ``host:port`` plus the shm endpoint for local peers,
    under one ``max_connections``. Without the endpoint (its name is taken) local peers use TCP."""

    def __init__(self, host: str, port: int, serve_connection, *, max_connections: int = 0, refuse=None,
                 ring_bytes: int = DEFAULT_RING_BYTES):
        self._tcp = tcp.Listener(host, port, serve_connection, max_connections=max_connections, refuse=refuse)
        self.host, self.port = self._tcp.host, self._tcp.port
        self._unix: _UnixListener | None = None
        supported, why = shm_supported()
        try:
            if not supported:
                raise OSError(why)
            self._unix = _UnixListener(endpoint_name(self._tcp.address), serve_connection,
                                       max_connections=max_connections, refuse=refuse, share=self._tcp,
                                       ring_bytes=ring_bytes)
        except OSError as exc:
            log.warning("no shared-memory endpoint for data address %s (%s): local peers use TCP",
                        self._tcp.address, exc)

    @property
    def address(self) -> str:
        return self._tcp.address

    @property
    def shm_endpoint(self) -> bool:
        return self._unix is not None

    @property
    def connections(self) -> int:
        return self._tcp.connections  # one set for both

    def close(self) -> None:
        if self._unix is not None:
            self._unix.close()
        self._tcp.close()


def _connect_endpoint(address: str, connect_timeout: float, ring_bytes: int) -> ShmConnection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(connect_timeout)
    try:
        sock.connect(endpoint_name(address))
    except OSError as exc:
        sock.close()
        raise ShardlineConnectionError(f"no shared-memory endpoint for the data plane at {address}: {exc}") from exc
    sock.settimeout(None)
    return ShmConnection(sock, ring_bytes=ring_bytes)


class Transport:
    """``shm`` (``auto=False``: a peer not on this host is a ShardlineConfigError) or ``auto`` (shm
    for local peers whose endpoint answers, TCP otherwise), with this side's ring size."""

    def __init__(self, *, auto: bool, ring_bytes: int = DEFAULT_RING_BYTES):
        self.NAME = "auto" if auto else NAME
        self.auto = auto
        self.ring_bytes = check_ring_bytes(ring_bytes)

    @property
    def capabilities(self) -> Capabilities:
        """A shm connection's (regions shared with local peers) where memfds work here; else PLAIN
        (auto: TCP to every peer). ``auto`` reaches remote peers over TCP: ask the connection."""
        return ShmConnection.CAPABILITIES if shm_supported()[0] else PLAIN

    def listen(self, host: str, port: int, serve_connection, *, max_connections: int = 0, refuse=None) -> Listener:
        return Listener(host, port, serve_connection, max_connections=max_connections, refuse=refuse,
                        ring_bytes=self.ring_bytes)

    def connect(self, address: str, connect_timeout: float = 10.0):
        host, _port = parse_host_port(address, what="data-plane address")
        if not is_local_host(host):
            if self.auto:
                return tcp.connect(address, connect_timeout)
            raise ShardlineConfigError(f"transport 'shm' needs every data-plane peer on this host, but {address!r} "
                                       f"is not a local address; use 'auto' (shm for local peers, TCP otherwise)")
        supported, why = shm_supported()
        if not supported:
            if self.auto:
                return tcp.connect(address, connect_timeout)
            raise ShardlineConfigError(f"transport 'shm' requested but {why}; use 'auto' to fall back to TCP")
        try:
            return _connect_endpoint(address, connect_timeout, self.ring_bytes)
        except ShardlineConnectionError as exc:
            if not self.auto:
                raise
            log.debug("%s; using TCP", exc)
            return tcp.connect(address, connect_timeout)


_DEFAULT = Transport(auto=False)
listen = _DEFAULT.listen
connect = _DEFAULT.connect
