"""The dispatcher in the cache role (``--cluster MAIN --rack R --cache-bytes N``): a rack cache (L2).

Thin glue over dispatcher/cache.py. The daemon

* serves the data plane with the PS's own connection loop (ps_server/dataplane.py: framing, the
  HELLO challenge with the cluster token, per-frame deadlines, the payload budget) over the
  configured transport; :class:`CacheFrontend` stands where a PS node's request handling stands and
  answers OP_PULL (``FrameHeader.via_node`` names the PS node the reader routes the blocks to) as
  that node would, through the BlockCache; every other op is refused (``INVALID_ARGUMENT``);
* fetches misses from the PS nodes over data-plane connections of its own (:class:`NodeLinks`),
  naming the versions it holds, at the reader's epoch, so the node checks ownership as it would
  for the reader and its refusals (``NOT_OWNER``, ``TIMEOUT``, ``UNAVAILABLE`` ...) reach the reader;
  a WeightSubscriber's pull (``FrameHeader.subscriber``) is fetched as one, and its reply blocks
  carry the node's checksums (``BlockRef.checksum``), dense;
* registers with the main dispatchers (RegisterCache) and renews its lease (CacheHeartbeat, every
  heartbeat interval): a cache that stops heartbeating leaves the routing table; a dispatcher that
  does not know it (a new leader) gets it registered again; the jobs the heartbeat lists drop the
  entries of deleted or recreated jobs;
* serves gRPC health only (the ready file's ``grpc``) and Prometheus metrics.

Unlike the main dispatcher this role imports torch (the frame codec and the PS connection loop).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardline.dispatcher.cache import BlockCache, Fetched, Want
from shardline.services.errors import RemoteError, ShardlineConfigError, ShardlineConnectionError, ShardlineError
from shardline.services.names import JOB_NAME_RE
from shardline.services.pb import common_pb2
from shardline.services.pb import dataplane_pb2 as dp
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
    """What the PS connection loop (ps_server/dataplane.serve_connection) calls for each frame, in
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
            from shardline.ps_server.store import StoreError

            raise StoreError("UNAVAILABLE", f"rack cache {self.node_id!r} does not know PS node {node[:200]!r} at "
                                            f"epoch {self._routing.epoch}; pull from the node")
        return address

    # --- the connection loop's interface ----------------------------------------------------
    def precheck(self, header) -> None:
        from shardline.ps_server.node import _check_want_dtypes, _refuse_duplicates
        from shardline.ps_server.store import StoreError

        if header.op != dp.OP_PULL:
            raise StoreError("INVALID_ARGUMENT", f"a rack cache serves pulls only, not {dp.Op.Name(header.op)}")
        if header.payload_bytes:
            raise StoreError("INVALID_ARGUMENT", f"a pull carries no payload, this one {header.payload_bytes} bytes")
        if not JOB_NAME_RE.fullmatch(header.job):
            raise StoreError("INVALID_ARGUMENT", f"invalid job name {header.job[:200]!r}")
        if not header.via_node:
            raise StoreError("INVALID_ARGUMENT", "a pull through a rack cache names the PS node (via_node)")
        _refuse_duplicates(header)
        _check_want_dtypes(header)
        if any(ref.dest_region for ref in header.blocks):
            raise StoreError("INVALID_ARGUMENT", f"rack cache {self.node_id!r} places no blocks in a client's shared "
                                                 f"region (pull them from their node for that)")

    def handle(self, header, view, cancelled=None, regions=None):
        """Serve a prechecked pull from the cache; its blocks go in the payload (``regions``, the
        shm connection's, is unused: see precheck)."""
        from shardline.ps_server.node import NotOwner
        from shardline.ps_server.store import StoreError
        from shardline.services import frame

        wants = [Want(ref.tensor, ref.index, ref.version if ref.has else None, ref.want_dtype or dp.FLOAT32)
                 for ref in header.blocks]
        timeout = min(header.wait_timeout_seconds or 60.0, MAX_PULL_WAIT_SECONDS)
        try:
            answer = self.cache.answer(header.job, header.via_node, header.epoch, header.min_step, wants, timeout,
                                       subscriber=header.subscriber)
        except RemoteError as exc:  # the node's refusal, passed on as the node gave it
            if exc.code == "NOT_OWNER":
                raise NotOwner(exc.remote_message, exc.epoch) from None
            raise StoreError(exc.code, exc.remote_message) from None
        except ShardlineConnectionError as exc:
            raise StoreError("UNAVAILABLE", f"rack cache {self.node_id!r}: {exc}") from None
        except ShardlineError as exc:
            raise StoreError("UNAVAILABLE", f"rack cache {self.node_id!r}: {exc}") from None
        reply = frame.FrameHeader(op=dp.OP_REPLY, request_id=header.request_id, job=header.job, epoch=header.epoch,
                                  step=answer.step, oldest_step=answer.oldest_step)
        if header.subscriber:  # every block at the step named is visible at it (dispatcher/cache.py)
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


