"""Aggregated pushes (host-level aggregation): a host's leader sends one push per block on behalf
of several ranks (FrameHeader.agg_ranks/agg_weights), its payload their weighted sum. A node
counts it as every one of those ranks' push: the step equals torch.optim on the weighted mean of
every rank's gradient, whatever the arrival order, with or without early steps; a resend is
ignored, a block one of the ranks pushed alone refuses the aggregate whole (AGGREGATE_CONFLICT).

JobStores for the accounting; a PSNode served over a real TCP or shm connection for the client's
side (Client.push(aggregate=...), record_pushed). The references are torch.optim on the weighted
mean, with the sums computed here."""

import itertools
import math
import re
import socket
import threading
import time
import types

import pytest
import torch
from job_specs import one_tensor_spec
from test_handover_catch_up import hand_over_on_the_wire
from test_pull_placement import ServedOverShm, shm_client  # noqa: F401 - a fixture
from test_store import ROUND_OFF, init_store, items_for, make_job, values

from shardline.ps_server.node import PSNode
from shardline.ps_server.store import Aggregate, JobStore, PushItem, StoreError
from shardline.services import frame
from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
from shardline.services.errors import ErrorCode, FrameError, RemoteError, ShardlineConfigError
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.routing import RoutingView
from shardline.worker.client import HostAggregate, TransferStats
from shardline.worker.read_router import ReadRouter

pytestmark = pytest.mark.timeout(60)
LR = 0.01
WEIGHTS = (3.0, 1.0, 0.5, 2.0)     # ranks 0..3; ranks 0 and 1 share a host


def step_grads(step: int, world: int = 4) -> list[dict]:
    """Each rank's gradients of ``step``: step 1 has a block both host ranks leave at zero (a[0])
    and a tensor only rank 1 of the host and rank 2 have a gradient for (b)."""
    g = torch.Generator().manual_seed(10 + step)
    grads = [{"a": torch.randn(4, 5, generator=g), "b": torch.randn(3, generator=g)} for _ in range(world)]
    if step == 1:
        for rank in (0, 1):
            grads[rank]["a"].view(-1)[:7] = 0.0
        del grads[0]["b"], grads[-1]["b"]
    return grads


def host_sum(grads: list[dict], ranks, weights) -> dict:
    """sum_i(w_i * g_i) over ``ranks``, per tensor (tensors none of them has are left out)."""
    sums = {}
    for name in ("a", "b"):
        parts = [w * grads[r][name] for r, w in zip(ranks, weights) if name in grads[r]]
        if parts:
            sums[name] = sum(parts[1:], parts[0].clone())
    return sums


def items(grads: dict) -> list[PushItem]:
    return [i for name, g in grads.items() for i in items_for(name, g)]


def reference(initial: dict, steps: list, weights, kind: str) -> dict:
    """torch.optim on the weighted mean of every rank's gradient of each step."""
    params = {n: initial[n].clone().requires_grad_() for n in ("a", "b")}
    if kind == "adamw":
        opt = torch.optim.AdamW(list(params.values()), lr=LR, weight_decay=0.1, foreach=False)
    else:
        opt = torch.optim.SGD(list(params.values()), lr=LR, momentum=0.9, foreach=False)
    for grads in steps:
        for n, p in params.items():
            parts = [(w, g[n]) for g, w in zip(grads, weights) if n in g]
            p.grad = None if not parts else sum(w * g for w, g in parts) / math.fsum(weights)
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def fresh(world: int = 4, kind: str = "adamw", sync: str = "bsp", **spec_fields):
    torch.manual_seed(0)
    initial = {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)}
    hp = dict(lr=LR, weight_decay=0.1) if kind == "adamw" else dict(lr=LR, momentum=0.9)
    spec = make_job(sync=sync, world_size=world, kind=kind, **hp)
    for key, value in spec_fields.items():
        setattr(spec, key, value)
    if sync == "ssp":
        spec.staleness = 1
    store = JobStore(spec)
    init_store(store, initial)
    return store, initial


