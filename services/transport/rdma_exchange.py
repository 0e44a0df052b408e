"""The RDMA connection-parameter exchange: a small versioned binary message on the TCP connection.

A client that wants RDMA sends an OFFER as the first bytes of its TCP connection; the node answers
ACCEPT (its own parameters) or DECLINE (a reason: no device, a version it does not speak, bad
parameters), and both sides then use RDMA or stay on this same TCP connection. Layout (big endian)::

    magic "SLRX" | version u8 | kind u8 | body length u16 | body

OFFER and ACCEPT bodies are one fixed ``PARAMS`` struct; a DECLINE body is a UTF-8 reason. The
magic differs from a data-plane frame's (``b"SL"`` then version 1), so a node tells an offer from
a plain TCP client by the first four bytes, and a node that predates RDMA answers an offer with a
frame error, which the client reads as "no RDMA here".

``decode`` checks everything before trusting anything: magic, version, kind, the body length
against the kind (oversized bodies are refused from the fixed header alone, before reading),
and each field's range. Nothing here touches a device.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shardline.services.errors import ShardlineConnectionError

MAGIC = b"SLRX"
VERSION = 1
OFFER, ACCEPT, DECLINE = 1, 2, 3
KIND_NAMES = {OFFER: "OFFER", ACCEPT: "ACCEPT", DECLINE: "DECLINE"}

HEADER = struct.Struct(">4sBBH")
# gid, lid, port, gid_index, qp_num, psn, mtu, slot_bytes, data_slots, spare_slots, ring addr, rkey, ring length
PARAMS = struct.Struct(">16sHBBIIBxIHHQIQ")
MAX_REASON_BYTES = 256
MAX_BODY_BYTES = max(PARAMS.size, MAX_REASON_BYTES)

# Bounds a peer's parameters must respect: they size what this side posts and copies.
MIN_SLOT_BYTES = 4096
MAX_SLOT_BYTES = 64 << 20
MAX_SLOTS = 4096
MTU_ENUMS = range(1, 6)  # IBV_MTU_256 .. IBV_MTU_4096


class ExchangeError(ShardlineConnectionError):
    """A malformed, oversized or out-of-range exchange message (the connection is not trusted further)."""


class ExchangeVersionError(ExchangeError):
    """A well-formed message of an exchange version this side does not speak."""

    def __init__(self, version: int):
        super().__init__(f"RDMA exchange version {version} is not supported (this side speaks {VERSION})")
        self.version = version


@dataclass(frozen=True)
class ConnParams:
    """One side's reliable-connected QP and receive ring, as its peer needs them.

    ``data_slots`` is the number of receive buffers the peer may fill with data chunks (its
    initial credits); ``spare_slots`` more are posted for credit-return messages. The ring is
    ``ring_bytes`` long at ``ring_addr``; ``ring_rkey`` is 0 because the ring is registered for
    local access only (send/recv needs no remote access, and the exchange runs before the peer
    has authenticated)."""

    gid: bytes
    lid: int
    port: int
    gid_index: int
    qp_num: int
    psn: int
    mtu: int
    slot_bytes: int
    data_slots: int
    spare_slots: int
    ring_addr: int
    ring_rkey: int
    ring_bytes: int

    def validate(self) -> "ConnParams":
        def check(ok: bool, what: str, value) -> None:
            if not ok:
                raise ExchangeError(f"RDMA exchange: {what} out of range: {value!r}")

        check(isinstance(self.gid, bytes) and len(self.gid) == 16, "gid (16 bytes)", self.gid)
        check(0 <= self.lid < 1 << 16, "lid", self.lid)
        check(1 <= self.port < 1 << 8, "port", self.port)
        check(0 <= self.gid_index < 1 << 8, "gid_index", self.gid_index)
        check(0 < self.qp_num < 1 << 24, "qp_num (24 bits)", self.qp_num)
        check(0 <= self.psn < 1 << 24, "psn (24 bits)", self.psn)
        check(self.mtu in MTU_ENUMS, "mtu (IBV_MTU_256..4096 = 1..5)", self.mtu)
        check(MIN_SLOT_BYTES <= self.slot_bytes <= MAX_SLOT_BYTES, "slot_bytes", self.slot_bytes)
        check(1 <= self.data_slots <= MAX_SLOTS, "data_slots", self.data_slots)
        check(1 <= self.spare_slots <= MAX_SLOTS, "spare_slots", self.spare_slots)
        check(0 <= self.ring_addr < 1 << 64, "ring_addr", self.ring_addr)
        check(0 <= self.ring_rkey < 1 << 32, "ring_rkey", self.ring_rkey)
        check(self.ring_bytes == self.slot_bytes * (self.data_slots + self.spare_slots),
              "ring_bytes (slot_bytes * slots)", self.ring_bytes)
        return self


@dataclass(frozen=True)
class Message:
    kind: int
    params: ConnParams | None = None
    reason: str = ""


def encode(kind: int, params: ConnParams | None = None, reason: str = "") -> bytes:
    if kind in (OFFER, ACCEPT):
        p = params.validate()
        body = PARAMS.pack(p.gid, p.lid, p.port, p.gid_index, p.qp_num, p.psn, p.mtu, p.slot_bytes, p.data_slots,
                           p.spare_slots, p.ring_addr, p.ring_rkey, p.ring_bytes)
    elif kind == DECLINE:
        body = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES]
    else:
        raise ValueError(f"unknown exchange message kind {kind!r}")
    return HEADER.pack(MAGIC, VERSION, kind, len(body)) + body


def decode_header(head: bytes) -> tuple[int, int]:
    """(kind, body length) from the fixed header; refuses a wrong magic, version, kind or size."""
    if len(head) != HEADER.size:
        raise ExchangeError(f"RDMA exchange header is {len(head)} bytes, expected {HEADER.size}")
    magic, version, kind, body_len = HEADER.unpack(head)
    if magic != MAGIC:
        raise ExchangeError(f"not an RDMA exchange message (magic {magic!r})")
    if version != VERSION:
        raise ExchangeVersionError(version)
    if kind not in KIND_NAMES:
        raise ExchangeError(f"RDMA exchange: unknown message kind {kind}")
    if kind == DECLINE:
        if body_len > MAX_REASON_BYTES:
            raise ExchangeError(f"RDMA exchange: DECLINE reason of {body_len} bytes exceeds {MAX_REASON_BYTES}")
    elif body_len != PARAMS.size:
        raise ExchangeError(f"RDMA exchange: {KIND_NAMES[kind]} body is {body_len} bytes, expected {PARAMS.size}")
    return kind, body_len


def decode_body(kind: int, body: bytes) -> Message:
    if kind == DECLINE:
        return Message(DECLINE, reason=body.decode("utf-8", "replace"))
    fields = PARAMS.unpack(body)
    return Message(kind, params=ConnParams(*fields).validate())


def decode(data: bytes) -> Message:
    """One whole message (header and body) from ``data``."""
    kind, body_len = decode_header(bytes(data[:HEADER.size]))
    if len(data) != HEADER.size + body_len:
        raise ExchangeError(f"RDMA exchange message is {len(data)} bytes, its header says {HEADER.size + body_len}")
    return decode_body(kind, bytes(data[HEADER.size:]))


def negotiated_mtu(local: ConnParams, peer: ConnParams) -> int:
    """The path MTU both ends support (the smaller IBV_MTU enum)."""
    return min(local.mtu, peer.mtu)


@dataclass(frozen=True)
class Decision:
    """What a connection uses: ``use_rdma`` and, when it does not, why (for the log and errors)."""

    use_rdma: bool
    reason: str = ""


def decide(local_reason: str | None, answer: Message | None) -> Decision:
    """The client's choice after the exchange: RDMA only if this side has a usable device
    (``local_reason`` None) and the peer ACCEPTed; otherwise TCP on the same connection, with the
    reason. ``answer`` None means the peer did not speak the exchange (a node without RDMA
    support answered with a frame)."""
    if local_reason is not None:
        return Decision(False, local_reason)
    if answer is None:
        return Decision(False, "the peer does not speak the RDMA exchange")
    if answer.kind == DECLINE:
        return Decision(False, f"the peer declined RDMA: {answer.reason}")
    if answer.kind != ACCEPT:
        raise ExchangeError(f"RDMA exchange: expected ACCEPT or DECLINE, got {KIND_NAMES[answer.kind]}")
    return Decision(True)
