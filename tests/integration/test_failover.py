"""Nothing stops on a death: real daemons (replication 2), one daemon killed or the ring changed
mid-run, two worker processes training through it; the final parameters must equal one process
running torch.optim on the same steps (tests/integration/train_model.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

import train_model
from shardline.local_cluster import LocalCluster
from shardline.worker.client import connect
from shardline.worker.flat_params import is_flat_name

pytestmark = pytest.mark.timeout(240)

STEPS = 16
CLI = [sys.executable, "-m", "shardline.cli"]


def start(cluster: LocalCluster, nodes: int, node_flags: dict | None = None, **dispatcher_flags):
    cluster.start_dispatcher(heartbeat_timeout=2, heartbeat_interval=0.5, **dispatcher_flags)
    handles = [cluster.add_node(node_id=f"ps{i}", wait=False, **(node_flags or {})) for i in range(nodes)]
    for h in handles:
        cluster.wait_ready(h)
    cluster.wait_for_nodes(nodes, timeout=30)
    return handles


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A dispatcher and two PS nodes shared by the tests that only fail workers (each its own job)."""
    with LocalCluster(tmp_path_factory.mktemp("two-nodes")) as cluster:
        start(cluster, 2)
        yield cluster


def test_kill_one_of_three_ps_mid_run(tmp_path):
    """kill -9 of a PS at step 5: its replicas take over, the workers resend the step in flight,
    and the dead node's blocks are re-replicated (every block has two copies again)."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        workers = train_model.start_workers(cluster.address, "kill-ps", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1)
        train_model.wait_for_steps(workers, 5)
        killed_at = time.monotonic()
        cluster.kill(nodes[1])
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        status = cluster.wait_until(lambda s: sum(n.state == "alive" for n in s.all_nodes) == 2, 10, "ps1 dead")
        assert {n.node_id for n in status.routing.nodes} == {"ps0", "ps2"}
        assert time.monotonic() - killed_at < 60


def test_a_dispatcher_restarted_without_its_state_takes_the_ring_back_from_the_nodes(tmp_path):
    """kill -9 of a dispatcher that keeps its state in memory, restarted on its address mid-run:
    it knows no node and no job; the first node to register again gives back the ring it routes by
    (the others are serving too, none syncs), the nodes give the job back, and the run equals
    torch.optim. Before, the first node to register became the only owner of every block, and
    the workers met blocks it never had."""
    with LocalCluster(tmp_path / "c") as cluster:
        dispatcher = cluster.add_dispatcher(heartbeat_timeout=2, heartbeat_interval=0.5)
        for h in [cluster.add_node(node_id=f"ps{i}", wait=False) for i in range(3)]:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(3, timeout=30)
        workers = train_model.start_workers(cluster.address, "stateless", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1)
        train_model.wait_for_steps(workers, 4)
        epoch = cluster.cluster_status().routing.epoch
        cluster.kill(dispatcher)
        cluster.restart(dispatcher)
        status = cluster.wait_until(lambda s: len(s.routing.nodes) == 3, 30, "the ring back")
        assert status.routing.epoch > epoch
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        log = dispatcher.log_tail(200)
        assert "took back the ring" in log and "ring change" not in log and "joining" not in log, log


def test_replicas_that_replay_gradients_take_over_from_a_killed_primary(tmp_path):
    """The default for BSP on nodes of one build: a primary sends its replicas each step's mean
    gradient and lr, and they step their copies themselves. kill -9 of a PS at step 5: the
    replicas that take its blocks over hold the values it would have had, so the run still equals
    torch.optim; the survivors counted the steps they replayed."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        workers = train_model.start_workers(cluster.address, "replay", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1)
        train_model.wait_for_steps(workers, 5)
        replayed = replayed_blocks(nodes[1])   # the primaries around it sent it gradients, not copies
        cluster.kill(nodes[1])
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        assert replayed > 0 and sum(replayed_blocks(n) for n in (nodes[0], nodes[2])) > 0


