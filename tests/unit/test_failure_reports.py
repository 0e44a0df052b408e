"""Named, fast failures: a wrong cluster address is refused at once, an unreachable one is reported
with what is retried, and a BSP step that waits names the ranks that have not committed it."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

from shardline.cli import render_workers
from shardline.services.config import parse_address_list
from shardline.services.daemon import parse_host_port
from shardline.services.dispatcher_client import DispatcherClient, unreachable_reason
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError, ShardlineTimeoutError
from shardline.services.pb import dispatcher_pb2
from shardline.services.stragglers import NodeCommits, lease_text, straggler_report

pytestmark = pytest.mark.timeout(60)

# What gRPC would read its own way (no port: 443; a scheme; bare IPv6) and then retry in silence.
BAD_CLUSTERS = ["127.0.0.1", "localhost", "127.0.0.1:", "::1", "[::1]", "::1:7000", "http://127.0.0.1:7000",
                "dns:///127.0.0.1:7000", "127.0.0.1:7000/", "127.0.0.1 :7000", "127.0.0.1:+7000", "127.0.0.1: 7000",
                "127.0.0.1:١٢", "127.0.0.1:1_000", "[127.0.0.1]:7000", "127.0.0.1:70000", "127.0.0.1:0",
                "127.0.0.1:7000,", ""]


@pytest.mark.parametrize("address", BAD_CLUSTERS)
def test_a_wrong_cluster_address_is_refused(address):
    with pytest.raises(ShardlineConfigError) as err:
        parse_address_list(address)
    assert repr(address) in str(err.value)


@pytest.mark.parametrize("address", ["127.0.0.1:7000", "localhost:7000", "no-such-host:7000", "my_host.example.com:1",
                                     "[::1]:7000", "[fe80::1%eth0]:7000", "a:7000,b:7001"])
def test_good_cluster_addresses_pass(address):
    assert ",".join(parse_address_list(address)) == address


def test_listen_addresses_may_pick_a_port():
    assert parse_host_port("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_host_port("[::]:0") == ("::", 0)


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "http://127.0.0.1:7000", "127.0.0.1:0"])
def test_psoptimizer_and_connect_refuse_a_wrong_address_within_a_second(address):
    import torch

    from shardline import PSOptimizer, connect

    model = torch.nn.Linear(2, 2)
    for make in (lambda: connect(address, job="j", connect_timeout=30),
                 lambda: PSOptimizer(model.named_parameters(), cluster=address, job="j", connect_timeout=30)):
        started = time.monotonic()
        with pytest.raises(ShardlineConfigError, match="cluster"):
            make()
        assert time.monotonic() - started < 1.0


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_unreachable_reasons_say_what_failed():
    refused = _RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                        "ipv4:127.0.0.1:7999: Failed to connect to remote host: Connection refused")
    assert "connection refused" in unreachable_reason(refused, "127.0.0.1:7999")
    dns = _RpcError(grpc.StatusCode.UNAVAILABLE, "errors resolving no-such-host:7000: [field:hostname lookup "
                    "error:address lookup failed for no-such-host:7000: Domain name not found]")
    assert unreachable_reason(dns, "no-such-host:7000") == "DNS cannot resolve 'no-such-host' (Domain name not found)"
    slow = _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    assert "no answer in time" in unreachable_reason(slow, "a:1")


def test_waiting_for_an_unreachable_dispatcher_logs_info_at_once_then_a_warning(caplog, closed_port):
    """INFO on the first failed try, a WARNING after warn_after naming the address and the reason;
    ``stop`` ends the wait at once (a daemon got SIGTERM)."""
    address = closed_port().address
    client = DispatcherClient(address)
    stop = threading.Event()
    errors = []

    def wait():
        try:
            client.wait_until_reachable(30, stop=stop, warn_after=0.5)
        except ShardlineConnectionError as exc:
            errors.append(exc)

    caplog.set_level(logging.INFO, logger="shardline.client")
    thread = threading.Thread(target=wait)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not any(r.levelno == logging.WARNING for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        thread.join(5)
    finally:
        stop.set()
        client.close()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert infos and "waiting for the dispatcher at " + address in infos[0] and "connection refused" in infos[0]
    assert warnings and address in warnings[0] and "connection refused" in warnings[0] and "30 s" in warnings[0]
    assert not thread.is_alive() and errors and "stopped" in str(errors[0])


def test_the_timeout_names_the_address_and_the_reason(closed_port):
    address = closed_port().address
    client = DispatcherClient(address)
    try:
        with pytest.raises(ShardlineTimeoutError) as err:
            client.wait_until_reachable(0.5)
    finally:
        client.close()
    assert address in str(err.value) and "connect_timeout" in str(err.value) and "connection refused" in str(err.value)


def test_straggler_report_names_missing_ranks_and_waiting_nodes():
    answers = [NodeCommits("ps1", 3, frozenset({0, 2})), NodeCommits("ps2", 3, frozenset({0, 2})),
               NodeCommits("ps3", 4, frozenset())]   # ps3 already applied step 3
    report = straggler_report(3, 3, answers, {1: "never connected", 0: "alive"})
    assert report.missing == (1,) and set(report.waiting) == {"ps1", "ps2"}
    assert report.describe() == ("ranks [1] did not commit step 3 (PS nodes ps1, ps2 wait for them); "
                                 "rank 1: never connected")


def test_straggler_report_with_nodes_waiting_for_different_ranks():
    answers = [NodeCommits("ps1", 5, frozenset({0})), NodeCommits("ps2", 5, frozenset({0, 1})),
               NodeCommits("ps3", None)]
    report = straggler_report(5, 3, answers)
    assert report.missing == (1, 2)
    text = report.describe()
    assert "ranks [1, 2] did not commit step 5" in text and "ps1 waits for ranks [1, 2]" in text
    assert "ps2 waits for ranks [2]" in text and "ps3 did not answer" in text


def test_straggler_report_when_every_rank_committed():
    report = straggler_report(2, 2, [NodeCommits("ps1", 2, frozenset({0, 1})), NodeCommits("ps2", 3, frozenset())])
    assert report.missing == () and report.complete == ("ps1",)
    assert "ps1 holds every commit of step 2 but has not applied it yet" in report.describe()


def test_straggler_report_when_every_node_applied_the_step_says_the_wait_is_for_copy_holders():
    report = straggler_report(2, 2, [NodeCommits("ps1", 3, frozenset()), NodeCommits("ps2", 3, frozenset())])
    assert report.describe().startswith("every PS node applied step 2; ")
    assert "copy holders have not acknowledged or synced it" in report.describe()


def test_lease_text():
    never = dispatcher_pb2.WorkerLease(job="j", rank=1, incarnation="", state="alive", age_seconds=3)
    assert lease_text(never) == "never connected"
    alive = dispatcher_pb2.WorkerLease(job="j", rank=0, incarnation="abc", state="alive", age_seconds=0.42, step=7)
    assert lease_text(alive) == "alive, at step 7, heartbeat 0.4 s ago"
    lost = dispatcher_pb2.WorkerLease(job="j", rank=2, incarnation="abc", state="lost", age_seconds=40, step=3,
                                      lost_unix_ms=1_000_000)
    assert lease_text(lost, now_unix_ms=1_012_000) == "lost 12 s ago (last at step 3, last heartbeat 40 s ago)"


def test_status_lists_every_rank_of_a_job():
    jobs = [{"name": "sft", "world_size": 3, "workers": [
        {"rank": 0, "state": "alive", "connected": True, "step": 4, "heartbeat_age_seconds": 0.3, "lost_for_seconds": None},
        {"rank": 2, "state": "lost", "connected": True, "step": 2, "heartbeat_age_seconds": 41.0, "lost_for_seconds": 11.0},
    ]}, {"name": "done", "world_size": 2, "workers": []}]
    lines = render_workers(jobs).splitlines()
    assert lines[0].split() == ["JOB", "RANK", "STATE", "STEP", "LAST", "HEARTBEAT", "NOTE"]
    assert lines[1].split()[:5] == ["sft", "0", "alive", "4", "0.3s"]
    assert lines[2].split()[:4] == ["sft", "1", "no", "lease"]
    assert lines[3].split()[:5] == ["sft", "2", "lost", "2", "41.0s"]
    assert len(lines) == 4  # a job without leases (finished) is left out
