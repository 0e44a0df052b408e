"""Lifecycle pieces every Shardline daemon shares: flags, gRPC server, metrics, ready file, signals.

Contract (SPEC "Interfaces that must stay stable"): every daemon accepts ``--listen HOST:PORT``
(port 0 picks a free port), ``--metrics-port PORT``, ``--config FILE`` and ``--ready-file PATH``.
Once serving it writes the ready file atomically: a JSON object with at least ``pid``, ``grpc`` and
``metrics`` ("host:port"). SIGTERM/SIGINT set a stop event; the daemon then shuts down within 10 s
and exits 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import re
import signal
import sys
import threading
from concurrent import futures
from typing import Callable, Iterable, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardline.services.errors import ShardlineConfigError

log = logging.getLogger("shardline")

# Bound on a single control-plane message; data moves on the binary data plane.
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Calls a server runs or queues at once; more get RESOURCE_EXHAUSTED instead of growing its queue.
GRPC_MAX_CONCURRENT_RPCS = 1024


_HOST_NAME = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def parse_host_port(value: str, *, what: str = "address") -> tuple[str, int]:
    """Parse ``HOST:PORT`` (IPv6 as ``[::1]:PORT``). Raises ShardlineConfigError quoting the value.

    Strict on purpose: the value goes to gRPC and sockets afterwards, and gRPC reads a target it
    does not understand its own way (no port means port 443, ``dns:`` a URI scheme) and then
    retries in silence. The host is a name or IPv4 address (letters, digits, ``.-_``) or a bracketed
    IPv6 address; the port is ASCII digits."""
    if not isinstance(value, str) or ":" not in value:
        raise ShardlineConfigError(f"{what} must be HOST:PORT, got {value!r}")
    if value.startswith("["):
        close = value.find("]")
        if close < 0 or value[close + 1:close + 2] != ":":
            raise ShardlineConfigError(f"{what} must be [IPV6]:PORT, got {value!r}")
        host, port_text = value[1:close], value[close + 2:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ShardlineConfigError(f"{what}: {host!r} in brackets is no IPv6 address, got {value!r}") from None
    else:
        host, _, port_text = value.rpartition(":")
        if ":" in host:
            if _is_ipv6(value) or _is_ipv6(host):
                raise ShardlineConfigError(f"{what} must be HOST:PORT with an IPv6 host in brackets ([::1]:7000), "
                                           f"got {value!r}")
            raise ShardlineConfigError(f"{what} must be HOST:PORT (no scheme or path), got {value!r}")
        if not host:
            raise ShardlineConfigError(f"{what} must be HOST:PORT with a host, got {value!r}")
        if not _HOST_NAME.match(host):
            raise ShardlineConfigError(f"{what} must be HOST:PORT with a host name or IP address as host "
                                       f"(no scheme, path or spaces), got {value!r}")
    if not (port_text.isascii() and port_text.isdigit()):
        raise ShardlineConfigError(f"{what} port must be an integer, got {value!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ShardlineConfigError(f"{what} port must be in 0..65535, got {value!r}")
    return host, port


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def add_common_args(parser: argparse.ArgumentParser, daemon: str) -> None:
    """Declare every option of ``daemon`` ("dispatcher", "ps" or "worker") from the schema in
    services/config.py: --listen, --metrics-port, --ready-file, --log-level, --log-format, --config
    and the daemon's own knobs. Parse with ``services.config.parse_daemon_args``."""
    from shardline.services.config import add_options

    add_options(parser, daemon)


# LogRecord attributes that are not event fields.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
# syslog priorities journald reads from a "<N>" line prefix (SyslogLevelPrefix=, on by default).
_SYSLOG_PRIORITY = {"CRITICAL": 2, "ERROR": 3, "WARNING": 4, "INFO": 6, "DEBUG": 7}


def _event_fields(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and not k.startswith("_")}


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n")


class LogFormatter(logging.Formatter):
    """One line per event, ``text`` or ``json``.

    text: ``2025-01-02T03:04:05.678Z INFO ps[123] shardline.ps: message key=value ...``
    json: ``{"ts": ..., "level": ..., "component": ..., "logger": ..., "msg": ..., "pid": ..., <fields>}``
    Fields are the ``extra={...}`` of the call; a traceback goes to ``exc``. Newlines are escaped, so an
    event is always exactly one line. ``journald``: prefix ``<priority>`` and leave the time to journald.
    """

    def __init__(self, component: str, fmt: str = "text", *, journald: bool = False):
        super().__init__()
        if fmt not in ("text", "json"):
            raise ShardlineConfigError(f"log_format must be text or json, got {fmt!r}")
        self.component, self.fmt, self.journald = component, fmt, journald

    @staticmethod
    def timestamp(record: logging.LogRecord) -> str:
        import datetime

        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        return ts.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        exc = None
        if record.exc_info:
            exc = self.formatException(record.exc_info)
        elif record.exc_text:
            exc = record.exc_text
        if record.stack_info:
            exc = (exc + "\n" if exc else "") + self.formatStack(record.stack_info)
        fields = _event_fields(record)
        if self.fmt == "json":
            obj = {"ts": self.timestamp(record), "level": record.levelname, "component": self.component,
                   "logger": record.name, "msg": msg, "pid": record.process, "thread": record.threadName}
            for key, value in fields.items():
                obj.setdefault(key, value)
            if exc:
                obj["exc"] = exc
            line = json.dumps(obj, default=str, ensure_ascii=False)
        else:
            parts = [] if self.journald else [self.timestamp(record)]
            parts += [record.levelname, f"{self.component}[{record.process}]", f"{record.name}:", msg]
            parts += [f"{k}={json.dumps(v, default=str) if not isinstance(v, str) or ' ' in v else v}"
                      for k, v in fields.items()]
            if exc:
                parts.append(f"exc={exc}")
            line = _one_line(" ".join(parts))
        if self.journald:
            line = f"<{_SYSLOG_PRIORITY.get(record.levelname, 6)}>{line}"
        return line


