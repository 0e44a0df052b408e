"""The systemd units under deploy/systemd/ and the daemons' sd_notify protocol.

* ``systemd-analyze verify`` accepts the units (templates and instances) without a single warning,
  with ExecStart= pointed at this checkout's console scripts (verify insists they exist).
* The daemons, started with a fake ``$NOTIFY_SOCKET`` (a datagram socket this test binds) and a
  short ``$WATCHDOG_USEC``, send READY=1 only once actually serving: at that instant the ready
  file exists and a gRPC health check answers SERVING; a PS node started before its dispatcher
  exists sends nothing (although its gRPC already answers) until it has registered; a worker only
  once it joined its job. Then WATCHDOG=1 keeps coming at WATCHDOG_USEC/2, and SIGTERM brings
  STOPPING=1 and exit status 0.

systemd is not PID 1 here (a container), so nothing starts the units for real; the test plays
systemd's part of the protocol. systemd-analyze comes from Debian's systemd package, which
``scripts/install-system-deps.sh`` (run by ``make test``) installs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.services.daemon import grpc_channel
from shardline.local_cluster import read_json_object
from shardline.services.pb import dispatcher_pb2, dispatcher_pb2_grpc
from ports import free_port

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO / "deploy" / "systemd"
INSTALL_BIN = "/opt/shardline/.venv/bin/"
VENV_BIN = Path(sys.executable).parent
UNITS = ("shardline-dispatcher.service", "shardline-ps@.service", "shardline-worker@.service")
INSTANCES = ("shardline-dispatcher.service", "shardline-ps@a1.service", "shardline-worker@sft-1-r0.service")
JOB_FILE = REPO / "tests" / "integration" / "data" / "demo_short.yaml"

WATCHDOG_USEC = 400_000          # systemd's WatchdogSec=0.4s: pings expected every 0.2 s
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0              # the daemons' promise on SIGTERM


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.fail("systemd-analyze is not installed: run scripts/install-system-deps.sh "
                    "(`make test` runs it; it installs Debian's systemd package)")
    return path


# -- unit files ------------------------------------------------------------------------------

def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value given (systemd allows repeated keys), continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"assignment outside a section: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_files_declare_the_operations_contract():
    for name in UNITS:
        unit = parse_unit((UNIT_DIR / name).read_text())
        svc = unit["Service"]
        one = {k: v[-1] for k, v in svc.items()}
        kind = name.split("@")[0].split(".")[0]  # shardline-dispatcher / shardline-ps / shardline-worker
        where = f"{name}: "
        assert one["Type"] == "notify", where + "Type=notify"
        assert one["NotifyAccess"] == "main", where
        assert re.fullmatch(r"\d+s?", one["WatchdogSec"]), where + "WatchdogSec="
        assert one["Restart"] == "on-failure", where
        assert one["ExecStart"].split()[0] == INSTALL_BIN + kind, where + one["ExecStart"]
        assert one["User"] == "shardline" and one["Group"] == "shardline", where
        assert any(not f.startswith("-") for f in svc["EnvironmentFile"]), where + "a required EnvironmentFile="
        # a PS writes its final checkpoint on SIGTERM (ps_server/main.py STOP_CHECKPOINT_TIMEOUT_SECONDS)
        stop = "300s" if kind == "shardline-ps" else "15s"
        assert one["KillSignal"] == "SIGTERM" and one["TimeoutStopSec"] == stop, where
        assert one["LimitNOFILE"] == "65536", where
        for key, value in (("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"), ("ProtectHome", "yes"),
                           ("PrivateTmp", "yes"), ("LockPersonality", "yes"), ("RestrictSUIDSGID", "yes"),
                           ("CapabilityBoundingSet", "")):
            assert one.get(key) == value, where + f"{key}={value}"
        assert "/var/lib/shardline" in one["ReadWritePaths"].split(), where
        assert set(one["RestrictAddressFamilies"].split()) >= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}, where
        assert "multi-user.target" in unit["Install"]["WantedBy"], where

    ps = parse_unit((UNIT_DIR / "shardline-ps@.service").read_text())["Service"]
    assert "--node-id %i" in ps["ExecStart"][-1]
    assert "/etc/shardline/ps-%i.env" in ps["EnvironmentFile"]
    assert ps["LimitMEMLOCK"] == ["infinity"]
    assert ps["PrivateDevices"] == ["no"] and ps["DevicePolicy"] == ["closed"]
    assert any("infiniband" in d for d in ps["DeviceAllow"])
    worker = parse_unit((UNIT_DIR / "shardline-worker@.service").read_text())["Service"]
    assert "/etc/shardline/worker-%i.env" in worker["EnvironmentFile"]
    assert worker["LimitMEMLOCK"] == ["infinity"]


def test_units_match_daemons_and_example_environment_files():
    """Flags in ExecStart= exist in that daemon; the units leave SHARDLINE_* to the environment files
    (a unit's Environment= would silently beat the operator's config file); every EnvironmentFile=
    has an example under deploy/env/ for the instances the docs use."""
    from shardline.dispatcher.main import build_parser as dispatcher_parser
    from shardline.ps_server.main import build_parser as ps_parser
    from shardline.jobs.worker_daemon import build_parser as worker_parser

    parsers = {"shardline-dispatcher": dispatcher_parser(), "shardline-ps": ps_parser(),
               "shardline-worker": worker_parser()}
    for name, instance in zip(UNITS, INSTANCES):
        svc = parse_unit((UNIT_DIR / name).read_text())["Service"]
        argv = svc["ExecStart"][-1].split()
        parser = parsers[Path(argv[0]).name]
        flags = {s for a in parser._actions for s in a.option_strings}
        for token in argv[1:]:
            if token.startswith("--"):
                assert token.split("=")[0] in flags, f"{name}: ExecStart uses unknown flag {token}"
        for assignment in " ".join(svc.get("Environment", [])).split():
            assert not assignment.startswith("SHARDLINE_"), f"{name}: Environment={assignment}"
        instance_name = instance.split("@")[1].split(".")[0] if "@" in instance else ""
        for env_file in svc["EnvironmentFile"]:
            example = REPO / "deploy" / "env" / Path(env_file.lstrip("-").replace("%i", instance_name)).name
            assert example.exists(), f"{name}: no example {example.relative_to(REPO)} for {env_file}"


def _install_copies(dest: Path) -> list[Path]:
    """Copy the units with ExecStart= pointing at this venv's console scripts (verify wants them)."""
    copies = []
    for name in UNITS:
        text = (UNIT_DIR / name).read_text()
        assert INSTALL_BIN in text, f"{name}: ExecStart= must use {INSTALL_BIN}"
        text = text.replace(INSTALL_BIN, f"{VENV_BIN}/")
        for binary in re.findall(rf"{re.escape(str(VENV_BIN))}/(\S+)", text):
            assert (VENV_BIN / binary).exists(), f"console script {binary} is not installed in {VENV_BIN}"
        (dest / name).write_text(text)
        copies.append(dest / name)
    return copies


