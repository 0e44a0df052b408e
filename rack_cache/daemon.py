"""The rack cache daemon: ``shardline-dispatcher --cluster MAIN --rack R --cache-bytes N``.

It serves the data plane with the connection loop every data-plane server shares
(services/dataplane_server.py) in front of a :class:`CacheFrontend` (rack_cache/server.py), registers
with the main dispatchers (RegisterCache) and renews its lease (CacheHeartbeat, every heartbeat
interval), and serves gRPC health and Prometheus metrics. This module is the ``CacheRole`` (dispatcher/main.py)
that the daemon's entry point (shardline/dispatcher_daemon.py) hands the dispatcher's ``main``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shardline.services.errors import ShardlineConfigError, ShardlineError
from shardline.services.pb import common_pb2

if TYPE_CHECKING:  # the dispatcher imports this module; it must not import torch (the frame codec)
    from shardline.rack_cache.server import CacheFrontend

log = logging.getLogger("shardline.cache")


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
    from shardline.rack_cache.server import CacheFrontend, NodeLinks
    from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
    from shardline.services import frame
    from shardline.services.daemon import (announce_ready, create_grpc_server, format_host_port, parse_host_port,
                                           start_metrics_server)
    from shardline.services.dispatcher_client import DispatcherClient
    from shardline.services.payload_budget import PayloadBudget
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
