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
from shardline.services.pb import dataplane_pb2 as dp

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
    def ref(numel, dtype=dp.FLOAT32):
        return dp.BlockRef(numel=numel, dtype=dtype)

    assert codec.accepts(BLOCK, ref(BLOCK)) and codec.accepts(BLOCK, ref(codec.packed_numel(BLOCK)))
    assert codec.accepts(BLOCK, ref(BLOCK, dp.BFLOAT16))
    assert not codec.accepts(BLOCK, ref(BLOCK + 1)) and not codec.accepts(BLOCK, ref(codec.packed_numel(BLOCK),
                                                                                     dp.BFLOAT16))
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


# --- a frozen tensor in its own dtype (bfloat16: 2 bytes per parameter) --------------------------

def bf16_spec() -> common_pb2.JobSpec:
    s = spec()
    s.tensors[1].dtype = "bfloat16"
    return s


def bf16_started() -> JobStore:
    job = JobStore(bf16_spec())
    base = initial()["base"].to(torch.bfloat16)   # what a worker holding a bf16 base sends
    job.init_blocks([("adapter", s.index, initial()["adapter"][s.start:s.stop]) for s in block_slices(TRAINED, BLOCK)]
                    + [("base", s.index, base[s.start:s.stop]) for s in block_slices(BASE, BLOCK)])
    return job


def test_a_frozen_bfloat16_tensor_is_stored_as_bfloat16_and_read_back_exactly():
    job = bf16_started()
    assert all(b.value.dtype == torch.bfloat16 for (t, _i), b in job.blocks.items() if t == "base")
    assert job_memory(job)["values"] == 4 * TRAINED + 2 * BASE
    want = initial()["base"].to(torch.bfloat16)
    wanted = [("base", s.index, None) for s in block_slices(BASE, BLOCK)]
    for dtype in (torch.bfloat16, torch.float32):   # a bf16 reader gets its bits, an fp32 reader their exact value
        _step, got = job.changed_blocks(wanted, copy=False, dtypes=[dtype] * len(wanted))
        assert torch.equal(torch.cat([v for _t, _i, _v, v in got]), want.to(dtype))


def test_an_unfrozen_bfloat16_tensor_trains_in_float32_from_its_values_like_torch_optim():
    job = bf16_started()
    ext = common_pb2.JobExtension(revision=1, step=0, unfreeze=["base"],
                                  group=OptimizerConfig.from_kwargs("adamw", lr=0.01, weight_decay=0.1).to_proto())
    new = apply_extension(job.spec, ext)
    assert next(t for t in new.tensors if t.name == "base").dtype == "float32"
    assert job.extend(new)
    assert all(b.value.dtype == torch.float32 for b in job.blocks.values())
    param = initial()["base"].to(torch.bfloat16).float().requires_grad_()
    opt = torch.optim.AdamW([param], lr=0.01, weight_decay=0.1)
    grad = torch.randn(BASE, generator=torch.Generator().manual_seed(9))
    job.push(0, 0, 1.0, [PushItem("base", s.index, grad[s.start:s.stop].clone()) for s in block_slices(BASE, BLOCK)])
    job.commit(0, 0, 1.0)
    param.grad = grad
    opt.step()
    got = torch.cat([job.blocks[("base", s.index)].value for s in block_slices(BASE, BLOCK)])
    torch.testing.assert_close(got, param.detach(), rtol=1e-6, atol=1e-6)


def test_a_bfloat16_blocks_copy_travels_in_bfloat16_and_lands_in_the_receivers_dtype():
    job = bf16_started()
    key = ("base", 2)
    refs, payloads = copy_refs(BlockCodec(job), [(key, job.blocks[key])])
    assert (refs[0].dtype, refs[0].numel, refs[0].nbytes) == (dp.BFLOAT16, BLOCK, 2 * BLOCK)
    payload = bytearray(b"".join(bytes(p) for p in payloads))
    flat = torch.frombuffer(payload, dtype=torch.bfloat16)
    value, state = BlockCodec(bf16_started()).unpack(BLOCK, flat, "base")
    assert value.dtype == torch.bfloat16 and torch.equal(value, job.blocks[key].value) and state == {}
    unfrozen = bf16_started()
    unfrozen.extend(apply_extension(unfrozen.spec, common_pb2.JobExtension(
        revision=1, step=0, unfreeze=["base"], group=OptimizerConfig.from_kwargs("adamw", lr=0.01).to_proto())))
    value, state = BlockCodec(unfrozen).unpack(BLOCK, flat, "base")
    assert value.dtype == torch.float32 and torch.equal(value, job.blocks[key].value.float()) and state