def assert_equals_reference(store, initial, steps, weights, kind="adamw"):
    want = reference(initial, steps, weights, kind)
    for n in ("a", "b"):
        torch.testing.assert_close(values(store, n, initial[n].shape), want[n], **ROUND_OFF)


def collected(store) -> list:
    return [(k, sorted(b.role.collecting.pushed_by), b.role.collecting.has_grad)
            for k, b in sorted(store.blocks.items()) if b.primary]


# --- the accounting --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("commit_follows", [False, True], ids=["early-steps", "commit-follows"])
@pytest.mark.parametrize("aggregate_first", [True, False], ids=["aggregate-first", "aggregate-last"])
def test_an_aggregate_of_two_ranks_and_two_solo_pushes_equal_torch_on_the_weighted_mean(kind, commit_follows,
                                                                                       aggregate_first):
    store, initial = fresh(kind=kind)
    host = Aggregate((0, 1), WEIGHTS[:2])
    steps = [step_grads(step) for step in range(3)]
    early = 0
    for step, grads in enumerate(steps):
        before = {k: b.value.clone() for k, b in store.blocks.items()}
        pushes = [lambda: store.push(0, step, WEIGHTS[0], items(host_sum(grads, (0, 1), WEIGHTS[:2])), lr=LR,
                                     commit_follows=commit_follows, aggregate=host)]
        pushes += [lambda r=r: store.push(r, step, WEIGHTS[r], items(grads[r]), lr=LR, commit_follows=commit_follows)
                   for r in (2, 3)]
        for push in pushes if aggregate_first else pushes[::-1]:
            push()
        assert sorted(store.push_weights[step].items()) == list(enumerate(WEIGHTS))
        # every rank's gradient (or zero flag) arrived: stepped before the commits, unless a commit follows
        everyone = {k for k in store.blocks if k[0] == "a" or (k[0] == "b" and all("b" in g for g in grads))}
        staged = {k for k, b in store.blocks.items() if b.role.collecting.staged is not None}
        assert staged == (set() if commit_follows else everyone)
        early += len(staged)
        if commit_follows:   # the first push of each block kept its value for a restarted rank
            assert all(torch.equal(b.role.kept.value, before[k]) for k, b in store.blocks.items() if k[0] != "frozen")
        for rank, weight in enumerate(WEIGHTS):
            store.commit(rank, step, weight, lr=LR)
        assert store.step == step + 1
    assert store.applied_early == early
    assert store.aggregated_ranks == 2 * 3
    assert_equals_reference(store, initial, steps, WEIGHTS, kind)


def test_an_aggregate_sent_again_and_its_ranks_pushing_alone_afterwards_are_resends():
    weights = WEIGHTS[:3]
    store, initial = fresh(world=3)
    grads = step_grads(0, world=3)
    host = Aggregate((0, 1), weights[:2])
    sums = host_sum(grads, (0, 1), weights[:2])
    store.push(0, 0, weights[0], items(sums), lr=LR, aggregate=host)
    sums_kept = {k: b.role.collecting.grad_buf.clone() for k, b in store.blocks.items() if b.role.collecting.has_grad}
    store.push(0, 0, weights[0], items(sums), lr=LR, aggregate=host)            # the reply was lost: sent again
    store.push(1, 0, weights[1], items(grads[1]), lr=LR)                        # a member's replay, alone
    store.push(0, 0, weights[0], items(grads[0]), lr=LR)                        # the leader's replay, alone
    assert all(torch.equal(store.blocks[k].role.collecting.grad_buf, v) for k, v in sums_kept.items())
    assert store.aggregated_ranks == 2
    store.push(2, 0, weights[2], items(grads[2]), lr=LR)
    for rank, weight in enumerate(weights):
        store.commit(rank, 0, weight, lr=LR)
    store.push(0, 0, weights[0], items(sums), lr=LR, aggregate=host)            # after the apply: a resend too
    assert store.step == 1 and store.aggregated_ranks == 2
    assert_equals_reference(store, initial, [grads], weights)


