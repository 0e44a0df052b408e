"""systemd readiness and watchdog notifications (``sd_notify(3)``) without extra dependencies.

Under a ``Type=notify`` unit systemd passes ``$NOTIFY_SOCKET``: a ``AF_UNIX``/``SOCK_DGRAM`` socket
path, or an abstract-namespace name written with a leading ``@``. A notification is one datagram of
newline-separated ``VARIABLE=VALUE`` assignments (``READY=1``, ``STATUS=...``, ``STOPPING=1``,
``WATCHDOG=1``). Outside systemd (no ``$NOTIFY_SOCKET``) every call here is a no-op returning False,
so daemons call these unconditionally.

With ``WatchdogSec=`` systemd also sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the process it
means); the service must send ``WATCHDOG=1`` more often than that. :class:`WatchdogPinger` sends it
every ``WATCHDOG_USEC / 2`` from a daemon thread; :func:`start_watchdog` starts one when the
environment asks for it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping

__all__ = [
    "WatchdogPinger", "format_message", "notify", "ready", "socket_address", "start_watchdog", "status",
    "stopping", "watchdog", "watchdog_period",
]

log = logging.getLogger("shardline.sdnotify")

# A notification must never hold a daemon up: a stalled receiver costs at most this long.
SEND_TIMEOUT_SECONDS = 2.0


def socket_address(value: str | None) -> str | bytes | None:
    """The ``sendto`` address for a ``$NOTIFY_SOCKET`` value, or None if unset or unsupported.

    ``/run/systemd/notify`` -> the path; ``@name`` -> ``b"\\0name"`` (Linux abstract namespace).
    Other forms (systemd's ``vsock:`` addresses, relative paths) are not supported here.
    """
    if not value:
        return None
    if value.startswith("@"):
        if len(value) < 2:
            return None
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None


def format_message(*lines: str, **fields: object) -> bytes:
    """Build a notification: each of ``lines`` (``"READY=1"``) then ``KEY=value`` for ``fields``.

    Values may not span lines (systemd reads one assignment per line), so newlines in a value
    become spaces; None values are left out.
    """
    parts = [line.replace("\n", " ") for line in lines if line]
    for key, value in fields.items():
        if value is None:
            continue
        if not key or "=" in key or "\n" in key:
            raise ValueError(f"invalid notification field name {key!r}")
        text = str(value).replace("\r", " ").replace("\n", " ")
        parts.append(f"{key}={text}")
    return "\n".join(parts).encode()


def notify(state: str | bytes, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1\\nSTATUS=serving"``) to ``$NOTIFY_SOCKET``.

    Returns True if the datagram was sent, False if there is no (usable) socket or sending failed;
    it never raises, so a notification problem cannot take a daemon down.
    """
    env = os.environ if environ is None else environ
    raw = env.get("NOTIFY_SOCKET")
    address = socket_address(raw)
    if address is None:
        if raw:
            log.warning("ignoring NOTIFY_SOCKET=%r: not an absolute path or @abstract name", raw)
        return False
    payload = state.encode() if isinstance(state, str) else bytes(state)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(SEND_TIMEOUT_SECONDS)
            sock.sendto(payload, address)
        return True
    except OSError as exc:
        log.warning("cannot notify systemd on %s: %s", raw, exc)
        return False


def ready(status: str | None = None, **kwargs) -> bool:
    """Tell systemd start-up is complete (``READY=1``), optionally with a ``STATUS=`` line."""
    return notify(format_message("READY=1", STATUS=status), **kwargs)


def stopping(status: str | None = None, **kwargs) -> bool:
    """Tell systemd the daemon is shutting down (``STOPPING=1``)."""
    return notify(format_message("STOPPING=1", STATUS=status), **kwargs)


def status(text: str, **kwargs) -> bool:
    """Update the free-form status line ``systemctl status`` shows (``STATUS=``)."""
    return notify(format_message(STATUS=text), **kwargs)


def watchdog(**kwargs) -> bool:
    """Keep-alive ping (``WATCHDOG=1``)."""
    return notify(b"WATCHDOG=1", **kwargs)


def watchdog_period(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """The watchdog timeout in seconds that systemd expects this process to honour, else None.

    Like ``sd_watchdog_enabled(3)``: ``$WATCHDOG_USEC`` must be a positive integer and
    ``$WATCHDOG_PID``, when set, must be this process (a child that inherited the environment must
    not ping on its parent's behalf).
    """
    env = os.environ if environ is None else environ
    usec_text = env.get("WATCHDOG_USEC", "")
    if not usec_text:
        return None
    try:
        usec = int(usec_text)
    except ValueError:
        log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec_text)
        return None
    if usec <= 0:
        return None
    pid_text = env.get("WATCHDOG_PID", "")
    if pid_text:
        try:
            watched = int(pid_text)
        except ValueError:
            log.warning("ignoring WATCHDOG_PID=%r: not an integer", pid_text)
            return None
        if watched != (os.getpid() if pid is None else pid):
            return None
    return usec / 1_000_000


class WatchdogPinger(threading.Thread):
    """A daemon thread sending ``WATCHDOG=1`` every ``interval`` seconds until :meth:`stop`.

    ``check``, if given, is called before each ping; a ping is skipped while it returns False (or
    raises), so systemd restarts a daemon whose health check keeps failing.
    """

    def __init__(self, interval: float, *, check: Callable[[], bool] | None = None,
                 send: Callable[[], bool] = watchdog):
        if not interval > 0:
            raise ValueError(f"watchdog interval must be > 0, got {interval!r}")
        super().__init__(name="sd-watchdog", daemon=True)
        self.interval = interval
        self.check = check
        self._send = send
        self._stopped = threading.Event()
        self.pings = 0

    def run(self) -> None:
        while True:
            healthy = True
            if self.check is not None:
                try:
                    healthy = bool(self.check())
                except Exception as exc:  # noqa: BLE001 - an unhealthy daemon, not a crashed pinger
                    log.warning("watchdog health check failed: %s", exc)
                    healthy = False
            if healthy and self._send():
                self.pings += 1
            if self._stopped.wait(self.interval):
                return

    def stop(self, timeout: float | None = None) -> None:
        """Stop pinging; waits up to ``timeout`` seconds for the thread to end."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)


def start_watchdog(*, check: Callable[[], bool] | None = None,
                   environ: Mapping[str, str] | None = None) -> WatchdogPinger | None:
    """Start a :class:`WatchdogPinger` at half the period systemd asked for; None if it asked for none."""
    period = watchdog_period(environ)
    if period is None:
        return None
    env = environ
    pinger = WatchdogPinger(period / 2, check=check, send=lambda: watchdog(environ=env))
    pinger.start()
    return pinger
