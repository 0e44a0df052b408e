"""The rack cache's request handling (:class:`CacheFrontend`) and its links to the PS nodes
(:class:`NodeLinks`); the daemon around them is rack_cache/daemon.py, the cache itself
rack_cache/cache.py.

Contract: the frontend stands in the shared data-plane connection loop
(services/dataplane_server.py: framing, HELLO, deadlines, payload budget) and answers OP_PULL as
the node named by ``FrameHeader.via_node`` would; every other op is refused (``INVALID_ARGUMENT``).
Misses are fetched at the reader's epoch, so the node's refusals (``NOT_OWNER``, ``TIMEOUT``,
``UNAVAILABLE`` ...) reach the reader; a subscriber's pull is fetched as one and answered dense
with the node's checksums.

Design: docs/architecture.md, "Rack caches (L2)".
"""

from __future__ import annotations

import logging
import threading
import time

from shardline.rack_cache.cache import BlockCache, Fetched, Want
from shardline.services.errors import (ErrorCode, NotOwnerError, RemoteError, RequestError, ShardlineConnectionError,
                                       ShardlineError)
from shardline.services.names import JOB_NAME_RE
from shardline.services.pb import common_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.request_checks import check_want_dtypes, refuse_duplicates
from shardline.services.routing import RoutingView

log = logging.getLogger("shardline.cache")

# Longest a pull may wait server-side (the PS's bound, ps_server/node.py MAX_PULL_WAIT_SECONDS).
MAX_PULL_WAIT_SECONDS = 600.0
# A fetch from a PS node may go this long without a byte beyond the pull's own wait; a request
# waiting for another reader's fetch waits as long beyond its own pull wait.
FETCH_TIMEOUT_SECONDS = 30.0
# Idle data-plane connections kept per PS node (concurrent fetches open more, then close them).
IDLE_LINKS_PER_NODE = 4
# A pull naming a node the cache's routing lacks refreshes the routing at most this often.
ROUTING_REFRESH_SECONDS = 0.5


class _NoJobs:
    """The connection loop looks up a job to wake its waiters or to report its step in an error
    reply; the cache holds no JobStore."""

    @staticmethod
    def get(name):
        return None


class NodeLinks:
    """Data-plane connections from the cache to PS nodes, by data address; a few kept per node."""

    def __init__(self, transport, connect_timeout: float, cluster_token: bytes | None):
        self._transport, self._connect_timeout, self._token = transport, connect_timeout, cluster_token
        self._idle: dict[str, list] = {}
        self._lock = threading.Lock()

    def take(self, address: str):
        from shardline.services.dataplane_client import DataPlaneConnection

        with self._lock:
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        return DataPlaneConnection(address, self._transport, self._connect_timeout, self._token)

    def give_back(self, conn) -> None:
        with self._lock:
            idle = self._idle.setdefault(conn.address, [])
            if len(idle) < IDLE_LINKS_PER_NODE:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()