def test_replicas_sent_copies_take_over_from_a_killed_primary(tmp_path):
    """replicate_gradients=False (SHARDLINE_TEST_REPLICATE_COPIES=1): a primary sends its replicas
    the stepped value and optimizer state. kill -9 of a PS at step 5: the run equals torch.optim,
    and no node replayed a step."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        workers = train_model.start_workers(cluster.address, "copies", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1, env={"SHARDLINE_TEST_REPLICATE_COPIES": "1"})
        train_model.wait_for_steps(workers, 5)
        assert replayed_blocks(nodes[1]) == 0
        cluster.kill(nodes[1])
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        assert sum(replayed_blocks(n) for n in (nodes[0], nodes[2])) == 0


@pytest.mark.parametrize("failpoint", ["ps.after_apply", "ps.holder_replay"])
def test_a_node_killed_between_a_steps_apply_and_its_holders_apply_loses_nothing(tmp_path, failpoint):
    """Defaults (gradient replay, reads from copy holders: rank 1 reads every block's replica).
    ps1 exits (as kill -9 would) at step 5: ``ps.after_apply``, a primary that applied the step
    and sent nothing of it yet; ``ps.holder_replay``, a holder that received the step's gradients
    and neither replayed nor acknowledged them, while a worker may be waiting to read them from
    it. The step is applied again from the workers' resends where it was lost; the run equals
    torch.optim."""
    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_dispatcher(heartbeat_timeout=2, heartbeat_interval=0.5)
        handles = [cluster.add_node(node_id=f"ps{i}", wait=False,
                                    **({"env": {"SHARDLINE_FAILPOINTS": f"{failpoint}@5"}} if i == 1 else {}))
                   for i in range(3)]
        for h in handles:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(3, timeout=30)
        workers = train_model.start_workers(cluster.address, "mid-replication", "adamw", "bsp", tmp_path,
                                            steps=STEPS, step_sleep=0.1)
        results = train_model.finish_workers(workers)
        assert handles[1].returncode is not None, f"{failpoint}@5 did not fire"
        train_model.assert_equals_reference(results, STEPS)


def rank_1_restarted(cluster, job: str, workers, tmp_path) -> list:
    """Rank 1 of ``workers`` exited as kill -9 does (137): start it again, finish both, check the
    run equals torch.optim's; returns both ranks' results."""
    crashed = workers[1][0]
    crashed.wait(60)
    assert crashed.returncode == 137, crashed.communicate()[0]
    restarted = train_model.start_workers(cluster.address, job, "adamw", "bsp", tmp_path, steps=STEPS, ranks=[1])
    results = train_model.finish_workers([workers[0], *restarted])
    train_model.assert_equals_reference(results, STEPS)
    return results


def kill_and_wait_for_the_survivors(cluster, nodes, victim: int) -> None:
    """SIGKILL ``nodes[victim]`` and wait until every other node routes with a newer epoch."""
    survivors = [n for i, n in enumerate(nodes) if i != victim]
    epoch = metric(survivors[0], "shardline_ps_ring_epoch")
    cluster.kill(nodes[victim])
    deadline = time.monotonic() + 30
    while min(metric(n, "shardline_ps_ring_epoch") for n in survivors) == epoch:
        assert time.monotonic() < deadline, f"the survivors did not route without {nodes[victim].node_id}"
        time.sleep(0.05)


def metric(node, name: str) -> float:
    """The sum of ``name``'s samples on ``node``'s metrics endpoint."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{node.metrics}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_a_replica_that_diverged_is_resynced_and_a_failover_after_it_equals_torch(tmp_path):
    """Replay with the divergence check every 2 steps (--replica-check-interval 2); failpoint
    ps.replay_diverge makes each node's first replayed copy from step 3 on differ by one ulp. The
    next checked step finds it (metric shardline_ps_replica_divergence_total, a WARNING naming
    job, block, step and primary); the holder syncs a full copy. kill -9 of a PS afterwards: the
    run still equals torch.optim."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3, node_flags={"replica_check_interval": 2,
                                              "env": {"SHARDLINE_FAILPOINTS": "ps.replay_diverge@3=1*raise"}})
        workers = train_model.start_workers(cluster.address, "diverge", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1)
        deadline = time.monotonic() + 60
        while sum(divergences(n) for n in nodes) == 0:
            assert time.monotonic() < deadline, "no divergence found"
            time.sleep(0.2)
        train_model.wait_for_steps(workers, 9)
        diverged = [n for n in nodes if divergences(n)]
        assert any("differs from its primary" in n.log_tail(400) for n in diverged)
        cluster.kill(next(n for n in nodes if n is not diverged[0]))
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)


def test_a_flat_job_survives_a_killed_primary(tmp_path):
    """flatten=True (the trainable parameters one tensor, in blocks of 16 elements over 3 nodes):
    kill -9 of a PS at step 5; the replicas take its blocks over and the run still equals torch.optim."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        workers = train_model.start_workers(cluster.address, "flat", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1, env={"SHARDLINE_TEST_FLATTEN": "1"})
        train_model.wait_for_steps(workers, 5)
        with connect(cluster.address, job="flat") as probe:
            assert [t.name for t in probe.wait_ready(30).tensors if t.trainable] == [
                t.name for t in probe.spec.tensors if is_flat_name(t.name)] != []
        cluster.kill(nodes[1])
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)


