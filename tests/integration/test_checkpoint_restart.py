"""Nothing is lost on a restart: real daemons with checkpoint and state directories, killed and
started again; the final parameters must equal single-process torch.optim on the same steps."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train_model
from shardline.local_cluster import LocalCluster
from ports import free_port

pytestmark = pytest.mark.timeout(240)

STEPS = 14
HERE = Path(__file__).parent


def start_cluster(cluster: LocalCluster, tmp_path: Path, *, nodes: int = 2, every: int = 1, **dispatcher_flags):
    cluster.start_dispatcher(listen=f"127.0.0.1:{free_port()}", state_dir=str(tmp_path / "dispatcher-state"),
                             heartbeat_timeout=3, **dispatcher_flags)
    handles = [cluster.add_node(node_id=f"ps{i}", checkpoint_dir=str(tmp_path / f"ps{i}-ckpt"),
                                checkpoint_every_steps=every, wait=False) for i in range(nodes)]
    for h in handles:
        cluster.wait_ready(h)
    cluster.wait_for_nodes(nodes, timeout=30)
    return handles


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(cluster, its directory) of start_cluster, for the tests that kill nothing (each its own job)."""
    root = tmp_path_factory.mktemp("shared")
    with LocalCluster(root / "c") as cluster:
        start_cluster(cluster, root)
        yield cluster, root


