"""``shardline-dispatcher``: the dispatcher daemon.

Options come from flags and, with ``--config FILE``, from a YAML mapping whose keys are the long
option names with underscores (``heartbeat_timeout: 2``); flags given on the command line override
the file. Once serving, the daemon writes the ready file ``{"pid", "grpc", "metrics"}``; SIGTERM or
SIGINT stop it within the grace period and it exits 0. Configuration errors exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

from dispatcher.server import create_server
from services.config import parse_daemon_args
from services.daemon import (
    add_common_args,
    format_host_port,
    install_stop_handlers,
    parse_host_port,
    setup_logging,
    start_metrics_server,
    announce_ready,
)
from services.errors import ShardlineConfigError

log = logging.getLogger("shardline.dispatcher")

PROG = "shardline-dispatcher"
DEFAULT_LISTEN = "0.0.0.0:7000"
STOP_GRACE_SECONDS = 5.0
DEFAULT_HEARTBEAT_INTERVAL = 1.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Shardline dispatcher: membership, routing and jobs")
    add_common_args(parser, default_listen=DEFAULT_LISTEN)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a heartbeat after which a PS node is declared dead")
    parser.add_argument("--heartbeat-interval", type=float, default=None,
                        help="seconds between heartbeats that PS nodes are told to use "
                             "(default: 1, or a third of --heartbeat-timeout if that is less)")
    parser.add_argument("--vnodes-per-capacity", type=int, default=128,
                        help="virtual nodes on the ring per unit of node capacity")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags over SHARDLINE_* environment over config file over defaults. Raises ShardlineConfigError."""
    args = parse_daemon_args(build_parser(), argv)
    if not 0 <= args.metrics_port <= 65535:
        raise ShardlineConfigError(f"metrics_port must be in 0..65535, got {args.metrics_port!r}")
    parse_host_port(args.listen, what="listen")
    if args.heartbeat_interval is None:
        # Leave room for two missed heartbeats before a node counts as dead.
        args.heartbeat_interval = min(DEFAULT_HEARTBEAT_INTERVAL, args.heartbeat_timeout / 3)
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        setup_logging(args.log_level, "dispatcher")
    except ShardlineConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    stop = install_stop_handlers()
    try:
        server, port, _servicer = create_server(
            args.listen,
            heartbeat_timeout=args.heartbeat_timeout,
            heartbeat_interval=args.heartbeat_interval,
            vnodes_per_capacity=args.vnodes_per_capacity,
        )
    except ShardlineConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    host, _ = parse_host_port(args.listen, what="listen")
    metrics_server = None
    try:
        try:
            metrics_server, metrics_port = start_metrics_server(host, args.metrics_port)
        except OSError as exc:
            print(f"{PROG}: error: cannot serve metrics on port {args.metrics_port!r}: {exc.strerror}", file=sys.stderr)
            return 2
        grpc_address = format_host_port(host, port)
        metrics_address = format_host_port(host, metrics_port)
        announce_ready(args.ready_file, {"grpc": grpc_address, "metrics": metrics_address})
        log.info("serving gRPC on %s, metrics on %s", grpc_address, metrics_address)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(STOP_GRACE_SECONDS).wait(STOP_GRACE_SECONDS + 1)
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
