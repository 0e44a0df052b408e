"""JobRegistry: validation, normalization, idempotent creation, conflicts, readiness, incarnations,
holders, tombstones and restarts over a state store."""

from __future__ import annotations

import re
import threading
import time

import pytest

from shardline.dispatcher.jobs import JobRegistry, UnknownJobError
from shardline.dispatcher.state_store import StateStoreError
from shardline.services.blocks import DEFAULT_BLOCK_ELEMENTS
from shardline.services.errors import ShardlineConfigError, ShardlineStateError, ShardlineTimeoutError
from shardline.services.pb import common_pb2, dispatcher_pb2


def make_spec(name: str = "sft-1", **overrides) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(
        name=name,
        optimizer=common_pb2.OptimizerSpec(kind="adamw", lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01),
        sync="bsp",
        world_size=2,
        tensors=[
            common_pb2.TensorSpec(name="layers.0.attn.weight", shape=[64, 64], trainable=True),
            common_pb2.TensorSpec(name="embed/tokens", shape=[100, 64], dtype="float32", trainable=True),
            common_pb2.TensorSpec(name="norm.bias", shape=[0], trainable=False),
        ],
    )
    for key, value in overrides.items():
        if key.startswith("optimizer_"):
            setattr(spec.optimizer, key[len("optimizer_"):], value)
        else:
            setattr(spec, key, value)
    return spec


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def jobs() -> JobRegistry:
    return JobRegistry(clock=FakeClock(), default_replication=2)   # the dispatcher's default


def test_create_normalizes_and_records(jobs):
    record, created = jobs.create(make_spec())
    assert created is True
    assert record.name == "sft-1" and record.ready is False
    assert record.created_unix_ms == 1_700_000_000_000
    assert record.spec.block_elements == DEFAULT_BLOCK_ELEMENTS
    assert [t.dtype for t in record.spec.tensors] == ["float32"] * 3
    assert jobs.get("sft-1").spec == record.spec


def test_identical_create_returns_existing_job(jobs):
    first, _ = jobs.create(make_spec())
    again, created = jobs.create(make_spec())
    assert created is False
    assert again.spec == first.spec and again.created_unix_ms == first.created_unix_ms


def test_spec_equal_after_normalization_is_not_a_conflict(jobs):
    jobs.create(make_spec())
    explicit = make_spec(block_elements=DEFAULT_BLOCK_ELEMENTS)
    for tensor in explicit.tensors:
        tensor.dtype = "float32"
    reordered = make_spec()
    reordered.tensors.reverse()
    assert jobs.create(explicit)[1] is False
    assert jobs.create(reordered)[1] is False


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"sync": "asp"}, "sync"),
        ({"world_size": 4}, "world_size"),
        ({"block_elements": 1024}, "block_elements"),
        ({"allow_nonfinite": True}, "allow_nonfinite"),
        ({"inexact_restarts": True}, "inexact_restarts"),
        ({"replicate_gradients": False}, "replicate_gradients"),   # a BSP job replays by default
        ({"optimizer_lr": 2e-4}, "optimizer.lr"),
        ({"optimizer_kind": "adam"}, "optimizer.kind"),
    ],
)
def test_conflicting_create_names_the_differing_field(jobs, overrides, field):
    jobs.create(make_spec())
    with pytest.raises(ShardlineStateError) as err:
        jobs.create(make_spec(**overrides))
    assert field in str(err.value) and "sft-1" in str(err.value)
    assert not isinstance(err.value, UnknownJobError)


def test_conflicting_tensors_are_named(jobs):
    jobs.create(make_spec())
    reshaped = make_spec()
    reshaped.tensors[1].shape[:] = [101, 64]
    with pytest.raises(ShardlineStateError, match=r"'embed/tokens' shape is \[100, 64\] but the request has \[101, 64\]"):
        jobs.create(reshaped)
    fewer = make_spec()
    del fewer.tensors[2]
    with pytest.raises(ShardlineStateError, match="norm.bias"):
        jobs.create(fewer)
    frozen = make_spec()
    frozen.tensors[0].trainable = False
    with pytest.raises(ShardlineStateError, match="trainable"):
        jobs.create(frozen)


