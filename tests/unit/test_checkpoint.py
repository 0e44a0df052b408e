"""Checkpoints of a real JobStore: round trips, incremental chains, torn writes, corruption, retention.

Expected values always come from the store itself (or from copies taken from it at the step in
question), never from the checkpoint module's own output.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import threading

import pytest
import safetensors.torch
import torch
from google.protobuf.json_format import MessageToDict

from shardline.ps_server import checkpoint
from shardline.ps_server.checkpoint import (
    WRITE_STAGES,
    BlockSnapshot,
    CheckpointDir,
    CheckpointError,
    JobSnapshot,
    read_job_tensors,
)
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import JobStore, PushItem
from shardline.services.blocks import block_slices
from shardline.services.errors import ShardlineConfigError, ShardlineStateError
from shardline.services.pb import common_pb2

BLOCK = 7
NODE = "ps-0"
JOB = "job-1"
TENSORS = [("layers.0/attn_w-q", [4, 5], True),   # 3 blocks, the last one short
           ("bias_1", [3], True),
           ("emb", [2, 9], True),                 # 3 blocks
           ("frozen", [2], False),
           ("scalar", [], True)]


class Trainer:
    """A JobStore of two BSP workers; ``step(keys)`` pushes random gradients for those blocks."""

    def __init__(self, kind="adamw", seed=0, **hp):
        self.gen = torch.Generator().manual_seed(seed)
        spec = common_pb2.JobSpec(name=JOB, sync="bsp", world_size=2, block_elements=BLOCK,
                                  optimizer=OptimizerConfig.from_kwargs(kind, lr=0.01, **hp).to_proto())
        for name, shape, trainable in TENSORS:
            spec.tensors.add(name=name, shape=shape, dtype="float32", trainable=trainable)
        self.spec = spec
        self.store = JobStore(spec)
        items = []
        for name, shape, _ in TENSORS:
            flat = torch.randn(math.prod(shape), generator=self.gen)
            items += [(name, s.index, flat[s.start:s.stop]) for s in block_slices(flat.numel(), BLOCK)]
        self.store.init_blocks(items)

    def trainable(self):
        return sorted(k for k in self.store.blocks if self.store.tensors[k[0]].trainable)

    def step(self, keys=None):
        keys = self.trainable() if keys is None else keys
        step = self.store.step
        for rank in (0, 1):
            grads = [PushItem(t, i, torch.randn(self.store.blocks[(t, i)].value.numel(), generator=self.gen))
                     for t, i in keys]
            self.store.push(rank, step, 1.0 + rank, grads)
        for rank in (0, 1):
            self.store.commit(rank, step, 1.0 + rank)
        assert self.store.step == step + 1

    def snapshot(self, *, full=True, base_step=None, keys=None, node_id=NODE, uid="uid-1", epoch=3):
        """Copies of the store's blocks (``keys``: only those; incremental: versions > base_step)."""
        held = {k: b.version for k, b in self.store.blocks.items() if keys is None or k in keys}
        written = sorted(held) if full else sorted(k for k, v in held.items() if v > base_step)
        blocks = []
        for t, i in written:
            b = self.store.blocks[(t, i)]
            state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.state.items()}
            blocks.append(BlockSnapshot(t, i, b.version, b.value.clone(), state))
        return JobSnapshot(job=JOB, uid=uid, node_id=node_id, epoch=epoch, step=self.store.step,
                           spec=MessageToDict(self.spec, preserving_proto_field_name=True),
                           held=held, blocks=blocks, full=full, base_step=base_step)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def expected_blocks(source):
    """(tensor, index) -> (version, value, state) from a JobStore or from a JobSnapshot's copies."""
    if isinstance(source, JobStore):
        return {k: (b.version, b.value, b.state) for k, b in source.blocks.items()}
    return {(b.tensor, b.index): (b.version, b.value, b.state) for b in source.blocks}


def assert_loaded_equals(loaded, expected, *, with_state=True):
    assert set(loaded.blocks) == set(expected)
    for key, (version, value, state) in expected.items():
        got = loaded.blocks[key]
        assert got.version == version, key
        assert got.value.dtype == torch.float32 and got.value.dim() == 1
        assert raw(got.value) == raw(value), key
        if not with_state:
            continue
        assert set(got.state) == set(state), key
        for k, v in state.items():
            g = got.state[k]
            if isinstance(v, torch.Tensor):
                assert isinstance(g, torch.Tensor) and g.dtype == v.dtype and g.shape == v.shape, (key, k)
                assert raw(g) == raw(v), (key, k)
            else:
                assert type(g) is type(v) and g == v, (key, k)


