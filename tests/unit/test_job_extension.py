"""Job revisions (a parameter group added during training): the dispatcher's state change
(validation, idempotence, conflicting requests, durability), a PS node's JobStore extension and
catch-up on frames naming a newer revision, and checkpoints of an extended job."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from google.protobuf.json_format import MessageToDict, ParseDict

from shardline.dispatcher.jobs import JobRegistry
from shardline.dispatcher.state_sqlite import SqliteStateStore
from shardline.ps_server.checkpoint import CheckpointDir, JobSnapshot, BlockSnapshot
from shardline.ps_server.node import PSNode
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import JobStore, PushItem, StoreError
from shardline.services import frame
from shardline.services.blocks import block_slices
from shardline.services.errors import ShardlineConfigError, ShardlineStateError, ShardlineTimeoutError
from shardline.services.extension import apply_extension
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp

BLOCK = 4


def base_spec(name="ft", **overrides) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name=name, sync="bsp", world_size=2, block_elements=BLOCK,
                              optimizer=OptimizerConfig.from_kwargs("adamw", lr=0.01, weight_decay=0.1).to_proto())
    spec.tensors.add(name="head", shape=[6], dtype="float32", trainable=True)
    spec.tensors.add(name="body", shape=[5], dtype="float32", trainable=False)
    spec.tensors.add(name="embed", shape=[3], dtype="float32", trainable=False)
    for key, value in overrides.items():
        setattr(spec, key, value)
    return spec


def extension(revision=1, step=3, unfreeze=("body",), new=(("adapter", [7]),), raw=None,
              **group) -> common_pb2.JobExtension:
    hyper = {"lr": 0.002, "weight_decay": 0.0, **group}
    ext = common_pb2.JobExtension(revision=revision, step=step, unfreeze=list(unfreeze),
                                  group=OptimizerConfig.from_kwargs("adamw", **hyper).to_proto())
    for key, value in (raw or {}).items():  # values the client-side checks would refuse
        setattr(ext.group, key, value)
    for name, shape in new:
        ext.tensors.add(name=name, shape=shape, dtype="float32", trainable=True)
    return ext


def ready_job(jobs: JobRegistry, spec=None):
    record, created = jobs.create(spec or base_spec())
    assert created
    return jobs.mark_ready(record.name)


# --- the dispatcher's state change -----------------------------------------------------------
def test_extend_makes_the_next_revision_and_every_rank_asking_again_gets_it():
    jobs = JobRegistry()
    uid = ready_job(jobs).uid
    record, applied = jobs.extend("ft", uid, extension())
    assert applied
    spec = record.spec
    assert len(spec.extensions) == 1 and record.ready_revision == 0, "new tensors: ready once initialized"
    assert [g.lr for g in spec.param_groups] == [pytest.approx(0.01), pytest.approx(0.002)]
    by_name = {t.name: t for t in spec.tensors}
    assert (by_name["body"].trainable, by_name["body"].group) == (True, 1)
    assert (by_name["adapter"].trainable, by_name["adapter"].group, by_name["adapter"].dtype) == (True, 1, "float32")
    assert (by_name["embed"].trainable, by_name["head"].group) == (False, 0)
    assert jobs.incarnations() == {"ft": (uid, 1)}
    again, applied = jobs.extend("ft", uid, extension())
    assert not applied and again.spec == spec
    assert jobs.mark_ready("ft", 1).ready_revision == 1
    only_unfreeze, applied = jobs.extend("ft", uid, extension(revision=2, step=5, unfreeze=("embed",), new=()))
    assert applied and only_unfreeze.ready_revision == 2, "nothing to initialize: ready at once"


@pytest.mark.parametrize("ext, fragment", [
    (extension(step=4), "it starts at step 3, this request at step 4"),
    (extension(lr=0.003), "its group's lr is 0.002, this request's 0.003"),
    (extension(unfreeze=()), "it unfreezes ['body'], this request []"),
    (extension(new=(("adapter", [8]),)), "it adds tensors"),
])
def test_a_different_request_for_a_made_revision_is_refused_naming_the_difference(ext, fragment):
    jobs = JobRegistry()
    ready_job(jobs)
    jobs.extend("ft", "", extension())
    with pytest.raises(ShardlineStateError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        jobs.extend("ft", "", ext)


@pytest.mark.parametrize("ext, fragment", [
    (extension(unfreeze=("head",)), "already trains in parameter group 0"),
    (extension(unfreeze=("nope",)), "has no tensor 'nope' to unfreeze"),
    (extension(unfreeze=("body", "body")), "unfrozen more than once"),
    (extension(new=(("head", [6]),)), "already has a tensor 'head'"),
    (extension(new=(("a", [1]), ("a", [1]))), "appears more than once"),
    (extension(unfreeze=(), new=()), "without tensors"),
    (extension(amsgrad=True), "amsgrad"),
    (extension(raw={"lr": -1.0}), "param_groups\\[1\\].lr"),
    (extension(new=(("bad name!", [1]),)), "bad name!"),
])
def test_an_extension_that_does_not_fit_the_job_is_refused_quoting_it(ext, fragment):
    jobs = JobRegistry()
    ready_job(jobs)
    with pytest.raises(ShardlineConfigError, match=fragment):
        jobs.extend("ft", "", ext)
    assert not jobs.get("ft").spec.extensions, "a refused extension changes nothing"


def test_revisions_in_order_of_the_job_uid_ready_and_bsp():
    jobs = JobRegistry()
    uid = ready_job(jobs).uid
    with pytest.raises(ShardlineStateError, match="is at revision 0; the request makes revision 2"):
        jobs.extend("ft", uid, extension(revision=2))
    with pytest.raises(ShardlineStateError, match="is now uid"):
        jobs.extend("ft", "another-uid", extension())
    jobs.create(base_spec(name="fresh"))
    with pytest.raises(ShardlineStateError, match="not ready yet"):
        jobs.extend("fresh", "", extension())
    ready_job(jobs, base_spec(name="async", sync="asp"))
    with pytest.raises(ShardlineConfigError, match="only to BSP jobs"):
        jobs.extend("async", "", extension())
    jobs.extend("ft", uid, extension())
    with pytest.raises(ShardlineConfigError, match="before revision 1's step 3"):
        jobs.extend("ft", uid, extension(revision=2, step=2, unfreeze=("embed",), new=()))


def test_wait_ready_of_a_revision_waits_for_its_initializer():
    jobs = JobRegistry()
    ready_job(jobs)
    jobs.extend("ft", "", extension())
    with pytest.raises(ShardlineTimeoutError, match="revision 1 of job 'ft'"):
        jobs.wait_ready("ft", 0.05, revision=1)
    threading.Timer(0.1, lambda: jobs.mark_ready("ft", 1)).start()
    assert jobs.wait_ready("ft", 5.0, revision=1).ready_revision == 1
    with pytest.raises(ShardlineStateError, match="no revision 2"):
        jobs.mark_ready("ft", 2)


def test_workers_that_start_after_the_change_pass_the_groups_the_job_has_now():
    jobs = JobRegistry()
    ready_job(jobs)
    extended, _ = jobs.extend("ft", "", extension())
    with pytest.raises(ShardlineStateError, match="revision 1: parameter groups were added during training"):
        jobs.create(base_spec())
    request = common_pb2.JobSpec()
    request.CopyFrom(extended.spec)
    del request.extensions[:]
    record, created = jobs.create(request)
    assert not created and len(record.spec.extensions) == 1


def test_a_revision_is_durable_across_a_registry_reload(tmp_path):
    store = SqliteStateStore(str(tmp_path))
    jobs = JobRegistry(store=store)
    uid = ready_job(jobs).uid
    made, _ = jobs.extend("ft", uid, extension())
    jobs.mark_ready("ft", 1)
    store.close()
    again = JobRegistry(store=SqliteStateStore(str(tmp_path)))
    record = again.get("ft")
    assert record.spec == made.spec and record.ready_revision == 1 and record.uid == uid
    assert not again.extend("ft", uid, extension())[1], "the same request after the reload: the revision it made"
    with pytest.raises(ShardlineStateError, match="made by another request"):
        again.extend("ft", uid, extension(step=9))


# --- a PS node's store ---------------------------------------------------------------------------
def values(spec: common_pb2.JobSpec, names=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    items = []
    for t in spec.tensors:
        if names is not None and t.name not in names:
            continue
        flat = torch.randn(math.prod(t.shape), generator=gen)
        items += [(t.name, s.index, flat[s.start:s.stop]) for s in block_slices(flat.numel(), BLOCK)]
    return items


def train(store: JobStore, names, seed=1):
    gen = torch.Generator().manual_seed(seed + store.step)
    step = store.step
    for rank in (0, 1):
        store.push(rank, step, 1.0, [PushItem(t, i, torch.randn(b.value.numel(), generator=gen))
                                     for (t, i), b in sorted(store.blocks.items()) if t in names])
    lrs = tuple(g.lr for g in store.spec.param_groups) or None
    for rank in (0, 1):
        store.commit(rank, step, 1.0, lr=lrs)


def test_the_store_takes_the_new_tensors_the_unfrozen_ones_and_the_new_groups_optimizer():
    store = JobStore(base_spec())
    store.init_blocks(values(store.spec))
    train(store, {"head"})
    with pytest.raises(StoreError, match="frozen"):
        train(store, {"body"})
    body_before = {k: (b.value.clone(), dict(b.state)) for k, b in store.blocks.items() if k[0] == "body"}
    new = apply_extension(store.spec, extension(step=store.step))
    assert store.extend(new) and store.revision == 1 and not store.extend(new)
    assert len(store.group_optimizers) == 2 and store.tensors["body"].group == 1 and store.tensors["body"].trainable
    assert store.tensors["adapter"].blocks == 2
    store.init_blocks(values(new, {"adapter"}))
    for key, (value, state) in body_before.items():
        assert torch.equal(store.blocks[key].value, value) and int(store.blocks[key].state["step"]) == 0, \
            "a frozen tensor's blocks start their group with a fresh state"
    train(store, {"head", "body", "adapter"})
    assert all(int(b.state["step"]) == 1 for k, b in store.blocks.items() if k[0] in ("body", "adapter"))
    other = apply_extension(base_spec(), extension(step=0, unfreeze=("embed",), new=()))
    with pytest.raises(StoreError, match="does not continue the revisions"):
        JobStore(new).extend(apply_extension(other, extension(revision=2, step=9, unfreeze=("body",), new=())))


def test_a_rank_behind_the_revision_is_refused_from_the_revisions_step_on():
    store = JobStore(apply_extension(base_spec(), extension(step=3)))
    store.check_revision(0, 2, 0, "commit")   # a step before the revision: a late resend, fine
    store.check_revision(0, 3, 1, "commit")
    with pytest.raises(StoreError, match="rank 1's push of step 3 is at revision 0 .* before step 3"):
        store.check_revision(1, 3, 0, "push")


class Dispatcher:
    """What a PS node asks the dispatcher: the job as it is now (counted)."""

    def __init__(self, spec):
        self.info = dispatcher_pb2.JobInfo(spec=spec, uid="u1", ready=True)
        self.asked = 0

    def __call__(self, name):
        self.asked += 1
        return self.info


def one_node(spec) -> tuple[PSNode, Dispatcher]:
    dispatcher = Dispatcher(spec)
    table = common_pb2.RoutingTable(epoch=1, default_replication=1)
    table.nodes.add(node_id="ps1", rack="default", grpc_address="x:1", data_address="ps1:1", vnodes=16)
    node = PSNode("ps1", dispatcher, lambda: table)
    node.refresh_routing()
    return node, dispatcher


def header(op, job="ft", revision=0, **fields):
    return frame.FrameHeader(op=op, request_id=1, job=job, epoch=1, revision=revision, **fields)


def test_a_frame_naming_a_newer_revision_makes_the_node_extend_the_job():
    node, dispatcher = one_node(base_spec())
    job = node.job("ft")
    job.init_blocks(values(job.spec))
    dispatcher.info.spec.CopyFrom(apply_extension(base_spec(), extension(step=0)))
    ref = dp.BlockRef(tensor="adapter", index=1, dtype=dp.FLOAT32, numel=3, nbytes=12)
    with pytest.raises(StoreError, match="no tensor 'adapter'"):
        node.precheck(header(dp.OP_INIT, blocks=[ref], payload_bytes=12))   # revision 0: nothing to learn
    node.precheck(header(dp.OP_INIT, revision=1, blocks=[ref], payload_bytes=12))
    assert job.revision == 1 and "adapter" in job.tensors and job.tensors["body"].trainable
    with pytest.raises(StoreError, match="every rank must add the same parameter group"):
        node.precheck(header(dp.OP_COMMIT, step=0, rank=1, revision=0))
    asked = dispatcher.asked
    for _ in range(3):  # a revision the dispatcher lacks: refused, asked about at most once a second
        with pytest.raises(StoreError, match="names revision 2 of job 'ft'; the dispatcher has revision 1"):
            node.precheck(header(dp.OP_PULL, revision=2))
    assert dispatcher.asked == asked + 1


def test_a_ring_change_holds_every_job_at_the_revision_the_dispatcher_lists():
    """A heartbeat's reply during a ring change lists each job's revision: a node holding an older
    one takes the newer spec (the new tensors' blocks are then among those it syncs), and its
    heartbeat reports the revision it holds."""
    node, dispatcher = one_node(base_spec())
    job = node.job("ft")
    dispatcher.info.spec.CopyFrom(apply_extension(base_spec(), extension(step=0)))
    node.hold_jobs(["ft"], {"ft": 0})
    assert job.revision == 0 and dispatcher.asked == 1, "the revision held: nothing to ask"
    node.hold_jobs(["ft"], {"ft": 1})
    assert job.revision == 1 and "adapter" in job.tensors
    assert [(h.job, h.revision) for h in node.held_jobs()] == [("ft", 1)]


def test_a_job_the_ring_change_lists_is_held_though_the_node_missed_it_before():
    """A request that named the job before it was created left a remembered miss; the job list
    of a heartbeat's reply is the dispatcher's word that it exists now."""
    node, _dispatcher = one_node(base_spec())
    node.name_misses.add("ft")
    node.hold_jobs(["ft"], {"ft": 0})
    assert node.store.get("ft") is not None


def test_a_ring_change_waits_for_every_node_to_hold_an_extended_jobs_revision(grpc_context):
    """The dispatcher counts a node's pending-ring readiness only at the job's current revision,
    and an extension made while the change is pending takes the reports made before it back."""
    from shardline.dispatcher.membership import Membership
    from shardline.dispatcher.server import DispatcherServicer

    m = Membership(5.0, has_data=lambda: True)
    for i, node_id in enumerate(("ps-0", "ps-1")):
        m.register(node_id, "r", f"127.0.0.1:{9000 + 2 * i}", f"127.0.0.1:{9001 + 2 * i}", 1.0, now=0.0)
    jobs = JobRegistry()
    uid = ready_job(jobs).uid
    servicer = DispatcherServicer(m, jobs, heartbeat_interval=0.5, clock=lambda: 0.0)
    pending = m.snapshot().pending_epoch

    def beat(node_id, revision):
        held = [dispatcher_pb2.HeldJob(job="ft", uid=uid, revision=revision)]
        return servicer.Heartbeat(dispatcher_pb2.HeartbeatRequest(node_id=node_id, ready_epoch=pending, jobs=held),
                                  grpc_context)

    assert dict(beat("ps-0", 0).job_revisions) == {"ft": 0}
    servicer.ExtendJob(dispatcher_pb2.ExtendJobRequest(name="ft", uid=uid, extension=extension()), grpc_context)
    reply = beat("ps-1", 1)
    assert m.snapshot().pending_epoch == pending, "switched on ps-0's report from before the extension"
    assert list(reply.jobs) == ["ft"] and dict(reply.job_revisions) == {"ft": 1}
    beat("ps-0", 0)
    assert m.snapshot().pending_epoch == pending, "switched while ps-0 held revision 0 of a job at revision 1"
    beat("ps-0", 1)
    assert m.snapshot().pending_epoch == 0


# --- checkpoints -----------------------------------------------------------------------------------
def snapshot(store: JobStore) -> JobSnapshot:
    step, held, copies = store.snapshot()
    return JobSnapshot(job="ft", uid="u1", node_id="ps1", epoch=1, step=step,
                       spec=MessageToDict(store.spec, preserving_proto_field_name=True), held=held,
                       blocks=[BlockSnapshot(*c) for c in copies], full=True, base_step=None)


def test_checkpoints_carry_the_spec_of_their_step_and_restore_with_it(tmp_path):
    store = JobStore(base_spec())
    store.init_blocks(values(store.spec))
    train(store, {"head"})
    ckdir = CheckpointDir(tmp_path, "ps1")
    ckdir.write(snapshot(store))                 # step 1, before the revision
    store.extend(apply_extension(store.spec, extension(step=store.step)))
    store.init_blocks(values(store.spec, {"adapter"}))
    train(store, {"head", "body", "adapter"})
    ckdir.write(snapshot(store))                 # step 2, after it

    loaded = ckdir.load("ft")
    spec = ParseDict(loaded.spec, common_pb2.JobSpec())
    assert loaded.step == 2 and len(spec.extensions) == 1
    restored = JobStore(spec)
    restored.restore(loaded.step, loaded.blocks)
    assert set(restored.blocks) == set(store.blocks)
    for key, block in store.blocks.items():
        assert torch.equal(restored.blocks[key].value, block.value)
        assert all(torch.equal(torch.as_tensor(restored.blocks[key].state[k]), torch.as_tensor(v))
                   for k, v in block.state.items())
    train(restored, {"head", "body", "adapter"})   # it trains on at its revision, groups and all
    train(store, {"head", "body", "adapter"})
    assert all(torch.equal(restored.blocks[k].value, b.value) for k, b in store.blocks.items())

    old = ckdir.load("ft", at_most=1)
    old_spec = ParseDict(old.spec, common_pb2.JobSpec())
    assert old.step == 1 and not old_spec.extensions, "a checkpoint from before the revision has the old spec"
    before = JobStore(old_spec)
    before.restore(old.step, old.blocks)
    assert before.extend(spec) and before.tensors["body"].trainable, "and the node extends it when asked"
