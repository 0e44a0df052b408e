"""``shardline-ps``: a PS node daemon.

Starts the data plane and gRPC, registers with the dispatcher (``--cluster``), heartbeats, keeps
its routing table at the dispatcher's epoch, writes the ready file, and serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

from shardline.ps_server import metrics as M
from shardline.ps_server.dataplane import serve_connection
from shardline.ps_server.node import PSNode
from shardline.ps_server.server import create_server
from shardline.services import auth, frame
from shardline.services.config import log_configuration, parse_daemon_args
from shardline.services.daemon import (add_common_args, format_host_port, install_stop_handlers, parse_host_port,
                             setup_logging, start_metrics_server, announce_ready)
from shardline.services.dispatcher_client import DispatcherClient
from shardline.services.errors import ShardlineConfigError, ShardlineError
from shardline.services.transport import get_transport

log = logging.getLogger("shardline.ps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardline-ps", description="Shardline parameter-server node")
    add_common_args(p, "ps")  # every option is declared in services/config.py
    return p


def _prepare_checkpoint_dir(path: str | None) -> str | None:
    """Create ``checkpoint_dir`` if missing and check that this node can write there.

    Checkpoints themselves are a later issue: the directory is validated now so that a unit file or
    config that names an unusable directory fails at deploy time, not at the first checkpoint.
    """
    if not path:
        return None
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ShardlineConfigError(f"checkpoint_dir {path!r} cannot be created: {exc.strerror or exc}") from None
    if not os.path.isdir(path) or not os.access(path, os.W_OK | os.X_OK):
        raise ShardlineConfigError(f"checkpoint_dir {path!r} is not a writable directory")
    return path


class HeartbeatLoop(threading.Thread):
    def __init__(self, client: DispatcherClient, node: PSNode, registration: dict, interval: float, stop: threading.Event):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.node, self.registration = client, node, registration
        self.interval, self.stop = interval, stop
        M.watch_node(node, registration.get("node_id"), registration.get("rack"))
        M.heartbeat(ok=True)  # registration just reached the dispatcher

    def run(self) -> None:
        failing = False  # log outages once, not once per heartbeat (journald floods otherwise)
        while not self.stop.wait(self.interval):
            blocks, nbytes = self.node.store.totals()
            try:
                resp = self.client.heartbeat(node_id=self.node.node_id, blocks=blocks, bytes=nbytes, epoch=self.node.routing.epoch)
                if not resp.registered:
                    log.warning("dispatcher does not know this node; registering again")
                    self.client.register_node(**self.registration)
                    self.node.refresh_routing()
                elif resp.epoch != self.node.routing.epoch:
                    self.node.refresh_routing()
                    log.info("routing updated to epoch %d", self.node.routing.epoch)
                M.heartbeat(ok=True)
                if failing:
                    log.info("heartbeats reach the dispatcher again")
                    failing = False
            except ShardlineError as exc:
                M.heartbeat(ok=False)
                (log.debug if failing else log.warning)("heartbeat failed: %s", exc)
                failing = True


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parse_daemon_args(parser, argv)  # validates types and bounds; cluster is required
        setup_logging(args.log_level, "ps", args.log_format)
        log_configuration(log, args)
        host, _ = parse_host_port(args.listen, what="listen")
        data_host, data_port = parse_host_port(args.data_listen or f"{format_host_port(host, 0)}", what="data_listen")
        transport = get_transport(args.transport)
        args.checkpoint_dir = _prepare_checkpoint_dir(args.checkpoint_dir)
        cluster_token = auth.load_token(args.cluster_token_file)
    except ShardlineConfigError as exc:
        print(f"shardline-ps: error: {exc}", file=sys.stderr)
        return 2

    import torch

    torch.set_num_threads(args.torch_threads)
    stop = install_stop_handlers()
    client = DispatcherClient(args.cluster, rpc_timeout=args.rpc_timeout, cluster_token=cluster_token)

    def fetch_job(name):
        info = client.get_job(name)
        return None if info is None else info.spec

    limits = frame.FrameLimits(max_payload_bytes=args.max_payload_bytes)
    node_holder: dict = {}
    ps_metrics = M.PSMetrics()

    def on_connection(sock, peer):
        M.CONNECTIONS.inc()
        try:
            serve_connection(sock, peer, node_holder["node"], limits, ps_metrics, cluster_token)
        finally:
            M.CONNECTIONS.dec()

    listener = transport.listen(data_host, data_port, on_connection)
    node_id = args.node_id or f"{socket.gethostname()}-{listener.port}"
    node = node_holder["node"] = PSNode(node_id, fetch_job, client.get_routing, metrics=ps_metrics)
    server, grpc_port, health = create_server(args.listen, node, cluster_token=cluster_token)
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