def test_kill_everything_then_resume_equals_uninterrupted(tmp_path):
    """kill -9 of every daemon (dispatcher, both PS, both workers) mid-run, then everything starts
    again with the same directories; the workers resume at opt.version."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start_cluster(cluster, tmp_path)
        workers = train_model.start_workers(cluster.address, "crash", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.15)
        train_model.wait_for_steps(workers, 5)
        train_model.kill_workers(workers)
        for h in [*nodes, cluster.dispatcher]:
            cluster.kill(h)
        cluster.restart(cluster.dispatcher)
        for h in nodes:
            cluster.restart(h, wait=False)
        for h in nodes:
            cluster.wait_ready(h)
        for h in nodes:
            assert "restored job crash at step" in h.log_tail(200), h.log_tail()
        resumed = train_model.finish_workers(
            train_model.start_workers(cluster.address, "crash", "adamw", "bsp", tmp_path, steps=STEPS))
        # resumed from the checkpoints (the latest step both nodes had reported durable), not from 0
        assert all(2 <= int(r["_start_version"]) <= STEPS for r in resumed), [int(r["_start_version"]) for r in resumed]
        train_model.assert_equals_reference(resumed, STEPS)


def test_sigterm_of_one_ps_mid_run_loses_nothing(tmp_path):
    """A PS stopped gracefully mid-run checkpoints what changed and restarts; the workers wait for
    it, resend the step in flight, and the job continues without restarting anything else."""
    with LocalCluster(tmp_path / "c") as cluster:
        nodes = start_cluster(cluster, tmp_path, every=0)  # only the graceful stop checkpoints (and step 0)
        workers = train_model.start_workers(cluster.address, "graceful", "adamw", "bsp", tmp_path, steps=STEPS,
                                            step_sleep=0.1)
        train_model.wait_for_steps(workers, 5)
        assert cluster.stop(nodes[1]) == 0
        log = nodes[1].log_tail(100)
        assert "durable at step" in log, log
        cluster.restart(nodes[1])
        assert "restored job graceful at step" in nodes[1].log_tail(200)
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)


def test_dispatcher_kill_and_restart_keeps_jobs_and_epoch(tmp_path):
    """The dispatcher alone is killed and restarted with its state directory while training runs:
    the job (spec, uid, readiness) and the epoch survive, and training finishes correctly."""
    with LocalCluster(tmp_path / "c") as cluster:
        start_cluster(cluster, tmp_path)
        workers = train_model.start_workers(cluster.address, "dispatcher-crash", "adamw", "bsp", tmp_path,
                                            steps=STEPS, step_sleep=0.1)
        train_model.wait_for_steps(workers, 3)
        before = cluster.cluster_status()
        job_before = next(j for j in before.jobs if j.spec.name == "dispatcher-crash")
        cluster.kill(cluster.dispatcher)
        cluster.restart(cluster.dispatcher)
        after = cluster.cluster_status()
        job_after = next(j for j in after.jobs if j.spec.name == "dispatcher-crash")
        assert job_after.uid == job_before.uid and job_after.ready and job_after.spec == job_before.spec
        assert after.routing.epoch > before.routing.epoch
        results = train_model.finish_workers(workers)
        train_model.assert_equals_reference(results, STEPS)
        cluster.wait_until(lambda s: all(n.state == "alive" for n in s.all_nodes), 10, "nodes alive again")


def test_lora_incremental_checkpoints_write_only_the_adapter(shared):
    """A LoRA-shaped job (a large frozen base, small trainable adapters): each incremental checkpoint
    writes about the adapters' value + AdamW state bytes, not the model's."""
    from shardline import connect

    cluster, root = shared  # checkpoints every step
    base, lora_a, lora_b = torch.randn(1024, 1024), torch.randn(8, 512) * 0.01, torch.zeros(512, 8)
    client = connect(cluster.address, job="lora")
    client.init({"base": base, "lora_a": lora_a, "lora_b": lora_b}, optimizer="adamw", lr=1e-3,
                trainable={"base": False}, block_elements=65536)
    for _ in range(4):
        client.push({"lora_a": torch.randn(8, 512), "lora_b": torch.randn(512, 8)})
        client.pull_changed()
    client.close()
    time.sleep(0.5)  # the last checkpoint is written in the background
    adapter_bytes = (lora_a.numel() + lora_b.numel()) * 4 * 3  # value, exp_avg, exp_avg_sq
    manifests = sorted(p for d in root.glob("ps*-ckpt") for p in (d / "lora").glob("*.manifest.json"))
    incrementals = [json.loads(p.read_text()) for p in manifests]
    incrementals = [m for m in incrementals if m["kind"] == "incremental"]
    assert incrementals, manifests
    for m in incrementals:  # one node's checkpoint: at most its copies of the adapters (replication 2)
        written = sum(f["bytes"] for f in m["files"].values())
        assert written <= 1.1 * adapter_bytes + 16384, f"step {m['step']}: {written} bytes for {adapter_bytes} adapter bytes"
        assert not any(key.startswith("base#") for key in m["blocks"]), "an incremental rewrote the frozen base"
    assert base.numel() * 4 > 20 * adapter_bytes  # the base would dwarf it


def test_export_from_cluster_and_offline_equals_the_model(shared, tmp_path):
    cluster, root = shared
    (result,) = train_model.finish_workers(
        train_model.start_workers(cluster.address, "export", "adamw", "bsp", tmp_path, world=1, steps=5))
    cli = [sys.executable, "-m", "shardline.cli"]
    online = tmp_path / "online.safetensors"
    out = subprocess.run([*cli, "export", "--cluster", cluster.address, "--job", "export", "--out", str(online)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "at step 5" in out.stdout
    ck = subprocess.run([*cli, "checkpoint", "--cluster", cluster.address, "--job", "export"],
                        capture_output=True, text=True, timeout=60)
    assert ck.returncode == 0 and "step 5 durable on 2 node(s)" in ck.stdout, ck.stdout + ck.stderr
    status = subprocess.run([*cli, "status", "--cluster", cluster.address, "--json"], capture_output=True,
                            text=True, timeout=60)
    job = next(j for j in json.loads(status.stdout)["jobs"] if j["name"] == "export")
    assert job["checkpoint_step"] == 5
    # offline: the nodes' checkpoint directories alone (the job is done: nothing writes them meanwhile)
    offline = tmp_path / "offline.safetensors"
    dirs = [arg for i in range(2) for arg in ("--checkpoint-dir", str(root / f"ps{i}-ckpt"))]
    out = subprocess.run([*cli, "export", *dirs, "--job", "export", "--out", str(offline), "--dtype", "bf16"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    model = train_model.SmallModel()
    trained = {k: v for k, v in result.items() if not k.startswith("_")}
    model.load_state_dict(load_file(str(online)))
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    exported = load_file(str(offline))
    assert set(exported) == set(trained)
    for name, value in exported.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, trained[name].to(torch.bfloat16)), name


def test_job_delete_removes_blocks_and_checkpoints(shared):
    from shardline import connect

    cluster, root = shared
    client = connect(cluster.address, job="doomed")
    client.init({"w": torch.ones(1000)}, optimizer="sgd", lr=0.1, block_elements=100)
    client.push({"w": torch.ones(1000)})
    client.pull_changed()
    client.close()
    cluster.wait_until(lambda s: any(j.spec.name == "doomed" and j.has_checkpoint for j in s.jobs), 10,
                       "a checkpoint of job doomed")
    assert any((root / f"ps{i}-ckpt" / "doomed").exists() for i in range(2))
    out = subprocess.run([sys.executable, "-m", "shardline.cli", "job", "delete", "--cluster",
                          cluster.address, "doomed"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "deleted" in out.stdout, out.stdout + out.stderr
    assert not any((root / f"ps{i}-ckpt" / "doomed").exists() for i in range(2))
    assert all(j.spec.name != "doomed" for j in cluster.cluster_status().jobs)
    again = subprocess.run([sys.executable, "-m", "shardline.cli", "job", "delete", "--cluster",
                            cluster.address, "doomed"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and "no job named 'doomed'" in again.stderr


def test_dispatcher_without_state_dir_learns_back_from_the_nodes(tmp_path):
    """The issue's reproduction: a dispatcher restarted WITHOUT its state forgot every job and came
    back at a lower epoch than the nodes. Now the nodes' heartbeats move its epoch above theirs and
    register the jobs they hold again, so a resumed worker continues the job and new jobs work."""
    from shardline import connect

    port = free_port()
    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_dispatcher(listen=f"127.0.0.1:{port}", heartbeat_timeout=3)
        for node in [cluster.add_node(node_id=f"ps{i}", wait=False) for i in range(2)]:  # in parallel
            cluster.wait_ready(node)
        cluster.wait_for_nodes(2, timeout=30)
        (before,) = train_model.finish_workers(
            train_model.start_workers(cluster.address, "amnesia", "adamw", "bsp", tmp_path, world=1, steps=4))
        epoch_before = cluster.cluster_status().routing.epoch
        cluster.kill(cluster.dispatcher)
        cluster.restart(cluster.dispatcher)
        status = cluster.wait_until(lambda s: any(j.spec.name == "amnesia" for j in s.jobs), 15,
                                    "job amnesia registered again by its nodes")
        assert status.routing.epoch > epoch_before
        (after,) = train_model.finish_workers(
            train_model.start_workers(cluster.address, "amnesia", "adamw", "bsp", tmp_path, world=1, steps=7))
        assert int(after["_start_version"]) == 4
        expected = train_model.reference("adamw", 7, world_size=1)
        for name, want in expected.items():
            assert (after[name] - want).abs().max().item() <= 1e-6, name
        client = connect(cluster.address, job="fresh-after-restart")
        client.init({"w": torch.ones(8)}, optimizer="sgd", lr=1.0)
        client.push({"w": torch.ones(8)})
        assert torch.equal(client.pull(["w"])["w"], torch.zeros(8))
        client.close()


def test_reusing_a_job_name_with_another_model_names_the_tensor(tmp_path):
    from shardline import PSOptimizer
    from shardline.services.errors import ShardlineStateError

    with LocalCluster(tmp_path / "c") as cluster:
        cluster.start_dispatcher()
        cluster.add_node()
        cluster.wait_for_nodes(1, timeout=30)
        first = torch.nn.Linear(4, 3)
        opt = PSOptimizer(first.named_parameters(), cluster=cluster.address, job="taken", world_size=1, rank=0)
        opt.close()
        with pytest.raises(ShardlineStateError) as err:
            PSOptimizer(torch.nn.Linear(5, 3).named_parameters(), cluster=cluster.address, job="taken",
                        world_size=1, rank=0)
        assert "'weight'" in str(err.value) and "[3, 4]" in str(err.value) and "[3, 5]" in str(err.value)
