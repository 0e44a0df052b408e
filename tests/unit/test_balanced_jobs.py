"""Length-balanced minibatches in job files (``train: {balance: tokens, ...}``), in one process: the
schema keys, the global-minibatch sampler and the split of it over simulated ranks, the microbatch
bound, and exactness: balancing changes only who computes what, never the parameters."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest

from shardline.jobs.runner import balanced_plans, run_local, run_training
from shardline.jobs.spec import parse_job
from shardline.jobs.workloads import SyntheticWorkload
from shardline.services.errors import ShardlineConfigError
from shardline.worker.balance import CostModel
from test_demo_task import BSPGroup, tiny

BALANCED = {"balance": "tokens", "micro_batch_tokens": 48, "cost": {"c0": 4, "c1": 1, "c2": 0.01}}
WIDE = {"kind": "reverse", "min_digits": 1, "max_digits": 12, "seed": 5}   # lengths 9..31


def job(task=None, **train) -> dict:
    d = tiny(**{"eval_examples": 0, "sample_prompts": 0, **train})
    if task is not None:
        d["task"] = dict(task)
    return d


def without_balance(spec):
    return dataclasses.replace(spec, train=dataclasses.replace(
        spec.train, balance="none", micro_batch_tokens=None, cost=None, global_batch_size=None))


def assert_same_parameters(a, b, atol=1e-5):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        diff = (sa[name] - sb[name]).abs().max().item()
        assert diff <= atol, f"{name}: max abs diff {diff}"


# -- schema ---------------------------------------------------------------------------------------

def test_balance_keys_defaults_and_round_trip():
    plain = parse_job(job()).train
    assert (plain.balance, plain.balance_method, plain.micro_batch_tokens, plain.cost, plain.global_batch_size) == \
        ("none", "kk", None, None, None)
    assert not plain.balanced and plain.global_batch(3) == 3 * plain.batch_size
    spec = parse_job(job(balance="tokens", balance_method="lpt", micro_batch_tokens=64, cost=[1, 2, 0.5],
                         global_batch_size=5))
    tr = spec.train
    assert tr.balanced and tr.balance_method == "lpt" and tr.micro_batch_tokens == 64
    assert tr.cost == CostModel(1.0, 2.0, 0.5) and tr.global_batch(3) == 5
    assert parse_job(job(balance="tokens", cost={"c1": 1, "c2": 0.1})).train.cost == CostModel(0, 1, 0.1)
    again = parse_job({"job": {"name": "again"}, "train": spec.to_dict()["train"]})   # cost as {c0, c1, c2}
    assert again.train == tr and spec.to_dict()["train"]["cost"] == {"c0": 1.0, "c1": 2.0, "c2": 0.5}


@pytest.mark.parametrize("train,where,quoted", [
    ({"balance": "tok"}, "train.balance", "'tok'"),
    ({"balance": "tokens", "balance_method": "contiguous"}, "train.balance_method", "'contiguous'"),
    ({"balance": "tokens", "micro_batch_tokens": 0}, "train.micro_batch_tokens", "got 0"),
    ({"balance": "tokens", "micro_batch_tokens": "64"}, "train.micro_batch_tokens", "'64'"),
    ({"balance": "tokens", "global_batch_size": 0}, "train.global_batch_size", "got 0"),
    ({"balance": "tokens", "cost": {"c0": -1}}, "train.cost", "-1"),
    ({"balance": "tokens", "cost": {"c3": 1}}, "train.cost", "'c3'"),
    ({"balance": "tokens", "cost": [0, 0, 0]}, "train.cost", "c0=0.0"),
    ({"balance": "tokens", "cost": [1, 2]}, "train.cost", "[1, 2]"),
    ({"balance": "tokens", "cost": "measure"}, "train.cost", "'measure'"),
    ({"balance": "tokens", "weight_by_tokens": False}, "train.weight_by_tokens", "False"),
    ({"micro_batch_tokens": 64}, "train.micro_batch_tokens", "only applies with train.balance: tokens, got 64"),
    ({"balance": "none", "cost": [1, 1, 0]}, "train.cost", "[1, 1, 0]"),
    ({"balance_method": "lpt"}, "train.balance_method", "'lpt'"),
    ({"global_batch_size": 4}, "train.global_batch_size", "got 4"),
    ({"balance": "tokens", "micro_batch": 64}, "train.micro_batch", "did you mean 'micro_batch_tokens'"),
])
def test_schema_errors_name_the_key_and_quote_the_value(train, where, quoted):
    with pytest.raises(ShardlineConfigError) as info:
        parse_job(job(**train), source="j.yaml")
    msg = str(info.value)
    assert msg.startswith(f"j.yaml: {where}"), msg
    assert quoted in msg, msg


# -- the global minibatch and its split -----------------------------------------------------------

def rows(batch) -> list[tuple[int, ...]]:
    return [tuple(x[:n].tolist()) for x, n in zip(batch.input_ids, (batch.input_ids != batch.pad_id).sum(1))]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("method", ["kk", "lpt"])
def test_every_ranks_part_covers_the_global_batch_exactly_once(world_size, method):
    spec = parse_job(job(WIDE, balance="tokens", balance_method=method, micro_batch_tokens=60, batch_size=6))
    workload = SyntheticWorkload(spec, lead=False)
    size = spec.train.global_batch(world_size)
    for step in (0, 7):
        examples = workload.examples_at(step * size, size)
        # the global minibatch holds the sequences the naive per-rank shares hold
        naive = [workload.batch(step, r, world_size, spec.train.batch_size) for r in range(world_size)]
        assert [row for b in naive for row in rows(b)] == rows(workload.collate(examples))
        # every simulated rank plans the same split; the parts cover the minibatch once
        plans = balanced_plans(spec.train, examples, range(world_size), world_size)
        parts = [plans[r].indices for r in range(world_size)]
        assert sorted(i for p in parts for i in p) == list(range(size))
        assert all(p for p in parts)                     # size >= world_size: nobody is left out
        for r in range(world_size):
            assert sorted(i for mb in plans[r].micro_batches for i in mb) == parts[r]
            assert balanced_plans(spec.train, examples, [r], world_size)[r] == plans[r]   # alone, the same


def test_micro_batches_respect_micro_batch_tokens():
    """A collated microbatch ([B, T], padded to its longest) holds at most micro_batch_tokens
    positions, unless it is one sequence longer than that."""
    limit = 40
    spec = parse_job(job(WIDE, balance="tokens", micro_batch_tokens=limit, batch_size=8))
    workload = SyntheticWorkload(spec, lead=False)
    seen_many = False
    for step in range(4):
        examples = workload.examples_at(step * 16, 16)
        for plan in balanced_plans(spec.train, examples, range(2), 2).values():
            for mb in plan.micro_batches:
                b = workload.collate([examples[i] for i in mb])
                assert b.input_ids.numel() <= limit or len(mb) == 1, (mb, tuple(b.input_ids.shape))
                seen_many |= len(mb) > 1
            assert len(plan.micro_batches) > 1
    assert seen_many


def test_a_rank_past_the_global_batch_gets_an_empty_part():
    spec = parse_job(job(WIDE, balance="tokens", global_batch_size=2))
    workload = SyntheticWorkload(spec, lead=False)
    plans = balanced_plans(spec.train, workload.examples_at(0, 2), range(3), 3)
    assert [len(plans[r].indices) for r in range(3)] == [1, 1, 0] and plans[2].micro_batches == []
    assert [plans[r].weight for r in range(3)] == [1.0, 1.0, 1.0]   # an empty rank: everyone weight 1


# -- exactness ------------------------------------------------------------------------------------

@pytest.mark.parametrize("train", [
    {"balance": "tokens"},
    BALANCED,
    {**BALANCED, "balance_method": "lpt", "micro_batch_tokens": 25},
])
def test_balanced_training_gives_the_parameters_of_the_naive_split(train):
    """run_local simulates every rank of the balanced split (microbatches, loss scales, the PS's
    weighted mean): the same parameters as the naive split on the same global batches."""
    spec = parse_job(job(WIDE, steps=8, **train))
    balanced = run_local(spec, world_size=3)
    naive = run_local(without_balance(spec), world_size=3)
    assert_same_parameters(balanced, naive)
    assert balanced.losses == pytest.approx(naive.losses, rel=1e-5)
    assert balanced.balance == "tokens" and naive.balance == "none"
    assert len(balanced.compute_seconds) == len(balanced.step_tokens) == 8
    assert balanced.step_tokens == naive.step_tokens      # the same sequences every step
    if train.get("micro_batch_tokens"):
        assert min(balanced.step_micro_batches) > 3


def run_bsp(spec, world_size: int):
    """run_training on every rank in threads against an in-process BSP parameter server."""
    group = BSPGroup(world_size, spec.train)
    results: list = [None] * world_size
    errors: list = []

    def work(rank):
        try:
            results[rank] = run_training(spec, group.factory, rank, world_size)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(r is not None for r in results)
    return results, group


def test_balanced_bsp_workers_match_the_single_process_reference():
    """Each rank trains its own balanced part and steps with the plan's weight: after BSP's
    weighted mean, every rank holds the parameters of one process on the whole minibatch."""
    spec = parse_job(job(WIDE, steps=6, **BALANCED))
    results, group = run_bsp(spec, 2)
    reference = run_local(without_balance(spec), world_size=2)
    for r in results:
        assert_same_parameters(r, reference)
    # the weights pushed are each rank's loss tokens; together, the whole minibatch's
    workload = SyntheticWorkload(spec, lead=False)
    examples = workload.examples_at(0, 16)
    plans = balanced_plans(spec.train, examples, range(2), 2)
    assert sorted(group.weights_seen[:2]) == sorted(p.weight for p in plans.values())
    assert sum(group.weights_seen[:2]) == workload.collate(examples).n_target_tokens
    # per step, the ranks' tokens add up to the minibatch's
    assert [a + b for a, b in zip(results[0].step_tokens, results[1].step_tokens)] == reference.step_tokens


def test_a_rank_with_an_empty_part_still_steps():
    """Three ranks, two sequences per global minibatch: rank 2 never computes, still commits every
    step (weight 1, no gradient), and everyone ends with the single-process parameters."""
    spec = parse_job(job(WIDE, steps=5, balance="tokens", global_batch_size=2))
    results, group = run_bsp(spec, 3)
    single = run_local(dataclasses.replace(without_balance(spec),
                                           train=dataclasses.replace(without_balance(spec).train, batch_size=2)), 1)
    for r in results:
        assert_same_parameters(r, single)
    empty = results[2]
    assert empty.step_tokens == [0] * 5 and empty.step_micro_batches == [0] * 5
    assert all(math.isnan(x) for x in empty.losses)
    assert group.weights_seen == [1.0] * 15
    assert all(math.isfinite(x) for x in results[0].losses)


def test_hf_balanced_training_matches_the_naive_split(tmp_path):
    """The JSONL workload: the global minibatch is the naive shares' sequences, and balanced
    training gives the naive split's parameters."""
    from hf_fixtures import build_tiny_llama, lognormal_records, write_jsonl

    build_tiny_llama(tmp_path / "llama")
    write_jsonl(tmp_path / "train.jsonl", lognormal_records(40, seed=3))
    d = {"job": {"name": "hf-balanced"}, "model": {"hf_path": "llama"},
         "data": {"path": "train.jsonl", "max_length": 64, "seed": 1},
         "train": {"steps": 4, "batch_size": 4, "lr": 0.01, "balance": "tokens", "micro_batch_tokens": 96}}
    spec = parse_job(d, base_dir=tmp_path)
    balanced = run_local(spec, world_size=2)
    naive = run_local(without_balance(spec), world_size=2)
    assert_same_parameters(balanced, naive)
    assert balanced.step_tokens == naive.step_tokens and max(balanced.step_micro_batches) > 2