def test_a_rank_that_pushed_alone_first_makes_the_aggregate_conflict_and_nothing_of_it_is_kept():
    weights = WEIGHTS[:3]
    store, initial = fresh(world=3)
    grads = step_grads(0, world=3)
    store.push(1, 0, weights[1], items_for("a", grads[1]["a"]), lr=LR)         # rank 1 pushed "a" alone
    before = collected(store)
    sums = host_sum(grads, (0, 1), weights[:2])
    with pytest.raises(StoreError) as err:   # "b" first: it would have been claimed before "a" conflicted
        store.push(0, 0, weights[0], items_for("b", sums["b"]) + items_for("a", sums["a"]), lr=LR,
                   aggregate=Aggregate((0, 1), weights[:2]))
    assert err.value.code == ErrorCode.AGGREGATE_CONFLICT
    assert "block a[0]" in str(err.value) and "[1]" in str(err.value) and "[0]" in str(err.value)
    assert collected(store) == before and store.push_weights[0] == {1: weights[1]}
    assert store.aggregated_ranks == 0
    # the ranks push alone instead
    store.push(0, 0, weights[0], items(grads[0]), lr=LR)
    store.push(1, 0, weights[1], items(grads[1]), lr=LR)                        # "a" again: a resend
    store.push(2, 0, weights[2], items(grads[2]), lr=LR)
    for rank, weight in enumerate(weights):
        store.commit(rank, 0, weight, lr=LR)
    assert_equals_reference(store, initial, [grads], weights)


def test_each_rank_of_an_aggregate_commits_with_the_weight_it_gave_and_no_other():
    weights = WEIGHTS[:3]
    store, initial = fresh(world=3)
    grads = step_grads(0, world=3)
    store.push(0, 0, weights[0], items(host_sum(grads, (0, 1), weights[:2])), lr=LR,
               aggregate=Aggregate((0, 1), weights[:2]))
    store.push(2, 0, weights[2], items(grads[2]), lr=LR)
    with pytest.raises(StoreError) as err:
        store.commit(1, 0, 4.0, lr=LR)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "4.0" in str(err.value) and "1.0" in str(err.value)
    with pytest.raises(StoreError) as err:   # a push of its own with another weight, alike
        store.push(1, 0, 4.0, items(grads[1]), lr=LR)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "rank 1" in str(err.value)
    with pytest.raises(StoreError, match="lr"):   # and with another lr than the aggregate named
        store.commit(1, 0, weights[1], lr=0.5)
    assert store.step == 0
    for rank, weight in enumerate(weights):
        store.commit(rank, 0, weight, lr=LR)
    assert_equals_reference(store, initial, [grads], weights)


@pytest.mark.parametrize("ranks, agg_weights, sender, message", [
    ((0, 3), (3.0, 1.0), 0, "rank 3 is out of range for world_size 3"),
    ((0,), (3.0,), 0, "at least 2"),
    ((1, 0), (1.0, 3.0), 0, "ascending and distinct"),
    ((0, 0), (3.0, 3.0), 0, "ascending and distinct"),
    ((1, 2), (1.0, 0.5), 0, "not among them"),
    ((0, 1), (3.0,), 0, "2 ranks and 1 weights"),
    ((0, 1), (3.0, float("nan")), 0, "weight nan"),
    ((0, 1), (3.0, 0.0), 0, "weight 0.0"),
    ((0, 1), (2.0, 1.0), 0, "weight 2.0, the frame's weight is 3.0"),
])
def test_an_aggregate_the_store_refuses_names_the_values_and_leaves_it_serving(ranks, agg_weights, sender, message):
    weights = WEIGHTS[:3]
    store, initial = fresh(world=3)
    grads = step_grads(0, world=3)
    with pytest.raises(StoreError) as err:
        store.push(sender, 0, weights[sender], items(host_sum(grads, (0, 1), weights[:2])), lr=LR,
                   aggregate=Aggregate(ranks, agg_weights))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and message in str(err.value)
    assert all(not pushed and not has_grad for _k, pushed, has_grad in collected(store)) and not store.push_weights
    for rank, weight in enumerate(weights):
        store.push(rank, 0, weight, items(grads[rank]), lr=LR)
        store.commit(rank, 0, weight, lr=LR)
    assert_equals_reference(store, initial, [grads], weights)


