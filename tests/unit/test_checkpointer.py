"""The PS checkpoint scheduler and the restore decision, on a real JobStore and CheckpointDir
(no network): what is checkpointed when, and that a restore equals the store it came from."""

from __future__ import annotations

import errno
import threading
import types

import pytest
import torch

from shardline.ps_server.checkpoint import CheckpointDir
from shardline.ps_server.checkpointer import Checkpointer
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.restore import choose_target, restore_job
from shardline.ps_server.store import JobStore, PushItem, StoreError
from shardline.services.blocks import block_slices
from shardline.services.pb import common_pb2, dispatcher_pb2

BLOCK = 5


def spec(every=None, name="job"):
    s = common_pb2.JobSpec(name=name, sync="bsp", world_size=1, block_elements=BLOCK,
                           optimizer=OptimizerConfig.from_kwargs("adamw", lr=0.01).to_proto())
    s.tensors.add(name="w", shape=[12], dtype="float32", trainable=True)
    s.tensors.add(name="frozen", shape=[4], dtype="float32", trainable=False)
    if every is not None:
        s.checkpoint_every_steps = every
    return s


def new_job(s):
    job = JobStore(s)
    job.uid = "u1"
    items = [("w", sl.index, torch.arange(12.0)[sl.start:sl.stop]) for sl in block_slices(12, BLOCK)]
    items.append(("frozen", 0, torch.ones(4)))
    job.init_blocks(items)
    return job


def step(job, touch=(0, 1, 2)):
    g = torch.randn(12)
    job.push(0, job.step, 1.0, [PushItem("w", i, g[i * BLOCK:(i + 1) * BLOCK].clone()) for i in touch])
    job.commit(0, job.step, 1.0)


def make(tmp_path, every=1, full_every=3, keep=2, **kw):
    ckdir = CheckpointDir(tmp_path / "ck", "n1", **kw)
    return ckdir, Checkpointer(ckdir, "n1", every_steps=every, full_every=full_every, keep=keep, epoch=lambda: 7)


def test_periodic_incremental_chain_restores_the_store(tmp_path):
    ckdir, ckpt = make(tmp_path, every=2)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    ckpt.on_request(job)          # the first non-INIT request: step 0 is checkpointed
    for _ in range(6):
        step(job, touch=(0,))     # only block w[0] changes: incrementals hold just it
    assert ckpt.flush(10)
    infos = ckdir.list("job")
    assert [c.step for c in infos] == [0, 2, 4, 6]
    assert [c.kind for c in infos] == ["full", "incremental", "incremental", "incremental"]
    assert [c.blocks for c in infos] == [4, 1, 1, 1]
    loaded = ckdir.load("job")
    assert loaded.step == 6 and loaded.epoch == 7 and loaded.uid == "u1"
    fresh = JobStore(job.spec)
    fresh.restore(loaded.step, loaded.blocks)
    for key, block in job.blocks.items():
        other = fresh.blocks[key]
        assert other.version == block.version and torch.equal(other.value, block.value)
        if key[0] == "frozen":   # a frozen block keeps no optimizer state
            assert other.state == block.state == {}
            continue
        assert torch.equal(other.state["exp_avg"], block.state["exp_avg"])
        assert torch.equal(other.state["step"], block.state["step"])
    ckpt.close()


def test_full_every_bounds_the_chain_and_job_option_overrides_node(tmp_path):
    ckdir, ckpt = make(tmp_path, every=100, full_every=2)
    job = new_job(spec(every=1))      # the job's own period wins over the node's
    ckpt.attach(job, job.spec)
    for _ in range(5):
        step(job)
    assert ckpt.flush(10)
    assert [c.kind for c in ckdir.list("job")][-5:] == ["full", "incremental", "incremental", "full", "incremental"]
    ckpt.close()


def test_request_now_later_and_past(tmp_path):
    ckdir, ckpt = make(tmp_path, every=0)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    step(job)
    assert ckpt.request("job", 1, timeout=10).step == 1            # at the step: now
    assert ckpt.request("job", 1, timeout=10).bytes_written == 0     # already durable
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", ckpt.request("job", 3, timeout=10)))
    t.start()
    step(job)
    step(job)                                                         # reaches 3: checkpointed at that boundary
    t.join(10)
    assert result["r"].step == 3 and not result["r"].past
    step(job)
    past = ckpt.request("job", 3, timeout=10)
    assert past.past and past.step == 4
    with pytest.raises(StoreError) as err:
        ckpt.request("job", 9, timeout=0.2)
    assert err.value.code == "TIMEOUT" and "step 9" in str(err.value)
    assert [c.step for c in ckdir.list("job")] == [1, 3]
    ckpt.close()


