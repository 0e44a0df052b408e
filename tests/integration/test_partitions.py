"""Network partitions on emulated hosts (tests/emulated_cluster.py): every daemon and worker in a
host of its own, and the switch drops their frames as a failed port or a split network would.

Three PS nodes (replication 2, the default timeouts: heartbeats every second, a node silent for 5 s
is dead) and two BSP ranks training the small model. In each case a fault starts once the ranks
took a few steps and ends 8 s later; then:

* the final parameters equal single-process torch.optim and, bit for bit, a run without faults;
* the cluster settles (every node alive and serving, no ring change pending) within 10 s of the
  network's return;
* the longest step stays within what the case allows: a PS cut off, the failure timeout + 1 s (the
  ranks leave it as soon as the dispatcher declares it dead); the dispatcher cut off, training
  never stops and no node is declared dead (it suspects its own isolation).

The same with two dispatchers on etcd, the leader cut off (from etcd too): the other takes over,
and training goes on. And the cases that passed before partitions were handled (kept passing): a
PS that loses only the dispatcher (split brain), a worker that loses only the dispatcher.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_model  # noqa: E402
from emulated_cluster import EmulatedCluster  # noqa: E402

pytestmark = pytest.mark.timeout(600)

NODES = ("ps0", "ps1", "ps2")
STEPS = 60
STEP_SLEEP = 0.25          # the ranks train through the whole fault (about 15 s of steps)
FAULT_AT_STEP = 8
FAULT_SECONDS = 8.0
SETTLE_SECONDS = 10.0
HEARTBEAT_TIMEOUT = 5.0    # the dispatcher's default


def settled(nodes=NODES, dispatchers: int = 1):
    def check(s) -> bool:
        return (not s.routing.pending_epoch and {n.node_id for n in s.routing.nodes} == set(nodes)
                and all(n.state == "alive" and not n.not_ready and n.heartbeat_age_seconds < 2.5 for n in s.all_nodes)
                and (dispatchers == 1 or sum(d.role == "leader" for d in s.dispatchers) == 1))
    return check


def start_cluster(workdir, hosts: list[str], add_dispatchers) -> EmulatedCluster:
    """Emulated hosts ``hosts`` (with NODES and the ranks' w0, w1), ``add_dispatchers(cluster)``
    and the three PS nodes; returns once the cluster formed."""
    cluster = EmulatedCluster(workdir, [*hosts, *NODES, "w0", "w1"])
    try:
        add_dispatchers(cluster)
        for handle in cluster.dispatchers:
            cluster.wait_ready(handle)
        started = [cluster.add_node(host, wait=False) for host in NODES]
        for node in started:
            cluster.wait_ready(node)
        cluster.wait_until(settled(dispatchers=len(cluster.dispatchers)), 60, "the cluster formed")
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with start_cluster(tmp_path_factory.mktemp("partitions"), ["disp"],
                       lambda c: c.start_dispatcher("disp")) as c:
        yield c


@pytest.fixture(scope="module")
def no_fault_run(cluster, tmp_path_factory):
    """The parameters of the same training without any fault (BSP: bit for bit what every
    faulted run must end with)."""
    work = tmp_path_factory.mktemp("no-fault")
    started = train_model.start_workers(cluster.address, "nofault", "adamw", "bsp", work, steps=STEPS,
                                        env=cluster.worker_env, wrap=lambda r, argv: cluster.on_host(f"w{r}", argv))
    return train_model.finish_workers(started, timeout=240)


def log_since(handle, offset: int) -> str:
    with open(handle.log_path, "rb") as fh:
        fh.seek(offset)
        return fh.read().decode("utf-8", "replace")


def run_with_fault(cluster: EmulatedCluster, tmp_path, job: str, fault, *, nodes=NODES) -> dict:
    """Train ``job`` on two ranks, apply ``fault(link)`` at step FAULT_AT_STEP for FAULT_SECONDS,
    mend, and wait for the cluster to settle. Returns what the test checks."""
    offsets = {h.name: h.log_path.stat().st_size for h in cluster.handles.values()}
    started = train_model.start_workers(
        cluster.address, job, "adamw", "bsp", tmp_path, steps=STEPS, step_sleep=STEP_SLEEP, log_output=True,
        env={**cluster.worker_env, "SHARDLINE_TEST_LOG_LEVEL": "INFO"},
        wrap=lambda r, argv: cluster.on_host(f"w{r}", argv))
    train_model.wait_for_steps(started, FAULT_AT_STEP, timeout=120)
    before = [train_model.steps_done(progress) for _, _, progress in started]
    faulted = time.monotonic()
    fault(cluster.link)
    time.sleep(FAULT_SECONDS)
    during = [train_model.steps_done(progress) for _, _, progress in started]
    cluster.link.mend()
    mended = time.monotonic()
    cluster.wait_until(settled(nodes, len(cluster.dispatchers)), 60, f"the cluster settled after the fault of {job}")
    settle = time.monotonic() - mended
    results = train_model.finish_workers(started, timeout=240)
    steps = [t for entry in started for t in train_model.step_times(entry)]
    longest = max(steps, key=lambda t: t[2] - t[1])
    outcome = dict(results=results, settle=settle, longest=longest[2] - longest[1], during=during, before=before,
                   faulted=faulted, mended=mended, logs={name: log_since(h, offsets.get(name, 0))
                                                         for name, h in cluster.handles.items()},
                   worker_logs=[train_model.output_log(out).read_text(errors="replace") for _, out, _ in started])
    print(f"{job}: longest step {outcome['longest']:.2f} s (step {longest[0]}, from {longest[1] - faulted:+.2f} s "
          f"after the fault), steps {before} -> {during} during the fault, settled {settle:.1f} s after it ended")
    return outcome


def assert_exact(outcome: dict, no_fault_run) -> None:
    train_model.assert_equals_reference(outcome["results"], STEPS)
    for got, want in zip(outcome["results"], no_fault_run):
        for name, value in want.items():
            if not name.startswith("_"):
                assert torch.equal(got[name], value), f"{name} differs from the run without faults"
    assert outcome["settle"] <= SETTLE_SECONDS, f"settled {outcome['settle']:.1f} s after the network returned"


def test_a_ps_cut_off_stalls_the_ranks_no_longer_than_the_failure_timeout(cluster, no_fault_run, tmp_path):
    outcome = run_with_fault(cluster, tmp_path, "cut-ps", lambda link: link.cut("ps1"))
    assert_exact(outcome, no_fault_run)
    assert outcome["longest"] <= HEARTBEAT_TIMEOUT + 1.0, outcome["worker_logs"][0][-3000:]
    assert min(outcome["during"]) > max(outcome["before"]), "no step was taken while ps1 was cut off"
    assert "nodes declared dead (no heartbeat for 5 s): ps1" in outcome["logs"]["dispatcher"]
    # the rank said what it waited for, and gave the node up once it left the ring
    assert any("waits for PS node 'ps1'" in text and "left the ring" in text for text in outcome["worker_logs"])


def test_the_dispatcher_cut_off_stops_no_step_and_declares_no_node_dead(cluster, no_fault_run, tmp_path):
    epoch = cluster.cluster_status().routing.epoch
    outcome = run_with_fault(cluster, tmp_path, "cut-dispatcher", lambda link: link.cut("disp"))
    assert_exact(outcome, no_fault_run)
    assert outcome["longest"] <= 2.0
    assert min(outcome["during"]) >= max(outcome["before"]) + 0.5 * FAULT_SECONDS / STEP_SLEEP
    log = outcome["logs"]["dispatcher"]
    assert "nodes declared dead" not in log and "suspecting this dispatcher's own isolation" in log, log
    assert "heartbeats returned" in log
    assert cluster.cluster_status().routing.epoch == epoch   # the ring never changed


def test_a_worker_cut_off_resumes_where_it_was(cluster, no_fault_run, tmp_path):
    """Both ranks wait for the cut one (BSP) and nothing else moves. Once the network returns, the
    cut rank's node watch hears the dispatcher again and sends its stuck request again on a new
    connection, within a second, instead of when TCP's backoff next retransmits it (5.4-5.5 s after
    an 8 s cut, measured before)."""
    epoch = cluster.cluster_status().routing.epoch
    outcome = run_with_fault(cluster, tmp_path, "cut-worker", lambda link: link.cut("w1"))
    assert_exact(outcome, no_fault_run)
    assert outcome["longest"] <= FAULT_SECONDS + 2.0
    assert cluster.cluster_status().routing.epoch == epoch
    assert "nodes declared dead" not in outcome["logs"]["dispatcher"]


def test_a_worker_that_loses_only_the_dispatcher_trains_on(cluster, no_fault_run, tmp_path):
    """A rank needs the dispatcher only to renew its lease (30 s) and to refresh the routing."""
    def fault(link):
        link.drop("w1", "disp")
        link.drop("disp", "w1")
    outcome = run_with_fault(cluster, tmp_path, "worker-without-dispatcher", fault)
    assert_exact(outcome, no_fault_run)
    assert outcome["longest"] <= 2.0
    assert min(outcome["during"]) >= max(outcome["before"]) + 0.5 * FAULT_SECONDS / STEP_SLEEP


@pytest.mark.parametrize("direction", ["ps-to-dispatcher", "dispatcher-to-ps", "both"])
def test_loss_between_a_ps_and_the_dispatcher_loses_nothing(cluster, no_fault_run, tmp_path, direction):
    """The PS keeps serving the ranks while the dispatcher moves its blocks away (split brain): no
    step is lost or applied twice, and the node comes back in sync once the loss ends."""
    def fault(link):
        if direction in ("ps-to-dispatcher", "both"):
            link.drop("ps1", "disp")
        if direction in ("dispatcher-to-ps", "both"):
            link.drop("disp", "ps1")
    outcome = run_with_fault(cluster, tmp_path, f"loss-{direction}", fault)
    assert_exact(outcome, no_fault_run)
    assert outcome["longest"] <= HEARTBEAT_TIMEOUT + 1.0


def test_the_etcd_leader_cut_off_hands_the_lead_over_and_training_goes_on(no_fault_run, tmp_path):
    """Cut off from the nodes and from etcd, the leader loses its lease (2 s) and the other
    dispatcher leads; the ranks, which need a dispatcher only to renew their leases, train on."""
    with _etcd_cluster(tmp_path) as cluster:
        leader = cluster.leader()
        host = "disp" if leader.name == "dispatcher" else "disp1"
        outcome = run_with_fault(cluster, tmp_path, "cut-leader", lambda link: link.cut(host))
        assert_exact(outcome, no_fault_run)
        assert outcome["longest"] <= HEARTBEAT_TIMEOUT
        assert min(outcome["during"]) > max(outcome["before"]), "training stopped while the leader was cut off"
        assert cluster.leader() is not leader
        for name, log in outcome["logs"].items():
            assert "nodes declared dead" not in log, f"{name}:\n{log}"


def _etcd_cluster(tmp_path) -> EmulatedCluster:
    def dispatchers(cluster):
        etcd = cluster.start_etcd("etcd")
        for host in ("disp", "disp1"):
            cluster.add_dispatcher(host, state_store=etcd.url, leader_lease_timeout=2, wait=False)
    return start_cluster(tmp_path / "cluster", ["etcd", "disp", "disp1"], dispatchers)
