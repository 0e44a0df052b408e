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
# Keys a --config file may set; --config itself cannot be nested.
CONFIG_KEYS = (
    "listen", "metrics_port", "ready_file", "log_level",
    "heartbeat_timeout", "heartbeat_interval", "vnodes_per_capacity",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Shardline dispatcher: membership, routing and jobs")
    add_common_args(parser, default_listen=DEFAULT_LISTEN)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="seconds without a heartbeat after which a PS node is declared dead")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0,
                        help="seconds between heartbeats that PS nodes are told to use")
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
    for key in data:
        if key not in CONFIG_KEYS:
            raise ShardlineConfigError(
                f"unknown key {key!r} in --config {path!r}; known keys: {', '.join(CONFIG_KEYS)}"
            )
    return data


def _check_number(value: object, key: str, kind: type) -> None:
    # YAML may give a string or a bool where a number belongs; argparse types only cover flags.
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ShardlineConfigError(f"{key} must be {'a number' if kind is float else 'an integer'}, got {value!r}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags over config file over defaults. Raises ShardlineConfigError for a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        parser.set_defaults(**load_config(args.config))
        args = parser.parse_args(argv)
    _check_number(args.heartbeat_timeout, "heartbeat_timeout", float)
    _check_number(args.heartbeat_interval, "heartbeat_interval", float)
    _check_number(args.vnodes_per_capacity, "vnodes_per_capacity", int)
    _check_number(args.metrics_port, "metrics_port", int)
    if not 0 <= args.metrics_port <= 65535:
        raise ShardlineConfigError(f"metrics_port must be in 0..65535, got {args.metrics_port!r}")
    parse_host_port(args.listen, what="listen")
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