def test_disk_full_fails_the_checkpoint_not_the_training(tmp_path):
    def failpoint(stage):
        if stage == "values.tmp" and fail.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")

    fail = threading.Event()
    ckdir, ckpt = make(tmp_path, every=1, failpoint=failpoint)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    step(job)
    assert ckpt.flush(10)
    fail.set()
    step(job)                      # its checkpoint fails; training goes on
    assert ckpt.flush(10)
    assert ckpt.durable_step("job") == 1
    fail.clear()
    step(job)
    assert ckpt.flush(10)
    assert ckpt.durable_step("job") == 3
    loaded = ckdir.load("job")     # the incremental after the failure still covers step 2's changes
    fresh = JobStore(job.spec)
    fresh.restore(loaded.step, loaded.blocks)
    assert all(torch.equal(fresh.blocks[k].value, b.value) for k, b in job.blocks.items())
    ckpt.close()


def test_checkpoint_now_after_freeze(tmp_path):
    ckdir, ckpt = make(tmp_path, every=0)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    step(job)
    step(job)
    job.freeze("stopping")
    with pytest.raises(StoreError) as err:
        step(job)
    assert err.value.code == "UNAVAILABLE"
    assert ckpt.checkpoint_now("job", timeout=10) == 2
    assert ckpt.checkpoint_now("job", timeout=10) == 2   # nothing changed since
    assert [c.step for c in ckdir.list("job")] == [2]
    ckpt.close()


def info(uid="u1", holders=None, has=True, step=0):
    return dispatcher_pb2.JobInfo(uid=uid, has_checkpoint=has, checkpoint_step=step, durable_steps=holders or {})


def test_choose_target():
    # warm: another node holds the job live at step 9
    assert choose_target(12, live_step=9, info=info(holders={"a": 5, "b": 8}, step=5), node_id="a") == ("warm", {"at_most": 9})
    # cold with several holders: the step they all have
    assert choose_target(12, live_step=None, info=info(holders={"a": 12, "b": 10}, step=10), node_id="a") == ("cold", {"exact": 10})
    # the only holder (or a job the dispatcher does not know): its latest
    assert choose_target(12, live_step=None, info=info(holders={"a": 11}, step=11), node_id="a") == ("single", {})
    assert choose_target(12, live_step=None, info=None, node_id="a") == ("single", {})


def test_cold_restore_rolls_back_and_discards_the_newer_timeline(tmp_path):
    ckdir, ckpt = make(tmp_path, every=1)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    for _ in range(4):
        step(job)
    assert ckpt.flush(10)
    ckpt.close()
    added = {}
    dispatcher_info = info(holders={"n1": 4, "n2": 2}, step=2)
    dispatcher_info.spec.CopyFrom(job.spec)
    report = restore_job(ckdir, "job", node_id="n1", get_job=lambda name: dispatcher_info, restore_job_rpc=None,
                         live_step=lambda name: None,
                         add_job=lambda s, uid, loaded: added.setdefault("loaded", loaded))
    assert report.mode == "cold" and report.step == 2 and added["loaded"].step == 2
    assert [c.step for c in ckdir.list("job")] == [1, 2]   # 3 and 4 belonged to the abandoned run


def test_restore_of_a_recreated_job_removes_the_old_checkpoints(tmp_path):
    ckdir, ckpt = make(tmp_path, every=1)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    step(job)
    assert ckpt.flush(10)
    ckpt.close()
    report = restore_job(ckdir, "job", node_id="n1", get_job=lambda name: info(uid="u2"), restore_job_rpc=None,
                         live_step=lambda name: None, add_job=None)
    assert report.mode == "stale" and report.step is None and ckdir.jobs() == []


def test_restore_registers_a_job_the_dispatcher_lost(tmp_path):
    ckdir, ckpt = make(tmp_path, every=1)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    step(job)
    assert ckpt.flush(10)
    ckpt.close()
    calls = []

    def restore_rpc(s, uid, node_id):
        calls.append((s.name, uid, node_id))
        out = info(uid=uid)
        out.spec.CopyFrom(s)
        return out

    added = {}
    report = restore_job(ckdir, "job", node_id="n1", get_job=lambda name: None, restore_job_rpc=restore_rpc,
                         live_step=lambda name: None,
                         add_job=lambda s, uid, loaded: added.update(spec=s, uid=uid, step=loaded.step))
    assert calls == [("job", "u1", "n1")] and report.step == 1 and added["uid"] == "u1"
    assert list(added["spec"].tensors) == list(job.spec.tensors)


def test_drop_deletes_checkpoints(tmp_path):
    ckdir, ckpt = make(tmp_path, every=1)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    step(job)
    assert ckpt.flush(10)
    ckpt.drop("job")
    assert ckdir.jobs() == [] and ckpt.durable_step("job") is None
    ckpt.close()


