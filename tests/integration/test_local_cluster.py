"""LocalCluster: real dispatcher and PS daemons started, killed, restarted and reaped; `shardline status`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shardline.local_cluster import DaemonStartError, LocalCluster

pytestmark = pytest.mark.timeout(90)

HEARTBEAT = {"heartbeat_timeout": 1, "heartbeat_interval": 0.2}


def shardline_cmd() -> list[str]:
    script = Path(sys.executable).parent / "shardline"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardline.cli"]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return text.encode() in fh.read()
    except OSError:
        return False


def pid_gone(pid: int, marker: str, *, zombie_ok: bool = False) -> bool:
    """True if no process ``pid`` of ours is left: none at all, or the pid was reused by a command
    that does not mention ``marker`` (the cluster's workdir). A zombie counts as left unless
    ``zombie_ok`` (an orphan's zombie is for init to reap)."""
    state = _state(pid)
    if state is None:
        return True
    if state == "Z":
        return zombie_ok
    return not _cmdline_has(pid, marker)


def processes_mentioning(text: str) -> list[int]:
    """Pids of processes (zombies included: their cmdline is empty, so in practice not) whose command line contains ``text`` (e.g. the cluster's workdir)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and _cmdline_has(int(entry), text):
            found.append(int(entry))
    return found


def kill_leftovers(text: str) -> None:
    for pid in processes_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def status_json(address: str) -> dict:
    out = subprocess.run([*shardline_cmd(), "status", "--cluster", address, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def start_nodes(cluster: LocalCluster, count: int = 2) -> list:
    """A dispatcher and ``count`` PS nodes at their defaults, every one ready and registered."""
    cluster.start_dispatcher()
    nodes = [cluster.add_node(wait=False) for _ in range(count)]
    for node in nodes:
        cluster.wait_ready(node)
    cluster.wait_for_nodes(count, timeout=30)
    return nodes


@pytest.fixture
def two_node_cluster(tmp_path):
    workdir = tmp_path / "cluster"
    cluster = LocalCluster(workdir, start_timeout=60)
    try:
        cluster.start_dispatcher(**HEARTBEAT)
        nodes = [cluster.add_node(wait=False), cluster.add_node(rack="r2", capacity=2, wait=False)]
        for h in nodes:
            cluster.wait_ready(h)
        yield cluster
    finally:
        cluster.shutdown()
        kill_leftovers(str(workdir))


def test_status_kill_restart_and_clean_sigterm(two_node_cluster):
    cluster = two_node_cluster
    ps0, ps1 = cluster.nodes
    alive = cluster.wait_for_nodes(2, timeout=20)
    assert sorted(n.node_id for n in alive) == ["ps-0", "ps-1"]
    assert ps0.data and ps0.grpc and ps0.metrics and ps0.node_id == "ps-0"
    assert ps0.log_path.exists() and ps0.ready_file.exists()

    data = status_json(cluster.address)
    assert data["alive_nodes"] == 2
    by_id = {n["node_id"]: n for n in data["nodes"]}
    assert {n["state"] for n in by_id.values()} == {"alive"}
    assert by_id["ps-1"]["rack"] == "r2" and by_id["ps-0"]["grpc"] == ps0.grpc
    # capacity 2 -> twice the virtual nodes; the key shares are those of the ring and sum to 1
    assert by_id["ps-1"]["vnodes"] == 2 * by_id["ps-0"]["vnodes"]
    assert sum(n["key_share"] for n in data["nodes"]) == pytest.approx(1.0)
    epoch = data["epoch"]

    # Jobs show the step their PS nodes applied (BSP: every node at the same step).
    import torch

    from shardline import connect

    client = connect(cluster.address, job="status-job")
    client.init({"w": torch.zeros(1000)}, optimizer="sgd", lr=0.1, block_elements=100)
    for _ in range(3):
        client.push({"w": torch.ones(1000)})
    client.pull()
    client.close()
    data = status_json(cluster.address)
    job = next(j for j in data["jobs"] if j["name"] == "status-job")
    assert job["step"] == 3 and job["sync"] == "bsp" and job["world_size"] == 1
    assert set(job["steps_by_node"]) == {"ps-0", "ps-1"} and set(job["steps_by_node"].values()) == {3}

    # The table form carries the same facts.
    table = subprocess.run([*shardline_cmd(), "status", "--cluster", cluster.address],
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0, table.stderr
    assert "ps-0" in table.stdout and "ps-1" in table.stdout and f"ring epoch {epoch}" in table.stdout
    assert re.search(r"^status-job\s+bsp\s+sgd\s+1\s+3\s", table.stdout, re.M), table.stdout

    # SIGKILL a PS: the dispatcher declares it dead after the heartbeat timeout.
    killed_pid = ps0.pid
    t0 = time.monotonic()
    assert cluster.kill(ps0) == -signal.SIGKILL
    assert pid_gone(killed_pid, str(cluster.workdir))
    cluster.wait_for_node_state("ps-0", "dead", timeout=10)
    assert time.monotonic() - t0 < 5
    data = status_json(cluster.address)
    assert data["alive_nodes"] == 1 and data["epoch"] > epoch
    assert {n["node_id"]: n["key_share"] for n in data["nodes"]}["ps-1"] == pytest.approx(1.0)

    # Restart: same name and node id, a new process, alive again.
    cluster.restart(ps0)
    assert ps0.pid != killed_pid and ps0.alive() and ps0.starts == 2
    cluster.wait_for_node_state("ps-0", "alive", timeout=10)
    cluster.wait_for_nodes(2, timeout=10)

    # SIGTERM: every daemon exits 0 within 10 s.
    pids = [killed_pid] + cluster.pids()
    for handle in [ps0, ps1, cluster.dispatcher]:
        t0 = time.monotonic()
        assert cluster.stop(handle, timeout=10) == 0, handle.log_tail()
        assert time.monotonic() - t0 < 10
    cluster.shutdown()
    assert all(pid_gone(p, str(cluster.workdir)) for p in pids)
    assert processes_mentioning(str(cluster.workdir)) == []


def test_shutdown_reaps_every_daemon(tmp_path):
    workdir = tmp_path / "c"
    cluster = LocalCluster(workdir)
    try:
        cluster.start_dispatcher(**HEARTBEAT)
        cluster.add_node()
        pids = cluster.pids()
        assert len(pids) == 2 and all(not pid_gone(p, str(workdir)) for p in pids)
        t0 = time.monotonic()
        codes = cluster.shutdown()
        assert time.monotonic() - t0 < 10
        assert codes == {"dispatcher": 0, "ps-0": 0}
        assert all(pid_gone(p, str(workdir)) for p in pids)
        assert processes_mentioning(str(workdir)) == []
        assert cluster.shutdown() == codes  # idempotent
        with pytest.raises(RuntimeError):
            cluster.add_node()
    finally:
        cluster.shutdown()
        kill_leftovers(str(workdir))


def test_sigterm_to_the_whole_cluster_at_once_stops_every_daemon_within_10_s(tmp_path):
    """A host shutdown SIGTERMs everything together: a PS whose drain the dispatcher accepted just
    before it stopped too does not wait out the 30 s leave timeout (no dispatcher can switch the
    ring any more)."""
    import torch

    from shardline.worker.client import connect

    with LocalCluster(tmp_path / "c") as cluster:
        dispatcher = cluster.start_dispatcher(**HEARTBEAT)
        nodes = [cluster.add_node(node_id=f"ps{i}") for i in range(2)]
        cluster.wait_for_nodes(2, timeout=30)
        client = connect(cluster.address, job="j", transport="tcp")
        client.init({"w": torch.zeros(1024)}, optimizer="sgd", lr=0.1)
        client.close()
        t0 = time.monotonic()
        nodes[0].proc.send_signal(signal.SIGTERM)  # its drain is accepted ...
        time.sleep(0.1)
        for handle in (dispatcher, nodes[1]):  # ... and then the dispatcher stops as well
            handle.proc.send_signal(signal.SIGTERM)
        for handle in nodes + [dispatcher]:
            assert handle.proc.wait(timeout=15) == 0, handle.log_tail()
        assert time.monotonic() - t0 < 10


def test_start_failure_reports_the_log_tail(tmp_path):
    with LocalCluster(tmp_path / "c") as cluster:
        with pytest.raises(DaemonStartError) as info:
            cluster.start_dispatcher(heartbeat_timeout=-1)
        message = str(info.value)
        assert "exited with code 2" in message and "heartbeat" in message and "dispatcher.log" in message


@pytest.mark.parametrize("how", ["exception", "sigkill"])
def test_safety_nets_when_the_owner_dies(tmp_path, how):
    """An owner that dies of an exception (atexit) or of SIGKILL (parent-death signal) leaves no daemon."""
    workdir = tmp_path / "c"
    pid_file = tmp_path / "pids.json"
    end = 'raise SystemExit("boom")' if how == "exception" else "os.kill(os.getpid(), signal.SIGKILL)"
    script = textwrap.dedent(f"""
        import json, os, signal
        from shardline.local_cluster import LocalCluster
        c = LocalCluster({str(workdir)!r})
        c.start_dispatcher()
        json.dump(c.pids(), open({str(pid_file)!r}, "w"))
        {end}
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        owner.communicate(timeout=60)
        pids = json.loads(pid_file.read_text())
        assert pids
        deadline = time.monotonic() + 10
        # Orphans are reaped by init; what matters is that none is left running.
        while not all(pid_gone(p, str(workdir), zombie_ok=True) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(pid_gone(p, str(workdir), zombie_ok=True) for p in pids)
        assert [p for p in processes_mentioning(str(workdir)) if _state(p) != "Z"] == []
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        kill_leftovers(str(workdir))


def test_dispatcher_outage_is_logged_once_per_node(tmp_path):
    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_dispatcher(heartbeat_timeout=1.5)
        node = cluster.add_node(node_id="ps-0")
        cluster.wait_for_nodes(1, timeout=20)
        cluster.kill(cluster.dispatcher)
        time.sleep(3.5)  # several heartbeat intervals (0.5 s) without a dispatcher
        failures = [line for line in node.log_path.read_text().splitlines() if "heartbeat failed" in line]
        assert len(failures) == 1, failures