def test_a_checkpoint_keeps_a_frozen_tensor_in_bfloat16(tmp_path):
    from google.protobuf import json_format

    from shardline.ps_server.checkpoint import BlockSnapshot, CheckpointDir, JobSnapshot

    job = bf16_started()
    job.uid = "u1"
    step, held, copies = job.snapshot()
    ckdir = CheckpointDir(tmp_path / "ck", "n1")
    ckdir.write(JobSnapshot(job="lora", uid="u1", node_id="n1", epoch=1, step=step,
                            spec=json_format.MessageToDict(job.spec, preserving_proto_field_name=True), held=held,
                            full=True, blocks=[BlockSnapshot(*copy) for copy in copies]))
    loaded = ckdir.load("lora")
    assert all(b.value.dtype == torch.bfloat16 for (t, _i), b in loaded.blocks.items() if t == "base")
    fresh = JobStore(bf16_spec())
    fresh.restore(loaded.step, {k: (b.version, b.value, b.state) for k, b in loaded.blocks.items()})
    for key, block in job.blocks.items():
        assert fresh.blocks[key].value.dtype == block.value.dtype and torch.equal(fresh.blocks[key].value, block.value)


def test_the_dispatcher_stores_only_frozen_tensors_in_bfloat16():
    import pytest

    from shardline.dispatcher.jobs import normalize_spec
    from shardline.services.errors import ShardlineConfigError
    from shardline.worker.client import storage_dtype

    assert normalize_spec(bf16_spec()).tensors[1].dtype == "bfloat16"
    bad = bf16_spec()
    bad.tensors[0].dtype = "bfloat16"
    with pytest.raises(ShardlineConfigError, match="'adapter' is trainable and 'bfloat16'"):
        normalize_spec(bad)
    bf16 = torch.zeros(2, dtype=torch.bfloat16)
    assert storage_dtype(bf16, trainable=False) == "bfloat16"
    assert storage_dtype(bf16, trainable=True) == storage_dtype(bf16.float(), trainable=False) == "float32"


# --- frozen values in a file, off the heap ------------------------------------------------------

def filed(tmp_path, job_spec=None) -> JobStore:
    job = JobStore(job_spec or bf16_spec(), spill_dir=str(tmp_path))
    base = initial()["base"].to(job.tensors["base"].dtype)
    job.init_blocks([("adapter", s.index, initial()["adapter"][s.start:s.stop]) for s in block_slices(TRAINED, BLOCK)]
                    + [("base", s.index, base[s.start:s.stop]) for s in block_slices(BASE, BLOCK)])
    return job


def test_frozen_values_live_in_an_unnamed_file_and_read_back_exactly(tmp_path):
    job = filed(tmp_path)
    assert list(tmp_path.iterdir()) == []                       # unnamed: nothing left behind, ever
    base = [b for (t, _i), b in job.blocks.items() if t == "base"]
    assert all(job.in_frozen_file(b.value) for b in base)
    assert not any(job.in_frozen_file(b.value) for (t, _i), b in job.blocks.items() if t == "adapter")
    got = job_memory(job)
    assert got["frozen_files"] == 2 * BASE and got["values"] == 4 * TRAINED   # the heap holds the adapter only
    wanted = [("base", s.index, None) for s in block_slices(BASE, BLOCK)]
    job.release_frozen_pages()                                  # out of the resident set: read again from the cache
    _step, read = job.changed_blocks(wanted, copy=False, dtypes=[torch.float32] * len(wanted))
    assert torch.equal(torch.cat([v for _t, _i, _v, v in read]), initial()["base"].to(torch.bfloat16).float())
    step, _held, copies = job.snapshot()                         # a checkpoint reads the slots, no clone
    assert all(job.in_frozen_file(value) for t, _i, _v, value, _s in copies if t == "base")


