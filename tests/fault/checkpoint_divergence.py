"""Where a chaos run left the torch reference: every kept checkpoint of every node, block by block.

After ``tests/fault/chaos.py --keep DIR`` fails with a parameter difference, the nodes'
checkpoint directories under DIR/seed-N hold every chain (``checkpoint_keep`` is unlimited there).
This replays the single-process AdamW reference of tests/integration/train_model.py and prints,
per node and checkpoint, the blocks whose value differs from the reference at the block's own
version, so the first step and node where the cluster diverged can be read off:

    python tests/fault/checkpoint_divergence.py DIR/seed-14 --job chaos-14 --steps 72
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))

import train_model  # noqa: E402
from shardline.ps_server.checkpoint import CheckpointDir  # noqa: E402
from shardline.services.blocks import block_slice  # noqa: E402
from shardline.worker.flat_params import is_flat_name  # noqa: E402


def reference_values(steps: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    """Flat parameter values after 0, 1, ..., ``steps`` reference AdamW steps; under ``"flat"``
    the tensor a flat job (``SHARDLINE_TEST_FLATTEN=1``) stores instead."""
    out = []
    for model in train_model.reference_steps("adamw", steps, world_size):
        values = {k: v.detach().clone().reshape(-1) for k, v in model.state_dict().items()}
        values["flat"] = torch.cat([values[name] for name in train_model.FLAT_MEMBERS])
        out.append(values)
    return out


def diverged_blocks(root: Path, job: str, values: list, block_elements: int, tol: float):
    """Yield (node directory, checkpoint step, blocks held, [(tensor, index, version, max abs diff)])."""
    for node_dir in sorted(p for p in root.iterdir() if p.name.endswith("-ckpt")):
        store = CheckpointDir.open_read_only(node_dir)
        for info in store.list(job):
            loaded = store.load(job, exact=info.step)
            bad = []
            for (tensor, index), block in sorted(loaded.blocks.items()):
                flat = values[block.version]["flat" if is_flat_name(tensor) else tensor]
                part = block_slice(flat.numel(), block_elements, index)
                want = flat[part.start:part.stop]
                diff = (block.value - want).abs().max().item()
                if diff > tol:
                    bad.append((tensor, index, block.version, diff))
            yield node_dir.name, info.step, len(loaded.blocks), bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a chaos --keep run directory (DIR/seed-N)")
    ap.add_argument("--job", required=True)
    ap.add_argument("--steps", type=int, required=True, help="steps the run trained")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--block-elements", type=int, default=16, help="the job's block size (train_model.py: 16)")
    ap.add_argument("--tol", type=float, default=1e-6)
    args = ap.parse_args(argv)
    values = reference_values(args.steps, args.world_size)
    first = None
    for node, step, held, bad in diverged_blocks(args.run_dir, args.job, values, args.block_elements, args.tol):
        shown = ", ".join(f"{t}[{i}]@v{v} {d:.2e}" for t, i, v, d in bad[:6]) + (" ..." if len(bad) > 6 else "")
        print(f"{node} step {step:>4}: {held:>3} blocks, {len(bad)} differ{': ' + shown if bad else ''}")
        if bad and (first is None or step < first[1]):
            first = (node, step)
    print("no checkpoint differs from the reference" if first is None
          else f"first divergent checkpoint: {first[0]} at step {first[1]}")
    return 0 if first is None else 1


if __name__ == "__main__":
    sys.exit(main())
