"""Reader racks as real daemons: 4 PS nodes on 3 racks (two on rack a), replication 2, a rack cache
of rack a, BSP workers of rack a pulling through it. The leader learns the job's reads come from
rack a and moves one copy of every block there through a ring change while the job trains; the
result still equals single-process torch.optim.

Three racks, not two: with two racks and replication 2 rack diversity already puts a copy of every
block on each rack, and the preference would have nothing to move.
"""

import train_model
from shardline.services.placement import place
from shardline.local_cluster import LocalCluster
from shardline.services.routing import RoutingView

JOB = "reader-rack"
STEPS = 24


def test_a_jobs_blocks_gain_a_copy_on_its_readers_rack_while_bsp_equals_torch_optim(tmp_path):
    with LocalCluster(tmp_path / "cluster") as c:
        c.start_dispatcher(heartbeat_interval=0.2, heartbeat_timeout=3, heat_half_life=0.5, rebalance_interval=0.5,
                           reader_racks=True)
        handles = [c.add_node(node_id=f"ps{i}", rack=rack, wait=False) for i, rack in enumerate("aabc")]
        for handle in handles:
            c.wait_ready(handle)
        c.wait_for_nodes(4, timeout=30)
        c.wait_ready(c.add_cache("a", 16 << 20, wait=False))
        c.wait_until(lambda s: any(x.rack == "a" for x in s.routing.caches), 30, "rack a's cache listed")
        started = train_model.start_workers(c.address, JOB, "adamw", "bsp", tmp_path, steps=STEPS, step_sleep=0.08,
                                            env={"SHARDLINE_RACK": "a"})
        try:
            train_model.wait_for_steps(started, 1)
            before = c.cluster_status()
            status = c.wait_until(lambda s: s.routing.reader_racks.get(JOB) == "a" and not s.routing.pending_epoch,
                                  30, f"job {JOB!r}'s reader rack a switched in")
            at_switch = min(train_model.steps_done(p) for _, _, p in started)
        finally:
            results = train_model.finish_workers(started)
    train_model.assert_equals_reference(results, STEPS, tol=1e-5)
    assert at_switch < STEPS, "the job ended before the switch: nothing trained across it"
    spec = next(j.spec for j in status.jobs if j.spec.name == JOB)
    racks = {n.node_id: n.rack for n in status.routing.nodes}
    after = place(RoutingView.from_proto(status.routing), spec).owners
    assert all(len(set(o)) == 2 and "a" in {racks[n] for n in o} for o in after.values()), after
    # Before the switch (and before any rebalance moved virtual nodes under load) some blocks had no
    # copy on rack a: the preference had something to move.
    assert before.routing.reader_racks.get(JOB) is None
    lacking = [k for k, o in place(RoutingView.from_proto(before.routing), spec).owners.items()
               if "a" not in {n.rack for n in before.routing.nodes if n.node_id in o}]
    assert lacking, "every block had a copy on rack a already: the test proves nothing"
    print(f"\nreader rack: {len(lacking)} of {len(after)} blocks gained a copy on rack a "
          f"(switched in at step {at_switch} of {STEPS})")
