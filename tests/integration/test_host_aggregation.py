"""Host aggregation (worker/host_group.py, worker/host_step.py): the workers of one host send each
block once for all of them. BSP still equals single-process torch.optim; a worker killed at any
step of the aggregation (the leader after summing, a member after handing its gradients over)
restarts and loses nothing; on emulated machines the defaults aggregate by themselves."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

import train_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEPS = 8
AGGREGATE = {"SHARDLINE_TEST_HOST_AGGREGATION": "1"}   # one host: only when asked for
KILL_STEP = 5


def aggregated_ranks(metrics_text: str, job: str) -> float:
    """Ranks a node's aggregated pushes of ``job`` covered (its Prometheus metrics' text)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(f'shardline_ps_aggregated_push_ranks_total{{job_name="{job}"}}'))


def node_metrics(node) -> str:
    import urllib.request

    return urllib.request.urlopen(f"http://{node.metrics}/metrics", timeout=10).read().decode()


def test_three_workers_of_one_host_push_each_block_once_and_equal_torch(cluster, tmp_path):
    job = "host-aggregation-three"
    results = train_model.finish_workers(train_model.start_workers(cluster.address, job, "adamw", "bsp", tmp_path,
                                                                    world=3, steps=STEPS, env=AGGREGATE))
    train_model.assert_equals_reference(results, STEPS, world_size=3, tol=1e-5)
    assert sum(aggregated_ranks(node_metrics(node), job) for node in cluster.nodes) > 0


def wait_for_deaths(workers, at_least: int, timeout: float = 60.0) -> list[int]:
    """The ranks (indices into ``workers``) that exited, once ``at_least`` did and no other one
    followed for a second; each must have been killed by the failpoint (exit 137)."""
    deadline = time.monotonic() + timeout
    dead: list[int] = []
    settled_at = None
    while time.monotonic() < deadline:
        now_dead = [r for r, (p, _, _) in enumerate(workers) if p.poll() is not None]
        if now_dead != dead:
            dead, settled_at = now_dead, time.monotonic()
        if len(dead) >= at_least and time.monotonic() - settled_at >= 1.0:
            break
        time.sleep(0.1)
    assert len(dead) >= at_least, f"only ranks {dead} exited within {timeout:g} s"
    for r in dead:
        p = workers[r][0]
        assert p.returncode == 137, (r, p.returncode, p.communicate()[0])
    return dead


@pytest.mark.parametrize("failpoint, deaths", [("worker.host_group_leader_summed", 1), ("worker.host_group_ready", 2)],
                         ids=["leader-after-summing", "members-after-ready"])
def test_a_worker_killed_mid_aggregation_restarts_and_loses_nothing(cluster, tmp_path, failpoint, deaths):
    """Three workers of one host; at step 5 the leader dies after summing (before its push), or
    both members die right after handing their gradients over (the leader pushes them, then finds
    them gone). The survivors push alone or wait in the step's pull; the dead ranks restart, redo
    the step (a node ignores a rank's push of a block an aggregate already brought) and the run
    equals torch.optim."""
    job = f"host-aggregation-{failpoint.rsplit('_', 1)[-1]}"
    env = {**AGGREGATE, "SHARDLINE_FAILPOINTS": f"{failpoint}@{KILL_STEP}"}   # only the leader (members) hit it
    workers = train_model.start_workers(cluster.address, job, "adamw", "bsp", tmp_path, world=3, steps=STEPS, env=env)
    dead = wait_for_deaths(workers, deaths)
    restarted = train_model.start_workers(cluster.address, job, "adamw", "bsp", tmp_path, world=3, steps=STEPS,
                                          ranks=dead, env=AGGREGATE)
    by_rank = {r: w for r, w in enumerate(workers)}
    by_rank.update(zip(dead, restarted))
    results = train_model.finish_workers([by_rank[r] for r in range(3)])
    train_model.assert_equals_reference(results, STEPS, world_size=3, tol=1e-5)
    for r in dead:
        assert int(results[r]["_start_version"]) in (KILL_STEP, KILL_STEP + 1)


