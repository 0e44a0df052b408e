"""PSOptimizer's options (worker/options.py): the one table of value checks, the one table of what
a joining worker must agree on with the job, and the constructor's keywords (a stable interface)."""

import inspect

import pytest

from shardline.services.errors import ShardlineConfigError
from shardline.services.pb import common_pb2
from shardline.worker.options import (MUST_MATCH, OPTION_CHECKS, JobOptions, check_job_matches, check_options)


@pytest.mark.parametrize("name, bad", [("prefetch_window", 2), ("prefetch_window", True), ("overlap", 1),
                                       ("priority_pull", "yes"), ("flatten", None), ("exact_restarts", 0),
                                       ("replicate_gradients", "no"), ("host_aggregation", 1)])
def test_a_bad_option_is_refused_quoting_it(name, bad):
    with pytest.raises(ShardlineConfigError, match=f"^{name} must .*, got {bad!r}$"):
        check_options({name: bad})


def test_good_options_pass_and_none_takes_the_jobs():
    check_options({"prefetch_window": 1, "overlap": False, "priority_pull": True, "flatten": False,
                   "exact_restarts": None, "replicate_gradients": None, "host_aggregation": None})
    assert [name for name, _, _ in OPTION_CHECKS][0] == "prefetch_window"   # checked first, as before


def job(**fields) -> common_pb2.JobSpec:
    spec = common_pb2.JobSpec(name="j", sync="bsp", world_size=2)
    for key, value in fields.items():
        setattr(spec, key, value)
    return spec


@pytest.mark.parametrize("spec, asks, message", [
    (job(), dict(world_size=3), "job 'j' has world_size 2, this worker says 3"),
    (job(), dict(staleness=1, sync="ssp"), "job 'j' is sync 'bsp' with staleness 0, this worker says 'ssp' with "
                                           "staleness 1"),
    (job(max_grad_norm=1.0), dict(max_grad_norm=0.5), "job 'j' clips gradients at max_grad_norm 1 (0: not at all), "
                                                      "this worker asks for 0.5"),
    (job(inexact_restarts=True), dict(exact_restarts=True), "job 'j' has exact_restarts False, this worker asks for "
                                                            "True"),
    (job(), dict(replicate_gradients=True), "job 'j' has replicate_gradients False, this worker asks for True"),
    (job(compression="sign"), dict(compression="none"), "job 'j' pushes gradients with compression 'sign', this "
                                                        "worker asks for 'none'"),
])
def test_a_worker_that_differs_from_its_job_is_told_both_values(spec, asks, message):
    with pytest.raises(ShardlineConfigError) as err:
        check_job_matches(spec, JobOptions(**{"world_size": 2, "rank": 1, **asks}))
    assert str(err.value) == message


def test_options_left_none_take_the_jobs():
    spec = job(max_grad_norm=1.0, inexact_restarts=True, replicate_gradients=True, compression="sign", staleness=0)
    check_job_matches(spec, JobOptions(world_size=2, rank=1))
    check_job_matches(spec, JobOptions(world_size=2, rank=1, max_grad_norm=1, exact_restarts=False, staleness=0))
    assert {row.option for row in MUST_MATCH} == {"world_size", "staleness", "max_grad_norm", "exact_restarts",
                                                  "replicate_gradients", "compression"}


def test_the_creators_defaults():
    kwargs = JobOptions(world_size=4, rank=0).create_kwargs()
    # replicate_gradients None: the dispatcher decides (replay for BSP/SSP on one build fingerprint)
    assert kwargs["staleness"] == 0 and kwargs["exact_restarts"] is True and kwargs["replicate_gradients"] is None


def test_psoptimizer_keeps_every_keyword_and_default():
    from shardline.worker.optim import PSOptimizer

    params = inspect.signature(PSOptimizer).parameters
    defaults = {name: p.default for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert defaults == {
        "optimizer": "adamw", "sync": "bsp", "staleness": None, "world_size": None, "rank": None,
        "block_elements": None, "transport": "auto", "pull_timeout": 600.0, "connect_timeout": 60.0,
        "rpc_timeout": 10.0, "allow_nonfinite": False, "cluster_token": None, "prefetch_window": 0,
        "recovery_timeout": 120.0, "replication": None, "worker_lease_timeout": None, "on_worker_failure": None,
        "tls_ca": None, "straggler_warning_seconds": 30.0, "max_grad_norm": None, "metrics_port": None,
        "metrics_host": "127.0.0.1", "overlap": False, "bucket_cap_mb": 1.0, "priority_pull": True,
        "compression": None, "rack": None, "exact_restarts": None, "replicate_gradients": None, "flatten": False,
        "host_aggregation": None}
    assert list(params)[:3] == ["params", "cluster", "job"] and "optimizer_kwargs" in params
