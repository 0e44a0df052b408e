"""Gradient replay as the default replication, decided from the PS nodes' build fingerprints
(dispatcher/replay_policy.py, services/build_fingerprint.py; docs/architecture.md, "Replication").

The rules, pure and through the dispatcher's servicer: a BSP or SSP job that does not say replays
on nodes of one fingerprint and gets copies on nodes of different ones; ASP and an explicit False
get copies; an explicit True on nodes of different fingerprints is refused at creation; a node of
another fingerprint is refused registration while a job replays.
"""

from __future__ import annotations

import platform

import grpc
import logging

import pytest
import torch

from shardline.dispatcher import replay_policy
from shardline.dispatcher.jobs import JobRegistry
from shardline.dispatcher.membership import Membership
from shardline.dispatcher.server import DispatcherServicer
from shardline.services import build_fingerprint
from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2, dispatcher_pb2

A = "torch=2.13.0+cpu;git=aaaa;config=1111;cpu=AVX2;python=3.11.7;machine=x86_64"
B = "torch=2.13.0+cpu;git=aaaa;config=1111;cpu=AVX512;python=3.11.7;machine=x86_64"


def spec(sync="bsp", replicate=None, name="j") -> common_pb2.JobSpec:
    out = common_pb2.JobSpec(name=name, sync=sync, world_size=2, staleness=2 if sync == "ssp" else 0,
                             optimizer=common_pb2.OptimizerSpec(kind="adamw", lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8))
    out.tensors.add(name="w", shape=[4], dtype="float32", trainable=True)
    if replicate is not None:
        out.replicate_gradients = replicate
    return out


# --- the fingerprint ---------------------------------------------------------------------------

def test_the_fingerprint_names_what_decides_how_a_step_is_computed(monkeypatch):
    monkeypatch.delenv(build_fingerprint.OVERRIDE_ENV, raising=False)
    fields = dict(part.split("=", 1) for part in build_fingerprint.compute().split(";"))
    assert fields["torch"] == torch.__version__
    assert fields["cpu"] == torch.backends.cpu.get_cpu_capability()
    assert fields["python"] == platform.python_version() and fields["machine"] == platform.machine()
    assert len(fields["config"]) == 12 and fields["git"] == torch.version.git_version[:12]
    assert build_fingerprint.compute() == build_fingerprint.compute()
    assert build_fingerprint.validate(build_fingerprint.compute())


def test_the_override_replaces_it_and_is_validated(monkeypatch):
    build_fingerprint.fingerprint.cache_clear()
    try:
        monkeypatch.setenv(build_fingerprint.OVERRIDE_ENV, "emulated-build-2")
        assert build_fingerprint.fingerprint() == "emulated-build-2"
        build_fingerprint.fingerprint.cache_clear()
        monkeypatch.setenv(build_fingerprint.OVERRIDE_ENV, "bad\nbuild")
        with pytest.raises(ShardlineConfigError, match=r"'bad\\nbuild'"):
            build_fingerprint.fingerprint()
    finally:
        build_fingerprint.fingerprint.cache_clear()
    for bad in ("x" * 257, "tab\there", 3):
        assert not build_fingerprint.valid(bad)
    assert build_fingerprint.valid("")


# --- the rules, pure ------------------------------------------------------------------------------

@pytest.mark.parametrize("sync, prints, want", [
    ("bsp", {"ps0": A, "ps1": A}, True),
    ("ssp", {"ps0": A, "ps1": A}, True),
    ("bsp", {}, True),                      # no node yet: a node that registers later is checked then
    ("asp", {"ps0": A, "ps1": A}, False),   # ASP steps a block again at every push: copies
    ("bsp", {"ps0": A, "ps1": B}, False),   # different builds: copies
    ("ssp", {"ps0": A, "ps1": B}, False),
    ("bsp", {"ps0": A, "ps1": ""}, False),  # a node that reports none: not detected, not assumed
])
def test_a_job_that_does_not_say_gets_the_default(sync, prints, want):
    out, why = replay_policy.resolve(spec(sync), prints)
    assert out.HasField("replicate_gradients") and out.replicate_gradients is want and why
    assert replay_policy.replays(out) is want
    assert replay_policy.copies_by_default(out) is (sync != "asp" and not want)


def test_a_job_of_one_copy_per_block_replicates_nothing_to_replay_unless_it_asks(caplog):
    """Replication 1: no copy holder would replay, and a replaying primary keeps each step's mean
    gradient for them (the replay spare, 4 bytes per parameter): a job that does not say gets false."""
    one = spec("bsp")
    one.replication = 1
    out, why = replay_policy.resolve(one, {"ps0": A, "ps1": A})
    assert out.HasField("replicate_gradients") and not out.replicate_gradients and "replication 1" in why
    assert not replay_policy.copies_by_default(out)     # nothing lost by it: logged at INFO, not WARNING
    one.replicate_gradients = True                       # asked for: kept as asked
    assert replay_policy.resolve(one, {"ps0": A})[0].replicate_gradients
    jobs = JobRegistry(default_replication=1)
    with caplog.at_level(logging.INFO, logger="shardline.dispatcher"):
        record, created = jobs.create(spec("bsp", name="single"), fingerprints={"ps0": A, "ps1": A})
    assert created and record.spec.replication == 1 and not record.spec.replicate_gradients
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_what_the_creator_says_stands():
    for sync in ("bsp", "ssp", "asp"):
        out, why = replay_policy.resolve(spec(sync, replicate=False), {"ps0": A, "ps1": A})
        assert out.HasField("replicate_gradients") and not out.replicate_gradients and not why
    out, _ = replay_policy.resolve(spec("bsp", replicate=True), {"ps0": A, "ps1": A})
    assert out.replicate_gradients
    # True on ASP is kept as asked and means copies, on any nodes (as before the default)
    out, _ = replay_policy.resolve(spec("asp", replicate=True), {"ps0": A, "ps1": B})
    assert out.replicate_gradients and not replay_policy.replays(out)