def job_files(root, step=None):
    names = sorted(os.listdir(os.path.join(root, JOB)))
    if step is None:
        return names
    return [n for n in names if n.startswith(f"{step:012d}.") or f".{step:012d}." in n]


def chain_dir(tmp_path, trainer, name="ckpt"):
    """full at 1, incremental at 2 (only layers.0 changed) and 3 (only emb#1 changed)."""
    d = CheckpointDir(tmp_path / name, NODE)
    snaps = {}
    trainer.step()
    snaps[1] = trainer.snapshot()
    d.write(snaps[1])
    trainer.step([("layers.0/attn_w-q", i) for i in range(3)])
    snaps[2] = trainer.snapshot(full=False, base_step=1)
    d.write(snaps[2])
    trainer.step([("emb", 1)])
    snaps[3] = trainer.snapshot(full=False, base_step=2)
    d.write(snaps[3])
    return d, snaps


def hash_helpers() -> list[str]:
    """The write's sha256 helper threads still alive."""
    return [t.name for t in threading.enumerate() if t.name == "checkpoint-sha256"]


@pytest.fixture(params=["inline", "threads"])
def hashing(request, monkeypatch):
    """Writes hash their files inline (as files under 4 MiB are) or in helper threads (as bigger
    ones are); either way no helper thread outlives the write."""
    if request.param == "threads":
        monkeypatch.setattr(checkpoint, "_HASH_THREAD_MIN_BYTES", 0)
    yield request.param
    assert not hash_helpers()


# ---------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind,hp", [("adamw", {"amsgrad": True, "weight_decay": 0.1}), ("sgd", {"momentum": 0.9})])
def test_full_checkpoint_round_trip(tmp_path, kind, hp):
    tr = Trainer(kind, **hp)
    tr.step()
    tr.step(tr.trainable()[:3])  # versions now differ between blocks
    d = CheckpointDir(tmp_path, NODE)
    info = d.write(tr.snapshot())
    assert (info.step, info.kind, info.base_step, info.full_step, info.uid, info.epoch) == (2, "full", None, 2, "uid-1", 3)
    assert info.blocks == len(tr.store.blocks)
    assert info.manifest_path == str(tmp_path / JOB / "000000000002.manifest.json")
    names = ["000000000002.manifest.json", "000000000002.state.safetensors", "000000000002.values.safetensors"]
    assert job_files(tmp_path) == names
    assert info.bytes_written == sum(os.path.getsize(tmp_path / JOB / n) for n in names)
    assert json.loads((tmp_path / "NODE.json").read_text()) == {"node_id": NODE, "format": 1}
    assert d.jobs() == [JOB] and d.list(JOB) == [info]

    loaded = CheckpointDir(tmp_path, NODE).load(JOB)
    assert_loaded_equals(loaded, expected_blocks(tr.store))
    assert {k: b.version for k, b in loaded.blocks.items()} == {k: b.version for k, b in tr.store.blocks.items()}
    assert len({b.version for b in loaded.blocks.values()}) == 3  # 0 (frozen), 1 and 2
    assert (loaded.step, loaded.uid, loaded.epoch, loaded.chain, loaded.skipped) == (2, "uid-1", 3, [2], [])
    assert loaded.spec == MessageToDict(tr.spec, preserving_proto_field_name=True)
    assert loaded.bytes_read >= info.bytes_written and loaded.seconds > 0

    # Plain safetensors files, readable by the safetensors library, keyed as documented.
    values = safetensors.torch.load_file(tmp_path / JOB / names[2])
    state = safetensors.torch.load_file(tmp_path / JOB / names[1])
    assert set(values) == {f"{t}#{i}" for t, i in tr.store.blocks}
    assert set(state) == {f"{t}#{i}#{k}" for (t, i), b in tr.store.blocks.items() for k in b.state}
    assert torch.equal(values["emb#2"], tr.store.blocks[("emb", 2)].value)
    step_entry = state["emb#0#step"]
    assert step_entry.dim() == 0 and step_entry.dtype == (torch.int64 if kind == "sgd" else torch.float32)