def test_node_reports_held_jobs(tmp_path):
    from shardline.ps_server.node import PSNode

    ckdir, ckpt = make(tmp_path, every=1)
    node = PSNode("n1", lambda name: types.SimpleNamespace(spec=spec(), uid="u1"),
                  lambda: common_pb2.RoutingTable(epoch=1), checkpointer=ckpt)
    job = node.job("job")
    job.init_blocks([("w", i, torch.zeros(sl.numel)) for i, sl in enumerate(block_slices(12, BLOCK))]
                    + [("frozen", 0, torch.ones(4))])
    step(job)
    assert ckpt.flush(10)
    (held,) = node.held_jobs()
    assert (held.job, held.uid, held.step, held.has_durable, held.durable_step) == ("job", "u1", 1, True, 1)
    assert node.drop_job("job", uid="other") is False
    assert node.drop_job("job", uid="u1") is True and node.held_jobs() == [] and ckdir.jobs() == []
    ckpt.close()


def test_failed_write_with_snapshots_queued_behind_it(tmp_path):
    """The writer is slow and its first write fails while two more snapshots wait (the second
    diffs against the failed one): training is held back by the backpressure, never broken, and
    the checkpoint after the failure restores the store exactly."""
    go, calls = threading.Event(), []

    def failpoint(stage):
        if stage == "values.tmp":
            calls.append(stage)
            if len(calls) == 2:       # the first write after step 0
                go.wait(10)
                raise OSError(errno.ENOSPC, "No space left on device")

    ckdir, ckpt = make(tmp_path, every=1, failpoint=failpoint)
    job = new_job(spec())
    ckpt.attach(job, job.spec)
    ckpt.on_request(job)
    assert ckpt.flush(10)
    step(job)                     # S1: its write blocks, then fails
    step(job)                     # S2: diffs against S1
    threading.Timer(0.3, go.set).start()
    step(job)                     # waits for the writer (two pending), then S3
    step(job)
    assert ckpt.flush(10)
    assert ckpt.durable_step("job") == 4
    assert 1 not in [c.step for c in ckdir.list("job")] and 2 not in [c.step for c in ckdir.list("job")]
    loaded = ckdir.load("job")
    fresh = JobStore(job.spec)
    fresh.restore(loaded.step, loaded.blocks)
    assert all(torch.equal(fresh.blocks[k].value, b.value) and fresh.blocks[k].version == b.version
               for k, b in job.blocks.items())
    ckpt.close()


def test_a_replica_copy_still_on_its_way_is_not_checkpointed_as_current(tmp_path):
    """A node keeps a replica copy of w[1] (its primary is elsewhere); the primary's copy of a step
    usually arrives after this node's own boundary of that step. A checkpoint of step s holds the
    copy only once it was carried through s: restored at s, a lagging copy (older version, step set
    to s) would pass for current, and in the sync after a whole-cluster restart it overwrote the
    primary's own copy (tests/integration/test_checkpoint_restart.py, kill everything)."""
    ckdir, ckpt = make(tmp_path, every=1, full_every=2, keep=5)
    job = new_job(spec())
    job.set_primary({("w", 0), ("w", 2)}, epoch=1)  # frozen[0] too is a copy: never carried here
    ckpt.attach(job, job.spec)
    replica = job.blocks[("w", 1)]

    def copy_from_primary(version, step):
        value = torch.full((BLOCK,), float(version))
        job.apply_copies([("w", 1, version, step, value, {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                                           for k, v in replica.state.items()})])

    step(job, touch=(0,))             # boundary 1; the primary's copy of step 0 is still on its way
    copy_from_primary(1, 1)
    step(job, touch=(0,))             # boundary 2: the copy is at step 1 (lags again)
    copy_from_primary(2, 2)
    job.carry_copies([(("w", 1), 2, 3)])  # its primary carried it through step 2 unchanged, early
    step(job, touch=(0,))             # boundary 3: the copy is current (version 2, carried to 3)
    assert ckpt.flush(10)
    held = {c: ckdir.load("job", exact=c).blocks for c in (1, 2, 3)}
    assert ("w", 1) not in held[1] and ("w", 1) not in held[2], "a lagging copy was checkpointed as current"
    assert held[3][("w", 1)].version == 2 and torch.equal(held[3][("w", 1)].value, torch.full((BLOCK,), 2.0))
    assert all(("w", i) in held[c] for c in (1, 2, 3) for i in (0, 2))  # the primaries are always there
    # a frozen tensor's copy never changes: held throughout, written once (not again when it is back)
    assert all(("frozen", 0) in held[c] for c in (1, 2, 3))
    assert [c.blocks for c in ckdir.list("job")] == [3, 1, 2]   # full {w0, w2, frozen}; w0; w0 and w1
    restored = JobStore(job.spec)
    restored.restore(2, held[2])
    assert ("w", 1) not in restored.blocks  # synced from its primary, never served or sent stale
    ckpt.close()