@pytest.mark.parametrize("job, message", [
    (dict(sync="asp"), "'asp'"),
    (dict(compression="sign"), "compression 'sign'"),
])
def test_a_job_that_takes_no_aggregates_refuses_them(job, message):
    store, _ = fresh(world=3, **job)
    with pytest.raises(StoreError) as err:
        store.push(0, 0, 1.0, items({"a": torch.ones(4, 5)}), aggregate=Aggregate((0, 1), (1.0, 1.0)))
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and message in str(err.value)


def test_a_bf16_sum_is_taken_as_it_is():
    weights = WEIGHTS[:3]
    store, initial = fresh(world=3)
    grads = step_grads(0, world=3)
    sums = {n: s.to(torch.bfloat16) for n, s in host_sum(grads, (0, 1), weights[:2]).items()}
    store.push(0, 0, weights[0], items(sums), lr=LR, aggregate=Aggregate((0, 1), weights[:2]))
    store.push(2, 0, weights[2], items(grads[2]), lr=LR)
    for rank, weight in enumerate(weights):
        store.commit(rank, 0, weight, lr=LR)
    # the reference: rank 0's share carries the whole sum as sent (w0 = 1 / w0 * (w0 * ...))
    as_sent = [{n: s.float() / weights[0] for n, s in sums.items()}, {}, grads[2]]
    assert_equals_reference(store, initial, [as_sent], weights)


def test_ssp_an_aggregate_of_a_step_ahead_is_collected_for_it():
    weights = WEIGHTS[:3]
    store, initial = fresh(world=3, sync="ssp")
    host = Aggregate((0, 1), weights[:2])
    steps = [step_grads(s, world=3) for s in range(2)]
    for step in (0, 1):   # the host runs a step ahead of rank 2
        store.push(0, step, weights[0], items(host_sum(steps[step], (0, 1), weights[:2])), aggregate=host)
    store.push(1, 1, weights[1], items_for("a", steps[1][1]["a"]))             # a member's replay of step 1: a resend
    assert sorted(store.blocks[("a", 0)].role.ahead[1].received) == [0, 1]
    store.commit(0, 0, weights[0])
    store.commit(1, 0, weights[1])
    store.push(2, 0, weights[2], items(steps[0][2]))
    store.commit(2, 0, weights[2])
    store.push(2, 1, weights[2], items(steps[1][2]))
    for rank, weight in enumerate(weights):
        store.commit(rank, 1, weight)
    assert store.step == 2
    want = reference(initial, steps, weights, "adamw")
    for n in ("a", "b"):
        torch.testing.assert_close(values(store, n, initial[n].shape), want[n], **ROUND_OFF)


