"""PS, dispatcher and worker metric helpers, without daemons: values land where the docs say."""

import math
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY

from shardline.dispatcher import metrics as DM
from shardline.dispatcher.membership import NodeRecord
from shardline.ps_server import metrics as PM
from shardline.worker import metrics as WM


def sample(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


# --- PS ------------------------------------------------------------------------------------------

def test_ps_request_counts_codes_bytes_and_sizes():
    m = PM.PSMetrics()
    keys = [("shardline_ps_requests_total", {"op": "PUSH", "code": "OK"}),
            ("shardline_ps_requests_total", {"op": "PUSH", "code": "STALE_STEP"}),
            ("shardline_ps_requests_total", {"op": "UNKNOWN", "code": "BAD_FRAME"}),
            ("shardline_ps_payload_bytes_total", {"op": "PUSH", "direction": "received"}),
            ("shardline_ps_request_payload_bytes_count", {"op": "PUSH"}),
            ("shardline_ps_request_seconds_count", {"op": "PUSH"})]
    before = [sample(name, **labels) for name, labels in keys]
    m.request("OP_PUSH", "OK", seconds=0.002, bytes_in=4096)
    m.request("OP_PUSH", "STALE_STEP", bytes_in=100)
    m.request(None, "BAD_FRAME")
    after = [sample(name, **labels) for name, labels in keys]
    # payload sizes: successful requests only
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1, 4196, 1, 1]


def test_bsp_barrier_runs_from_first_commit_to_application():
    m = PM.PSMetrics()
    job = "unit-barrier"
    s0 = sample("shardline_ps_bsp_barrier_seconds_sum", job_name=job)
    m.commit(job, 5, applied=False, now=100.0)
    m.commit(job, 5, applied=False, now=101.0)
    m.commit(job, 5, applied=True, now=103.5)
    assert sample("shardline_ps_bsp_barrier_seconds_count", job_name=job) == 1
    assert sample("shardline_ps_bsp_barrier_seconds_sum", job_name=job) - s0 == pytest.approx(3.5)
    # A leftover open barrier of an older step does not leak into the next one.
    m.commit(job, 6, applied=False, now=200.0)
    m.commit(job, 7, applied=True, now=300.0)  # step 6 never completed here (e.g. a restart)
    assert sample("shardline_ps_bsp_barrier_seconds_count", job_name=job) == 2
    assert sample("shardline_ps_bsp_barrier_seconds_sum", job_name=job) - s0 == pytest.approx(3.5)


def test_timed_commit_records_apply_only_when_the_step_advances():
    m = PM.PSMetrics()
    job = "unit-apply"
    assert m.timed_commit(job, 3, lambda: 3) == 3      # barrier not full yet
    assert sample("shardline_ps_optimizer_apply_seconds_count", job_name=job) == 0
    assert m.timed_commit(job, 3, lambda: 4) == 4      # last worker: applied
    assert sample("shardline_ps_optimizer_apply_seconds_count", job_name=job) == 1
    assert sample("shardline_ps_bsp_barrier_seconds_count", job_name=job) == 1
    def refused():
        raise ValueError("stale step")

    with pytest.raises(ValueError):                    # a refused commit records nothing
        m.timed_commit(job, 4, refused)
    assert sample("shardline_ps_optimizer_apply_seconds_count", job_name=job) == 1


@pytest.fixture
def watched():
    yield
    PM._COLLECTOR.node = None
    PM._COLLECTOR.last_heartbeat = None