def _stream_is_journal(stream) -> bool:
    """True when ``stream`` is the journald stream systemd connected (``$JOURNAL_STREAM`` = dev:inode)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    try:
        dev, ino = (int(x) for x in value.split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return st.st_dev == dev and st.st_ino == ino


def setup_logging(level: str, component: str, fmt: str = "text", *, stream=None) -> logging.Handler:
    """Log one line per event to ``stream`` (stdout) at ``level`` and above, as ``text`` or ``json``.

    Calling it again replaces the handler the previous call installed. Routes ``warnings`` through
    logging and returns the handler. Raises ShardlineConfigError for a bad level or format.
    """
    numeric = logging.getLevelName(str(level).upper())
    if not isinstance(numeric, int):
        raise ShardlineConfigError(f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    stream = sys.stdout if stream is None else stream
    handler = logging.StreamHandler(stream)
    handler.setFormatter(LogFormatter(component, fmt, journald=_stream_is_journal(stream)))
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_shardline", False):
            root.removeHandler(old)
    handler._shardline = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(numeric)
    logging.captureWarnings(True)
    return handler


def create_grpc_server(
    address: str,
    register: Iterable[Callable[[grpc.Server], None]],
    *,
    max_workers: int = 16,
    cluster_token: bytes | None = None,
    tls=None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Create and start a gRPC server on ``address`` with the standard health service.

    ``register`` are callbacks that add servicers (``add_XServicer_to_server``). With
    ``cluster_token`` every call but the health service must carry it (services/auth.py). With
    ``tls`` (a services.security.ServerTLS) the port speaks TLS only. Returns the server, the bound
    port (useful with port 0) and the health servicer (already SERVING for "").
    """
    from shardline.services.auth import BearerTokenServerInterceptor
    from shardline.services.grpc_metrics import MetricsInterceptor

    # Metrics first, so refused calls are counted (code UNAUTHENTICATED).
    interceptors = [MetricsInterceptor()]
    if cluster_token is not None:
        interceptors.append(BearerTokenServerInterceptor(cluster_token))

    host, port = parse_host_port(address, what="--listen")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=interceptors,
        maximum_concurrent_rpcs=GRPC_MAX_CONCURRENT_RPCS,
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
    if tls is not None:
        credentials = grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)])
        bound = server.add_secure_port(format_host_port(host, port), credentials)
    else:
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
    from shardline.services import sdnotify

    write_ready_file(path, info)
    summary = ", ".join(f"{key} {info[key]}" for key in ("node_id", "job", "grpc", "data", "metrics") if info.get(key))
    sdnotify.ready(status=f"serving: {summary}" if summary else "serving")
    if _watchdog is None:
        _watchdog = sdnotify.start_watchdog()


class _StopEvent(threading.Event):
    """A stop event that tells systemd ``STOPPING=1`` the first time it is set, whoever sets it."""

    def set(self) -> None:
        if not self.is_set():
            from shardline.services import sdnotify

            sdnotify.stopping(status="stopping")
        super().set()


# Set by a supervising process (LocalCluster, `shardline up`, the benchmark) to its pid: the daemon
# asks the kernel for SIGTERM when that process dies, so an interrupted supervisor leaves no
# orphans. Done by the daemon itself, not in a preexec_fn: running Python between fork and exec
# in a process with gRPC threads can crash the child.
PARENT_PID_ENV = "SHARDLINE_PARENT_PID"


def arm_parent_death_signal() -> None:
    value = os.environ.get(PARENT_PID_ENV)
    if not value or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError, ValueError):
        return
    if str(os.getppid()) != value.strip():  # the supervisor died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def exit_after_stop(code: int) -> "NoReturn":
    """End a daemon whose own shutdown finished: flush the logs and streams, then leave without
    the interpreter's teardown.

    Why: a connection thread may still be inside a torch kernel with the GIL released (a push
    that was being applied when the stop came); tearing the interpreter down under it runs C++
    static destructors while it works, and the process aborts ("terminate called without an
    active exception", exit -6) after a clean stop. Everything that must outlive the process was
    written and synced before this is called."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def install_stop_handlers() -> threading.Event:
    """Return an event set by SIGTERM or SIGINT (clean shutdown, exit code 0).

    Setting it (by a signal or by the daemon itself) sends ``STOPPING=1`` to systemd. Also arms
    the parent-death signal when a supervisor asked for it (``SHARDLINE_PARENT_PID``).
    """
    stop = _StopEvent()

    def _handler(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    arm_parent_death_signal()
    return stop


def grpc_channel(address: str, cluster_token: bytes | None = None, *, tls_ca: bytes | None = None,
                 options: Iterable[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to a Shardline daemon with the cluster's message bounds (and extra channel
    ``options``). With ``tls_ca`` (PEM bytes) it speaks TLS and accepts only a server whose
    certificate that CA signed for the host of ``address``; else plaintext. With ``cluster_token``
    every unary call carries it."""
    channel_options = [
        ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        *options,
    ]
    if tls_ca is not None:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca),
                                      options=channel_options)
    else:
        channel = grpc.insecure_channel(address, options=channel_options)
    if cluster_token is None:
        return channel
    from shardline.services.auth import BearerTokenClientInterceptor

    return grpc.intercept_channel(channel, BearerTokenClientInterceptor(cluster_token))