class CacheFrontend:
    """What the data-plane connection loop (services/dataplane_server.serve_connection) calls for each frame, in
    place of a PSNode: ``precheck`` before the payload, ``handle`` after it."""

    def __init__(self, cache_id: str, capacity_bytes: int, links: NodeLinks, fetch_routing, *,
                 fetch_timeout: float = FETCH_TIMEOUT_SECONDS, rack: str = ""):
        self.node_id = cache_id
        self.rack = rack  # named in its fetches: the nodes count where a job's reads come from
        self.store = _NoJobs()
        self.links = links
        self._fetch_routing = fetch_routing
        self._routing = RoutingView.empty()
        self._routing_lock = threading.Lock()
        self._refreshed_at = 0.0
        self.cache = BlockCache(capacity_bytes, self.fetch, fetch_timeout=fetch_timeout)

    # --- routing ----------------------------------------------------------------------------
    @property
    def routing(self) -> RoutingView:
        return self._routing

    def update_routing(self, table: common_pb2.RoutingTable) -> None:
        view = RoutingView.from_proto(table)
        with self._routing_lock:
            if view.epoch >= self._routing.epoch:
                self._routing = view

    def _address(self, node: str) -> str:
        address = self._routing.address_of(node)
        if address is None and time.monotonic() - self._refreshed_at >= ROUTING_REFRESH_SECONDS:
            self._refreshed_at = time.monotonic()
            try:
                self.update_routing(self._fetch_routing())
            except ShardlineError as exc:
                log.debug("routing refresh failed: %s", exc)
            address = self._routing.address_of(node)
        if address is None:
            raise RequestError(ErrorCode.UNAVAILABLE, f"rack cache {self.node_id!r} does not know PS node "
                                                      f"{node[:200]!r} at epoch {self._routing.epoch}; pull from the node")
        return address

    # --- the connection loop's interface ----------------------------------------------------
    def precheck(self, header) -> None:
        if header.op != dp.OP_PULL:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"a rack cache serves pulls only, not {dp.Op.Name(header.op)}")
        if header.payload_bytes:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"a pull carries no payload, this one {header.payload_bytes} bytes")
        if not JOB_NAME_RE.fullmatch(header.job):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"invalid job name {header.job[:200]!r}")
        if not header.via_node:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "a pull through a rack cache names the PS node (via_node)")
        refuse_duplicates(header)
        check_want_dtypes(header)
        if any(ref.dest_region for ref in header.blocks):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"rack cache {self.node_id!r} places no blocks in a "
                                                             f"client's shared region (pull them from their node for that)")

    def handle(self, header, view, cancelled=None, regions=None):
        """Serve a prechecked pull from the cache; its blocks go in the payload (``regions``, the
        shm connection's, is unused: see precheck)."""
        from shardline.services import frame

        wants = [Want(ref.tensor, ref.index, ref.version if ref.has else None, ref.want_dtype or dp.FLOAT32)
                 for ref in header.blocks]
        timeout = min(header.wait_timeout_seconds or 60.0, MAX_PULL_WAIT_SECONDS)
        try:
            answer = self.cache.answer(header.job, header.via_node, header.epoch, header.min_step, wants, timeout,
                                       subscriber=header.subscriber)
        except RemoteError as exc:  # the node's refusal, passed on as the node gave it
            if exc.code == ErrorCode.NOT_OWNER:
                raise NotOwnerError(ErrorCode.NOT_OWNER, exc.remote_message, epoch=exc.epoch) from None
            raise RequestError(exc.code, exc.remote_message) from None
        except ShardlineConnectionError as exc:
            raise RequestError(ErrorCode.UNAVAILABLE, f"rack cache {self.node_id!r}: {exc}") from None
        except ShardlineError as exc:
            raise RequestError(ErrorCode.UNAVAILABLE, f"rack cache {self.node_id!r}: {exc}") from None
        reply = frame.FrameHeader(op=dp.OP_REPLY, request_id=header.request_id, job=header.job, epoch=header.epoch,
                                  step=answer.step, oldest_step=answer.oldest_step)
        if header.subscriber:  # every block at the step named is visible at it (rack_cache/cache.py)
            reply.min_step = answer.step
        payloads = []
        for tensor, index, version, dtype, data in answer.blocks:
            reply.blocks.append(dp.BlockRef(tensor=tensor, index=index, dtype=dtype, version=version,
                                            numel=len(data) // frame.ITEMSIZE[dtype], nbytes=len(data),
                                            checksum=answer.checksums.get((tensor, index), 0)))
            payloads.append(data)
        return reply, payloads

    def after_reply(self, header, reply) -> None:
        """After a reply went out: nothing to count (a cache's reads are the PS nodes' heat)."""

    # --- fetching from the PS nodes ---------------------------------------------------------
    def fetch(self, job: str, node: str, epoch: int, min_step: int, asks: list, timeout: float, *,
              subscriber: bool = False) -> Fetched:
        """One pull from ``node`` (BlockCache's FetchFn): raises RemoteError with the node's answer.
        ``subscriber``: a subscriber pull (the node's checksums; bf16 blocks may come as deltas)."""
        from shardline.services import delta, frame
        from shardline.services.dataplane_client import REPLY_LIMITS

        address = self._address(node)
        header = frame.FrameHeader(op=dp.OP_PULL, job=job, epoch=epoch, min_step=min_step,
                                   wait_timeout_seconds=timeout, subscriber=subscriber, reader_rack=self.rack)
        asked = {}
        for tensor, index, have, dtype in asks:
            header.blocks.append(dp.BlockRef(tensor=tensor, index=index, version=have or 0, has=have is not None,
                                             want_dtype=0 if dtype == dp.FLOAT32 else dtype))
            asked[(tensor, index)] = dtype
        conn = self.links.take(address)
        try:
            conn.sock.settimeout(FETCH_TIMEOUT_SECONDS + timeout)
            frame.send_frame(conn.sock, header)
            reply = frame.recv_header(conn.sock, REPLY_LIMITS)
            if reply.op == dp.OP_ERROR:
                self.links.give_back(conn)
                conn = None
                raise RemoteError(dp.ErrorCode.Name(reply.code), reply.message, epoch=reply.epoch, step=reply.step)
            blocks, checksums, deltas = {}, {}, {}
            for ref in reply.blocks:
                key = (ref.tensor, ref.index)
                dtype = asked.pop(key, None)
                is_delta = subscriber and ref.dtype == dp.BF16_DELTA and dtype == dp.BFLOAT16
                if not (is_delta and delta.delta_ref_problem(reply, ref) is None) and (
                        dtype != ref.dtype or ref.nbytes != frame.wire_nbytes(ref.dtype, ref.numel)):
                    raise ShardlineConnectionError(f"PS node {node!r} sent an unexpected block {ref.tensor[:200]}"
                                                   f"[{ref.index}]")
                data = bytearray(ref.nbytes)
                frame.recv_exactly_into(conn.sock, memoryview(data))
                blocks[key] = (ref.version, data)
                if subscriber:
                    checksums[key] = ref.checksum
                if is_delta:
                    deltas[key] = (ref.base_version, int(ref.delta_elements))
        except (OSError, ConnectionError) as exc:
            conn.close()
            conn = None
            raise ShardlineConnectionError(f"PS node {node!r} at {address}: {exc}") from exc
        except BaseException:
            if conn is not None:
                conn.close()
                conn = None
            raise
        finally:
            if conn is not None:
                conn.sock.settimeout(None)
                self.links.give_back(conn)
        return Fetched(reply.step, blocks, reply.oldest_step, reply.min_step if subscriber else None, checksums, deltas)