def test_node_state_is_read_at_scrape_time(watched):
    import torch

    from shardline.ps_server.delta_history import DeltaHistory
    from shardline.ps_server.optimizer import OptimizerConfig
    from shardline.ps_server.store import JobStore
    from shardline.services.pb import common_pb2

    spec = common_pb2.JobSpec(name="unit-node", sync="bsp", world_size=4, block_elements=16,
                              optimizer=OptimizerConfig.from_kwargs("sgd", lr=0.1).to_proto())
    spec.tensors.add(name="w", shape=[32], dtype="float32", trainable=True)
    job = JobStore(spec)
    job.init_blocks([("w", 0, torch.zeros(16)), ("w", 1, torch.zeros(16))])
    job.step, job.commits = 7, {7: {0: (1.0, 0), 2: (1.0, 0)}}
    node = SimpleNamespace(store=SimpleNamespace(jobs=lambda: [job]), routing=SimpleNamespace(epoch=9),
                           delta_history=DeltaHistory(0))
    assert REGISTRY.get_sample_value("shardline_ps_ring_epoch") is None  # nothing before a node is watched
    PM.watch_node(node, "unit-ps", "r1")
    PM.heartbeat(ok=True)
    assert sample("shardline_ps_blocks", job_name="unit-node") == 2
    assert sample("shardline_ps_parameter_bytes", job_name="unit-node") == 128
    assert sample("shardline_ps_job_step", job_name="unit-node") == 7
    assert sample("shardline_ps_job_world_size", job_name="unit-node") == 4
    assert sample("shardline_ps_bsp_committed_workers", job_name="unit-node") == 2
    assert sample("shardline_ps_memory_bytes", job_name="unit-node", kind="values") == 128
    assert sample("shardline_ps_memory_bytes", job_name="unit-node", kind="gradients") == 0
    assert sample("shardline_ps_memory_parameters", job_name="unit-node") == 32
    assert sample("shardline_ps_ring_epoch") == 9
    assert sample("shardline_ps_info", node_id="unit-ps", rack="r1") == 1
    assert 0 <= sample("shardline_ps_heartbeat_age_seconds") < 5
    job.step, node.routing.epoch = 8, 10                # no update call needed
    assert sample("shardline_ps_job_step", job_name="unit-node") == 8
    assert sample("shardline_ps_ring_epoch") == 10
    failures = sample("shardline_ps_heartbeat_failures_total")
    PM.heartbeat(ok=False)
    assert sample("shardline_ps_heartbeat_failures_total") == failures + 1


# --- dispatcher ----------------------------------------------------------------------------------

def record(node_id, state="alive", age=0.5, rack="r1", blocks=3, nbytes=300, vnodes=128):
    return NodeRecord(node_id=node_id, rack=rack, grpc_address="h:1", data_address="h:2", capacity=1.0, state=state,
                      vnodes=vnodes if state == "alive" else 0, heartbeat_age_seconds=age, blocks=blocks, bytes=nbytes, member="serving")


def test_dispatcher_publish_sets_and_removes_node_series():
    DM.publish(7, [record("u1"), record("u2", state="dead", age=9.0)], heartbeat_timeout=5.0, jobs=3)
    assert sample("shardline_ring_epoch") == 7
    assert sample("shardline_live_nodes") == 1 and sample("shardline_dead_nodes") == 1
    assert sample("shardline_heartbeat_timeout_seconds") == 5.0
    assert sample("shardline_jobs") == 3
    assert sample("shardline_node_alive", node_id="u1", rack="r1") == 1
    assert sample("shardline_node_alive", node_id="u2", rack="r1") == 0
    assert sample("shardline_node_heartbeat_age_seconds", node_id="u2", rack="r1") == 9.0
    assert sample("shardline_node_blocks", node_id="u1", rack="r1") == 3
    assert sample("shardline_node_parameter_bytes", node_id="u1", rack="r1") == 300
    assert sample("shardline_node_vnodes", node_id="u1", rack="r1") == 128
    # u2 forgotten, u1 moved to another rack: their old series go away.
    DM.publish(8, [record("u1", rack="r2")], heartbeat_timeout=5.0, jobs=3)
    assert REGISTRY.get_sample_value("shardline_node_alive", {"node_id": "u2", "rack": "r1"}) is None
    assert REGISTRY.get_sample_value("shardline_node_alive", {"node_id": "u1", "rack": "r1"}) is None
    assert sample("shardline_node_alive", node_id="u1", rack="r2") == 1
    assert sample("shardline_dead_nodes") == 0
    dead = sample("shardline_nodes_declared_dead_total")
    DM.nodes_declared_dead(2)
    DM.nodes_declared_dead(0)
    assert sample("shardline_nodes_declared_dead_total") == dead + 2


def test_dispatcher_servicer_publishes_membership():
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.dispatcher.membership import Membership
    from shardline.dispatcher.server import DispatcherServicer

    now = [1000.0]
    servicer = DispatcherServicer(Membership(heartbeat_timeout=2.0, isolation_share=1.0), JobRegistry(),
                                  heartbeat_interval=0.5, clock=lambda: now[0])   # its one node dies: no isolation guard
    servicer.membership.register("svc-a", "r1", "127.0.0.1:1", "127.0.0.1:2", 1.0, now[0])
    now[0] += 3.0
    assert servicer.expire() == ["svc-a"]
    assert sample("shardline_node_alive", node_id="svc-a", rack="r1") == 0
    assert sample("shardline_node_heartbeat_age_seconds", node_id="svc-a", rack="r1") == pytest.approx(3.0)
    assert sample("shardline_dead_nodes") == 1 and sample("shardline_live_nodes") == 0


# --- worker --------------------------------------------------------------------------------------

