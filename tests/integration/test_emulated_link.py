"""bench/emulated_link.py: hosts in network namespaces behind NICs of a chosen rate (vs_ddp --link).

Real namespaces, veths and token-bucket filters (root and iproute2, as scripts/install-system-deps.sh
sets up): a transfer between two hosts takes at least its size over the rate, the hosts reach each
other and nothing else, and closing deletes every namespace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from emulated_link import EmulatedLink, check_rate, python_wrapper  # noqa: E402
from host_counters import nic_delta, read_nic  # noqa: E402

SEND = """
import socket, sys, time
n = int(sys.argv[2]); c = socket.create_connection((sys.argv[1], 7400), timeout=20)
t = time.perf_counter(); c.sendall(bytes(n)); c.recv(1); print(time.perf_counter() - t)
"""
RECEIVE = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7400)); s.listen(1)
print("ready", flush=True); c, _ = s.accept(); got = 0; buf = bytearray(1 << 20)
while True:
    k = c.recv_into(buf)
    if not k: break
    got += k
    if got >= {n}: break
c.sendall(b"x")
"""


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_a_rate_that_is_not_a_tc_rate_is_refused_with_the_value():
    assert check_rate("10gbit") == "10gbit" and check_rate("2.5gbit") == "2.5gbit"
    for bad in ("10", "10GB", "fast", "1gbit; rm -rf /"):
        with pytest.raises(ValueError, match="--link"):
            check_rate(bad)


def test_a_transfer_between_two_hosts_takes_its_size_over_the_rate_and_closing_deletes_the_namespaces(tmp_path):
    """Also: each host's eth0 counters, read through the pid of a process living there (as
    vs_ddp.py reads them), count the payload once, plus headers and acknowledgements."""
    n = 8 << 20   # 8 MiB at 400 Mbit/s: at least 0.168 s
    before = namespaces()
    with EmulatedLink(["a", "b"], "400mbit", prefix=f"sltest{id(tmp_path) % 10**6}") as link:
        made = namespaces() - before
        assert len(made) == 3   # the switch and two hosts
        residents = {h: subprocess.Popen(link.command(h, ["sleep", "60"])) for h in ("a", "b")}
        receiver = subprocess.Popen(link.command("b", [sys.executable, "-c", RECEIVE.format(n=n)]),
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert receiver.stdout.readline().strip() == "ready"
            counters = {h: read_nic(p.pid) for h, p in residents.items()}
            sent = subprocess.run(link.command("a", [sys.executable, "-c", SEND, link.address("b"), str(n)]),
                                  capture_output=True, text=True, timeout=60)
            assert sent.returncode == 0, sent.stderr
            seconds = float(sent.stdout)
            assert seconds >= 0.9 * n * 8 / 400e6, f"{n} bytes took {seconds:.3f} s: the rate was not enforced"
            assert receiver.wait(timeout=30) == 0
            moved = {h: nic_delta(counters[h], read_nic(p.pid)) for h, p in residents.items()}
            assert n <= moved["a"]["tx_bytes"] <= 1.1 * n and n <= moved["b"]["rx_bytes"] <= 1.1 * n, moved
            assert moved["a"]["rx_bytes"] < 0.1 * n and moved["b"]["tx_bytes"] < 0.1 * n, moved
        finally:
            for proc in (receiver, *residents.values()):
                proc.kill()
                proc.wait()
        # a host reaches no loopback service of the machine's own namespace
        probe = subprocess.run(link.command("a", ["ip", "route", "get", "192.0.2.1"]), capture_output=True, text=True)
        assert probe.returncode != 0, "a host must have no route beyond the emulated switch"
    assert namespaces() & made == set()


def test_the_python_wrapper_runs_in_the_namespace_its_environment_names(tmp_path):
    wrapper = python_wrapper(tmp_path / "python", sys.executable)
    code = "import os; print(os.readlink('/proc/self/ns/net'))"
    here = subprocess.run([wrapper, "-c", code], capture_output=True, text=True, check=True).stdout
    assert here.strip() == __import__("os").readlink("/proc/self/ns/net")
    with EmulatedLink(["a"], "1gbit", prefix=f"sltestw{id(tmp_path) % 10**6}") as link:
        ns = link.hosts["a"][0]
        inside = subprocess.run([wrapper, "-c", code], capture_output=True, text=True, check=True,
                                env={"EMULATED_HOST_NETNS": ns, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}).stdout
        assert inside.strip() != here.strip()


# Connects to HOST:7401 within 1 s: prints "ok", or the error's class name.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 7401), timeout=1).close(); print("ok")
except OSError as exc:
    print(type(exc).__name__)
"""
LISTEN = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 7401)); s.listen(16)
print("ready", flush=True)
while True:
    s.accept()[0].close()
"""


def test_a_cut_host_and_a_one_way_drop_lose_frames_silently_until_mended(tmp_path):
    """cut: the host reaches nobody and nobody reaches it, and a connect times out (a silent
    network, not a refusal); drop(a, b): a cannot reach b, b still reaches c; mend: all back."""
    with EmulatedLink(["a", "b", "c"], None, prefix=f"sltestp{id(tmp_path) % 10**6}") as link:
        listeners = [subprocess.Popen(link.command(h, [sys.executable, "-c", LISTEN]), stdout=subprocess.PIPE, text=True)
                     for h in ("b", "c")]
        try:
            for proc in listeners:
                assert proc.stdout.readline().strip() == "ready"

            def reach(src: str, dst: str) -> str:
                done = subprocess.run(link.command(src, [sys.executable, "-c", CONNECT, link.address(dst)]),
                                      capture_output=True, text=True, timeout=30)
                return done.stdout.strip()

            assert reach("a", "b") == "ok" and reach("a", "c") == "ok"
            link.cut("b")
            assert reach("a", "b") == "TimeoutError" and reach("c", "b") == "TimeoutError"
            assert reach("a", "c") == "ok"
            link.mend()
            assert reach("a", "b") == "ok"
            link.drop("a", "b")
            assert reach("a", "b") == "TimeoutError"   # a's SYN is lost
            assert reach("b", "c") == "ok" and reach("a", "c") == "ok"
            link.mend()
            assert reach("a", "b") == "ok"
        finally:
            for proc in listeners:
                proc.kill()
                proc.wait()