def bad_tensor(**fields) -> common_pb2.JobSpec:
    spec = make_spec()
    spec.tensors.append(common_pb2.TensorSpec(**fields))
    return spec


@pytest.mark.parametrize(
    "spec, fragment",
    [
        (make_spec(name=""), "''"),
        (make_spec(name="has space"), "'has space'"),
        (make_spec(name="a/b"), "'a/b'"),
        (make_spec(name="x" * 129), "xxxx"),
        (make_spec(sync="ssp"), "'ssp'"),          # staleness 0 is BSP: refused, not treated as BSP
        (make_spec(sync="ssp", staleness=17), "17"),
        (make_spec(staleness=2), "staleness 2"),   # staleness with BSP
        (make_spec(world_size=0), "world_size"),
        (make_spec(block_elements=64 * 1024 * 1024 + 1), "67108865"),
        (make_spec(optimizer_kind="lion"), "'lion'"),
        (make_spec(optimizer_kind=""), "optimizer.kind"),
        (make_spec(optimizer_lr=-0.1), "-0.1"),
        (make_spec(optimizer_lr=float("nan")), "nan"),
        (make_spec(optimizer_beta2=1.0), "optimizer.beta2"),
        (make_spec(optimizer_eps=-1e-8), "optimizer.eps"),
        (make_spec(optimizer_weight_decay=-0.01), "optimizer.weight_decay"),
        (bad_tensor(name="bad name!", shape=[1]), "'bad name!'"),
        (bad_tensor(name="", shape=[1]), "''"),
        (bad_tensor(name="t" * 257, shape=[1]), "tttt"),
        (bad_tensor(name="norm.bias", shape=[1]), "'norm.bias'"),
        (bad_tensor(name="neg", shape=[2, -1]), "[2, -1]"),
        (bad_tensor(name="half", shape=[2], dtype="float16"), "'float16'"),
    ],
)
def test_invalid_specs_are_rejected_quoting_the_value(jobs, spec, fragment):
    with pytest.raises(ShardlineConfigError) as err:
        jobs.create(spec)
    assert fragment in str(err.value)
    assert jobs.list() == []


def test_sgd_nesterov_follows_torch_rules(jobs):
    sgd = common_pb2.OptimizerSpec(kind="sgd", lr=0.1, nesterov=True)
    spec = make_spec()
    spec.optimizer.CopyFrom(sgd)
    with pytest.raises(ShardlineConfigError, match="nesterov"):
        jobs.create(spec)
    spec.optimizer.momentum = 0.9
    assert jobs.create(spec)[1] is True


def test_missing_optimizer_is_rejected(jobs):
    spec = make_spec()
    spec.ClearField("optimizer")
    with pytest.raises(ShardlineConfigError, match="optimizer.kind"):
        jobs.create(spec)


def test_records_are_copies(jobs):
    record, _ = jobs.create(make_spec())
    record.spec.world_size = 99
    assert jobs.get("sft-1").spec.world_size == 2


def test_get_unknown_job_raises_not_found_error(jobs):
    with pytest.raises(UnknownJobError, match="'nope'"):
        jobs.get("nope")
    with pytest.raises(UnknownJobError):
        jobs.mark_ready("nope")
    with pytest.raises(UnknownJobError):
        jobs.wait_ready("nope", 0.0)


def test_mark_ready_is_idempotent(jobs):
    jobs.create(make_spec())
    assert jobs.mark_ready("sft-1").ready is True
    assert jobs.mark_ready("sft-1").ready is True
    assert jobs.get("sft-1").ready is True


def test_wait_ready_times_out(jobs):
    jobs.create(make_spec())
    with pytest.raises(ShardlineTimeoutError, match="sft-1"):
        jobs.wait_ready("sft-1", 0.0)
    start = time.monotonic()
    with pytest.raises(ShardlineTimeoutError):
        jobs.wait_ready("sft-1", 0.1)
    assert 0.09 <= time.monotonic() - start < 2.0


