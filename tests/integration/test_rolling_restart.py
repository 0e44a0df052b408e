"""A rolling restart of every daemon while workers train, as an upgrade runs it: each PS node in
turn stopped (SIGTERM: it drains) and started again, then each dispatcher (the leader last: it
resigns). Real daemons on a real etcd. The workers take a step every STEP_SLEEP s and are held
before each step (failpoint train.before_step) but for STEPS_PER_RESTART more as each daemon
stops, so they train while it drains, is down and comes back. Nothing may be lost: the run equals
torch.optim."""

from __future__ import annotations

import time

import pytest

import train_model
from shardline.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(240)

STEPS_PER_RESTART = 12   # steps the workers may take from each daemon's stop on
STEP_SLEEP = 0.25        # s: so those steps span its stop and its start
DAEMONS = 5              # 3 PS nodes, 2 dispatchers
STEPS = STEPS_PER_RESTART * (DAEMONS + 1)


def done(workers) -> int:
    return min(train_model.steps_done(progress) for _, _, progress in workers)


def test_a_rolling_restart_of_every_daemon_while_workers_train(tmp_path, etcd):
    with LocalCluster(tmp_path / "c") as cluster:
        dispatchers = [cluster.add_dispatcher(state_store=etcd.url, state_prefix="/rolling", leader_lease_timeout=2,
                                              heartbeat_timeout=4, heartbeat_interval=0.5, wait=False)
                       for _ in range(2)]
        for h in dispatchers:
            cluster.wait_ready(h)
        nodes = [cluster.add_node(node_id=f"ps{i}", wait=False) for i in range(3)]
        for h in nodes:
            cluster.wait_ready(h)
        cluster.wait_for_nodes(3, timeout=30)
        held = tmp_path / "failpoints"
        allowed = STEPS_PER_RESTART
        train_model.allow(held, allowed)
        workers = train_model.start_workers(cluster.address, "rolling", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=STEP_SLEEP, env=train_model.held_env(held))
        train_model.wait_for_steps(workers, allowed)

        def settled(s) -> bool:   # every node back in the ring, no ring change pending, one leader
            return (not s.routing.pending_epoch and {n.node_id for n in s.routing.nodes} == {"ps0", "ps1", "ps2"}
                    and all(n.state == "alive" and not n.not_ready for n in s.all_nodes)
                    and sum(d.role == "leader" for d in s.dispatchers) == 1 and len(s.dispatchers) == 2)

        leader = cluster.leader()
        order = nodes + [h for h in dispatchers if h is not leader] + [leader]
        assert len(order) == DAEMONS
        for daemon in order:
            before = done(workers)
            allowed += STEPS_PER_RESTART
            train_model.allow(held, allowed)   # the workers train on while it stops, drains or hands the lead over
            started = time.monotonic()
            code = cluster.stop(daemon)
            assert code == 0, f"{daemon.name} exited {code} on SIGTERM:\n{daemon.log_tail()}"
            stopped = done(workers)
            cluster.restart(daemon)
            cluster.wait_until(settled, 60, f"the cluster settled after {daemon.name} restarted")
            back = done(workers)
            print(f"{daemon.name}: stopped and back in {time.monotonic() - started:.1f} s; steps done "
                  f"{before} -> {stopped} (stopped) -> {back} (settled)")
            assert back > before, f"no step was taken while {daemon.name} restarted"
            train_model.wait_for_steps(workers, allowed, timeout=60)
        assert cluster.leader() is not leader   # the lead moved when the leader stopped

        train_model.allow(held)
        train_model.assert_equals_reference(train_model.finish_workers(workers), STEPS)
        status = cluster.cluster_status()
        assert all(n.blocks > 0 for n in status.all_nodes), [(n.node_id, n.blocks) for n in status.all_nodes]