def replayed_blocks(node) -> int:
    return int(metric(node, "shardline_ps_blocks_replayed_total"))


def divergences(node) -> int:
    return int(metric(node, "shardline_ps_replica_divergence_total"))


def test_add_a_fourth_ps_mid_run(tmp_path):
    """A node joining mid-job is brought in sync (two-phase ring change) before it serves; the job
    never meets a node that lacks its blocks."""
    with LocalCluster(tmp_path / "c") as cluster:
        start(cluster, 3)
        workers = train_model.start_workers(cluster.address, "join", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.4)
        train_model.wait_for_steps(workers, 3)
        cluster.add_node(node_id="ps3")
        cluster.wait_for_nodes(4, timeout=30)  # serving: the switch happened while training went on
        assert min(train_model.steps_done(p) for _, _, p in workers) < STEPS - 2, "the job ended before the switch"
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        status = cluster.cluster_status()
        ps3 = next(n for n in status.all_nodes if n.node_id == "ps3")
        assert ps3.member == "serving" and ps3.blocks > 0


def test_a_join_waits_for_a_sigstopped_node_and_status_names_what_it_waits_for(tmp_path):
    """SIGSTOP of a serving PS, then a fourth node joins mid-job: the ring change cannot switch (the
    stopped node neither hands its blocks over nor reports), `shardline status` names the nodes it
    waits for and why. A second job is created while the change waits (every node must then hold
    it before the switch). After SIGCONT the ring switches and both runs equal torch.optim."""
    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_dispatcher(heartbeat_timeout=30, heartbeat_interval=0.5)   # no death: a pause
        nodes = [cluster.add_node(node_id=f"ps{i}") for i in range(3)]
        cluster.wait_for_nodes(3, timeout=30)
        workers = train_model.start_workers(cluster.address, "join-paused", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.2)
        train_model.wait_for_steps(workers, 3)
        cluster.kill(nodes[1], signal.SIGSTOP)
        try:
            cluster.add_node(node_id="ps3")
            status = cluster.wait_until(lambda s: s.routing.pending_epoch and any(
                n.node_id == "ps1" and n.not_ready for n in s.all_nodes), 20, "a ring change waiting for ps1")
            waiting = {n.node_id: n.not_ready for n in status.all_nodes if n.not_ready}
            assert waiting.get("ps1") == "has not reported ready yet", waiting
            out = subprocess.run([*CLI, "status", "--cluster", cluster.address], capture_output=True, text=True,
                                 timeout=60)
            line = next((ln for ln in out.stdout.splitlines() if "waiting for:" in ln), "")
            assert "ps1 has not reported ready yet" in line, out.stdout + out.stderr
            late = train_model.start_workers(cluster.address, "created-mid-change", "adamw", "bsp", tmp_path,
                                             steps=8)
            status = cluster.wait_until(lambda s: any(j.spec.name == "created-mid-change" for j in s.jobs), 30,
                                        "the second job created")
            assert status.routing.pending_epoch, "switched while ps1 was stopped"
        finally:
            cluster.kill(nodes[1], signal.SIGCONT)
        cluster.wait_for_nodes(4, timeout=60)
        train_model.assert_equals_reference(train_model.finish_workers(workers), STEPS)
        train_model.assert_equals_reference(train_model.finish_workers(late), 8)
        status = cluster.cluster_status()
        assert not any(n.not_ready for n in status.all_nodes)
        ps3 = next(n for n in status.all_nodes if n.node_id == "ps3")
        assert ps3.member == "serving" and ps3.blocks > 0


def test_drain_a_ps_mid_run(tmp_path):
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        workers = train_model.start_workers(cluster.address, "drain", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.4)
        train_model.wait_for_steps(workers, 4)
        out = subprocess.run([*CLI, "drain", "--cluster", cluster.address, "ps2", "--wait", "60"],
                             capture_output=True, text=True, timeout=90)
        assert out.returncode == 0 and "ps2 drained" in out.stdout, out.stdout + out.stderr
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        assert nodes[2].alive()
        status = cluster.cluster_status()
        assert "ps2" not in {n.node_id for n in status.routing.nodes}


