"""services.sdnotify: message format, socket addressing (paths and abstract names), watchdog timing."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid

import pytest

from shardline.services import sdnotify

pytestmark = pytest.mark.timeout(30)


class Receiver:
    """A NOTIFY_SOCKET stand-in: an AF_UNIX datagram socket bound to a path or an abstract name."""

    def __init__(self, address: str | bytes):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(5.0)

    def recv(self, timeout: float = 5.0) -> str:
        self.sock.settimeout(timeout)
        return self.sock.recv(4096).decode()

    def nothing_within(self, seconds: float) -> bool:
        self.sock.settimeout(seconds)
        try:
            self.sock.recv(4096)
        except TimeoutError:
            return True
        return False

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def path_receiver():
    # A short directory: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path can be longer.
    directory = tempfile.mkdtemp(prefix="sdn-")
    path = os.path.join(directory, "notify.sock")
    r = Receiver(path)
    yield path, r
    r.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def abstract_receiver():
    name = f"shardline-test-{os.getpid()}-{uuid.uuid4().hex}"
    r = Receiver(b"\0" + name.encode())
    yield "@" + name, r
    r.close()


# -- message format --------------------------------------------------------------------------

def test_format_message_lines_and_fields():
    assert sdnotify.format_message("READY=1", STATUS="serving on 127.0.0.1:7000") == \
        b"READY=1\nSTATUS=serving on 127.0.0.1:7000"
    assert sdnotify.format_message("STOPPING=1", STATUS=None) == b"STOPPING=1"
    assert sdnotify.format_message(STATUS="a") == b"STATUS=a"


def test_format_message_values_stay_on_one_line():
    assert sdnotify.format_message("READY=1", STATUS="two\nlines\r") == b"READY=1\nSTATUS=two lines "
    with pytest.raises(ValueError):
        sdnotify.format_message(**{"A=B": "x"})


def test_socket_address_forms():
    assert sdnotify.socket_address("/run/systemd/notify") == "/run/systemd/notify"
    assert sdnotify.socket_address("@foo/bar") == b"\0foo/bar"
    for unusable in (None, "", "@", "relative/path", "vsock:2:1234"):
        assert sdnotify.socket_address(unusable) is None


# -- sending ---------------------------------------------------------------------------------

def test_noop_without_notify_socket(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready(status="x") is False
    assert sdnotify.watchdog() is False
    assert sdnotify.stopping() is False


def test_unsupported_socket_value_is_ignored(monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", "not-absolute")
    assert sdnotify.notify("READY=1") is False


def test_missing_socket_returns_false(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent.sock"))
    assert sdnotify.notify("READY=1") is False  # logged, never raised


def test_path_socket(monkeypatch, path_receiver):
    path, r = path_receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.ready(status="serving: grpc 127.0.0.1:1") is True
    assert r.recv() == "READY=1\nSTATUS=serving: grpc 127.0.0.1:1"
    assert sdnotify.watchdog() is True
    assert r.recv() == "WATCHDOG=1"
    assert sdnotify.stopping() is True
    assert r.recv() == "STOPPING=1"
    assert sdnotify.status("draining") is True
    assert r.recv() == "STATUS=draining"


def test_abstract_socket(monkeypatch, abstract_receiver):
    name, r = abstract_receiver
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    assert sdnotify.ready() is True
    assert r.recv() == "READY=1"


def test_explicit_environ_overrides_process_environment(monkeypatch, path_receiver):
    path, r = path_receiver
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1", environ={"NOTIFY_SOCKET": path}) is True
    assert r.recv() == "READY=1"


# -- watchdog --------------------------------------------------------------------------------

def test_watchdog_period_rules():
    pid = os.getpid()
    assert sdnotify.watchdog_period({}) is None
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "3000000"}) == 3.0
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(pid)}) == 3.0
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(pid + 1)}) is None
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "0"}) is None
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "soon"}) is None
    assert sdnotify.watchdog_period({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}) is None


def test_start_watchdog_needs_watchdog_usec(path_receiver):
    path, r = path_receiver
    assert sdnotify.start_watchdog(environ={"NOTIFY_SOCKET": path}) is None
    assert r.nothing_within(0.3)


def test_start_watchdog_pings_at_half_the_period_until_stopped(path_receiver):
    path, r = path_receiver
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000", "WATCHDOG_PID": str(os.getpid())}
    pinger = sdnotify.start_watchdog(environ=env)
    assert pinger is not None and pinger.interval == pytest.approx(0.1)
    try:
        t0 = time.monotonic()
        for _ in range(5):
            assert r.recv(timeout=2.0) == "WATCHDOG=1"
        elapsed = time.monotonic() - t0
        # 5 pings, the first at once, then one per 0.1 s: about 0.4 s, far below 5 full periods.
        assert 0.25 <= elapsed < 1.0, elapsed
    finally:
        pinger.stop(timeout=2.0)
    assert not pinger.is_alive()
    while not r.nothing_within(0.05):  # drain a ping that raced with stop()
        pass
    assert r.nothing_within(0.4)


def test_watchdog_for_another_pid_does_not_ping(path_receiver):
    path, r = path_receiver
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": str(os.getpid() + 1)}
    assert sdnotify.start_watchdog(environ=env) is None
    assert r.nothing_within(0.3)


def test_watchdog_health_check_gates_pings():
    healthy = threading.Event()
    sent = []
    pinger = sdnotify.WatchdogPinger(0.02, check=healthy.is_set, send=lambda: sent.append(1) or True)
    pinger.start()
    try:
        time.sleep(0.2)
        assert sent == []
        healthy.set()
        deadline = time.monotonic() + 3
        while len(sent) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(sent) >= 3
    finally:
        pinger.stop(timeout=2.0)
    assert pinger.pings == len(sent)


def test_watchdog_check_that_raises_skips_the_ping():
    sent = []

    def boom():
        raise RuntimeError("unhealthy")

    pinger = sdnotify.WatchdogPinger(0.02, check=boom, send=lambda: sent.append(1) or True)
    pinger.start()
    time.sleep(0.15)
    pinger.stop(timeout=2.0)
    assert sent == [] and not pinger.is_alive()


def test_watchdog_rejects_bad_interval():
    with pytest.raises(ValueError):
        sdnotify.WatchdogPinger(0)


# -- the daemon hooks (services.daemon) ------------------------------------------------------

def test_announce_ready_writes_the_file_then_notifies(monkeypatch, path_receiver, tmp_path):
    import json

    from shardline.services import daemon

    path, r = path_receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.setattr(daemon, "_watchdog", None)
    ready_file = tmp_path / "ready.json"
    daemon.announce_ready(str(ready_file), {"grpc": "127.0.0.1:1", "metrics": "127.0.0.1:2", "node_id": "n1"})
    assert r.recv() == "READY=1\nSTATUS=serving: node_id n1, grpc 127.0.0.1:1, metrics 127.0.0.1:2"
    assert json.loads(ready_file.read_text())["pid"] == os.getpid()
    assert daemon._watchdog is None  # no WatchdogSec, no pinger
    daemon.announce_ready(None, {"grpc": "127.0.0.1:1"})  # under systemd there is often no ready file
    assert r.recv() == "READY=1\nSTATUS=serving: grpc 127.0.0.1:1"


def test_stop_event_sends_stopping_once(monkeypatch, path_receiver):
    import signal

    from shardline.services import daemon

    path, r = path_receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = daemon.install_stop_handlers()
        assert r.nothing_within(0.1)
        stop.set()
        assert stop.is_set()
        assert r.recv() == "STOPPING=1\nSTATUS=stopping"
        stop.set()
        assert r.nothing_within(0.2)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
