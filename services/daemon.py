"""Lifecycle pieces every Shardline daemon shares: flags, gRPC server, metrics, ready file, signals.

Contract (SPEC "Interfaces that must stay stable"): every daemon accepts ``--listen HOST:PORT``
(port 0 picks a free port), ``--metrics-port PORT``, ``--config FILE`` and ``--ready-file PATH``.
Once serving it writes the ready file atomically: a JSON object with at least ``pid``, ``grpc`` and
``metrics`` ("host:port"). SIGTERM/SIGINT set a stop event; the daemon then shuts down within 10 s
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.errors import ShardlineConfigError

log = logging.getLogger("shardline")

# Bound on a single control-plane message; data moves on the binary data plane.
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def parse_host_port(value: str, *, what: str = "address") -> tuple[str, int]:
    """Parse ``HOST:PORT`` (IPv6 as ``[::1]:PORT``). Raises ShardlineConfigError quoting the value."""
    if not isinstance(value, str) or ":" not in value:
        raise ShardlineConfigError(f"{what} must be HOST:PORT, got {value!r}")
    host, _, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ShardlineConfigError(f"{what} must be HOST:PORT with a host, got {value!r}")
    try:
        port = int(port_text)
    except ValueError:
        raise ShardlineConfigError(f"{what} port must be an integer, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise ShardlineConfigError(f"{what} port must be in 0..65535, got {value!r}")
    return host, port


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_common_args(parser: argparse.ArgumentParser, *, default_listen: str) -> None:
    parser.add_argument("--listen", default=default_listen, help="gRPC bind address HOST:PORT (port 0 = any free port)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus metrics port on the --listen host (0 = any free port)")
    parser.add_argument("--config", default=None, help="YAML config file")
    parser.add_argument("--ready-file", default=None, help="write a JSON object here once serving")
    parser.add_argument("--log-level", default=os.environ.get("SHARDLINE_LOG_LEVEL", "INFO"), help="DEBUG, INFO, WARNING or ERROR")


def setup_logging(level: str, component: str) -> None:
    numeric = logging.getLevelName(str(level).upper())
    if not isinstance(numeric, int):
        raise ShardlineConfigError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    logging.basicConfig(
        level=numeric,
        stream=sys.stdout,
        format=f"%(asctime)s %(levelname)s {component}[%(process)d] %(name)s: %(message)s",
    )


def create_grpc_server(
    address: str,
    register: Iterable[Callable[[grpc.Server], None]],
    *,
    max_workers: int = 16,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Create and start a gRPC server on ``address`` with the standard health service.

    ``register`` are callbacks that add servicers (``add_XServicer_to_server``). Returns the server,
    the bound port (useful with port 0) and the health servicer (already SERVING for "").
    """
    from services.grpc_metrics import MetricsInterceptor

    host, port = parse_host_port(address, what="--listen")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[MetricsInterceptor()],  # shardline_grpc_server_* metrics on every daemon
        options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    for add in register:
        add(server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(format_host_port(host, port))
    if bound == 0:
        raise ShardlineConfigError(f"cannot bind gRPC to --listen {address!r}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def start_metrics_server(host: str, port: int) -> tuple[object, int]:
    """Serve the default Prometheus registry on host:port (0 = free port). Returns (server, port)."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    return server, server.server_port


def write_ready_file(path: str | None, info: dict) -> None:
    """Write ``info`` as JSON to ``path`` atomically (rename), so readers never see half a file."""
    if not path:
        return
    info = {"pid": os.getpid(), **info}
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(info, fh)
        fh.write("\n")
    os.replace(tmp, path)


_watchdog = None  # the process's systemd watchdog pinger, started once by announce_ready


def announce_ready(path: str | None, info: dict) -> None:
    """The daemon is serving: write the ready file (if ``path``), then tell systemd.

    Sends ``READY=1`` with a ``STATUS=`` summary of ``info`` to ``$NOTIFY_SOCKET`` and, when the
    unit has ``WatchdogSec=``, starts the ``WATCHDOG=1`` keep-alive thread. Outside systemd only
    the file is written. Call it exactly once serving (after binding, registering, joining).
    """
    global _watchdog
    from services import sdnotify

    write_ready_file(path, info)
    summary = ", ".join(f"{key} {info[key]}" for key in ("node_id", "job", "grpc", "data", "metrics") if info.get(key))
    sdnotify.ready(status=f"serving: {summary}" if summary else "serving")
    if _watchdog is None:
        _watchdog = sdnotify.start_watchdog()


class _StopEvent(threading.Event):
    """A stop event that tells systemd ``STOPPING=1`` the first time it is set, whoever sets it."""

    def set(self) -> None:
        if not self.is_set():
            from services import sdnotify

            sdnotify.stopping(status="stopping")
        super().set()


def install_stop_handlers() -> threading.Event:
    """Return an event set by SIGTERM or SIGINT (clean shutdown, exit code 0).

    Setting it (by a signal or by the daemon itself) sends ``STOPPING=1`` to systemd.
    """
    stop = _StopEvent()

    def _handler(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def grpc_channel(address: str) -> grpc.Channel:
    """An insecure channel to a Shardline daemon with the cluster's message bounds."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ],
    )