def test_replay_asked_for_on_nodes_of_different_builds_is_refused_naming_them():
    with pytest.raises(ShardlineConfigError) as err:
        replay_policy.resolve(spec("bsp", replicate=True), {"ps0": A, "ps1": B, "ps2": A})
    message = str(err.value)
    assert "'j'" in message and f"ps0, ps2: {A}" in message and f"ps1: {B}" in message
    assert "replicate_gradients=False" in message


def test_a_node_of_another_build_is_refused_only_while_a_job_replays_and_unknown_builds_are_not_compared():
    replay_policy.check_registration("ps2", B, {"ps0": A, "ps1": A}, replaying=[])
    replay_policy.check_registration("ps2", A, {"ps0": A, "ps1": A}, replaying=["j"])
    replay_policy.check_registration("ps0", A, {}, replaying=["j"])
    with pytest.raises(ShardlineConfigError) as err:
        replay_policy.check_registration("ps2", B, {"ps0": A, "ps1": A}, replaying=["j"])
    assert f"'ps2' has build fingerprint {B!r}" in str(err.value) and f"ps0, ps1: {A}" in str(err.value)
    assert "'j'" in str(err.value)
    # fingerprints not known are compared with none: a node of an older build that reports none,
    # and the live nodes a restarted dispatcher restored from its state until they report theirs
    replay_policy.check_registration("ps2", "", {"ps0": A}, replaying=["j"])
    replay_policy.check_registration("ps0", A, {"ps1": ""}, replaying=["j"])
    with pytest.raises(ShardlineConfigError) as err:
        replay_policy.check_registration("ps2", B, {"ps0": A, "ps1": ""}, replaying=["j"])
    assert f"'ps2' has build fingerprint {B!r}" in str(err.value)


# --- through the dispatcher's servicer ----------------------------------------------------------------

class Aborted(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class Context:
    def abort(self, code, message):
        raise Aborted(code, message)

    def set_trailing_metadata(self, _metadata):
        pass

    def peer(self):
        return "ipv4:127.0.0.1:5555"


@pytest.fixture
def dispatcher():
    return DispatcherServicer(Membership(heartbeat_timeout=5.0), JobRegistry(default_replication=2),
                              heartbeat_interval=0.5, clock=lambda: 0.0)


def register(servicer, node_id, fingerprint):
    servicer.RegisterNode(dispatcher_pb2.RegisterNodeRequest(
        node_id=node_id, rack="default", grpc_address="127.0.0.1:1", data_address="127.0.0.1:2", capacity=1.0,
        incarnation=node_id, build_fingerprint=fingerprint), Context())


def create(servicer, job_spec):
    return servicer.CreateJob(dispatcher_pb2.CreateJobRequest(spec=job_spec), Context()).job.spec


def test_the_dispatcher_decides_each_jobs_replication_from_its_nodes(dispatcher):
    register(dispatcher, "ps0", A)
    register(dispatcher, "ps1", A)
    assert create(dispatcher, spec("bsp", name="bsp")).replicate_gradients is True
    assert create(dispatcher, spec("ssp", name="ssp")).replicate_gradients is True
    assert create(dispatcher, spec("asp", name="asp")).replicate_gradients is False
    assert create(dispatcher, spec("bsp", replicate=False, name="copies")).replicate_gradients is False
    # a worker joining later without a say gets the job's decision, one saying otherwise a conflict
    assert create(dispatcher, spec("bsp", name="bsp")).replicate_gradients is True
    with pytest.raises(Aborted) as err:
        create(dispatcher, spec("bsp", replicate=False, name="bsp"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "replicate_gradients" in str(err.value)
    # the fingerprint is in the cluster's status
    status = dispatcher.GetClusterStatus(dispatcher_pb2.GetClusterStatusRequest(), Context())
    assert {n.node_id: n.build_fingerprint for n in status.routing.nodes} == {"ps0": A, "ps1": A}


def test_on_nodes_of_different_builds_a_default_job_gets_copies_and_replay_is_refused(dispatcher, caplog):
    register(dispatcher, "ps0", A)
    register(dispatcher, "ps1", B)
    with caplog.at_level("WARNING", logger="shardline.dispatcher.jobs"):
        assert create(dispatcher, spec("bsp", name="default")).replicate_gradients is False
    assert "different build fingerprints" in caplog.text and "default" in caplog.text
    with pytest.raises(Aborted) as err:
        create(dispatcher, spec("bsp", replicate=True, name="replay"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"ps0: {A}" in str(err.value) and f"ps1: {B}" in str(err.value)
    # no job replays: a third build may still register
    register(dispatcher, "ps2", "a third build")


def test_a_node_of_another_build_cannot_join_while_a_job_replays(dispatcher):
    register(dispatcher, "ps0", A)
    register(dispatcher, "ps1", A)
    create(dispatcher, spec("bsp", name="replaying"))
    with pytest.raises(Aborted) as err:
        register(dispatcher, "ps2", B)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"'ps2' has build fingerprint {B!r}" in str(err.value) and "'replaying'" in str(err.value)
    assert "ps2" not in {n.node_id for n in dispatcher.GetClusterStatus(
        dispatcher_pb2.GetClusterStatusRequest(), Context()).routing.nodes}
    register(dispatcher, "ps2", A)            # one of the cluster's build may
    register(dispatcher, "ps0", A)            # and a known node re-registering
    with pytest.raises(Aborted):
        register(dispatcher, "ps1", B)        # restarted with another build: refused too
