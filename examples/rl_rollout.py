"""RL post-training in miniature: a trainer job and rollout engines that follow its policy through
WeightSubscriber, reporting the policy version of every sample (staleness).

    shardline up --ps 2 --workers 1 --steps 100000 &     # a cluster (training its demo job meanwhile)
    export SHARDLINE_CLUSTER_TOKEN_FILE=...                # what `shardline up` printed, as its address
    python examples/rl_rollout.py --cluster 127.0.0.1:PORT --job rl-1 --rollouts 2 --steps 30

The task: a tiny policy (an embedding and a linear head, as a language model's first and last
layers) sees a prompt token p and is rewarded 1 for answering (p + 1) mod V. This process trains
it with REINFORCE (PSOptimizer, Adam) on the samples the rollout engines send; each rollout engine
is a separate process (this script with ``--role rollout``) that holds the policy in bf16, samples
from it, and calls ``WeightSubscriber.poll()`` between batches: the changed tensors are loaded
into its model the way vLLM's ``load_weights`` takes them. Samples travel through JSONL files in
``--spool`` (a stand-in for the queue a real system uses), each naming the policy version that
produced it; the trainer reports, per step, how stale the samples it learned from were (its
version minus theirs), and each engine reports the versions it sampled with. The reward rises
as the engines pick up new versions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

VOCAB, DIM = 16, 16


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, prompts: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(prompts))


def reward(prompts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    return (actions == (prompts + 1) % VOCAB).float()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help="dispatcher HOST:PORT")
    p.add_argument("--job", default="rl-rollout")
    p.add_argument("--role", default="trainer", choices=("trainer", "rollout"))
    p.add_argument("--rollouts", type=int, default=2, help="rollout engine processes the trainer starts")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=64, help="samples per training step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--spool", help="directory of the sample files (default: a new temporary one)")
    p.add_argument("--index", type=int, default=0, help="rollout: this engine's number")
    p.add_argument("--sample-seconds", type=float, default=0.02, help="rollout: time one batch of samples takes")
    p.add_argument("--timeout", type=float, default=60.0, help="longest wait for weights or samples")
    return p.parse_args(argv)


# --- rollout engine --------------------------------------------------------------------------
def rollout(args) -> int:
    from shardline import WeightSubscriber

    torch.set_num_threads(1)
    engine = Policy().to(torch.bfloat16)
    params = dict(engine.named_parameters())
    sub = WeightSubscriber(args.cluster, args.job, dtype=torch.bfloat16, pull_timeout=args.timeout)
    g = torch.Generator().manual_seed(100 + args.index)
    out = Path(args.spool) / f"rollout-{args.index}.jsonl"
    versions: dict[int, int] = {}   # policy version -> samples made with it
    rewards: dict[int, list[float]] = {}
    with sub, open(out, "a") as fh, torch.no_grad():
        version = -1
        while version < args.steps:
            new, changed = sub.poll()
            for name, tensor in changed:   # what an engine's load_weights does with the iterable
                params[name].copy_(tensor)
            version = new
            prompts = torch.randint(0, VOCAB, (args.batch // 4,), generator=g)
            probs = torch.softmax(engine(prompts).float(), dim=-1)
            actions = torch.multinomial(probs, 1, generator=g).squeeze(1)
            r = reward(prompts, actions)
            for p_, a, rr in zip(prompts.tolist(), actions.tolist(), r.tolist()):
                fh.write(json.dumps({"prompt": p_, "action": a, "reward": rr, "version": version}) + "\n")
            fh.flush()
            versions[version] = versions.get(version, 0) + len(prompts)
            rewards.setdefault(version, []).extend(r.tolist())
            time.sleep(args.sample_seconds)
    first, last = min(rewards), max(rewards)
    print(json.dumps({"rollout": args.index, "samples": sum(versions.values()), "versions": versions,
                      "reward_first_version": sum(rewards[first]) / len(rewards[first]),
                      "reward_last_version": sum(rewards[last]) / len(rewards[last]),
                      "pulled_bytes": sub.stats.pulled_bytes, "polls": sub.stats.polls,
                      "delta_blocks": sub.stats.delta_blocks, "checksum_failures": sub.stats.checksum_failures}),
          flush=True)
    return 0


# --- trainer ---------------------------------------------------------------------------------
class Spool:
    """Reads the samples the rollout engines append, each file from where it stopped."""

    def __init__(self, directory: Path):
        self.directory, self.offsets, self.pending = directory, {}, []

    def wait_for_engines(self, timeout: float, engines) -> None:
        """Until every engine has written a sample (it is serving the policy): a trainer that
        started on the first engine's samples alone could finish before a slow one starts."""
        deadline = time.monotonic() + timeout
        while sum(1 for path in self.directory.glob("rollout-*.jsonl") if path.stat().st_size) < len(engines):
            dead = [p for p in engines if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"not every rollout engine served within {timeout:g} s; exited: "
                                 f"{[p.args[-1] for p in dead]}")
            time.sleep(0.05)

    def take(self, n: int, timeout: float, engines) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.pending) < n:
            for path in sorted(self.directory.glob("rollout-*.jsonl")):
                with open(path) as fh:
                    fh.seek(self.offsets.get(path, 0))
                    data = fh.read()
                complete = data[:data.rfind("\n") + 1]   # a line being written is read next time
                self.offsets[path] = self.offsets.get(path, 0) + len(complete)
                self.pending.extend(json.loads(line) for line in complete.splitlines())
            if len(self.pending) >= n:
                break
            dead = [p for p in engines if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"no {n} samples within {timeout:g} s ({len(self.pending)} arrived); "
                                 f"rollout engines exited: {[p.args[-1] for p in dead]}")
            time.sleep(0.01)
        batch, self.pending = self.pending[:n], self.pending[n:]
        return batch


