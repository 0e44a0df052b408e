"""tests/fault/checkpoint_divergence.py: the tool that names where a kept chaos run left the reference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fault"))

import checkpoint_divergence  # noqa: E402
import train_model  # noqa: E402  (on the path through checkpoint_divergence)
from shardline.ps_server.checkpoint import BlockSnapshot, CheckpointDir, JobSnapshot  # noqa: E402
from shardline.services.blocks import block_slices  # noqa: E402

BLOCK = 16


def write_checkpoint(root: Path, node: str, step: int, values: dict, bump: tuple[str, int] | None = None) -> None:
    blocks = []
    for name, flat in values.items():
        for part in block_slices(flat.numel(), BLOCK):
            value = flat[part.start:part.stop].clone()
            if (name, part.index) == bump:
                value[0] += 1e-3
            blocks.append(BlockSnapshot(name, part.index, step, value, {}))
    snap = JobSnapshot(job="j", uid="u", node_id=node, epoch=1, step=step, spec={},
                       held={(b.tensor, b.index): step for b in blocks}, blocks=blocks, full=True)
    CheckpointDir(root / f"{node}-ckpt", node).write(snap)


def test_the_reference_trajectory_ends_where_train_models_reference_does():
    values = checkpoint_divergence.reference_values(3, 2)
    final = train_model.reference("adamw", 3, world_size=2)
    assert len(values) == 4
    for name, want in final.items():
        assert torch.equal(values[3][name], want.reshape(-1))


def test_the_first_divergent_checkpoint_is_named_by_node_step_and_block(tmp_path, capsys):
    values = checkpoint_divergence.reference_values(4, 2)
    write_checkpoint(tmp_path, "ps0", 2, values[2])
    write_checkpoint(tmp_path, "ps1", 2, values[2])
    write_checkpoint(tmp_path, "ps1", 4, values[4], bump=("embed.weight", 3))
    assert checkpoint_divergence.main([str(tmp_path), "--job", "j", "--steps", "4"]) == 1
    out = capsys.readouterr().out
    assert "ps1-ckpt step    4:" in out and "1 differ: embed.weight[3]@v4 1.00e-03" in out
    assert "first divergent checkpoint: ps1-ckpt at step 4" in out


def test_checkpoints_equal_to_the_reference_pass(tmp_path, capsys):
    values = checkpoint_divergence.reference_values(2, 2)
    write_checkpoint(tmp_path, "ps0", 2, values[2])
    assert checkpoint_divergence.main([str(tmp_path), "--job", "j", "--steps", "2"]) == 0
    assert "no checkpoint differs from the reference" in capsys.readouterr().out


def test_a_flat_jobs_checkpoints_are_compared_with_the_flat_reference(tmp_path, capsys):
    """A flat job (SHARDLINE_TEST_FLATTEN=1) stores one tensor named flat<group>.<digest>: it is
    compared with train_model's FLAT_MEMBERS concatenated."""
    values = checkpoint_divergence.reference_values(3, 2)
    flat = {"flat0.0123456789ab": values[3]["flat"]}
    assert torch.equal(flat["flat0.0123456789ab"],
                       torch.cat([values[3][n] for n in train_model.FLAT_MEMBERS]))
    write_checkpoint(tmp_path, "ps0", 3, flat, bump=("flat0.0123456789ab", 2))
    assert checkpoint_divergence.main([str(tmp_path), "--job", "j", "--steps", "3"]) == 1
    assert "1 differ: flat0.0123456789ab[2]@v3 1.00e-03" in capsys.readouterr().out