def test_large_files_hashed_while_written_have_the_digests_of_their_bytes(tmp_path):
    # Files of several MiB are hashed by helper threads while they are written and fsync'ed.
    gen = torch.Generator().manual_seed(5)
    n = 1 << 20  # 4 MiB of float32 per tensor
    blocks = [BlockSnapshot("w", i, 1, torch.randn(n, generator=gen),
                            {"exp_avg": torch.randn(n, generator=gen), "exp_avg_sq": torch.rand(n, generator=gen),
                             "step": torch.tensor(1.0)}) for i in range(2)]
    snap = JobSnapshot(job=JOB, uid="uid-1", node_id=NODE, epoch=1, step=1, spec={}, held={("w", 0): 1, ("w", 1): 1},
                       blocks=blocks, full=True)
    d = CheckpointDir(tmp_path, NODE)
    info = d.write(snap)
    assert not hash_helpers()
    manifest = json.loads(open(info.manifest_path, "rb").read())
    for name, entry in manifest["files"].items():
        data = (tmp_path / JOB / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}, name
    assert_loaded_equals(d.load(JOB, verify=True), expected_blocks(snap))


def test_incremental_chain_replays_to_the_full_checkpoint_of_the_same_step(tmp_path):
    tr = Trainer("adam")
    d, snaps = chain_dir(tmp_path, tr)
    full = CheckpointDir(tmp_path / "full", NODE)
    full.write(tr.snapshot())

    loaded = d.load(JOB)
    assert loaded.chain == [1, 2, 3]
    reference = full.load(JOB)
    assert reference.chain == [3]
    assert_loaded_equals(loaded, expected_blocks(tr.store))
    assert_loaded_equals(reference, {k: (b.version, b.value, b.state) for k, b in loaded.blocks.items()})

    # An older step of the chain restores what the store held then.
    at2 = d.load(JOB, exact=2)
    assert at2.chain == [1, 2]
    assert_loaded_equals(at2, expected_blocks(snaps[1]) | expected_blocks(snaps[2]))
    assert d.load(JOB, at_most=2).step == 2

    # An incremental writes only the changed blocks: payload bytes are exactly their values+state.
    infos = {i.step: i for i in d.list(JOB)}
    assert [(i.kind, i.base_step, i.full_step, i.blocks) for i in infos.values()] == [
        ("full", None, 1, 9), ("incremental", 1, 1, 3), ("incremental", 2, 1, 1)]
    for step in (2, 3):
        changed = snaps[step].blocks
        payload = sum(b.value.numel() * 4 + sum(v.numel() * v.element_size() for v in b.state.values())
                      for b in changed)
        files = [tmp_path / "ckpt" / JOB / f"{step:012d}.{kind}.safetensors" for kind in ("values", "state")]
        headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
        manifest = os.path.getsize(infos[step].manifest_path)
        assert sum(os.path.getsize(f) for f in files) - headers == payload
        assert infos[step].bytes_written == payload + headers + manifest
    assert infos[3].bytes_written < infos[2].bytes_written < infos[1].bytes_written


def test_write_refuses_inconsistent_snapshots(tmp_path):
    tr = Trainer()
    tr.step()
    d = CheckpointDir(tmp_path, NODE)
    d.write(tr.snapshot())
    with pytest.raises(CheckpointError, match="already has a checkpoint at step 1"):
        d.write(tr.snapshot())
    tr.step([("emb", 0)])
    inc = tr.snapshot(full=False, base_step=1)
    inc.blocks = []  # emb#0 changed but is not written
    with pytest.raises(CheckpointError, match=r"omits block emb#0 \(version 2\)"):
        d.write(inc)
    with pytest.raises(CheckpointError, match="needs its base checkpoint at step 0"):
        d.write(tr.snapshot(full=False, base_step=0))
    with pytest.raises(CheckpointError, match="base checkpoint .* is of job uid 'uid-1'"):
        d.write(tr.snapshot(full=False, base_step=1, uid="uid-2"))
    with pytest.raises(CheckpointError, match="is of node 'ps-9'"):
        d.write(tr.snapshot(node_id="ps-9"))
    partial = tr.snapshot()
    partial.blocks.pop()
    with pytest.raises(CheckpointError, match="must write every held block"):
        d.write(partial)
    assert [i.step for i in d.list(JOB)] == [1]


