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

import yaml

from dispatcher.server import create_server
from services.daemon import (
    add_common_args,
    format_host_port,
    install_stop_handlers,
    parse_host_port,
    setup_logging,
    start_metrics_server,
    write_ready_file,
)
from services.errors import ShardlineConfigError

log = logging.getLogger("shardline.dispatcher")

PROG = "shardline-dispatcher"
DEFAULT_LISTEN = "0.0.0.0:7000"
STOP_GRACE_SECONDS = 5.0
DEFAULT_HEARTBEAT_INTERVAL = 1.0
# Keys a --config file may set and the type each value must have; --config itself cannot nest.
CONFIG_KEYS: dict[str, type] = {
    "listen": str,
    "metrics_port": int,
    "ready_file": str,
    "log_level": str,
    "heartbeat_timeout": float,
    "heartbeat_interval": float,
    "vnodes_per_capacity": int,
}


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


def load_config(path: str) -> dict:
    """Read a YAML mapping of option names (underscored) to values. Raises ShardlineConfigError."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read --config {path!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ShardlineConfigError(f"--config {path!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ShardlineConfigError(f"--config {path!r} must hold a mapping of option names, got {type(data).__name__}")
    for key, value in data.items():
        if key not in CONFIG_KEYS:
            raise ShardlineConfigError(
                f"unknown key {key!r} in --config {path!r}; known keys: {', '.join(CONFIG_KEYS)}"
            )
        _check_type(value, CONFIG_KEYS[key], f"{key} in --config {path!r}")
    return data


def _check_type(value: object, kind: type, what: str) -> None:
    # Values from the file bypass argparse's type conversion, so they are checked here.
    if kind is str:
        ok, expected = isinstance(value, str), "a string"
    elif kind is int:
        ok, expected = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:
        ok, expected = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    if not ok:
        raise ShardlineConfigError(f"{what} must be {expected}, got {value!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags over config file over defaults. Raises ShardlineConfigError for a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**load_config(args.config))
        args = parser.parse_args(argv)
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
        write_ready_file(args.ready_file, {"grpc": grpc_address, "metrics": metrics_address})
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
