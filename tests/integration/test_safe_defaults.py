"""Safe by default, with real daemons: without flags they bind loopback only; a non-loopback bind
without a cluster token refuses to start; ``allow_insecure`` starts with a WARNING that
``shardline status`` repeats.

Whatever binds a fixed or a non-loopback address runs inside a network namespace created for the
test (tests/netns.py): nothing is reachable from the host's network, and the default ports are free.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netns import NetNS, NetNSUnavailable, listening

pytestmark = pytest.mark.timeout(180)

DATA = Path(__file__).parent / "data"
JOB = DATA / "demo_short.yaml"
MODULES = {"dispatcher": "shardline.dispatcher.main", "ps": "shardline.ps_server.main",
           "worker": "shardline.jobs.worker_daemon"}
# Daemons must not see a token or config the developer's shell may export.
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")}


def daemon_argv(kind: str, *args: str) -> list[str]:
    return [sys.executable, "-m", MODULES[kind], *args]


@pytest.fixture
def netns():
    try:
        ns = NetNS()
    except NetNSUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)  # never a silent skip
    try:
        yield ns
    finally:
        ns.close()


def start(ns: NetNS | None, kind: str, workdir: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path, Path]:
    """Start a daemon (in ``ns``, else here) with a ready file and a log; dies with this process."""
    ready, log = workdir / f"{name}.json", workdir / f"{name}.log"
    env = {**CLEAN_ENV, "SHARDLINE_PARENT_PID": str(os.getpid()), "PYTHONUNBUFFERED": "1"}
    argv = daemon_argv(kind, "--ready-file", str(ready), *args)
    with open(log, "wb") as out:
        if ns is not None:
            proc = ns.popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        else:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return proc, ready, log


def wait_ready(proc: subprocess.Popen, ready: Path, log: Path, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            info = json.loads(ready.read_text())
            if info.get("pid") == proc.pid:
                return info
        except (OSError, ValueError):
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    pytest.fail(f"{ready.stem} (exit {proc.poll()}) not ready within {timeout:g} s:\n{log.read_text()[-3000:]}")


def stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_default_binds_are_loopback(netns, tmp_path):
    """No --listen, no --data-listen: every socket of the dispatcher, a PS and a worker is 127.0.0.1."""
    disp, disp_ready, disp_log = start(netns, "dispatcher", tmp_path, "dispatcher")
    d = wait_ready(disp, disp_ready, disp_log)
    assert d["grpc"] == "127.0.0.1:7000"
    ps, ps_ready, ps_log = start(netns, "ps", tmp_path, "ps", "--cluster", "127.0.0.1:7000", "--node-id", "p1")
    p = wait_ready(ps, ps_ready, ps_log)
    worker, w_ready, w_log = start(netns, "worker", tmp_path, "worker", "--cluster", "127.0.0.1:7000", "--job", str(JOB),
                                   "--steps", "100000", "--progress", "off")
    w = wait_ready(worker, w_ready, w_log)
    try:
        sockets = netns.listening()
        assert sockets, "no listening socket seen"
        assert all(host == "127.0.0.1" for host, _ in sockets), sockets
        ports = {port for _, port in sockets}
        expected = {7000, 7100, *(port_of(info[k]) for info in (d, p, w) for k in ("grpc", "metrics")),
                    port_of(p["data"])}
        assert expected <= ports, (expected, sockets)
        assert p["grpc"] == "127.0.0.1:7100" and p["data"].startswith("127.0.0.1:") and w["grpc"].startswith("127.0.0.1:")
        for proc in (disp, ps, worker):  # what each daemon holds itself
            assert all(host == "127.0.0.1" for host, _ in listening(proc.pid, own_only=True))
    finally:
        stop(worker, ps, disp)
    assert (disp.returncode, ps.returncode) == (0, 0), (disp_log.read_text()[-2000:], ps_log.read_text()[-2000:])


REFUSALS = [
    ("dispatcher", ("--listen", "0.0.0.0:0"), "listen 0.0.0.0:0"),
    ("dispatcher", ("--listen", "[::]:0"), "listen [::]:0"),
    ("ps", ("--listen", "0.0.0.0:0", "--cluster", "127.0.0.1:1"), "listen 0.0.0.0:0"),
    ("ps", ("--data-listen", "0.0.0.0:0", "--listen", "127.0.0.1:0", "--cluster", "127.0.0.1:1"), "data_listen 0.0.0.0:0"),
    ("worker", ("--listen", "0.0.0.0:0", "--cluster", "127.0.0.1:1", "--job", str(JOB)), "listen 0.0.0.0:0"),
]


@pytest.mark.parametrize("kind,args,named", REFUSALS, ids=[f"{k}-{' '.join(a[:2])}" for k, a, _ in REFUSALS])
def test_non_loopback_bind_without_token_refuses_to_start(netns, kind, args, named):
    res = netns.run(daemon_argv(kind, *args, "--metrics-port", "0"), timeout=60, env=CLEAN_ENV)
    assert res.returncode == 2, res.stderr
    assert "refusing to bind" in res.stderr and named in res.stderr, res.stderr
    assert "cluster_token_file" in res.stderr and "allow_insecure" in res.stderr, res.stderr
    assert netns.listening() == []  # it bound nothing before refusing


def test_allow_insecure_starts_warns_and_status_shows_it(netns, tmp_path):
    disp, disp_ready, disp_log = start(netns, "dispatcher", tmp_path, "dispatcher", "--listen", "0.0.0.0:0",
                                       "--metrics-port", "0", "--allow-insecure")
    d = wait_ready(disp, disp_ready, disp_log)
    cluster = f"127.0.0.1:{port_of(d['grpc'])}"
    ps, ps_ready, ps_log = start(netns, "ps", tmp_path, "ps", "--cluster", cluster, "--listen", "0.0.0.0:0",
                                 "--metrics-port", "0", "--node-id", "open-ps", "--allow-insecure", "true")
    wait_ready(ps, ps_ready, ps_log)
    try:
        for log in (disp_log, ps_log):
            lines = [line for line in log.read_text().splitlines() if "WARNING" in line and "INSECURE" in line]
            assert lines and "0.0.0.0:0" in lines[0], log.read_text()
        assert any(host == "0.0.0.0" for host, _ in netns.listening())
        cli = [sys.executable, "-m", "shardline.cli", "status", "--cluster", cluster]
        res = netns.run(cli, timeout=60, env=CLEAN_ENV)
        assert res.returncode == 0, res.stderr
        first = res.stdout.splitlines()[:2]
        assert first[0].startswith("WARNING: INSECURE: the dispatcher"), res.stdout
        assert first[1].startswith("WARNING: INSECURE: PS node(s) open-ps"), res.stdout
        assert "security: authentication NONE" in res.stdout
        res = netns.run([*cli, "--json"], timeout=60, env=CLEAN_ENV)
        sec = json.loads(res.stdout)["security"]
        assert sec == {"insecure": True, "cluster_token": False, "tls": False, "insecure_nodes": ["open-ps"]}
    finally:
        stop(ps, disp)


def test_loopback_cluster_without_token_is_not_flagged(netns, tmp_path):
    """The default (loopback, no token) is not 'insecure' in status, only unauthenticated."""
    disp, disp_ready, disp_log = start(netns, "dispatcher", tmp_path, "dispatcher", "--listen", "127.0.0.1:0")
    d = wait_ready(disp, disp_ready, disp_log)
    try:
        res = netns.run([sys.executable, "-m", "shardline.cli", "status", "--cluster", d["grpc"]],
                        timeout=60, env=CLEAN_ENV)
        assert res.returncode == 0, res.stderr
        assert "INSECURE" not in res.stdout and "security: authentication none (loopback only), gRPC plaintext" in res.stdout
        assert "INSECURE" not in disp_log.read_text()
    finally:
        stop(disp)