def test_a_handover_mid_step_carries_the_aggregates_ranks():
    weights = WEIGHTS[:3]
    torch.manual_seed(0)
    initial = {"a": torch.randn(4, 5), "b": torch.randn(3), "frozen": torch.randn(2)}
    old, new = (JobStore(make_job(world_size=3, lr=LR, weight_decay=0.1)) for _ in range(2))
    for node in (old, new):
        init_store(node, initial)
    keys = set(new.blocks)
    new.set_primary(set(), epoch=2)
    grads = step_grads(0, world=3)
    host = Aggregate((0, 1), weights[:2])
    sums = host_sum(grads, (0, 1), weights[:2])
    old.push(0, 0, weights[0], items(sums), lr=LR, aggregate=host)
    new.set_primary(keys, epoch=3, awaiting={k: ("old", time.monotonic() + 60) for k in keys})
    _gained, handovers = old.set_primary(set(), epoch=3)
    assert {h.ranks for h in handovers if h.key[0] != "frozen"} == {(0, 1)}
    hand_over_on_the_wire("old", old, "new", new, handovers)
    assert all(b.role.collecting.handed == {0, 1} for k, b in new.blocks.items() if k[0] != "frozen")
    # the host's resends at the new epoch are ignored; rank 2 pushes there
    new.push(0, 0, weights[0], items(sums), lr=LR, aggregate=host)
    new.push(1, 0, weights[1], items(grads[1]), lr=LR)
    new.push(2, 0, weights[2], items(grads[2]), lr=LR)
    for rank, weight in enumerate(weights):
        new.commit(rank, 0, weight, lr=LR, epoch=3)
    assert new.step == 1
    assert_equals_reference(new, initial, [grads], weights)


# --- the frame check -----------------------------------------------------------------------
def push_header(**fields) -> frame.FrameHeader:
    header = frame.FrameHeader(op=dp.OP_PUSH, request_id=1, job="j", step=0, rank=0, weight=3.0)
    header.agg_ranks.extend(fields.pop("agg_ranks", (0, 1)))
    header.agg_weights.extend(fields.pop("agg_weights", (3.0, 1.0)))
    for key, value in fields.items():
        setattr(header, key, value)
    return header


@pytest.mark.parametrize("fields, message", [
    (dict(op=dp.OP_COMMIT), "OP_COMMIT frame names aggregated ranks"),
    (dict(op=dp.OP_PULL, agg_ranks=()), "OP_PULL frame names aggregated ranks"),
    (dict(agg_weights=(3.0,)), "2 ranks and 1 weights"),
    (dict(agg_ranks=(0,), agg_weights=(3.0,)), "at least 2"),
    (dict(agg_ranks=(1, 0)), "ascending and distinct"),
    (dict(agg_ranks=(0, 0)), "ascending and distinct"),
    (dict(agg_ranks=(1, 2)), "not among them"),
    (dict(agg_weights=(3.0, float("inf"))), "weight inf"),
    (dict(agg_weights=(3.0, -1.0)), "weight -1.0"),
    (dict(weight=2.0), "weight 3.0, the frame's weight is 2.0"),
])
def test_the_frame_check_refuses_a_malformed_aggregate(fields, message):
    with pytest.raises(FrameError, match=re.escape(message)):
        frame.validate_header(push_header(**fields))


def test_a_well_formed_aggregate_passes_the_frame_check():
    frame.validate_header(push_header())
    frame.validate_header(push_header(rank=2, weight=0.5, agg_ranks=(0, 2, 7), agg_weights=(3.0, 0.5, 1.0)))
    frame.validate_header(push_header(weight=0.0, agg_weights=(1.0, 2.0)))   # weight unset: 1


# --- the client, through a node's data plane ---------------------------------------------------
NODE_BLOCK = 64
NODE_TABLE = common_pb2.RoutingTable(epoch=1)
NODE_TABLE.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)


def node_spec(world: int = 3) -> common_pb2.JobSpec:
    spec = one_tensor_spec(world, "adamw", NODE_BLOCK, lr=LR)
    spec.tensors.add(name="b", shape=[5], dtype="float32", trainable=True)
    return spec


def served_node(initial: dict) -> PSNode:
    node = PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=node_spec(), uid="u", ready=True), lambda: NODE_TABLE)
    node.refresh_routing()
    job = node.add_job(node_spec(), "u")
    job.init_blocks([("w", i, initial["w"][i * NODE_BLOCK:(i + 1) * NODE_BLOCK].clone()) for i in (0, 1)]
                    + [("b", 0, initial["b"].clone())])
    return node


