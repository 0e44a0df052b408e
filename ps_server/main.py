"""``shardline-ps``: a PS node daemon.

Starts the data plane and gRPC, registers with the dispatcher (``--cluster``), heartbeats, keeps
its routing table at the dispatcher's epoch, writes the ready file, and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time

from ps_server import metrics as M
from ps_server.dataplane import serve_connection
from ps_server.node import PSNode
from ps_server.server import create_server
from services import frame
from services.config import parse_daemon_args
from services.daemon import (add_common_args, format_host_port, install_stop_handlers, parse_host_port,
                             setup_logging, start_metrics_server, announce_ready)
from services.dispatcher_client import DispatcherClient
from services.errors import ShardlineConfigError, ShardlineError
from services.transport import TRANSPORT_NAMES, get_transport

log = logging.getLogger("shardline.ps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardline-ps", description="Shardline parameter-server node")
    add_common_args(p, default_listen="0.0.0.0:7100")
    p.add_argument("--cluster", help="dispatcher address HOST:PORT")
    p.add_argument("--node-id", default=None, help="node id (default: host name and data port)")
    p.add_argument("--rack", default="default")
    p.add_argument("--capacity", type=float, default=1.0, help="relative weight on the ring")
    p.add_argument("--data-listen", default=None, help="data-plane bind HOST:PORT (default: --listen host, free port)")
    p.add_argument("--transport", default="auto", choices=TRANSPORT_NAMES)
    p.add_argument("--max-payload-bytes", type=int, default=frame.DEFAULT_LIMITS.max_payload_bytes)
    p.add_argument("--connect-timeout", type=float, default=60.0, help="how long to wait for the dispatcher at start")
    p.add_argument("--rpc-timeout", type=float, default=10.0)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="intra-op threads for optimizer math (1: a node's connection threads already run in parallel)")
    return p


class HeartbeatLoop(threading.Thread):
    def __init__(self, client: DispatcherClient, node: PSNode, registration: dict, interval: float, stop: threading.Event):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.node, self.registration = client, node, registration
        self.interval, self.stop = interval, stop

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            blocks, nbytes = self.node.store.totals()
            M.BLOCKS.set(blocks)
            M.BYTES_HELD.set(nbytes)
            for job in self.node.store.jobs():
                M.JOB_STEP.labels(job.name).set(job.step)
            try:
                resp = self.client.heartbeat(node_id=self.node.node_id, blocks=blocks, bytes=nbytes, epoch=self.node.routing.epoch)
                if not resp.registered:
                    log.warning("dispatcher does not know this node; registering again")
                    self.client.register_node(**self.registration)
                    self.node.refresh_routing()
                elif resp.epoch != self.node.routing.epoch:
                    self.node.refresh_routing()
                    log.info("routing updated to epoch %d", self.node.routing.epoch)
                M.EPOCH.set(self.node.routing.epoch)
            except ShardlineError as exc:
                log.warning("heartbeat failed: %s", exc)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parse_daemon_args(parser, argv)
        setup_logging(args.log_level, "shardline-ps")
        if not args.cluster:
            raise ShardlineConfigError("--cluster HOST:PORT (the dispatcher) is required")
        parse_host_port(args.cluster, what="--cluster")
        host, _ = parse_host_port(args.listen, what="--listen")
        data_host, data_port = parse_host_port(args.data_listen or f"{format_host_port(host, 0)}", what="--data-listen")
        if not args.capacity > 0:
            raise ShardlineConfigError(f"--capacity must be > 0, got {args.capacity!r}")
        if args.max_payload_bytes <= 0:
            raise ShardlineConfigError(f"--max-payload-bytes must be > 0, got {args.max_payload_bytes!r}")
        transport = get_transport(args.transport)
        if args.torch_threads < 1:
            raise ShardlineConfigError(f"--torch-threads must be >= 1, got {args.torch_threads!r}")
    except ShardlineConfigError as exc:
        print(f"shardline-ps: error: {exc}", file=sys.stderr)
        return 2

    import torch

    torch.set_num_threads(args.torch_threads)
    stop = install_stop_handlers()
    client = DispatcherClient(args.cluster, rpc_timeout=args.rpc_timeout)

    def fetch_job(name):
        info = client.get_job(name)
        return None if info is None else info.spec

    limits = frame.FrameLimits(max_payload_bytes=args.max_payload_bytes)
    node_holder: dict = {}
    ps_metrics = M.PSMetrics()

    def on_connection(sock, peer):
        M.CONNECTIONS.inc()
        try:
            serve_connection(sock, peer, node_holder["node"], limits, ps_metrics)
        finally:
            M.CONNECTIONS.dec()

    listener = transport.listen(data_host, data_port, on_connection)
    node_id = args.node_id or f"{socket.gethostname()}-{listener.port}"
    node = node_holder["node"] = PSNode(node_id, fetch_job, client.get_routing, metrics=ps_metrics)
    server, grpc_port, health = create_server(args.listen, node)
    _, metrics_port = start_metrics_server(host, args.metrics_port)

    registration = dict(node_id=node_id, rack=args.rack, grpc_address=format_host_port(host, grpc_port),
                        data_address=listener.address, capacity=args.capacity)
    try:
        client.wait_until_reachable(args.connect_timeout)
        resp = client.register_node(**registration)
        node.refresh_routing()
    except ShardlineError as exc:
        log.error("cannot join cluster %s: %s", args.cluster, exc)
        listener.close()
        server.stop(0)
        return 1
    HeartbeatLoop(client, node, registration, resp.heartbeat_interval_seconds or 1.0, stop).start()
    log.info("node %s serving: grpc %s, data %s (%s), rack %s, epoch %d", node_id, registration["grpc_address"],
             listener.address, transport.NAME, args.rack, node.routing.epoch)
    announce_ready(args.ready_file, {"grpc": registration["grpc_address"], "metrics": format_host_port(host, metrics_port),
                                     "data": listener.address, "node_id": node_id})
    stop.wait()
    started = time.monotonic()
    listener.close()
    server.stop(grace=2).wait(5)
    client.close()
    log.info("stopped in %.2f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