# ---------------------------------------------------------------------- crashes and failures


def test_a_crash_at_any_stage_leaves_earlier_checkpoints_loadable(tmp_path, hashing):
    tr = Trainer()
    tr.step()
    seen = []

    def crash_here(stage):
        # What a kill -9 right now leaves on disk.
        seen.append(stage)
        shutil.copytree(tmp_path / "ckpt", tmp_path / f"crash-{stage}")

    CheckpointDir(tmp_path / "ckpt", NODE).write(tr.snapshot())
    tr.step(tr.trainable()[:2])
    snap2 = tr.snapshot(full=False, base_step=1)
    CheckpointDir(tmp_path / "ckpt", NODE, failpoint=crash_here).write(snap2)
    assert seen == list(WRITE_STAGES)

    for n, stage in enumerate(WRITE_STAGES):
        root = tmp_path / f"crash-{stage}"
        d = CheckpointDir(root, NODE)
        visible = n >= WRITE_STAGES.index("manifest.renamed")
        assert [i.step for i in d.list(JOB)] == ([1, 2] if visible else [1]), stage
        assert d.load(JOB, exact=1).chain == [1]
        loaded = d.load(JOB)
        assert loaded.step == (2 if visible else 1) and loaded.skipped == []
        if visible:
            assert_loaded_equals(loaded, expected_blocks(tr.store))
            continue
        # The next write replaces the torn one and sweeps its leftovers.
        d.write(snap2)
        assert not [f for f in job_files(root) if f.startswith(".")], stage
        assert_loaded_equals(d.load(JOB), expected_blocks(tr.store))


@pytest.mark.parametrize("stage", WRITE_STAGES)
def test_a_failed_write_leaves_nothing_behind(tmp_path, stage, hashing):
    tr = Trainer()
    tr.step()
    CheckpointDir(tmp_path, NODE).write(tr.snapshot())
    before = job_files(tmp_path)
    tr.step()

    def fail(s):
        if s == stage:
            raise RuntimeError(f"injected at {s}")

    with pytest.raises(RuntimeError, match="injected"):
        CheckpointDir(tmp_path, NODE, failpoint=fail).write(tr.snapshot(full=False, base_step=1))
    assert not hash_helpers()
    assert job_files(tmp_path) == before
    assert CheckpointDir(tmp_path, NODE).load(JOB).step == 1