class CacheCollector:
    """Prometheus metrics read from the cache when scraped (no labels: one cache per process)."""

    def __init__(self, frontend: CacheFrontend, rack: str):
        self.frontend, self.rack = frontend, rack

    def collect(self):
        cache = self.frontend.cache
        s = cache.stats
        for name, text, value in (
                ("hits", "Blocks a rack cache answered from memory", s.hits),
                ("misses", "Blocks a rack cache fetched from their PS node for a pull", s.misses),
                ("coalesced_misses", "Missed blocks a pull waited for in another pull's fetch", s.coalesced),
                ("served_bytes", "Block bytes a rack cache sent to readers", s.bytes_served),
                ("fetched_bytes", "Block bytes a rack cache received from PS nodes", s.bytes_fetched),
                ("evictions", "Blocks evicted to keep resident bytes within cache_bytes", s.evictions),
                ("passed_through", "Blocks bigger than the cache, fetched and fanned out without being kept",
                 s.passed_through)):
            family = CounterMetricFamily(f"shardline_cache_{name}", text, labels=["rack"])
            family.add_metric([self.rack], value)
            yield family
        for name, text, value in (("resident_bytes", "Block bytes a rack cache holds", cache.resident_bytes),
                                  ("capacity_bytes", "A rack cache's bound (cache_bytes)", cache.capacity_bytes)):
            family = GaugeMetricFamily(f"shardline_cache_{name}", text, labels=["rack"])
            family.add_metric([self.rack], value)
            yield family


class CacheHeartbeats(threading.Thread):
    """Registers the cache with the main dispatchers and renews its lease until ``stop``."""

    def __init__(self, client, frontend: CacheFrontend, info: common_pb2.CacheInfo, stop: threading.Event):
        super().__init__(name="cache-heartbeat", daemon=True)
        self.client, self.frontend, self.info, self.stop = client, frontend, info, stop
        self.interval = 1.0
        self.registered = False

    def register(self) -> None:
        resp = self.client.register_cache(self.info)
        self.interval = max(0.1, resp.heartbeat_interval_seconds or 1.0)
        self.registered = True
        log.info("registered as the cache of rack %s (lease %.3g s)", self.info.rack, resp.lease_seconds)

    def beat(self) -> None:
        cache = self.frontend.cache
        if not self.registered:
            self.register()
        resp = self.client.cache_heartbeat(cache_id=self.info.cache_id, incarnation=self.info.incarnation,
                                           resident_bytes=cache.resident_bytes, hits=cache.stats.hits,
                                           misses=cache.stats.misses)
        if not resp.registered:
            log.info("the dispatcher does not know this cache (a new leader, or the lease ran out): registering again")
            self.register()
        if resp.epoch > self.frontend.routing.epoch:
            self.frontend.update_routing(self.client.get_routing())
        dropped = cache.retain_jobs({j.name: j.uid for j in resp.jobs})
        if dropped:
            log.info("dropped the blocks of jobs deleted or created again: %s", ", ".join(dropped))

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            try:
                self.beat()
            except ShardlineError as exc:  # the dispatcher fails over or restarts: the next beat registers
                self.registered = False
                log.warning("cache heartbeat failed: %s", exc)


