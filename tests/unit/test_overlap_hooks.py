"""Push during backward (worker/overlap.py) and priority pull (worker/priority_pull.py) without a
cluster: a fake send records what would go out, on a real one-thread executor."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn

from shardline.services.blocks import block_slices
from shardline.services.errors import ShardlineConfigError
from shardline.worker.flat_params import flat_layout
from shardline.worker.overlap import BackwardPusher, FlatBackwardPusher, bucket_cap_bytes, plan_buckets
from shardline.worker.priority_pull import PriorityPull


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 2)
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Recorder:
    """``send`` of a BackwardPusher: what it got, in order (copies: the caller may reuse grads)."""

    def __init__(self, fail_on: str | None = None):
        self.sent: list[tuple[dict, float, object, bool]] = []
        self.fail_on = fail_on

    def __call__(self, grads, weight, lrs, commit):
        if self.fail_on in grads:
            raise ConnectionError(f"push of {self.fail_on} failed")
        self.sent.append(({n: g.clone() for n, g in grads.items()}, weight, lrs, commit))


@pytest.fixture
def comm():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown(wait=True)


def pusher_for(model, comm, send, cap=1, info=(2.0, 0.1)):
    return BackwardPusher(list(model.named_parameters()), send=send, submit=comm.submit,
                          round_info=lambda: info, cap_bytes=cap)


def loss_of(model, seed=1):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    return model(x).pow(2).sum()


def test_plan_buckets_cuts_at_the_cap_and_keeps_big_tensors_alone():
    assert plan_buckets([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert plan_buckets([4, 100, 4], 8) == [[0], [1], [2]]
    assert plan_buckets([], 8) == []
    assert bucket_cap_bytes(1) == 2**20
    with pytest.raises(ShardlineConfigError, match="bucket_cap_mb.*0"):
        bucket_cap_bytes(0)


def test_buckets_go_out_during_backward_last_layer_first_and_the_commit_at_its_end(comm):
    model, send = Net(), Recorder()
    pusher = pusher_for(model, comm, send)
    seen_during_backward = []
    # a hook on the first layer's input gradient runs at the very end of backward: by then the
    # buckets of the later layers were handed to the communication thread
    model.a.weight.register_hook(lambda g: seen_during_backward.append(len(pusher._round.futures)))
    loss_of(model).backward()
    assert pusher.finish() == (2.0, 0.1)
    assert seen_during_backward and seen_during_backward[0] >= 3
    names = [n for grads, *_ in send.sent for n in grads]
    assert names[:2] == ["c.bias", "c.weight"] or names[:2] == ["c.weight", "c.bias"]
    assert sorted(names) == sorted(n for n, p in model.named_parameters() if p.grad is not None)
    assert "unused.weight" not in names  # grad None: not pushed
    assert [commit for *_, commit in send.sent] == [False] * (len(send.sent) - 1) + [True]
    for grads, *_ in send.sent:
        for n, g in grads.items():
            assert torch.equal(g, dict(model.named_parameters())[n].grad)
    assert pusher.finish() is None  # the round ended


def test_no_sync_accumulates_and_the_next_backward_pushes_the_sum(comm):
    model, send = Net(), Recorder()
    pusher = pusher_for(model, comm, send, cap=10**6)  # one bucket
    reference = Net()
    for seed in (1, 2):
        loss_of(reference, seed).backward()
    with pusher.no_sync():
        loss_of(model, 1).backward()
    assert not pusher.active and not send.sent
    loss_of(model, 2).backward()
    pusher.finish()
    pushed = {n: g for grads, *_ in send.sent for n, g in grads.items()}
    for n, p in reference.named_parameters():
        if p.grad is not None:
            assert torch.allclose(pushed[n], p.grad, atol=0, rtol=0), n


def test_a_gradient_only_from_a_no_sync_microbatch_goes_out_with_the_commit(comm):
    model, send = Net(), Recorder()
    pusher = pusher_for(model, comm, send)
    with pusher.no_sync():
        model.unused(torch.ones(1, 2)).sum().backward()
    loss_of(model).backward()
    pusher.finish()
    last, *_, commit = send.sent[-1]
    assert commit and "unused.weight" in last and "unused.bias" in last


def test_a_second_backward_outside_no_sync_is_refused_at_finish(comm):
    model, send = Net(), Recorder()
    pusher = pusher_for(model, comm, send)
    loss_of(model).backward()
    loss_of(model).backward()
    with pytest.raises(ShardlineConfigError, match="second backward.*no_sync"):
        pusher.finish()


def test_a_failed_push_stops_the_round_and_is_raised_without_a_commit(comm):
    model, send = Net(), Recorder(fail_on="b.weight")
    pusher = pusher_for(model, comm, send)
    loss_of(model).backward()
    with pytest.raises(ConnectionError, match="b.weight"):
        pusher.finish()
    assert send.sent and not any(commit for *_, commit in send.sent)
    assert all("a.weight" not in grads for grads, *_ in send.sent)  # pushed after the failure: skipped
    send.fail_on = None  # the next step starts a fresh round
    model.zero_grad()
    loss_of(model).backward()
    assert pusher.finish() == (2.0, 0.1)


def test_an_error_of_round_info_is_raised_at_finish_and_nothing_is_sent(comm):
    model, send = Net(), Recorder()

    def bad_info():
        raise ShardlineConfigError("only lr can change")

    pusher = BackwardPusher(list(model.named_parameters()), send=send, submit=comm.submit, round_info=bad_info,
                            cap_bytes=1)
    loss_of(model).backward()
    with pytest.raises(ShardlineConfigError, match="only lr"):
        pusher.finish()
    assert not send.sent


def test_buckets_follow_the_order_the_first_backward_produced(comm):
    model, send = Net(), Recorder()
    pusher = BackwardPusher(list(model.named_parameters()), send=send, submit=comm.submit,
                            round_info=lambda: (1.0, 0.1), cap_bytes=10**6)
    assert pusher.buckets == [[7, 6, 5, 4, 3, 2, 1, 0]]
    pusher._cap = 1  # one bucket per tensor from now on
    loss_of(model).backward()
    pusher.finish()
    order = [i for bucket in pusher.buckets for i in bucket]
    assert pusher.buckets == [[i] for i in order] and sorted(order) == list(range(8))
    assert set(order[:2]) == {4, 5} and set(order[4:6]) == {0, 1}  # c's gradients came first, a's last
    assert order[-2:] == [7, 6]  # the unused layer (no gradient) keeps the reverse registration order, at the end


def test_priority_pull_learns_the_forward_order_and_a_module_waits_only_for_its_own(comm):
    model = Net()
    params = list(model.named_parameters())
    names = [n for n, _ in params]
    pull = PriorityPull(params, cap_bytes=1)

    def before_forward(module, _args):
        pull.before_forward(module)  # (a pre-hook returning a value would replace the arguments)

    hook = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
    try:
        model(torch.ones(1, 4))  # teaches the order (here the registration order, as forward runs a, b, c)
        chunks = pull.begin()
        assert [names[i] for c in chunks for i in c][:6] == names[:6]
        gate = threading.Event()
        pulled = []

        def fake_pull(indices):
            if names[indices[0]].startswith("b."):
                assert gate.wait(10)
            pulled.extend(indices)

        fut = comm.submit(pull.run, chunks, fake_pull)
        assert pull.before_forward(model.a)  # a's chunks arrive while b's are held back
        assert not pull._ready[names.index("b.weight")].is_set()
        gate.set()
        assert pull.before_forward(model.b) and pull.before_forward(model.c)
        fut.result(10)
        assert sorted(pulled) == list(range(len(params)))

        def broken(indices):
            raise ConnectionError("node lost")

        fut = comm.submit(pull.run, pull.begin(), broken)
        assert pull.before_forward(model.c) is False  # released, told the pull failed
        with pytest.raises(ConnectionError):
            fut.result(10)
    finally:
        hook.remove()


def test_a_backward_that_raised_is_reported_and_the_next_one_pushes_again(comm):
    model, send = Net(), Recorder()
    pusher = pusher_for(model, comm, send)
    x = torch.randn(3, 4)
    h = torch.tanh(model.a(x))

    def boom(grad):
        raise RuntimeError("boom")

    h.register_hook(boom)  # after c's and b's gradients were final, before a's
    with pytest.raises(RuntimeError, match="boom"):
        model.c(torch.tanh(model.b(h))).sum().backward()
    with pytest.raises(ShardlineConfigError, match="did not finish"):
        pusher.finish()
    assert not any(commit for *_, commit in send.sent)
    model.zero_grad()
    loss_of(model).backward()
    assert pusher.finish() == (2.0, 0.1)
    assert send.sent[-1][-1] is True


class FlatNet(nn.Module):
    """Three layers, every parameter used (a flat group needs every member's gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 8)   # 32 + 8
        self.b = nn.Linear(8, 8)   # 64 + 8
        self.c = nn.Linear(8, 2)   # 16 + 2

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class BlockRecorder:
    """``send`` of a FlatBackwardPusher: each call's blocks, their values at send time, and commit."""

    def __init__(self):
        self.sent: list[tuple[dict, bool]] = []

    def __call__(self, payload, weight, lrs, commit):
        self.sent.append(({name: {i: buf[i * BLOCK:(i + 1) * BLOCK].clone() for i in indices}
                           for name, (buf, indices) in payload.items()}, commit))


BLOCK = 24   # blocks of the 130-element flat tensor: 0..5, each straddling parameters


def flat_pusher_for(model, comm, send, buffers=None):
    groups = flat_layout([{"params": list(model.parameters()), "param_names": [n for n, _ in model.named_parameters()]}])

    def buffer(f):
        buf = torch.full((f.numel,), float("nan"))   # every element must be written before it goes out
        if buffers is not None:
            buffers.append(buf)
        return buf

    slices = {f.name: block_slices(f.numel, BLOCK) for f in groups}
    pusher = FlatBackwardPusher(groups, slices, buffer=buffer, send=send, submit=comm.submit,
                                round_info=lambda: (2.0, 0.1))
    return pusher, groups[0]


def test_flat_blocks_go_out_once_every_parameter_overlapping_them_is_final(comm):
    model, send = FlatNet(), BlockRecorder()
    pusher, group = flat_pusher_for(model, comm, send)
    loss_of(model).backward()
    assert pusher.finish() == (2.0, 0.1)
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    sent = [(i, value) for blocks, _ in send.sent for i, value in blocks[group.name].items()]
    assert sorted(i for i, _ in sent) == list(range(6)), "each block exactly once"
    for i, value in sent:
        assert torch.equal(value, flat[i * BLOCK:(i + 1) * BLOCK]), f"block {i}"
    # backward finishes c first, a last: the last blocks (c's and b's ranges) went out first, and the
    # blocks holding a.weight (elements 0..31) last; none of it commits (step() does)
    assert [i for i, _ in sent][0] == 5 and {i for i, _ in sent[-2:]} == {0, 1}
    assert not any(commit for _, commit in send.sent)
    assert len(send.sent) >= 3, "blocks go out during backward, not all at its end"


def test_flat_no_sync_gathers_the_accumulated_gradients_when_backward_ends(comm):
    model, reference, send = FlatNet(), FlatNet(), BlockRecorder()
    pusher, group = flat_pusher_for(model, comm, send)
    for seed in (1, 2):
        loss_of(reference, seed).backward()
    with pusher.no_sync():
        loss_of(model, 1).backward()
    assert not send.sent
    loss_of(model, 2).backward()
    pusher.finish()
    flat = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    blocks = {i: v for b, _ in send.sent for i, v in b[group.name].items()}
    assert torch.equal(torch.cat([blocks[i] for i in range(6)]), flat[:6 * BLOCK])


def test_flat_a_member_without_a_gradient_is_the_rounds_error(comm):
    model, send = FlatNet(), BlockRecorder()
    pusher, _group = flat_pusher_for(model, comm, send)
    model.b.weight.requires_grad_(False)   # after the layout: b.weight gets no gradient in backward
    loss_of(model).backward()
    with pytest.raises(ShardlineConfigError, match="'b.weight' got none this step"):
        pusher.finish()
    # blocks 0 (a.weight only) and 5 (c only) are complete without b.weight: they may have gone
    # out before backward's end found the missing gradient (the send races that), no other may
    sent = {i for blocks, _ in send.sent for i in next(iter(blocks.values()))}
    assert sent <= {0, 5}, "only blocks without b.weight may have gone out"
    with pytest.raises(ShardlineConfigError, match="second backward"):   # the flat rule of one backward holds
        model.b.weight.requires_grad_(True)
        model.zero_grad()
        loss_of(model).backward()
        loss_of(model).backward()
        pusher.finish()