def _verify(tool: str, unit_dir: Path, args: list[str]) -> tuple[int, str]:
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{unit_dir}:", "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_PAGER": ""}
    proc = subprocess.run([tool, "verify", "--man=no", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    return proc.returncode, proc.stdout + proc.stderr


def _complaints(output: str, unit_dir: Path) -> list[str]:
    """Lines of verify output about our units (other noise from the host's own units is not ours)."""
    names = [n.split("@")[0].split(".")[0] for n in UNITS]  # shardline-dispatcher, shardline-ps, ...
    return [line for line in output.splitlines()
            if str(unit_dir) in line or any(n in line for n in names)]


def test_systemd_analyze_verify(tmp_path):
    tool = systemd_analyze()
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    copies = _install_copies(unit_dir)

    # The unit files as files (templates included) and as the instances operators enable.
    for args in ([str(p) for p in copies], list(INSTANCES)):
        code, output = _verify(tool, unit_dir, args)
        complaints = _complaints(output, unit_dir)
        assert code == 0 and not complaints, \
            f"systemd-analyze verify {' '.join(args)} exited {code}:\n{output}"

    # The check has teeth: a misspelt key and a bad value in a copy are reported.
    broken = unit_dir / "shardline-ps@.service"
    broken.write_text(broken.read_text().replace("LockPersonality=yes", "LockPersonalty=yes\nRestart=sometimes"))
    code, output = _verify(tool, unit_dir, [str(broken), "shardline-ps@a1.service"])
    assert "LockPersonalty" in output and "sometimes" in output, output
    assert _complaints(output, unit_dir)


def test_sysusers_and_tmpfiles_snippets(tmp_path):
    """The account and directories the units rely on, applied by the real tools to a scratch root."""
    sysusers_conf = REPO / "deploy" / "sysusers.d" / "shardline.conf"
    tmpfiles_conf = REPO / "deploy" / "tmpfiles.d" / "shardline.conf"
    rows = [line.split() for line in sysusers_conf.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert any(r[0] == "u" and r[1] == "shardline" for r in rows), rows
    rows = [line.split() for line in tmpfiles_conf.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert ["d", "/var/lib/shardline", "0750", "shardline", "shardline", "-"] in rows, rows

    systemd_analyze()  # same Debian package as systemd-sysusers and systemd-tmpfiles
    sysusers, tmpfiles = shutil.which("systemd-sysusers"), shutil.which("systemd-tmpfiles")
    assert sysusers and tmpfiles, "systemd-sysusers/systemd-tmpfiles missing: run scripts/install-system-deps.sh"
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    # Only a scratch --root is touched, never this machine's accounts or directories.
    dry = os.geteuid() != 0  # creating accounts and chowning need root (CI and the dev machines are)
    proc = subprocess.run([sysusers, f"--root={root}", *(["--dry-run"] if dry else []), str(sysusers_conf)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and "shardline" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    if dry:
        return
    passwd = {line.split(":")[0]: line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()}
    assert passwd["shardline"][5:] == ["/var/lib/shardline", "/usr/sbin/nologin"], passwd["shardline"]
    proc = subprocess.run([tmpfiles, f"--root={root}", "--create", str(tmpfiles_conf)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stdout + proc.stderr
    state = (root / "var" / "lib" / "shardline").stat()
    assert (state.st_uid, state.st_gid) == (int(passwd["shardline"][2]), int(passwd["shardline"][3]))
    assert state.st_mode & 0o777 == 0o750
    etc = (root / "etc" / "shardline").stat()
    assert (etc.st_uid, etc.st_gid, etc.st_mode & 0o777) == (0, int(passwd["shardline"][3]), 0o750)


# -- the notify protocol against real daemons --------------------------------------------------

class FakeSystemd:
    """Binds a NOTIFY_SOCKET (a path or an abstract name), records every datagram with its arrival
    time, and runs ``on_ready`` in the receiving thread the moment READY=1 arrives, so checks made
    there observe the daemon at exactly that point."""

    def __init__(self, address: str, on_ready=None):
        self.address = address
        bind_to = b"\0" + address[1:].encode() if address.startswith("@") else address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind_to)
        self.sock.settimeout(0.1)
        self.on_ready = on_ready
        self.ready_check: object = None   # what on_ready returned, or the exception it raised
        self.messages: list[tuple[float, dict[str, str]]] = []
        self.cond = threading.Condition()
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=f"fake-systemd {address}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            if fields.get("READY") == "1" and self.on_ready is not None:
                try:
                    self.ready_check = self.on_ready(fields)
                except Exception as exc:  # noqa: BLE001 - reported by the test
                    self.ready_check = exc
            with self.cond:
                self.messages.append((time.monotonic(), fields))
                self.cond.notify_all()

    def count(self, key: str) -> int:
        with self.cond:
            return sum(1 for _, f in self.messages if f.get(key) == "1")

    def times(self, key: str) -> list[float]:
        with self.cond:
            return [t for t, f in self.messages if f.get(key) == "1"]

    def wait_for(self, key: str, *, n: int = 1, timeout: float, proc: subprocess.Popen | None = None,
                 log: Path | None = None) -> float:
        """Time at which the n-th ``KEY=1`` arrived; fails on timeout or if ``proc`` exits first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                stamps = [t for t, f in self.messages if f.get(key) == "1"]
                if len(stamps) >= n:
                    return stamps[n - 1]
                if proc is not None and proc.poll() is not None:
                    pytest.fail(f"daemon exited with {proc.returncode} before {key}=1 #{n}:\n{_tail(log)}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"no {key}=1 #{n} on {self.address} within {timeout} s; got "
                                f"{[f for _, f in self.messages]}\n{_tail(log)}")
                self.cond.wait(min(left, 0.1))

    def close(self) -> None:
        self._closed = True
        self.thread.join(2)
        self.sock.close()


def _tail(log: Path | None, lines: int = 40) -> str:
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def _health_serving(address: str, timeout: float = 2.0) -> bool:
    channel = grpc_channel(address)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


def _routing_node_ids(dispatcher: str) -> set[str]:
    channel = grpc_channel(dispatcher)
    try:
        table = dispatcher_pb2_grpc.DispatcherStub(channel).GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=5)
        return {n.node_id for n in table.nodes}
    finally:
        channel.close()


def _job_exists(dispatcher: str, name: str) -> bool:
    channel = grpc_channel(dispatcher)
    try:
        dispatcher_pb2_grpc.DispatcherStub(channel).GetJob(dispatcher_pb2.GetJobRequest(name=name), timeout=5)
        return True
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise
    finally:
        channel.close()


class Daemons:
    """Starts console-script daemons in their own sessions; ``close`` leaves none behind."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}

    def start(self, name: str, argv: list[str], notify_socket: str) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SHARDLINE_") and k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
        env.update(NOTIFY_SOCKET=notify_socket, WATCHDOG_USEC=str(WATCHDOG_USEC), PYTHONUNBUFFERED="1")
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([str(VENV_BIN / argv[0]), *argv[1:]], cwd=REPO, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        # WATCHDOG_PID would be the daemon's own pid under systemd; the pid is known only now, and
        # the daemon must also accept the variable being unset (tested here).
        self.procs.append(proc)
        self.logs[proc.pid] = log
        return proc

    def log(self, proc: subprocess.Popen) -> Path:
        return self.logs[proc.pid]

    def terminate(self, proc: subprocess.Popen) -> int:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=STOP_TIMEOUT + 5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{proc.args[0]} still running {STOP_TIMEOUT + 5} s after SIGTERM:\n{_tail(self.log(proc))}")

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def daemons(tmp_path):
    d = Daemons(tmp_path)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def sock_dir():
    """A short directory for NOTIFY_SOCKET paths (AF_UNIX paths are limited to 107 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="sdn-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def fake_systemd(sock_dir):
    """Factory of FakeSystemd sockets: ``"@name"`` binds an abstract name, ``"x.sock"`` a path in
    ``sock_dir``; all are closed at teardown."""
    made: list[FakeSystemd] = []

    def make(name: str, on_ready=None) -> FakeSystemd:
        fake = FakeSystemd(name if name.startswith("@") else str(sock_dir / name), on_ready)
        made.append(fake)
        return fake

    try:
        yield make
    finally:
        for fake in made:
            fake.close()


def _serving_snapshot(ready_file: Path, extra=None):
    """on_ready callback: what the daemon looks like the moment READY=1 arrives."""

    def check(fields):
        info = read_json_object(ready_file)
        snapshot = {"ready_file": info, "status": fields.get("STATUS", "")}
        snapshot["health"] = _health_serving(info["grpc"]) if info else False
        if extra is not None and info:
            snapshot.update(extra(info))
        return snapshot

    return check


def _assert_watchdog(fake: FakeSystemd, ready_at: float, proc, log) -> None:
    """WATCHDOG=1 starts once ready and keeps coming at about WATCHDOG_USEC/2."""
    first = len(fake.times("WATCHDOG"))
    fake.wait_for("WATCHDOG", n=first + 5, timeout=10, proc=proc, log=log)
    stamps = fake.times("WATCHDOG")
    assert stamps[0] >= ready_at, "WATCHDOG=1 before READY=1"
    gaps = [b - a for a, b in zip(stamps[first:], stamps[first + 1:])]
    period = WATCHDOG_USEC / 1e6
    assert max(gaps) < period, f"watchdog gaps {gaps} exceed WatchdogSec={period}s"
    assert min(gaps) > period / 8, f"watchdog pings far too frequent: {gaps}"


def _assert_clean_stop(daemons: Daemons, fake: FakeSystemd, proc) -> None:
    sent = time.monotonic()
    code = daemons.terminate(proc)
    stopping = fake.times("STOPPING")
    assert stopping and stopping[0] >= sent, f"no STOPPING=1 after SIGTERM:\n{_tail(daemons.log(proc))}"
    assert code == 0, f"exit status {code} after SIGTERM:\n{_tail(daemons.log(proc))}"
    assert fake.count("READY") == 1, "READY=1 must be sent exactly once"


def test_ready_only_once_serving_watchdog_and_stopping(tmp_path, daemons, fake_systemd):
    # Path socket for the dispatcher, abstract-namespace socket for the PS: both forms end to end.
    dispatcher_port, ps_port = free_port(), free_port()
    cluster = f"127.0.0.1:{dispatcher_port}"
    ps_ready_file = tmp_path / "ps.json"
    dispatcher_ready_file = tmp_path / "dispatcher.json"

    ps_fake = fake_systemd(f"@shardline-test-{uuid.uuid4().hex}", _serving_snapshot(
        ps_ready_file, extra=lambda info: {"registered": info.get("node_id") in _routing_node_ids(cluster)}))
    dispatcher_fake = fake_systemd("dispatcher.sock", _serving_snapshot(dispatcher_ready_file))
    # 1. The PS first: its dispatcher does not exist yet.
    ps = daemons.start("ps", ["shardline-ps", "--listen", f"127.0.0.1:{ps_port}", "--metrics-port", "0",
                              "--ready-file", str(ps_ready_file), "--cluster", cluster, "--node-id", "sd-ps",
                              "--transport", "tcp", "--connect-timeout", "90"], ps_fake.address)
    ps_log = daemons.log(ps)
    deadline = time.monotonic() + START_TIMEOUT
    while not _health_serving(f"127.0.0.1:{ps_port}", timeout=0.5):  # its gRPC is up ...
        assert ps.poll() is None, f"PS exited with {ps.returncode}:\n{_tail(ps_log)}"
        assert time.monotonic() < deadline, f"PS gRPC never came up:\n{_tail(ps_log)}"
        time.sleep(0.1)
    time.sleep(1.5)
    # ... but it has not registered, so it is not ready: no READY=1, no ready file, no watchdog yet.
    assert ps.poll() is None, _tail(ps_log)
    assert ps_fake.messages == [], f"PS notified before registering: {ps_fake.messages}"
    assert not ps_ready_file.exists()

    # 2. The dispatcher.
    dispatcher = daemons.start("dispatcher", [
        "shardline-dispatcher", "--listen", cluster, "--metrics-port", "0",
        "--ready-file", str(dispatcher_ready_file)], dispatcher_fake.address)
    dispatcher_log = daemons.log(dispatcher)
    d_ready = dispatcher_fake.wait_for("READY", timeout=START_TIMEOUT, proc=dispatcher, log=dispatcher_log)
    snap = dispatcher_fake.ready_check
    assert isinstance(snap, dict), snap
    assert snap["ready_file"] and snap["ready_file"]["grpc"] == cluster, snap
    assert snap["health"], f"dispatcher sent READY=1 before its gRPC health check answered: {snap}"
    assert cluster in snap["status"], snap

    # 3. Now the PS registers and only then says READY=1.
    p_ready = ps_fake.wait_for("READY", timeout=START_TIMEOUT, proc=ps, log=ps_log)
    assert p_ready > d_ready
    snap = ps_fake.ready_check
    assert isinstance(snap, dict), snap
    assert snap["ready_file"] and snap["ready_file"]["node_id"] == "sd-ps", snap
    assert snap["health"], f"PS sent READY=1 before its gRPC health check answered: {snap}"
    assert snap["registered"], f"PS sent READY=1 before the dispatcher routed to it: {snap}"
    assert "sd-ps" in snap["status"], snap

    # 4. Watchdog keep-alives from both, at WatchdogSec/2.
    _assert_watchdog(dispatcher_fake, d_ready, dispatcher, dispatcher_log)
    _assert_watchdog(ps_fake, p_ready, ps, ps_log)

    # 5. SIGTERM: STOPPING=1, exit 0, within the promised time.
    _assert_clean_stop(daemons, ps_fake, ps)
    _assert_clean_stop(daemons, dispatcher_fake, dispatcher)


def test_worker_ready_once_joined(tmp_path, daemons, fake_systemd):
    dispatcher_fake = fake_systemd("d.sock")
    ps_fake = fake_systemd("p.sock")
    cluster = f"127.0.0.1:{free_port()}"
    worker_ready_file = tmp_path / "worker.json"
    worker_fake = fake_systemd("w.sock", _serving_snapshot(
        worker_ready_file, extra=lambda info: {"job": _job_exists(cluster, info["job"])}))
    dispatcher = daemons.start("dispatcher", ["shardline-dispatcher", "--listen", cluster, "--metrics-port", "0"],
                               dispatcher_fake.address)
    dispatcher_fake.wait_for("READY", timeout=START_TIMEOUT, proc=dispatcher, log=daemons.log(dispatcher))
    ps = daemons.start("ps", ["shardline-ps", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--cluster",
                              cluster, "--node-id", "sd-ps", "--transport", "tcp"], ps_fake.address)
    ps_fake.wait_for("READY", timeout=START_TIMEOUT, proc=ps, log=daemons.log(ps))

    worker = daemons.start("worker", [
        "shardline-worker", "--listen", "127.0.0.1:0", "--metrics-port", "0", "--ready-file", str(worker_ready_file),
        "--cluster", cluster, "--job", str(JOB_FILE), "--rank", "0", "--world-size", "1", "--steps", "100000",
        "--transport", "tcp", "--progress", "off", "--summary", "line"], worker_fake.address)
    w_log = daemons.log(worker)
    w_ready = worker_fake.wait_for("READY", timeout=START_TIMEOUT * 2, proc=worker, log=w_log)
    snap = worker_fake.ready_check
    assert isinstance(snap, dict), snap
    assert snap["ready_file"] and snap["ready_file"]["job"] == "demo-short", snap
    assert snap["health"] and snap["job"], f"worker sent READY=1 before it joined its job: {snap}"
    _assert_watchdog(worker_fake, w_ready, worker, w_log)
    _assert_clean_stop(daemons, worker_fake, worker)
    _assert_clean_stop(daemons, ps_fake, ps)
    _assert_clean_stop(daemons, dispatcher_fake, dispatcher)