def test_a_frozen_copy_installed_again_keeps_its_slot_and_an_unfrozen_one_leaves_the_file(tmp_path):
    job = filed(tmp_path)
    key = ("base", 1)
    slot = job.blocks[key].value
    job.apply_copies([("base", 1, 0, 0, slot.clone(), {})])     # a sync sends it again: unchanged
    assert job.blocks[key].value.data_ptr() == slot.data_ptr()
    assert job.extend(unfreeze_base(job))
    value = job.blocks[key].value
    assert value.dtype == torch.float32 and not job.in_frozen_file(value)   # trained in the heap
    assert torch.equal(value, slot.float())


def test_without_room_for_the_file_frozen_values_stay_in_memory(tmp_path, monkeypatch, caplog):
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    job = filed(tmp_path)
    assert not any(job.in_frozen_file(b.value) for b in job.blocks.values())
    assert job_memory(job)["values"] == 4 * TRAINED + 2 * BASE
    assert "stay in memory" in caplog.text and "No space left" in caplog.text
    missing = JobStore(bf16_spec(), spill_dir=str(tmp_path / "absent"))   # a directory that is gone
    assert missing.frozen_file is None and missing.spill_dir is None


def test_status_shows_frozen_values_in_files_apart_from_memory():
    from shardline.cli import render_memory

    job = {"parameters": 1_000_000, "bytes": {"values": 4_000, "optimizer_state": 8_000, "frozen_files": 1_990_000}}
    text = render_memory({"ps-0": {"rss_bytes": 300 << 20, "anon_bytes": 200 << 20, "receive_buffer_bytes": 0,
                                   "jobs": {"lora": job}}})
    header = next(line for line in text.splitlines() if line.startswith("NODE") and " JOB " in line)
    assert "IN FILES" in header
    row = next(line for line in text.splitlines() if " lora " in line)
    assert row.split()[-1] == "0.0"         # 12,000 B of memory for 1,000,000 parameters (files apart)


def test_the_spill_dir_is_made_and_checked_at_start(tmp_path):
    from types import SimpleNamespace

    import pytest

    from shardline.ps_server.main import open_spill_dir
    from shardline.services.errors import ShardlineConfigError

    made = tmp_path / "spill" / "a"
    assert open_spill_dir(SimpleNamespace(frozen_values="files", spill_dir=str(made))) == str(made)
    assert made.is_dir() and list(made.iterdir()) == []
    assert open_spill_dir(SimpleNamespace(frozen_values="memory", spill_dir=str(made))) is None
    afile = tmp_path / "a-file"
    afile.write_text("x")
    with pytest.raises(ShardlineConfigError, match="spill_dir .*a-file/sub.* cannot hold .*frozen_values: memory"):
        open_spill_dir(SimpleNamespace(frozen_values="files", spill_dir=str(afile / "sub")))


def test_a_spill_dir_on_a_tmpfs_is_told_apart_from_a_disk():
    from shardline.ps_server.main import filesystem_of

    mounts = ("overlay / overlay rw 0 0\n"
              "tmpfs /tmp tmpfs rw,nosuid 0 0\n"
              "/dev/vda /var/lib ext4 rw 0 0\n"
              "tmpfs /var/lib/odd\\040dir tmpfs rw 0 0\n")
    assert filesystem_of("/tmp/shardline", mounts) == "tmpfs"
    assert filesystem_of("/var/tmp", mounts) == "overlay"
    assert filesystem_of("/var/lib/shardline/spill", mounts) == "ext4"
    assert filesystem_of("/var/lib/odd dir/x", mounts) == "tmpfs"
    assert filesystem_of("/tmpx", mounts) == "overlay"       # a prefix of a name is not its mount