@pytest.mark.parametrize("failpoint", ["worker.after_push", "worker.commit_partial"])
def test_a_worker_killed_mid_step_restarts_and_redoes_it(two_nodes, tmp_path, failpoint):
    """Rank 1 dies between its push and its commit (or after committing on one node only) at
    step 6; restarted with the same rank it resumes at opt.version: its resent pushes replace
    nothing (they are the same gradients), a half-made commit is completed from the other nodes."""
    cluster, job = two_nodes, f"worker-crash-{failpoint.split('.')[-1]}"
    env = {1: {"SHARDLINE_FAILPOINTS": f"{failpoint}@6"}}
    workers = train_model.start_workers(cluster.address, job, "adamw", "bsp", tmp_path, steps=STEPS, env=env)
    results = rank_1_restarted(cluster, job, workers, tmp_path)
    assert int(results[1]["_start_version"]) in (6, 7)


def test_a_ps_restarts_while_a_rank_that_half_committed_is_dead(tmp_path):
    """Rank 1 dies after committing step 6 on one node only; before it comes back a PS restarts
    (its blocks move away and back: two ring changes). The nodes complete the half-made commit
    from their peers before blocks change owner, the restarted rank resumes at the oldest step a
    block still collects, and the parameters equal torch.optim's (found by the seeded fault run)."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        env = {1: {"SHARDLINE_FAILPOINTS": "worker.commit_partial@6"}}
        workers = train_model.start_workers(cluster.address, "half-commit", "adamw", "bsp", tmp_path, steps=STEPS,
                                            env=env)
        crashed = workers[1][0]
        crashed.wait(60)
        assert crashed.returncode == 137, crashed.communicate()[0]
        cluster.restart(nodes[2], wait=True)   # SIGTERM: it leaves the ring, then rejoins
        cluster.wait_for_nodes(3, timeout=60)
        restarted = train_model.start_workers(cluster.address, "half-commit", "adamw", "bsp", tmp_path,
                                              steps=STEPS, ranks=[1])
        results = train_model.finish_workers([workers[0], *restarted])
        train_model.assert_equals_reference(results, STEPS)


def test_a_half_committed_rank_and_a_dead_primary_of_its_blocks(tmp_path):
    """Rank 1 dies at step 6 after committing on ps0 only, and ps1 (which lacks that commit) is
    SIGKILLed before the commit relay completes it there: ps0 applies step 6, ps1's blocks move to
    their replicas without rank 1's gradients, and the restarted rank 1 redoes step 6. It must
    recompute on the parameters its first incarnation used (ps0 keeps each block's value from
    before its last step), not on ps0's stepped ones: the result equals torch.optim's (the seeded
    fault run's seed 14 difference)."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        env = {1: {"SHARDLINE_FAILPOINTS": "worker.commit_partial@6"}}
        workers = train_model.start_workers(cluster.address, "half-commit-dead-primary", "adamw", "bsp", tmp_path,
                                            steps=STEPS, env=env)
        workers[1][0].wait(60)
        cluster.kill(nodes[1])   # well inside the relay's delay: ps1 never learns rank 1's commit
        results = rank_1_restarted(cluster, "half-commit-dead-primary", workers, tmp_path)
        assert int(results[1]["_start_version"]) == 6


@pytest.mark.parametrize("flat", [False, True], ids=["per-tensor", "flat"])
def test_a_commit_that_reached_only_a_draining_node(tmp_path, flat):
    """Rank 0 dies at step 6 after committing on ps0 only, while ps0 drains (SIGTERM: it leaves
    the ring, then restarts and rejoins, syncing its copies from the others). ps0 may apply step 6 at the old
    epoch (rank 1 committed it there too), and its blocks move to the others at version 7, then
    back when it rejoins; the restarted rank 0 redoes step 6 and must get every block as of step 6
    wherever it is now (the handovers carry the value from before the step, and a leaving node
    sends them before it exits): no warning that its gradient may differ, and the result equals
    torch.optim's (chaos seed 4). Whether rank 0 redoes step 6 or the commit relay completes it
    from ps0 before ps0 stops is timing, and mostly the relay wins: then this passes without the
    handovers' previous values too (tests/unit/test_handover_catch_up.py and test_leave_ring.py
    check those deterministically). Its first version redid the step, and failed on a handover
    refused for naming a block three times (its value, copy and previous value)."""
    steps, at = 12, 6
    held = tmp_path / "failpoints"
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3)
        common = {"SHARDLINE_TEST_LOG_LEVEL": "INFO", **({"SHARDLINE_TEST_FLATTEN": "1"} if flat else {})}
        env = {0: {**common, **train_model.held_env(held, at, also=f"worker.commit_partial@{at}")},
               1: {**common, **train_model.held_env(held, at)}}
        workers = train_model.start_workers(cluster.address, "commit-to-a-draining-node", "adamw", "bsp", tmp_path,
                                            steps=steps, env=env, log_output=True)
        train_model.wait_for_steps(workers, at)   # both held before step 6
        nodes[0].proc.send_signal(signal.SIGTERM)
        cluster.wait_until(lambda s: s.routing.pending_epoch, 10, "ps0 draining")
        train_model.allow(held)   # step 6 runs while ps0 leaves the ring
        crashed = workers[0][0]
        crashed.wait(60)
        assert crashed.returncode == 137, train_model.worker_output(workers[0])
        nodes[0].proc.wait(30)
        cluster.restart(nodes[0], wait=True)
        workers[0] = train_model.start_workers(cluster.address, "commit-to-a-draining-node", "adamw", "bsp",
                                               tmp_path, steps=steps, ranks=[0], env=common, log_output=True)[0]
        results = train_model.finish_workers(workers)
        output = train_model.worker_output(workers[0])
        assert "may differ" not in output, output
        train_model.assert_equals_reference(results, steps)
        # it redid step 6, or the commit relay completed step 6 from ps0 before ps0 stopped
        assert int(results[0]["_start_version"]) in (at, at + 1)