def test_wait_ready_wakes_when_marked(jobs):
    jobs.create(make_spec())
    results: list = []
    waiters = [threading.Thread(target=lambda: results.append(jobs.wait_ready("sft-1", 10.0))) for _ in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    start = time.monotonic()
    jobs.mark_ready("sft-1")
    for w in waiters:
        w.join(timeout=5)
    assert time.monotonic() - start < 1.0
    assert [r.ready for r in results] == [True, True, True]


def test_wait_ready_on_ready_job_returns_at_once(jobs):
    jobs.create(make_spec())
    jobs.mark_ready("sft-1")
    assert jobs.wait_ready("sft-1", 0.0).ready is True


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf")])
def test_wait_ready_rejects_bad_timeout(jobs, timeout):
    jobs.create(make_spec())
    with pytest.raises(ShardlineConfigError, match="timeout"):
        jobs.wait_ready("sft-1", timeout)


def test_list_is_sorted_by_name(jobs):
    for name in ("b-job", "a-job", "c.job"):
        jobs.create(make_spec(name=name))
    assert [r.name for r in jobs.list()] == ["a-job", "b-job", "c.job"]


def test_concurrent_creates_have_exactly_one_creator(jobs):
    barrier = threading.Barrier(8)
    created: list[bool] = []

    def create() -> None:
        barrier.wait()
        created.append(jobs.create(make_spec())[1])

    threads = [threading.Thread(target=create) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert sorted(created) == [False] * 7 + [True]


# --- incarnations, holders, tombstones and restarts -----------------------------------------------

def held(job: str, uid: str, durable: int | None = None) -> dispatcher_pb2.HeldJob:
    return dispatcher_pb2.HeldJob(job=job, uid=uid, step=(durable or 0) + 1, has_durable=durable is not None,
                                  durable_step=durable or 0)


def test_each_incarnation_gets_its_own_uid(jobs):
    first, _ = jobs.create(make_spec())
    assert re.fullmatch(r"[0-9a-f]{16}", first.uid)
    assert jobs.create(make_spec())[0].uid == first.uid  # the same incarnation
    assert jobs.delete("sft-1").uid == first.uid
    with pytest.raises(UnknownJobError):
        jobs.get("sft-1")
    with pytest.raises(UnknownJobError, match="'sft-1'"):
        jobs.delete("sft-1")
    second, created = jobs.create(make_spec())
    assert created and second.uid != first.uid and second.ready is False


def test_checkpoint_step_is_the_least_durable_step_of_the_holders(jobs):
    uid = jobs.create(make_spec())[0].uid
    record = jobs.get("sft-1")
    assert (record.has_checkpoint, record.checkpoint_step, record.durable_steps) == (False, 0, {})  # no holder
    jobs.report_held("ps-0", [held("sft-1", uid, 7)], record=True)
    jobs.report_held("ps-1", [held("sft-1", uid)], record=True)
    record = jobs.get("sft-1")
    assert dict(record.holders) == {"ps-0": 7, "ps-1": None}
    assert (record.has_checkpoint, record.checkpoint_step, record.durable_steps) == (False, 0, {"ps-0": 7})
    jobs.report_held("ps-1", [held("sft-1", uid, 5)], record=True)
    record = jobs.get("sft-1")
    assert (record.has_checkpoint, record.checkpoint_step, record.durable_steps) == (True, 5, {"ps-0": 7, "ps-1": 5})
    with pytest.raises(TypeError):
        record.holders["ps-9"] = 1  # type: ignore[index]  # read-only snapshot


def test_heartbeat_reports_set_holders_and_checkpoint_steps(recording_store):
    jobs = JobRegistry(clock=FakeClock(), store=recording_store)
    a = jobs.create(make_spec("a"))[0].uid
    b = jobs.create(make_spec("b"))[0].uid
    assert jobs.report_held("ps-0", [held("a", a, 3), held("b", b)], record=True) == ([], {"a": 3})
    writes = len(recording_store.applies)
    assert jobs.report_held("ps-0", [held("a", a, 3), held("b", b)], record=True) == ([], {"a": 3})
    assert len(recording_store.applies) == writes  # nothing changed: nothing written
    # A node that no longer lists a job stops being its holder; an unregistered node changes nothing.
    assert jobs.report_held("ps-0", [held("a", a, 4)], record=True) == ([], {"a": 4})
    assert dict(jobs.get("b").holders) == {}
    assert jobs.report_held("ps-1", [held("a", a)], record=False) == ([], {"a": 4})
    assert dict(jobs.get("a").holders) == {"ps-0": 4}
    assert len(recording_store.applies) == writes + 1  # one write for both jobs' changes


def test_drop_decisions(jobs):
    old = jobs.create(make_spec("re"))[0].uid
    jobs.delete("re")
    new = jobs.create(make_spec("re"))[0].uid
    gone = jobs.create(make_spec("gone"))[0].uid
    jobs.delete("gone")
    live = jobs.create(make_spec("live"))[0].uid
    cases = [
        (held("re", old, 2), ["re"], {}),                 # a replaced incarnation
        (held("re", new, 2), [], {"re": 2}),              # the current one under that name
        (held("gone", gone, 1), ["gone"], {}),            # deleted
        (held("live", "f" * 16, 1), ["live"], {}),        # the name now has another uid
        (held("live", live, 1), [], {"live": 1}),
        (held("lost", "0123456789abcdef", 9), [], {}),    # name and uid unknown (state lost): keep
        (held("live", "", 1), [], {}),                    # incarnation unknown: never dropped
    ]
    for item, drop, steps in cases:
        assert jobs.report_held("ps-0", [item], record=True) == (drop, steps), item


def test_restart_brings_back_jobs_holders_and_tombstones(recording_store):
    clock = FakeClock()
    jobs = JobRegistry(clock=clock, store=recording_store)
    spec = make_spec("a", checkpoint_every_steps=0)  # an explicit 0 (never) differs from unset
    a, _ = jobs.create(spec)
    jobs.mark_ready("a")
    b, _ = jobs.create(make_spec("b", sync="asp"))
    jobs.report_held("ps-0", [held("a", a.uid, 6), held("b", b.uid)], record=True)
    deleted = jobs.create(make_spec("c"))[0].uid
    jobs.delete("c")

    again = JobRegistry(clock=clock, store=recording_store)
    assert [(r.name, r.ready, r.uid, r.created_unix_ms, dict(r.holders)) for r in again.list()] == [
        ("a", True, a.uid, a.created_unix_ms, {"ps-0": 6}),
        ("b", False, b.uid, b.created_unix_ms, {"ps-0": None}),
    ]
    assert again.get("a").spec == a.spec and again.get("a").spec.HasField("checkpoint_every_steps")
    assert again.get("b").spec == b.spec
    assert again.create(make_spec("a", checkpoint_every_steps=0))[1] is False
    assert again.report_held("ps-1", [held("c", deleted)], record=True)[0] == ["c"]
    with pytest.raises(ShardlineStateError, match="deleted"):
        again.restore(make_spec("c"), deleted, "ps-1")


def test_restore_rules(jobs):
    existing, _ = jobs.create(make_spec("have"))
    record, restored = jobs.restore(make_spec("have"), "1111111111111111", "ps-0")
    assert restored is False and record.uid == existing.uid  # the node compares uids itself
    gone = jobs.create(make_spec("gone"))[0].uid
    jobs.delete("gone")
    with pytest.raises(ShardlineStateError) as err:
        jobs.restore(make_spec("gone"), gone, "ps-0")
    assert "'gone'" in str(err.value) and "deleted" in str(err.value) and not isinstance(err.value, UnknownJobError)
    spec = make_spec("lost", block_elements=0)
    record, restored = jobs.restore(spec, "abcdef0123456789", "ps-0")
    assert restored is True and record.uid == "abcdef0123456789" and record.ready is True
    assert record.spec.block_elements == DEFAULT_BLOCK_ELEMENTS  # normalized
    assert jobs.wait_ready("lost", 0.0).ready is True


@pytest.mark.parametrize("uid, node_id, fragment", [("", "ps-0", "uid"), ("a b", "ps-0", "'a b'"),
                                                    ("abc", "bad node", "'bad node'")])
def test_restore_rejects_bad_arguments(jobs, uid, node_id, fragment):
    with pytest.raises(ShardlineConfigError, match=fragment):
        jobs.restore(make_spec(), uid, node_id)
    assert jobs.list() == []


def test_deleting_a_job_fails_its_waiters(jobs):
    jobs.create(make_spec())
    errors: list = []

    def wait() -> None:
        try:
            jobs.wait_ready("sft-1", 10.0)
        except UnknownJobError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    jobs.delete("sft-1")
    jobs.create(make_spec())  # a new incarnation does not satisfy a waiter of the old one
    waiter.join(timeout=5)
    assert errors and "deleted" in str(errors[0])


def test_failed_writes_change_nothing(recording_store):
    jobs = JobRegistry(clock=FakeClock(), store=recording_store)
    uid = jobs.create(make_spec("a"))[0].uid
    recording_store.failing = True
    with pytest.raises(StateStoreError, match="/state/dispatcher.db"):
        jobs.create(make_spec("b"))
    with pytest.raises(StateStoreError):
        jobs.mark_ready("a")
    with pytest.raises(StateStoreError):
        jobs.report_held("ps-0", [held("a", uid, 1)], record=True)
    with pytest.raises(StateStoreError):
        jobs.delete("a")
    with pytest.raises(StateStoreError):
        jobs.restore(make_spec("c"), "abcdef0123456789", "ps-0")
    assert [(r.name, r.ready, dict(r.holders)) for r in jobs.list()] == [("a", False, {})]
    jobs.report_held("ps-0", [], record=True)  # no change, no write: still fine
    recording_store.failing = False
    assert JobRegistry(store=recording_store).get("a").uid == uid


@pytest.mark.parametrize(
    "mutate, fragment",
    [
        (lambda v: v.pop("uid"), "'uid'"),
        (lambda v: v.update(uid="no spaces allowed"), "'no spaces allowed'"),
        (lambda v: v["spec"].update(sync="gossip"), "'gossip'"),
        (lambda v: v["spec"].update(name="other"), "'other'"),
        (lambda v: v.update(holders={"ps-0": -1}), "-1"),
        (lambda v: v.update(ready="yes"), "'yes'"),
    ],
)
def test_a_bad_stored_job_is_named(recording_store, mutate, fragment):
    JobRegistry(store=recording_store).create(make_spec("a"))
    value = recording_store.load()["job/a"]
    mutate(value)
    recording_store.apply({"job/a": value})
    with pytest.raises(StateStoreError) as err:
        JobRegistry(store=recording_store)
    assert "'job/a'" in str(err.value) and fragment in str(err.value)


def grouped_spec(*groups: common_pb2.OptimizerSpec, tensor_group: int = 1) -> common_pb2.JobSpec:
    spec = make_spec()
    spec.param_groups.extend(groups)
    spec.optimizer.CopyFrom(groups[0])
    spec.tensors[1].group = tensor_group
    return spec


ADAMW = dict(kind="adamw", lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8)


def test_param_groups_are_validated_and_compared(jobs):
    ok = grouped_spec(common_pb2.OptimizerSpec(weight_decay=0.01, **ADAMW),
                      common_pb2.OptimizerSpec(weight_decay=0.0, **{**ADAMW, "lr": 1e-5}))
    record, created = jobs.create(ok)
    assert created and len(record.spec.param_groups) == 2 and record.spec.tensors[1].group == 1
    other = grouped_spec(common_pb2.OptimizerSpec(weight_decay=0.01, **ADAMW),
                         common_pb2.OptimizerSpec(weight_decay=0.1, **{**ADAMW, "lr": 1e-5}))
    with pytest.raises(ShardlineStateError, match=r"param_groups\[1\].weight_decay"):
        jobs.create(other)


@pytest.mark.parametrize("spec, fragment", [
    (grouped_spec(common_pb2.OptimizerSpec(**ADAMW), common_pb2.OptimizerSpec(**{**ADAMW, "lr": -1.0})),
     "param_groups[1].lr"),
    (grouped_spec(common_pb2.OptimizerSpec(**ADAMW), common_pb2.OptimizerSpec(**{**ADAMW, "kind": "sgd"})),
     "every group uses the job's optimizer"),
    (grouped_spec(common_pb2.OptimizerSpec(**ADAMW), common_pb2.OptimizerSpec(amsgrad=True, **ADAMW)),
     "amsgrad"),
    (grouped_spec(common_pb2.OptimizerSpec(**ADAMW), common_pb2.OptimizerSpec(**ADAMW), tensor_group=2),
     "names parameter group 2, the job has 2"),
])
def test_invalid_param_groups_are_refused_saying_why(jobs, spec, fragment):
    with pytest.raises(ShardlineConfigError) as err:
        jobs.create(spec)
    assert fragment in str(err.value)