@pytest.mark.parametrize("target", ["values", "state", "manifest"])
def test_disk_full_raises_naming_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, target, hashing):
    tr = Trainer()
    tr.step()
    d = CheckpointDir(tmp_path, NODE)
    d.write(tr.snapshot())
    before = {n: (tmp_path / JOB / n).read_bytes() for n in job_files(tmp_path)}
    real_write_all = checkpoint._write_all

    def write_all(fd, data):
        if f".{target}." in os.readlink(f"/proc/self/fd/{fd}"):
            real_write_all(fd, memoryview(data).cast("B")[: len(data) // 2])  # part of it lands
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write_all(fd, data)

    monkeypatch.setattr(checkpoint, "_write_all", write_all)
    tr.step()
    with pytest.raises(CheckpointError, match=rf"cannot write .*/{JOB}/\.000000000002\.{target}\..*No space left on device"):
        d.write(tr.snapshot())
    assert not hash_helpers()
    monkeypatch.undo()
    assert {n: (tmp_path / JOB / n).read_bytes() for n in job_files(tmp_path)} == before
    assert [i.step for i in d.list(JOB)] == [1]
    assert d.load(JOB).step == 1


def corrupt_flip(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # inside the tensor data: only the hash can notice
    path.write_bytes(bytes(data))


def corrupt_truncate(path):
    os.truncate(path, os.path.getsize(path) - 4)


def corrupt_manifest(path, **changes):
    m = json.loads(path.read_text())
    for k, v in changes.items():
        if k == "held":
            m["held"].update(v)
        else:
            m[k] = v
    path.write_text(json.dumps(m))


CORRUPTIONS = {
    "flip values": ("values.safetensors", corrupt_flip, "has sha256"),
    "truncate state": ("state.safetensors", corrupt_truncate, "has .* bytes, its manifest says"),
    "delete values": ("values.safetensors", os.unlink, "No such file or directory"),
    "unparsable manifest": ("manifest.json", lambda p: p.write_text('{"format": 1, "job"'), "is not valid JSON"),
    "other node's manifest": ("manifest.json", lambda p: corrupt_manifest(p, node_id="ps-7"), "belongs to node 'ps-7'"),
    "other job's manifest": ("manifest.json", lambda p: corrupt_manifest(p, job="job-2"), "belongs to job 'job-2'"),
    "inconsistent chain": ("manifest.json", lambda p: corrupt_manifest(p, held={"bias_1#0": 2}),
                           "block bias_1#0 is version 1 in .*000000000001.manifest.json, .* holds version 2"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_a_corrupt_checkpoint_is_named_and_skipped(tmp_path, case):
    suffix, corrupt, reason = CORRUPTIONS[case]
    tr = Trainer()
    d, snaps = chain_dir(tmp_path, tr)
    bad = tmp_path / "ckpt" / JOB / f"000000000003.{suffix}"
    corrupt(bad)

    loaded = d.load(JOB)
    assert loaded.step == 2 and loaded.chain == [1, 2]
    assert_loaded_equals(loaded, expected_blocks(snaps[1]) | expected_blocks(snaps[2]))
    [(step, why)] = loaded.skipped
    assert step == 3 and re.search(reason, why)
    assert str(bad) in why or "chain" in case
    with pytest.raises(CheckpointError, match=reason) as exc:
        d.load(JOB, exact=3)
    assert str(bad) in str(exc.value) or "chain" in case


def test_a_corrupt_full_checkpoint_fails_its_whole_chain(tmp_path):
    tr = Trainer()
    d, _ = chain_dir(tmp_path, tr)
    values1 = tmp_path / "ckpt" / JOB / "000000000001.values.safetensors"
    corrupt_flip(values1)
    with pytest.raises(CheckpointError) as exc:
        d.load(JOB)
    message = str(exc.value)
    assert all(f"step {s}: checkpoint file {values1} has sha256" in message for s in (3, 2, 1)), message
    # Without verification the flipped byte goes unnoticed: the hash is what catches it.
    assert d.load(JOB, verify=False).step == 3
    with pytest.raises(CheckpointError, match="has no checkpoint at step 7"):
        d.load(JOB, exact=7)


def test_a_dir_of_another_node_or_unwritable_is_refused(tmp_path):
    CheckpointDir(tmp_path / "a", "ps-1")
    with pytest.raises(CheckpointError) as exc:
        CheckpointDir(tmp_path / "a", "ps-2")
    assert all(s in str(exc.value) for s in (str(tmp_path / "a"), "'ps-1'", "'ps-2'"))
    assert issubclass(CheckpointError, ShardlineStateError)

    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'file' / 'sub'} is not a writable directory"):
        CheckpointDir(tmp_path / "file" / "sub", "ps-1")
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "ro").mkdir(mode=0o500)
        with pytest.raises(CheckpointError, match="not a writable directory: Permission denied"):
            CheckpointDir(tmp_path / "ro", "ps-1")

    ro = CheckpointDir.open_read_only(tmp_path / "a")
    assert ro.node_id == "ps-1"
    with pytest.raises(CheckpointError, match="opened read-only"):
        ro.delete_job(JOB)
    with pytest.raises(CheckpointError, match="has no NODE.json"):
        CheckpointDir.open_read_only(tmp_path)


# ---------------------------------------------------------------------- retention


def test_retention_keeps_the_newest_full_chains_and_protected_ones(tmp_path):
    tr = Trainer("sgd", momentum=0.9)
    d = CheckpointDir(tmp_path, NODE)
    for step in range(1, 8):
        tr.step(tr.trainable()[step % 3::3])
        full = step in (1, 4, 6)
        d.write(tr.snapshot(full=full, base_step=None if full else step - 1))
    jobdir = tmp_path / JOB
    (jobdir / ".000000000008.values.safetensors.tmp-0123").write_bytes(b"torn")
    (jobdir / "000000000008.values.safetensors").write_bytes(b"orphan")  # renamed, no manifest
    (jobdir / "README").write_text("not ours")

    removed = d.retain(JOB, keep_full=1, protect=[3])
    assert [i.step for i in d.list(JOB)] == [1, 2, 3, 6, 7]
    names = [os.path.basename(p) for p in removed]
    assert names[:2] == ["000000000004.manifest.json", "000000000005.manifest.json"]  # manifests first
    assert sorted(names[2:]) == sorted([".000000000008.values.safetensors.tmp-0123", "000000000004.state.safetensors",
                                        "000000000004.values.safetensors", "000000000005.state.safetensors",
                                        "000000000005.values.safetensors", "000000000008.values.safetensors"])
    assert (jobdir / "README").exists()
    assert d.load(JOB, exact=3).chain == [1, 2, 3]
    assert_loaded_equals(d.load(JOB), expected_blocks(tr.store))

    d.retain(JOB, keep_full=1)
    assert [i.step for i in d.list(JOB)] == [6, 7]
    assert d.retain(JOB, keep_full=2) == []

    # Restored to step 6: step 7 belongs to an abandoned timeline and its number will be reused.
    assert [os.path.basename(p) for p in d.discard_after(JOB, 6)][0] == "000000000007.manifest.json"
    assert [i.step for i in d.list(JOB)] == [6]
    d.write(tr.snapshot(full=False, base_step=6))
    assert d.load(JOB).chain == [6, 7]
    with pytest.raises(ShardlineConfigError, match="keep_full must be an integer >= 1, got 0"):
        d.retain(JOB, keep_full=0)


def test_delete_job(tmp_path):
    tr = Trainer()
    tr.step()
    d = CheckpointDir(tmp_path, NODE)
    d.write(tr.snapshot())
    (tmp_path / "empty-job").mkdir()
    assert d.jobs() == [JOB]
    d.delete_job(JOB)
    assert d.jobs() == [] and sorted(os.listdir(tmp_path)) == ["NODE.json", "empty-job"]
    with pytest.raises(CheckpointError, match=f"job '{JOB}' has no checkpoint in"):
        d.load(JOB)
    d.delete_job(JOB)  # already gone: nothing to do
    with pytest.raises(CheckpointError, match="cannot name a checkpoint folder"):
        d.delete_job("..")


# ---------------------------------------------------------------------- offline export


def store_tensors(store):
    out = {}
    for name, meta in store.tensors.items():
        flat = torch.empty(meta.numel)
        for s in block_slices(meta.numel, BLOCK):
            flat[s.start:s.stop] = store.blocks[(name, s.index)].value
        out[name] = flat.view(meta.shape)
    return out


def test_read_job_tensors_assembles_blocks_of_several_nodes(tmp_path):
    tr = Trainer()
    tr.step()
    tr.step(tr.trainable()[::2])
    keys = sorted(tr.store.blocks)
    halves = {"n1": set(keys[::2]), "n2": set(keys[1::2])}
    dirs = {n: CheckpointDir(tmp_path / n, n) for n in halves}
    for n, held in halves.items():
        dirs[n].write(tr.snapshot(keys=held, node_id=n))
    expected = store_tensors(tr.store)
    tr.step()
    dirs["n1"].write(tr.snapshot(keys=halves["n1"], node_id="n1", full=False, base_step=2))  # n2 lacks step 3
    before = sorted(os.listdir(tmp_path / "n2"))

    step, spec, tensors = read_job_tensors([dirs["n1"], str(tmp_path / "n2")], JOB)
    assert step == 2 and spec == MessageToDict(tr.spec, preserving_proto_field_name=True)
    assert set(tensors) == set(expected)
    for name, t in expected.items():
        assert tensors[name].shape == t.shape and raw(tensors[name]) == raw(t), name
    assert tensors["scalar"].shape == ()
    assert sorted(os.listdir(tmp_path / "n2")) == before  # opened read-only
    with pytest.raises(CheckpointError, match="has no checkpoint at step 3"):
        read_job_tensors([dirs["n1"], dirs["n2"]], JOB, step=3)

    assert keys[1] == ("emb", 0) and keys[1] in halves["n2"]
    lacking = halves["n2"] - {keys[1]}
    CheckpointDir(tmp_path / "n3", "n3").write(tr.snapshot(keys=lacking, node_id="n3"))
    CheckpointDir(tmp_path / "n4", "n4").write(tr.snapshot(keys=halves["n1"], node_id="n4"))
    with pytest.raises(CheckpointError, match=r"tensor 'emb' of job 'job-1' at step 3: block\(s\) \[0\] are in none"):
        read_job_tensors([tmp_path / "n3", tmp_path / "n4"], JOB)
