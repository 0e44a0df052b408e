"""Named, fast failures with real daemons on 127.0.0.1: an unreachable dispatcher is reported on a
training script's stderr within 8 s, a PS started before its dispatcher says that it waits, and a
BSP rank that never arrives is named by the WARNING, the pull_timeout error and ``shardline status``."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time

import pytest
import torch

from shardline import PSOptimizer
from shardline.services.errors import StepTimeoutError
from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

CLI = [sys.executable, "-m", "shardline.cli"]


def _read_lines(stream, into: list, started: list) -> None:
    for line in stream:
        into.append((time.monotonic() - started[0] if started else None, line.rstrip("\n")))


def test_an_unreachable_cluster_is_reported_on_stderr_within_8_s(closed_port):
    """A training script with no logging set up: PSOptimizer on an address nobody listens on prints
    a WARNING saying what it retries within 8 s, and fails after connect_timeout naming the reason
    (the WARNING falls due 4 s after the wait starts; under make test's load the script took up to
    2 s more to get there, and once came at 6.0 s against a bound of 6)."""
    address = closed_port().address
    script = (
        "import sys, torch\n"
        "from shardline import PSOptimizer\n"
        "model = torch.nn.Linear(2, 2)\n"
        "print('calling', flush=True)\n"
        f"PSOptimizer(model.named_parameters(), cluster={address!r}, job='j', connect_timeout=8)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started: list = []
        assert proc.stdout.readline().strip() == "calling"
        started.append(time.monotonic())
        lines: list = []
        reader = threading.Thread(target=_read_lines, args=(proc.stderr, lines, started), daemon=True)
        reader.start()
        proc.wait(timeout=60)
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    took = time.monotonic() - started[0]
    text = "\n".join(line for _, line in lines)
    warning = next(((at, line) for at, line in lines if "still not reachable" in line), None)
    assert warning is not None, text
    assert warning[0] <= 8.0, f"the WARNING came after {warning[0]:.1f} s:\n{text}"
    assert address in warning[1] and "connection refused" in warning[1], text
    assert proc.returncode != 0 and "ShardlineTimeoutError" in text and "connect_timeout" in text, text
    assert took < 8 + 5, f"it failed after {took:.1f} s"


def _wait_for_log(handle, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = handle.log_path.read_text() if handle.log_path.exists() else ""
        if needle in text:
            return text
        if not handle.alive():
            break
        time.sleep(0.1)
    raise AssertionError(f"{handle.name} did not log {needle!r} within {timeout:g} s:\n{handle.log_tail()}")


def test_a_ps_started_before_its_dispatcher_says_it_waits(tmp_path, closed_port):
    """Both PS nodes log at once that they wait for the dispatcher; SIGTERM ends one's wait with exit
    code 0 at once; the other joins once the dispatcher is up."""
    refusing = closed_port()
    address = refusing.address
    with LocalCluster(tmp_path / "c") as cluster:
        waiting = cluster.add_node(node_id="early", cluster=address, wait=False, connect_timeout=60)
        stopped = cluster.add_node(node_id="stopped", cluster=address, wait=False, connect_timeout=60)
        for handle in (waiting, stopped):
            text = _wait_for_log(handle, f"waiting for the dispatcher at {address}", 30)
            assert "connection refused" in text and "connect_timeout" in text, text
        started = time.monotonic()
        assert cluster.stop(stopped) == 0, stopped.log_tail()
        assert time.monotonic() - started < 5
        refusing.release()
        cluster.add_dispatcher(listen=address)
        cluster.wait_ready(waiting, timeout=30)
        cluster.wait_for_nodes(1, timeout=30)
        assert f"dispatcher at {address} answers" in waiting.log_path.read_text(), waiting.log_tail()


def test_a_missing_rank_is_named_by_the_warning_the_error_and_status(cluster, caplog):
    """World size 2, only rank 0 runs: after straggler_warning_seconds it logs which rank has not
    committed (and which nodes wait), the pull_timeout error names it, and `shardline status` lists
    both ranks (rank 0 alive at its step, rank 1 never connected)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    caplog.set_level(logging.WARNING, logger="shardline.worker")
    opt = PSOptimizer(model.named_parameters(), cluster=cluster.address, job="straggler", optimizer="sgd", lr=0.1,
                      world_size=2, rank=0, straggler_warning_seconds=1, pull_timeout=4, transport="tcp")
    try:
        model(torch.ones(3, 4)).sum().backward()
        started = time.monotonic()
        with pytest.raises(StepTimeoutError) as err:
            opt.step()
        took = time.monotonic() - started
        status = subprocess.run([*CLI, "status", "--cluster", cluster.address], capture_output=True, text=True,
                                timeout=30)
    finally:
        opt.close()
    message = str(err.value)
    assert err.value.ranks == (1,) and err.value.step == 0
    assert "ranks [1] did not commit step 0 (PS nodes ps1, ps2 wait for them)" in message, message
    assert "pull_timeout" in message and "rank 1: never connected" in message, message
    assert 4 <= took < 4 + 6, f"the step failed after {took:.1f} s"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "still waits" in r.getMessage()]
    assert warnings, [r.getMessage() for r in caplog.records]
    assert "ranks [1] did not commit step 0" in warnings[0].getMessage() and "ps1, ps2" in warnings[0].getMessage()
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]  # every 1, 2, 4... s: not every slice
    assert status.returncode == 0, status.stderr
    rows = {tuple(line.split()[:3]) for line in status.stdout.splitlines() if line.startswith("straggler ")}
    assert ("straggler", "0", "alive") in rows and ("straggler", "1", "waiting") in rows, status.stdout
    assert "never connected" in status.stdout, status.stdout


def test_every_waiting_worker_names_the_missing_rank(cluster, caplog):
    """World size 3, ranks 0 and 1 run (threads of this process), rank 2 never comes: both waiting
    workers log the WARNING naming rank 2 and both fail naming it."""
    caplog.set_level(logging.WARNING, logger="shardline.worker")
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        try:
            opt = PSOptimizer(model.named_parameters(), cluster=cluster.address, job="straggler-3", optimizer="sgd",
                              lr=0.1, world_size=3, rank=rank, straggler_warning_seconds=1, pull_timeout=3,
                              transport="tcp")
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            errors[rank] = exc
            return
        try:
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        except BaseException as exc:  # noqa: BLE001
            errors[rank] = exc
        finally:
            opt.close()

    threads = [threading.Thread(target=run, args=(rank,), name=f"rank-{rank}") for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    for rank in (0, 1):
        assert isinstance(errors.get(rank), StepTimeoutError) and errors[rank].ranks == (2,), errors
    warned = {r.threadName for r in caplog.records
              if r.levelno == logging.WARNING and "ranks [2] did not commit step 0" in r.getMessage()}
    assert warned == {"rank-0", "rank-1"}, [(r.threadName, r.getMessage()) for r in caplog.records]
