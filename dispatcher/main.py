"""``shardline-dispatcher``: the dispatcher daemon.

Options are declared in the schema of services/config.py (docs/configuration.md): flag >
``SHARDLINE_*`` environment > ``--config`` file (section ``dispatcher:`` over ``common:``, or a flat
file) > default. Once serving, the daemon writes the ready file ``{"pid", "grpc", "metrics"}``; SIGTERM or
SIGINT stop it within the grace period and it exits 0. Configuration errors (``state_dir`` and
``state_store`` both set, ...) and a ``--state-dir`` that cannot be used (not writable, damaged,
held by another dispatcher) exit 2; an etcd ``--state-store`` that does not answer within
``--connect-timeout`` exits 1. With a state store the daemon is ready (ready file) as a follower;
it leads once elected (dispatcher/leader.py). With ``--cache-bytes N`` (and ``--cluster``,
``--rack``) it runs as a rack cache instead (rack_cache/daemon.py; the ready file adds ``data``): the
entry point (shardline/dispatcher_daemon.py) hands ``main`` that role, since the dispatcher's package
does not import the rack cache's.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import Protocol

from shardline.dispatcher.server import create_server
from shardline.dispatcher.state_store import StateStoreError
from shardline.services.config import log_configuration, parse_daemon_args
from shardline.services.daemon import (
    add_common_args,
    format_host_port,
    install_stop_handlers,
    parse_host_port,
    setup_logging,
    start_metrics_server,
    announce_ready,
)
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError, ShardlineTimeoutError
from shardline.services.security import daemon_security

log = logging.getLogger("shardline.dispatcher")

PROG = "shardline-dispatcher"
STOP_GRACE_SECONDS = 5.0
DEFAULT_HEARTBEAT_INTERVAL = 1.0


class CacheRole(Protocol):
    """The rack-cache role (the module rack_cache/daemon.py)."""

    def validate_cache_args(self, args: argparse.Namespace) -> None: ...

    def run_cache(self, args: argparse.Namespace, security, stop: threading.Event, *, prog: str) -> int: ...


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Shardline dispatcher: membership, routing and jobs")
    add_common_args(parser, "dispatcher")
    return parser


def parse_args(argv: list[str] | None, cache_role: CacheRole | None = None) -> argparse.Namespace:
    """Flags over SHARDLINE_* environment over config file over defaults. Raises ShardlineConfigError,
    also for cache_bytes without ``cache_role``."""
    args = parse_daemon_args(build_parser(), argv)
    if args.heartbeat_interval is None:
        # Leave room for two missed heartbeats before a node counts as dead.
        args.heartbeat_interval = min(DEFAULT_HEARTBEAT_INTERVAL, args.heartbeat_timeout / 3)
    elif args.heartbeat_interval >= args.heartbeat_timeout:
        raise ShardlineConfigError(
            f"heartbeat_interval must be below heartbeat_timeout, got interval {args.heartbeat_interval!r} "
            f"and timeout {args.heartbeat_timeout!r}")
    if args.cache_bytes:
        if cache_role is None:
            raise ShardlineConfigError(f"cache_bytes={args.cache_bytes!r}: the rack-cache role runs from "
                                       f"{PROG} (shardline.dispatcher_daemon), not from the dispatcher's module")
        cache_role.validate_cache_args(args)
    else:  # a shared environment or config file may carry them for other daemons: only flags count
        for key in ("rack", "data_listen"):
            if getattr(args, key) and args.config_sources.get(key) == "flag":
                raise ShardlineConfigError(f"{key}={getattr(args, key)!r} is for a dispatcher in the rack-cache role: "
                                           f"set cache_bytes too")
    return args


def main(argv: list[str] | None = None, cache_role: CacheRole | None = None) -> int:
    try:
        args = parse_args(argv, cache_role)
        setup_logging(args.log_level, "dispatcher", args.log_format)
        log_configuration(log, args)
        host, _ = parse_host_port(args.listen, what="listen")
        # gRPC and metrics bind the listen host (the metrics port does not matter to the policy)
        binds = {"listen": args.listen, "metrics": format_host_port(host, args.metrics_port)}
        if args.cache_bytes:  # a rack cache also serves the data plane
            binds["data_listen"] = args.data_listen or format_host_port(host, 0)
        security = daemon_security(args, binds)
    except ShardlineConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    stop = install_stop_handlers()
    if args.cache_bytes:
        return cache_role.run_cache(args, security, stop, prog=PROG)
    try:
        server, port, _servicer = create_server(
            args.listen,
            heartbeat_timeout=args.heartbeat_timeout,
            heartbeat_interval=args.heartbeat_interval,
            isolation_share=args.isolation_share,
            isolation_timeout=args.isolation_timeout,
            vnodes_per_capacity=args.vnodes_per_capacity,
            cluster_token=security.token,
            server_tls=security.server_tls,
            tls_ca=security.tls_ca,
            insecure=security.insecure,
            state_dir=args.state_dir,
            state_store=args.state_store,
            state_prefix=args.state_prefix,
            leader_lease_timeout=args.leader_lease_timeout,
            advertise_address=args.advertise_address,
            connect_timeout=args.connect_timeout,
            replication=args.replication,
            heat_half_life=args.heat_half_life,
            rebalance_interval=args.rebalance_interval,
            reader_racks=args.reader_racks,
        )
    except (ShardlineConfigError, StateStoreError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (ShardlineTimeoutError, ShardlineConnectionError) as exc:  # etcd did not answer in time
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
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
        log.info("serving gRPC on %s, metrics on %s; %s", grpc_address, metrics_address, security.summary)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(STOP_GRACE_SECONDS).wait(STOP_GRACE_SECONDS + 1)
        server.close()
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
