"""Replication's links to peer PS nodes: frames to one peer go in order on one connection.

A frame that fails is retried on a fresh connection until ``replication_timeout``; then its
``done`` callback gets the error (the replicator drops the holder). A peer that left the routing
table is not waited for. docs/architecture.md, "Replication".
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

from shardline.services import frame
from shardline.services.dataplane_client import DataPlaneConnection
from shardline.services.errors import RemoteError, ShardlineConnectionError, ShardlineError

log = logging.getLogger("shardline.ps.replication")

REPLICATION_TIMEOUT_SECONDS = 10.0
CONNECT_TIMEOUT_SECONDS = 5.0


@dataclass(eq=False)
class Send:
    header: frame.FrameHeader
    payloads: Callable[[], list] | list
    done: Callable[[Exception | None, frame.FrameHeader | None], None] | None = None


class PeerLink(threading.Thread):
    """Frames to one peer node, in order, on one connection (one sender thread). A failed send is
    retried on a fresh connection until ``replication_timeout``; then its ``done`` gets the error."""

    def __init__(self, peer: str, address_of: Callable[[str], str | None], transport, token: bytes | None,
                 timeout: float):
        super().__init__(name=f"replicate-{peer}", daemon=True)
        self.peer = peer
        self._address_of = address_of
        self._transport = transport
        self._token = token
        self.timeout = timeout
        self.queue: "queue.Queue[Send | None]" = queue.Queue()
        self._conn: DataPlaneConnection | None = None
        self.start()

    def send(self, item: Send) -> None:
        self.queue.put(item)

    def close(self) -> None:
        self.queue.put(None)

    def barrier(self) -> threading.Event:
        """An event set once every frame queued before it was sent (or given up on)."""
        reached = threading.Event()
        self.queue.put(reached)
        return reached

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                if self._conn is not None:
                    self._conn.close()
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            error, reply = None, None
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    conn = self._connection()
                    payloads = item.payloads() if callable(item.payloads) else item.payloads
                    reply = conn.request(item.header, payloads, timeout=self.timeout)
                    error = None
                    break
                except RemoteError as exc:  # the peer answered: no point retrying
                    error = exc
                    break
                except (ShardlineError, OSError) as exc:
                    error = exc
                    self._conn = None
                    if time.monotonic() >= deadline or self._address_of(self.peer) is None:
                        break  # out of time, or the peer left the routing table (declared dead)
                    time.sleep(0.2)
            if item.done is not None:
                try:
                    item.done(error, reply)
                except Exception:  # a callback bug must not stop the link
                    log.exception("replication callback failed")

    def abandon_if_gone(self) -> None:
        """From another thread, after a routing change: a peer that left the routing table
        (declared dead, drained) is not waited for. The frame in flight on its connection fails
        at once (its ``done`` gets the error: its holder is dropped, the step's visibility goes on)
        instead of after ``replication_timeout``."""
        conn = self._conn
        if conn is not None and self._address_of(self.peer) is None:
            log.info("node %s left the routing table: its replication link gives up the frame in flight", self.peer)
            conn.abort()

    def _connection(self) -> DataPlaneConnection:
        if self._conn is None:
            address = self._address_of(self.peer)
            if address is None:
                raise ShardlineConnectionError(f"node {self.peer!r} is not in the routing table")
            self._conn = DataPlaneConnection(address, self._transport, CONNECT_TIMEOUT_SECONDS, self._token)
        return self._conn


class PeerLinks:
    """One PeerLink per peer, created on first use."""

    def __init__(self, address_of: Callable[[str], str | None], transport, token: bytes | None,
                 timeout: float = REPLICATION_TIMEOUT_SECONDS):
        self._address_of = address_of
        self._transport = transport
        self._token = token
        self.timeout = timeout
        self._links: dict[str, PeerLink] = {}
        self._lock = threading.Lock()

    def link(self, peer: str) -> PeerLink:
        with self._lock:
            link = self._links.get(peer)
            if link is None or not link.is_alive():
                link = self._links[peer] = PeerLink(peer, self._address_of, self._transport, self._token, self.timeout)
            return link

    def abandon_gone(self) -> None:
        """After a routing change: links to peers that left it give up the frame in flight."""
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.abandon_if_gone()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until every frame queued so far went out; False if some did not."""
        with self._lock:
            barriers = [link.barrier() for link in self._links.values() if link.is_alive()]
        deadline = time.monotonic() + timeout
        return all(b.wait(max(0.0, deadline - time.monotonic())) for b in barriers)

    def close(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()