def test_worker_task_metrics_bind_job_and_rank():
    m = WM.TaskMetrics("unit-job", 3)
    labels = {"job_name": "unit-job", "rank": "3"}
    assert math.isnan(REGISTRY.get_sample_value("shardline_worker_loss", labels))  # no step yet: a gap, not 0
    m.loss.set(2.5)
    m.tokens.inc(100)
    assert REGISTRY.get_sample_value("shardline_worker_loss", labels) == 2.5
    assert REGISTRY.get_sample_value("shardline_worker_tokens_total", labels) == 100


def test_step_metrics_record_a_psoptimizer_flow(monkeypatch):
    """What PSOptimizer calls, in its order: construction (the first pull), then per step zero_grad,
    push, the pull after the commit, the end of step()."""
    clock = [100.0]
    monkeypatch.setattr(WM.time, "perf_counter", lambda: clock[0])
    labels = {"job_name": "unit-flow", "rank": "1"}
    stats = SimpleNamespace(pushed_bytes=0, pulled_bytes=4096)     # the client's running totals
    m = WM.StepMetrics("unit-flow", 1)
    for name in ("shardline_worker_steps_total", "shardline_worker_push_bytes_total",
                 "shardline_worker_pull_bytes_total", "shardline_worker_version",
                 "shardline_worker_step_seconds_count", "shardline_worker_pull_wait_seconds_count"):
        assert REGISTRY.get_sample_value(name, labels) == 0, name   # visible before the first step
    m.transferred(stats, version=0)
    for step in range(3):
        m.start()                                  # zero_grad()
        clock[0] += 0.5                            # forward, backward
        stats.pushed_bytes += 1000                 # push, commit
        clock[0] += 0.25                           # the pull waits for the step, then moves 200 bytes
        stats.pulled_bytes += 200
        m.waited(0.25)
        m.transferred(stats, version=step + 1)
        m.stepped()
    assert sample("shardline_worker_steps_total", **labels) == 3
    assert sample("shardline_worker_step_seconds_count", **labels) == 3
    assert sample("shardline_worker_step_seconds_sum", **labels) == pytest.approx(3 * 0.75)
    assert sample("shardline_worker_pull_wait_seconds_count", **labels) == 3
    assert sample("shardline_worker_pull_wait_seconds_sum", **labels) == pytest.approx(0.75)
    assert sample("shardline_worker_push_bytes_total", **labels) == 3000
    assert sample("shardline_worker_pull_bytes_total", **labels) == 4096 + 600
    assert sample("shardline_worker_version", **labels) == 3
    # Without zero_grad the step runs from the end of the previous one.
    clock[0] += 2.0
    m.stepped()
    assert sample("shardline_worker_step_seconds_sum", **labels) == pytest.approx(3 * 0.75 + 2.0)
    # A second optimizer of the same job and rank in this process shares the series (no clash).
    again = WM.StepMetrics("unit-flow", 1)
    again.transferred(SimpleNamespace(pushed_bytes=10, pulled_bytes=0), version=4)
    assert sample("shardline_worker_push_bytes_total", **labels) == 3010
    assert sample("shardline_worker_version", **labels) == 4


def test_worker_metric_labels_are_bounded():
    for metric in WM.LIBRARY_METRICS + WM.DAEMON_METRICS:
        assert metric._labelnames == ("job_name", "rank"), metric


def test_library_metrics_endpoint_follows_the_bind_policy():
    from shardline.services.errors import ShardlineConfigError

    with pytest.raises(ShardlineConfigError, match="refusing to serve metrics on 0.0.0.0:9400.*cluster token"):
        WM.check_bind("0.0.0.0", 9400, has_token=False)
    WM.check_bind("0.0.0.0", 9400, has_token=True)
    WM.check_bind("127.0.0.1", 0, has_token=False)
    WM.check_bind("localhost", 9400, has_token=False)
    for port in (-1, 65536, "9400", True, 1.5):
        with pytest.raises(ShardlineConfigError, match="metrics_port"):
            WM.check_bind("127.0.0.1", port, has_token=False)
    with pytest.raises(ShardlineConfigError, match="refusing"):
        WM.serve("::", 0, has_token=False)


def test_library_serves_the_default_registry():
    import urllib.request

    WM.StepMetrics("unit-serve", 0).stepped()
    server, address = WM.serve("127.0.0.1", 0, has_token=False)
    try:
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'shardline_worker_steps_total{job_name="unit-serve",rank="0"} 1.0' in text
        from shardline.services.errors import ShardlineConfigError

        with pytest.raises(ShardlineConfigError, match="cannot serve metrics on 127.0.0.1"):
            WM.serve("127.0.0.1", int(port), has_token=False)   # taken
    finally:
        server.shutdown()
        server.server_close()