def train_on_machines(tmp_path, job: str, ps_hosts: tuple[str, ...], rank_hosts: dict[int, str]):
    """Train ``job`` on emulated machines (network namespaces, tests/emulated_cluster.py): a PS
    node on each of ``ps_hosts``, rank r on ``rank_hosts[r]``, every option at its default.
    Returns the workers' results, checked equal to torch.optim, what the nodes' metrics say of
    aggregated pushes (ranks covered), and each rank's log (INFO)."""
    from emulated_cluster import EmulatedCluster

    machines = ["disp", *dict.fromkeys([*ps_hosts, *rank_hosts.values()])]
    with EmulatedCluster(tmp_path / "c", machines) as cluster:
        cluster.start_dispatcher("disp")
        nodes = [cluster.add_node(h, wait=False) for h in ps_hosts]
        for node in nodes:
            cluster.wait_ready(node)
        cluster.wait_for_nodes(len(nodes), timeout=60)
        workers = train_model.start_workers(cluster.address, job, "adamw", "bsp", tmp_path, world=len(rank_hosts),
                                            steps=STEPS, env={**cluster.worker_env, "SHARDLINE_TEST_LOG_LEVEL": "INFO"},
                                            log_output=True,
                                            wrap=lambda rank, argv: cluster.on_host(rank_hosts[rank], argv))
        results = train_model.finish_workers(workers, timeout=240)
        train_model.assert_equals_reference(results, STEPS, world_size=len(rank_hosts), tol=1e-5)
        covered = sum(aggregated_ranks(cluster.http_get(f"http://{node.metrics}/metrics"), job) for node in nodes)
    logs = {rank: train_model.output_log(out).read_text(errors="replace") for rank, (_, out, _) in enumerate(workers)}
    return results, covered, logs


def test_on_two_emulated_machines_the_defaults_aggregate_each_hosts_pushes(tmp_path):
    """Two machines (network namespaces), a PS node and two workers on each, every option at its
    default: a push crosses machines, so each host's workers aggregate by themselves; the run
    equals torch.optim and the nodes saw aggregated pushes."""
    _results, covered, _logs = train_on_machines(tmp_path, "host-aggregation-machines", ("ha", "hb"),
                                           {0: "ha", 1: "ha", 2: "hb", 3: "hb"})
    assert covered > 0


def test_where_the_nodes_run_on_other_machines_each_hosts_workers_share_one_pull(tmp_path):
    """The PS nodes on machines of their own, two workers on each of two worker machines, every
    option at its default: every read crosses machines, so each host's leader pulls the step and
    its member takes it from the leader's region. The run equals torch.optim; a member pulled no
    block after joining (its steps came from its leader), its leader pulled every step."""
    hosts = {0: "wa", 1: "wa", 2: "wb", 3: "wb"}
    results, _covered, logs = train_on_machines(tmp_path, "host-pull-machines", ("pa", "pb"), hosts)
    for host in ("wa", "wb"):
        ranks = [r for r, h in hosts.items() if h == host]
        shared = {r: int(results[r]["_shared_steps"]) for r in ranks}
        pulled = {r: int(results[r]["_pulled_blocks"]) for r in ranks}
        leader = min(ranks, key=lambda r: shared[r])
        member = next(r for r in ranks if r != leader)
        # The leader sums its first step alone (no member joined yet); a member that started later
        # under load joins a step later still. Every step after those came from the leader.
        late = [int(n) for n in re.findall(rf"excluded rank {member} from step (\d+) \(it came late\)", logs[member])]
        declined = [int(n) for pair in re.findall(r"the pull of step (\d+) is not shared|pull of step (\d+) \(",
                                               logs[leader] + logs[member]) for n in pair if n]
        assert shared[leader] == 0 and shared[member] >= STEPS - 2 and all(s < 2 for s in late + declined), \
            (host, shared, late, declined, logs[member])
        # the member's blocks: the join's, and at most two steps' of its own (before the group formed)
        assert pulled[member] < pulled[leader], (host, pulled)
