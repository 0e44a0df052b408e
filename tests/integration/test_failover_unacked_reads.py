"""Reads before the acknowledgement across real daemons (docs/architecture.md): the copy holders
lack a step the workers read (``ps.holder_replay`` paused), then the primary is killed, alone or
with a worker while it resends; the run equals torch.optim."""

from __future__ import annotations

import time

import pytest

import train_model
from shardline.local_cluster import LocalCluster
from shardline.services import failpoints
from test_failover import STEPS, kill_and_wait_for_the_survivors, metric, rank_1_restarted, start

pytestmark = pytest.mark.timeout(240)


def test_a_primary_killed_after_the_workers_read_a_step_its_holders_lacked_loses_nothing(tmp_path):
    """Every node's copy holder pauses before replaying step 5 (``ps.holder_replay@5=pause``):
    no holder acknowledges it. The primaries serve the workers that step anyway (they keep its
    gradients to resend), the workers push and commit step 6 on it, and only the read of step 7
    waits. ps1 is killed there; once the survivors route without it, their holders go on: the
    frames of the dead primary are refused, its blocks are taken over two steps behind the job,
    and the workers' resends of steps 5 and 6 recompute them. The run equals torch.optim."""
    paused = tmp_path / "failpoints"
    paused.mkdir()
    env = {failpoints.ENV: "ps.holder_replay@5=pause(120)", failpoints.DIR_ENV: str(paused)}
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3, node_flags={"env": env})
        try:
            workers = train_model.start_workers(cluster.address, "read-before-acks", "adamw", "bsp", tmp_path,
                                                steps=STEPS, step_sleep=0.05)
            train_model.wait_for_steps(workers, 6)   # step 5's values read: no holder has them
            deadline = time.monotonic() + 30
            while min(metric(n, "shardline_ps_job_step") for n in nodes) < 7:   # step 6 committed everywhere
                assert time.monotonic() < deadline, "the workers did not commit step 6"
                time.sleep(0.05)
            assert train_model.steps_done(workers[0][2]) == 6   # the read of step 7 waits for the acks
            assert sum(metric(n, "shardline_ps_blocks_read_before_acks_total") for n in nodes) > 0
            kill_and_wait_for_the_survivors(cluster, nodes, 1)
        finally:
            failpoints.release(paused, "ps.holder_replay")
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)


def test_a_worker_killed_while_it_resends_after_a_failover_restarts_and_the_run_equals_torch(tmp_path):
    """As above, the holders lack step 5 and the workers read it; both then pause after pushing
    step 6 (``worker.after_push@6=pause``). ps1 is killed; rank 1 exits (as kill -9 would) while
    it resends: its step 5's blocks went out again, not its commit (``worker.replay_resend@5``).
    Restarted, it resumes at step 5, where the blocks taken over from ps1 still are, and redoes
    it on the values kept for it; the run equals torch.optim."""
    paused = tmp_path / "failpoints"
    paused.mkdir()
    node_env = {failpoints.ENV: "ps.holder_replay@5=pause(120)", failpoints.DIR_ENV: str(paused)}
    held = "worker.after_push@6=pause(120)"
    env = {0: {failpoints.ENV: held, failpoints.DIR_ENV: str(paused)},
           1: {failpoints.ENV: f"{held},worker.replay_resend@5", failpoints.DIR_ENV: str(paused)}}
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start(cluster, 3, node_flags={"env": node_env})
        try:
            workers = train_model.start_workers(cluster.address, "resend-crash", "adamw", "bsp", tmp_path,
                                                steps=STEPS, env=env)
            failpoints.wait_paused(paused, "worker.after_push", processes=2, timeout=60)
            kill_and_wait_for_the_survivors(cluster, nodes, 1)
        finally:
            failpoints.release(paused, "ps.holder_replay")
            failpoints.release(paused, "worker.after_push")
        results = rank_1_restarted(cluster, "resend-crash", workers, tmp_path)
        assert int(results[1]["_start_version"]) == 5