class ServedOverTcp:
    """``node`` serving one TCP-like connection (a socket pair) in a thread; ``client`` is the other end."""

    def __init__(self, node: PSNode):
        self.client, server = socket.socketpair()
        self.thread = threading.Thread(target=serve_connection, daemon=True,
                                       args=(server, "local:1", node, ConnectionPolicy(payload_timeout=5.0)))
        self.thread.start()

    def close(self):
        self.client.close()
        self.thread.join(10)


def node_client(offline_client, rank: int, conn_sock):
    """An offline Client of ``rank`` whose only node, n1, is served on ``conn_sock``."""
    client = offline_client(node_spec())
    client.rank, client.incarnation, client.lr = rank, f"rank{rank}", LR
    client._request_ids, client._commit_follows, client._pulling_at_step = itertools.count(1), False, False
    client._unchecked, client._carried, client._staging_buffers = {}, None, {}
    client._reads, client.stats, client._oldest = ReadRouter(None), TransferStats(), {}
    client._local_addresses, client.recovery_timeout, client.connect_timeout = {}, 10.0, 5.0
    client.routing = RoutingView.from_proto(NODE_TABLE)
    client.dispatcher = types.SimpleNamespace(get_routing=lambda: NODE_TABLE)
    client._conns = {"n1": types.SimpleNamespace(sock=conn_sock, lock=threading.Lock(), address="x:2",
                                                 close=lambda: None)}
    return client