def validate_cache_args(args) -> None:
    """The cache role's options: cluster and rack are required with cache_bytes (ShardlineConfigError)."""
    if not args.cluster:
        raise ShardlineConfigError(f"cache_bytes={args.cache_bytes!r} runs this dispatcher as a rack cache: it needs "
                                   f"cluster (the main dispatchers' HOST:PORT[,...])")
    if not args.rack:
        raise ShardlineConfigError(f"cache_bytes={args.cache_bytes!r} runs this dispatcher as a rack cache: it needs "
                                   f"rack (the rack whose readers it serves)")
    if args.state_dir or args.state_store:
        raise ShardlineConfigError("a rack cache keeps no dispatcher state: drop state_dir/state_store "
                                   f"(got {args.state_dir or args.state_store!r})")


def run_cache(args, security, stop: threading.Event, *, prog: str) -> int:
    """Run the cache role until ``stop``; the exit code."""
    from shardline.ps_server.admission import PayloadBudget
    from shardline.ps_server.dataplane import ConnectionPolicy, serve_connection
    from shardline.services import frame
    from shardline.services.daemon import (announce_ready, create_grpc_server, format_host_port, parse_host_port,
                                           start_metrics_server)
    from shardline.services.dispatcher_client import DispatcherClient
    from shardline.services.transport import get_transport

    host, _ = parse_host_port(args.listen, what="listen")
    client = DispatcherClient(args.cluster, rpc_timeout=args.rpc_timeout, cluster_token=security.token,
                              tls_ca=security.tls_ca)
    transport = get_transport(args.transport)
    links = NodeLinks(transport, args.connect_timeout, security.token)
    cache_id = f"cache-{args.rack}-{socket.gethostname()}-{os.getpid()}"
    frontend = CacheFrontend(cache_id, args.cache_bytes, links, client.get_routing, rack=args.rack)
    # A pull has no payload; the budget is there because the loop takes one.
    policy = ConnectionPolicy(limits=frame.FrameLimits(max_payload_bytes=0), cluster_token=security.token,
                              budget=PayloadBudget(1 << 20))
    data_host, data_port = parse_host_port(args.data_listen or format_host_port(host, 0), what="data_listen")
    listener = transport.listen(data_host, data_port,
                                lambda sock, peer: serve_connection(sock, peer, frontend, policy))
    server, grpc_port, _health = create_grpc_server(args.listen, [], cluster_token=security.token,
                                                    tls=security.server_tls)
    collector = CacheCollector(frontend, args.rack)
    REGISTRY.register(collector)
    metrics_server = None
    try:
        metrics_server, metrics_port = start_metrics_server(host, args.metrics_port)
        client.wait_until_reachable(args.connect_timeout, stop=stop)
        frontend.update_routing(client.get_routing())
        info = common_pb2.CacheInfo(cache_id=cache_id, rack=args.rack, data_address=listener.address,
                                    grpc_address=format_host_port(host, grpc_port), incarnation=os.urandom(8).hex(),
                                    capacity_bytes=args.cache_bytes)
        heartbeats = CacheHeartbeats(client, frontend, info, stop)
        heartbeats.register()
        heartbeats.start()
        announce_ready(args.ready_file, {"grpc": info.grpc_address, "metrics": format_host_port(host, metrics_port),
                                         "data": listener.address, "cache_id": cache_id, "rack": args.rack})
        log.info("rack cache %s of rack %s serving: data %s (%s), %d bytes, main dispatchers %s", cache_id, args.rack,
                 listener.address, transport.NAME, args.cache_bytes, args.cluster)
        stop.wait()
    except ShardlineError as exc:
        stopped = stop.is_set()
        (log.info if stopped else log.error)("rack cache cannot join cluster %s: %s", args.cluster, exc)
        return 0 if stopped else 1
    except OSError as exc:
        print(f"{prog}: error: {exc}")
        return 2
    finally:
        listener.close()
        links.close()
        server.stop(1).wait(2)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        REGISTRY.unregister(collector)
        client.close()
    log.info("stopped")
    return 0