def trainer(args) -> int:
    from shardline import PSOptimizer

    torch.set_num_threads(1)
    spool_dir = Path(args.spool or tempfile.mkdtemp(prefix="rl-rollout-"))
    spool_dir.mkdir(parents=True, exist_ok=True)
    spool = Spool(spool_dir)
    model = Policy()
    opt = PSOptimizer(model.named_parameters(), cluster=args.cluster, job=args.job, optimizer="adam", lr=args.lr,
                      world_size=1, rank=0)
    me = [sys.executable, os.path.abspath(__file__), "--cluster", args.cluster, "--job", args.job, "--role", "rollout",
          "--steps", str(args.steps), "--batch", str(args.batch), "--spool", str(spool_dir),
          "--sample-seconds", str(args.sample_seconds), "--timeout", str(args.timeout)]
    engines = [subprocess.Popen([*me, "--index", str(i)], stdout=subprocess.PIPE, text=True)
               for i in range(args.rollouts)]
    try:
        spool.wait_for_engines(args.timeout, engines)
        for step in range(opt.version, args.steps):
            samples = spool.take(args.batch, args.timeout, engines)
            prompts = torch.tensor([s["prompt"] for s in samples])
            actions = torch.tensor([s["action"] for s in samples])
            rewards = torch.tensor([s["reward"] for s in samples])
            stale = [step - s["version"] for s in samples]
            logp = torch.log_softmax(model(prompts), dim=-1).gather(1, actions[:, None]).squeeze(1)
            loss = -((rewards - rewards.mean()) * logp).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"step {step}: reward {rewards.mean():.2f}, sample staleness mean {sum(stale) / len(stale):.1f} "
                  f"max {max(stale)} (policy versions {min(s['version'] for s in samples)}.."
                  f"{max(s['version'] for s in samples)})", flush=True)
        reports = []
        for p in engines:
            out, _ = p.communicate(timeout=args.timeout)
            if p.returncode != 0:
                raise SystemExit(f"rollout engine exited with {p.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in engines:
            if p.poll() is None:
                p.kill()
                p.wait()
        opt.close()
    for r in reports:
        print(f"rollout {r['rollout']}: {r['samples']} samples over {len(r['versions'])} policy versions "
              f"{sorted(int(v) for v in r['versions'])}; reward {r['reward_first_version']:.2f} -> "
              f"{r['reward_last_version']:.2f}; {r['pulled_bytes']:,} B pulled in {r['polls']} polls "
              f"({r['delta_blocks']} delta blocks, {r['checksum_failures']} checksum failures)", flush=True)
    print(json.dumps({"rollouts": reports}), flush=True)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return rollout(args) if args.role == "rollout" else trainer(args)


if __name__ == "__main__":
    sys.exit(main())