def node_grads(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    grads = [{"w": torch.randn(2 * NODE_BLOCK, generator=g), "b": torch.randn(5, generator=g)} for _ in range(3)]
    grads[0]["b"] = None   # the leader has no gradient for "b", rank 1 has
    return grads


def node_reference(initial: dict, grads: list[dict], weights) -> dict:
    params = {n: initial[n].clone().requires_grad_() for n in ("w", "b")}
    opt = torch.optim.AdamW(list(params.values()), lr=LR, foreach=False)
    for n, p in params.items():
        p.grad = sum(w * g[n] for g, w in zip(grads, weights) if g[n] is not None) / math.fsum(weights)
    opt.step()
    return {n: p.detach() for n, p in params.items()}


def node_values(node: PSNode) -> dict:
    job = node.store.get("j")
    return {"w": torch.cat([job.blocks[("w", i)].value for i in (0, 1)]), "b": job.blocks[("b", 0)].value}


def assert_node_equals_torch(node: PSNode, initial: dict, grads: list[dict], weights) -> None:
    """The node's values after the step equal torch.optim's on the weighted mean (node_reference)."""
    want = node_reference(initial, grads, weights)
    for n, v in node_values(node).items():
        torch.testing.assert_close(v, want[n], **ROUND_OFF)


def sums_of(grads: list[dict], weights) -> dict:
    return {n: sum(w * g[n] for g, w in zip(grads[:2], weights[:2]) if g[n] is not None) for n in ("w", "b")}


def watch_pushes(node: PSNode) -> list:
    """The (rank, agg_ranks) of every push ``node`` begins."""
    seen, real = [], node.begin_push

    def begin_push(header, scratch, regions=None):
        seen.append((header.rank, tuple(header.agg_ranks)))
        return real(header, scratch, regions)
    node.begin_push = begin_push
    return seen


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_client_pushes_an_aggregate_over_the_data_plane(transport, offline_client, request):
    weights = WEIGHTS[:3]
    initial = {"w": torch.randn(2 * NODE_BLOCK, generator=torch.Generator().manual_seed(1)), "b": torch.randn(5)}
    node = served_node(initial)
    pushes = watch_pushes(node)
    served = [ServedOverTcp(node) if transport == "tcp" else ServedOverShm(node) for _ in range(3)]
    make = offline_client if transport == "tcp" else request.getfixturevalue("shm_client")
    clients = [node_client(make, rank, s.client) for rank, s in enumerate(served)]
    for client in clients:
        client._local_addresses["x:2"] = transport == "shm"   # the node is on this host
    try:
        grads = node_grads(2)
        sums = sums_of(grads, weights)
        leader, member, other = clients
        if transport == "shm":   # the sums in the leader's gradient buffers: the node takes them from there
            sums = leader.stage_gradients(sums)
            assert all(leader._shm.in_grad_region(t) for t in sums.values())
        leader.push(grads[0], weight=weights[0], commit=False,
                    aggregate=HostAggregate((0, 1), weights[:2], sums))
        assert pushes == [(0, (0, 1))]
        assert leader._inflight[0].grads.keys() == {("w", 0), ("w", 1)}   # its own blocks, not the sums'
        assert torch.equal(leader._inflight[0].grads[("w", 1)], grads[0]["w"][NODE_BLOCK:])
        if transport == "shm":
            assert leader.stats.taken_blocks == 3
        member.record_pushed(grads[1], weight=weights[1])
        assert member._inflight[0].grads.keys() == {("w", 0), ("w", 1), ("b", 0)} and pushes == [(0, (0, 1))]
        other.push(grads[2], weight=weights[2])
        leader.commit(weight=weights[0])
        member.commit(weight=weights[1])
        assert node.store.get("j").step == 1 and node.store.get("j").aggregated_ranks == 2
        assert_node_equals_torch(node, initial, grads, weights)
    finally:
        for s in served:
            s.close()


def test_a_node_recovered_within_an_aggregate_gets_the_leaders_record_alone_then_the_conflict(offline_client):
    """The node refuses the aggregate as busy (its blocks wait for a handover); the leader's
    recovery resends its own record alone, then the aggregate again: the node now holds the
    leader's blocks but not the member's, so AGGREGATE_CONFLICT, and the ranks push alone."""
    weights = WEIGHTS[:3]
    initial = {"w": torch.randn(2 * NODE_BLOCK, generator=torch.Generator().manual_seed(3)), "b": torch.randn(5)}
    node = served_node(initial)
    job = node.store.get("j")
    keys = set(job.blocks)
    job.set_primary(set(), epoch=1)   # taken over (again) from a live primary whose handover never comes
    job.set_primary(keys, epoch=1, awaiting={k: ("old", time.monotonic() + 1.5) for k in keys})
    pushes = watch_pushes(node)
    served = [ServedOverTcp(node) for _ in range(3)]
    leader, member, other = (node_client(offline_client, rank, s.client) for rank, s in enumerate(served))
    try:
        grads = node_grads(4)
        with pytest.raises(RemoteError) as err:
            leader.push(grads[0], weight=weights[0], commit=False,
                        aggregate=HostAggregate((0, 1), weights[:2], sums_of(grads, weights)))
        assert err.value.code == ErrorCode.AGGREGATE_CONFLICT
        aggregated = [ranks for _rank, ranks in pushes]
        assert aggregated[0] == (0, 1) and aggregated[-1] == (0, 1) and () in aggregated[1:-1], pushes
        assert job.aggregated_ranks == 0
        leader.push(grads[0], weight=weights[0])   # alone: a resend where the record went already
        member.push(grads[1], weight=weights[1])
        other.push(grads[2], weight=weights[2])
        assert_node_equals_torch(node, initial, grads, weights)
    finally:
        for s in served:
            s.close()


def test_the_client_refuses_an_aggregate_that_does_not_fit_before_sending(offline_client):
    client = node_client(offline_client, 0, None)
    g = {"w": torch.ones(2 * NODE_BLOCK), "b": torch.ones(5)}
    cases = [
        (HostAggregate((0, 1), (1.0, 1.0), {"w": g["w"]}), "no sum for block b[0]"),
        (HostAggregate((0, 3), (1.0, 1.0), g), "world_size 3"),
        (HostAggregate((1, 2), (1.0, 1.0), g), "not among them"),
        (HostAggregate((0, 1), (2.0, 1.0), g), "weight 2.0, the frame's weight is 1.0"),
    ]
    for aggregate, message in cases:
        with pytest.raises(ShardlineConfigError, match=re.escape(message)):
            client.push(g, aggregate=aggregate)
    assert not client._inflight