def test_on_worker_failure_fail_names_the_lost_rank(two_nodes, tmp_path):
    """A rank that stops heartbeating fails the job within the lease timeout: the other rank gets
    ShardlineWorkerLostError naming it instead of waiting for pull_timeout."""
    cluster = two_nodes
    env = {"SHARDLINE_TEST_ON_WORKER_FAILURE": "fail", "SHARDLINE_TEST_LEASE_TIMEOUT": "3",
           1: {"SHARDLINE_FAILPOINTS": "worker.before_push@4"}}
    env = {0: {k: v for k, v in env.items() if isinstance(k, str)},
           1: {**{k: v for k, v in env.items() if isinstance(k, str)}, **env[1]}}
    workers = train_model.start_workers(cluster.address, "lose-a-rank", "adamw", "bsp", tmp_path, steps=STEPS,
                                        env=env)
    survivor, lost = workers[0][0], workers[1][0]
    # timed from rank 1's death, not from the start (a loaded machine takes seconds to start a worker)
    assert lost.wait(60) == 137, train_model.worker_output(workers[1])
    died = time.monotonic()
    output, _ = survivor.communicate(timeout=60)
    took = time.monotonic() - died
    assert survivor.returncode != 0
    assert "ShardlineWorkerLostError" in output and "rank 1 lost" in output, output
    assert took < 3 + 10, f"the survivor learned it {took:.1f} s after rank 1 died"
    train_model.kill_workers(workers)


def test_a_missing_rank_is_named_when_the_pull_times_out(two_nodes, tmp_path):
    """on_worker_failure: wait (the default) and a short pull_timeout: the error names the rank that
    did not commit (the issue's reproduction waited 600 s and named no rank)."""
    cluster = two_nodes
    common = {"SHARDLINE_TEST_PULL_TIMEOUT": "4", "SHARDLINE_TEST_LEASE_TIMEOUT": "2"}
    env = {0: common, 1: {**common, "SHARDLINE_FAILPOINTS": "worker.before_push@3"}}
    workers = train_model.start_workers(cluster.address, "wait-for-rank", "adamw", "bsp", tmp_path, steps=STEPS,
                                        env=env)
    output, _ = workers[0][0].communicate(timeout=60)
    assert workers[0][0].returncode != 0
    assert "StepTimeoutError" in output and "pull_timeout" in output, output
    assert "ranks [1] did not commit step 3 (PS nodes ps0, ps1 wait for them); rank 1: lost" in output, output
    status = subprocess.run([*CLI, "status", "--cluster", cluster.address], capture_output=True, text=True,
                            timeout=30)
    assert "job wait-for-rank: rank 1 missing for" in status.stdout, status.stdout
    train_model.kill_workers(workers)
