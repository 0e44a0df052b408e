"""A frozen tensor's blocks keep no optimizer state (issue 41): they are never stepped, so the
state would stay the fresh one, 8 bytes per parameter for AdamW kept for nothing. Unfrozen, they
get the fresh state (as a new torch.optim group starts); their copies travel as the value alone;
a checkpoint that kept their state restores without it."""

from __future__ import annotations

import torch

from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.replication_codec import BlockCodec, copy_refs
from shardline.ps_server.store import JobStore, PushItem
from shardline.ps_server.store.memory import job_memory
from shardline.services.blocks import block_slices
from shardline.services.extension import apply_extension
from shardline.services.pb import common_pb2

BLOCK = 8
TRAINED, BASE = 20, 100


def spec() -> common_pb2.JobSpec:
    s = common_pb2.JobSpec(name="lora", sync="bsp", world_size=1, block_elements=BLOCK,
                           optimizer=OptimizerConfig.from_kwargs("adamw", lr=0.01, weight_decay=0.1).to_proto())
    s.tensors.add(name="adapter", shape=[TRAINED], dtype="float32", trainable=True)
    s.tensors.add(name="base", shape=[BASE], dtype="float32", trainable=False)
    return s


def initial() -> dict:
    gen = torch.Generator().manual_seed(3)
    return {"adapter": torch.randn(TRAINED, generator=gen), "base": torch.randn(BASE, generator=gen)}


def started(job_spec=None) -> JobStore:
    job = JobStore(job_spec or spec())
    job.init_blocks([(name, s.index, value[s.start:s.stop]) for name, value in initial().items()
                     for s in block_slices(value.numel(), BLOCK)])
    return job


def unfreeze_base(job: JobStore) -> common_pb2.JobSpec:
    ext = common_pb2.JobExtension(revision=1, step=job.step, unfreeze=["base"],
                                  group=OptimizerConfig.from_kwargs("adamw", lr=0.01, weight_decay=0.1).to_proto())
    return apply_extension(job.spec, ext)


def test_a_frozen_tensor_costs_its_values_only():
    job = started()
    assert all(b.state == {} for (t, _i), b in job.blocks.items() if t == "base")
    assert all(set(b.state) == {"step", "exp_avg", "exp_avg_sq"} for (t, _i), b in job.blocks.items() if t == "adapter")
    got = job_memory(job)
    assert got["values"] == 4 * (TRAINED + BASE)
    assert got["optimizer_state"] == 8 * TRAINED + 4 * len(block_slices(TRAINED, BLOCK))   # moments, step counts


def test_an_unfrozen_tensor_gets_the_fresh_state_and_trains_like_a_new_torch_optim_group():
    job = started()
    grads = [torch.randn(BASE, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    assert job.extend(unfreeze_base(job))
    assert all(set(b.state) == {"step", "exp_avg", "exp_avg_sq"} for b in job.blocks.values())
    param = initial()["base"].clone().requires_grad_()
    opt = torch.optim.AdamW([param], lr=0.01, weight_decay=0.1)
    for step, grad in enumerate(grads):
        job.push(0, step, 1.0, [PushItem("base", s.index, grad[s.start:s.stop].clone())
                                for s in block_slices(BASE, BLOCK)])
        job.commit(0, step, 1.0)
        param.grad = grad.clone()
        opt.step()
    got = torch.cat([job.blocks[("base", s.index)].value for s in block_slices(BASE, BLOCK)])
    torch.testing.assert_close(got, param.detach(), rtol=1e-6, atol=1e-6)


def test_a_frozen_blocks_copy_travels_as_its_value_alone_and_gets_the_receivers_state():
    job = started()
    codec = BlockCodec(job)
    key = ("base", 1)
    refs, payloads = copy_refs(codec, [(key, job.blocks[key])])
    assert refs[0].numel == BLOCK and refs[0].nbytes == 4 * BLOCK          # no state packed
    flat = torch.frombuffer(bytearray(b"".join(bytes(p) for p in payloads)), dtype=torch.float32)
    value, state = codec.unpack(BLOCK, flat, "base")
    assert torch.equal(value, job.blocks[key].value) and state == {}
    trained = ("adapter", 0)
    refs, _ = copy_refs(codec, [(trained, job.blocks[trained])])
    assert refs[0].numel == codec.packed_numel(BLOCK) > BLOCK
    assert codec.accepts(BLOCK, BLOCK) and codec.accepts(BLOCK, codec.packed_numel(BLOCK))
    assert not codec.accepts(BLOCK, BLOCK + 1)
    # a holder that learnt the revision unfreezing the tensor gives the copy the fresh state: the
    # sender's, untouched while it was frozen, is that
    holder = started()
    holder.extend(unfreeze_base(holder))
    _value, state = BlockCodec(holder).unpack(BLOCK, flat, "base")
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and not state["exp_avg"].any()


def test_a_checkpoint_that_kept_a_frozen_blocks_state_restores_without_it():
    job = started()
    blocks = {}
    for key, block in job.blocks.items():
        state = block.state or job.optimizer.init_state(block.value.numel())   # as builds before kept it
        blocks[key] = (block.version, block.value.clone(), state)
    fresh = JobStore(spec())
    fresh.restore(0, blocks)
    assert all(b.state == {} for (t, _i), b in fresh.blocks.items() if t == "base")
    assert all(b.state for (t, _i), b in fresh.blocks.items() if t == "adapter")
