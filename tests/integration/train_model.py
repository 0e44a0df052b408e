"""The small model and data the BSP/ASP integration tests train, shared by the worker script and
the single-process reference. Run as a script it is one worker process:

    python train_model.py CLUSTER JOB RANK WORLD_SIZE OPTIMIZER SYNC STEPS OUT.safetensors schedule|constant PREFETCH \
        [PROGRESS_FILE STEP_SLEEP_SECONDS]

It resumes a job the cluster already holds (``range(opt.version, steps)``); with PROGRESS_FILE it
writes the number of steps done there after each step (fault tests kill it at a chosen step).
Before each step it hits failpoint ``train.before_step``: a test that arms it with ``pause``
(``held_env``) lets the workers on step by step (``allow``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from shardline.services import failpoints

VOCAB, DIM, OUT, BATCH = 40, 8, 3, 6
HYPER = {
    "adamw": dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
    "sgd": dict(lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": dict(lr=0.05),
}
# Every worker process start_workers started in this process: kill_started reaps those left
# running when a test ends (tests/integration/conftest.py), e.g. paused before a step by a test
# that failed before it let them finish.
_started_procs: list = []
# The failpoint a worker hits before each step (its step number), where a test holds it.
BEFORE_STEP = "train.before_step"


class SmallModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(VOCAB, DIM)          # most rows untouched per step: zero blocks
        self.proj = nn.Linear(DIM, OUT)
        # frozen, bf16: the PS nodes store it as bf16 in their frozen-value files
        self.scale = nn.Parameter(torch.full((OUT,), 0.5, dtype=torch.bfloat16), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(5))     # never in the graph: grad stays None

    def forward(self, tokens):
        return self.proj(self.embed(tokens).mean(1)) * self.scale


def batch(step: int, rank: int, n: int = BATCH):
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB // 4, (n, 4), generator=g)  # only a quarter of the vocabulary
    targets = tokens[:, 0] % OUT  # learnable from the first token's embedding
    return tokens, targets


def loss_fn(model, tokens, targets):
    return nn.functional.cross_entropy(model(tokens), targets)


def scheduled_lr(optimizer: str, step: int) -> float:
    """A warmup schedule: the lr of step ``step`` (tests that schedules reach the servers)."""
    return HYPER[optimizer]["lr"] * min(1.0, (step + 1) / 4)


# What a flat job (SHARDLINE_TEST_FLATTEN=1) stores as its one flat tensor, in order.
FLAT_MEMBERS = ("embed.weight", "proj.weight", "proj.bias")


def reference_steps(optimizer: str, steps: int, world_size: int, schedule: bool = False):
    """Single process, torch.optim, each step on the concatenation of all ranks' batches: yields
    the model before the first step and after each of the ``steps`` (the same object, stepped)."""
    model = SmallModel()
    cls = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer]
    opt = cls([p for p in model.parameters() if p.requires_grad], **HYPER[optimizer])
    yield model
    for step in range(steps):
        parts = [batch(step, r) for r in range(world_size)]
        tokens = torch.cat([p[0] for p in parts])
        targets = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        loss_fn(model, tokens, targets).backward()
        if schedule:
            opt.param_groups[0]["lr"] = scheduled_lr(optimizer, step)
        opt.step()
        yield model


def reference(optimizer: str, steps: int, world_size: int, schedule: bool = False) -> dict[str, torch.Tensor]:
    """The parameters after ``reference_steps``' last step."""
    for model in reference_steps(optimizer, steps, world_size, schedule):
        pass
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def start_workers(cluster_addr, job, optimizer, sync, tmp_path, world=2, steps=8, schedule=False, prefetch=0,
                  step_sleep=0.0, ranks=None, env=None, transport=None, log_output=False, wrap=None):
    """Start ``world`` worker processes of this script (or only ``ranks``); returns [(process, out
    path, progress path)]. ``env``: extra environment (rank -> dict, or one dict for all);
    ``transport``: the workers' data-plane transport (default auto); ``log_output``: append each
    worker's output to ``<job>-rank<r>.log`` beside its out path (kept across its restarts) instead
    of a pipe; ``wrap(rank, argv)``: the command line that runs ``argv`` (e.g. in an emulated host).
    Each worker writes the start and end (``time.monotonic()``) of every step it takes to
    ``step_times_path(out)``."""
    import subprocess

    started = []
    for rank in (range(world) if ranks is None else ranks):
        extra = env.get(rank, {}) if isinstance(env, dict) and all(isinstance(k, int) for k in env) else (env or {})
        if transport is not None:
            extra = {**extra, "SHARDLINE_TEST_TRANSPORT": transport}
        out = tmp_path / f"{job}-rank{rank}.safetensors"
        progress = tmp_path / f"{job}-rank{rank}.progress"
        if log_output:
            output = open(output_log(out), "a")
            output.write(f"--- rank {rank} started, env {extra}\n")
            output.flush()
        else:
            output = subprocess.PIPE
        argv = [sys.executable, __file__, cluster_addr, job, str(rank), str(world), optimizer, sync, str(steps), str(out),
                "schedule" if schedule else "constant", str(prefetch), str(progress), str(step_sleep)]
        started.append((subprocess.Popen(
            argv if wrap is None else wrap(rank, argv),
            stdout=output, stderr=subprocess.STDOUT, text=True, env={**os.environ, **extra}), out, progress))
        _started_procs.append(started[-1][0])
        if log_output:
            output.close()  # the child holds its own copy
    return started


def step_times_path(out):
    """Where the worker saving to ``out`` writes ``step start end`` for each step it takes."""
    return out.with_suffix(".steps")


def step_times(started_entry) -> list[tuple[int, float, float]]:
    """``(step, start, end)`` of every step one ``start_workers`` entry took, in order (a
    restarted worker's steps follow its earlier incarnation's)."""
    try:
        lines = step_times_path(started_entry[1]).read_text().splitlines()
    except FileNotFoundError:
        return []
    return [(int(a), float(b), float(c)) for a, b, c in (line.split() for line in lines if line.count(" ") == 2)]


def output_log(out):
    """Where ``start_workers(log_output=True)`` writes the output of the worker saving to ``out``."""
    return out.with_suffix(".log")


def worker_output(started_entry) -> str:
    """The output of one ``start_workers`` entry that exited: its pipe, else its log's tail."""
    proc, out, _ = started_entry
    if proc.stdout is not None:
        return proc.communicate()[0] or ""
    return output_log(out).read_text(errors="replace")[-6000:]


def finish_workers(started, timeout=120):
    """Wait for workers from ``start_workers``; return each one's saved tensors."""
    from safetensors.torch import load_file

    try:
        for entry in started:
            # a pipe is drained while waiting (a worker blocked on a full pipe never exits); a log is read after
            output = entry[0].communicate(timeout=timeout)[0]
            assert entry[0].returncode == 0, output if output is not None else worker_output(entry)
    finally:
        kill_workers(started)
    return [load_file(str(out)) for _, out, _ in started]


def kill_workers(started) -> int:
    """Kill the processes of ``start_workers`` entries that still run; returns how many."""
    alive = [p for p, _, _ in started if p.poll() is None]
    for p in alive:
        p.kill()
        p.wait()
    return len(alive)


def kill_started() -> int:
    """Kill every worker process start_workers started in this process that still runs (a test or
    harness that failed midway may have left some); returns how many."""
    killed = kill_workers([(p, None, None) for p in _started_procs])
    _started_procs.clear()
    return killed


def wait_for_steps(started, at_least: int, timeout: float = 60) -> None:
    """Wait until every worker of ``start_workers`` finished ``at_least`` steps."""
    deadline = time.monotonic() + timeout
    while min(steps_done(progress) for _, _, progress in started) < at_least:
        for entry in started:
            assert entry[0].poll() is None, worker_output(entry)
        assert time.monotonic() < deadline, f"workers did not reach step {at_least}"
        time.sleep(0.02)


def assert_equals_reference(results, steps: int, world_size: int = 2, tol: float = 1e-6) -> None:
    """Every worker ran ``steps`` steps and holds single-process AdamW's parameters (within ``tol``)."""
    expected = reference("adamw", steps, world_size=world_size)
    for res in results:
        assert int(res["_version"]) == steps
        for name, want in expected.items():
            diff = (res[name] - want).abs().max().item()
            assert diff <= tol, f"{name}: max abs diff {diff}"


def steps_done(progress_path) -> int:
    try:
        return int(progress_path.read_text() or 0)
    except (OSError, ValueError):
        return 0


def run_workers(cluster_addr, job, optimizer, sync, tmp_path, world=2, steps=8, schedule=False, prefetch=0,
                transport=None):
    """Run ``world`` worker processes of this script; return each one's saved tensors."""
    return finish_workers(start_workers(cluster_addr, job, optimizer, sync, tmp_path, world, steps, schedule, prefetch,
                                        transport=transport))


def held_env(directory, at_step: int | None = None, also: str = "") -> dict[str, str]:
    """The environment of workers held before step ``at_step`` (before every step if None) until
    ``allow(directory, ...)`` lets them on; ``also``: more SHARDLINE_FAILPOINTS entries."""
    held = BEFORE_STEP if at_step is None else f"{BEFORE_STEP}@{at_step}"
    return {failpoints.ENV: ",".join(filter(None, [f"{held}=pause", also])), failpoints.DIR_ENV: str(directory)}


def allow(directory, steps: int | None = None) -> None:
    """Let the workers of ``held_env(directory)`` run the steps below ``steps`` (all of them if None)."""
    failpoints.release(directory, BEFORE_STEP, until_step=steps)


def main(argv):
    cluster, job, rank, world, optimizer, sync, steps, out, schedule, prefetch, *rest = argv
    rank, world, steps = int(rank), int(world), int(steps)
    progress_file, step_sleep = (rest[0], float(rest[1])) if rest else (None, 0.0)
    import logging

    from safetensors.torch import save_file

    # a fault run's logs (chaos.py) are read against the daemons': timestamps, and INFO on request
    logging.basicConfig(level=os.environ.get("SHARDLINE_TEST_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from shardline import PSOptimizer

    torch.set_num_threads(1)
    model = SmallModel()
    # fault tests set the job's worker-failure policy through the environment
    policy = {k: v for k, v in (("on_worker_failure", os.environ.get("SHARDLINE_TEST_ON_WORKER_FAILURE")),
                                ("worker_lease_timeout", os.environ.get("SHARDLINE_TEST_LEASE_TIMEOUT"))) if v}
    if "worker_lease_timeout" in policy:
        policy["worker_lease_timeout"] = float(policy["worker_lease_timeout"])
    # replication: unset, the cluster's default (BSP/SSP replay gradients on nodes of one build);
    # the fault suites ask for either path explicitly
    if os.environ.get("SHARDLINE_TEST_REPLICATE_GRADIENTS") == "1":
        policy["replicate_gradients"] = True
    if os.environ.get("SHARDLINE_TEST_REPLICATE_COPIES") == "1":   # copies of value and state
        policy["replicate_gradients"] = False
    if os.environ.get("SHARDLINE_TEST_HOST_AGGREGATION") == "1":   # even where every node is on this host
        policy["host_aggregation"] = True
    if os.environ.get("SHARDLINE_TEST_FLATTEN") == "1":  # the trainable parameters as one tensor on the PS
        model.unused.requires_grad_(False)  # a flat step needs every trainable parameter's gradient (it has none)
        assert [n for n, p in model.named_parameters() if p.requires_grad] == list(FLAT_MEMBERS)
        policy["flatten"] = True
    opt = PSOptimizer(model.named_parameters(), cluster=cluster, job=job, optimizer=optimizer, sync=sync,
                      world_size=world, rank=rank, block_elements=16, connect_timeout=60,
                      pull_timeout=float(os.environ.get("SHARDLINE_TEST_PULL_TIMEOUT", 120)),
                      prefetch_window=int(prefetch), transport=os.environ.get("SHARDLINE_TEST_TRANSPORT", "auto"),
                      **policy,
                      **HYPER[optimizer])
    eval_tokens, eval_targets = batch(10_000, 0, n=300)
    with torch.no_grad():
        eval_first = loss_fn(model, eval_tokens, eval_targets).item()
    losses = []
    start_version = opt.version
    times = open(step_times_path(Path(out)), "a")
    for step in range(start_version, steps):
        failpoints.hit(BEFORE_STEP, step)   # a fault test paces training here (held_env, allow)
        started = time.monotonic()
        tokens, targets = batch(step, rank)
        if schedule == "schedule":  # before backward: with overlap, backward pushes with the step's lr
            opt.set_lr(scheduled_lr(optimizer, step))
        opt.zero_grad()
        loss = loss_fn(model, tokens, targets)
        loss.backward()
        opt.step()
        times.write(f"{step} {started:.6f} {time.monotonic():.6f}\n")
        times.flush()
        losses.append(loss.item())
        if progress_file:
            with open(progress_file + ".tmp", "w") as fh:
                fh.write(str(step + 1))
            os.replace(progress_file + ".tmp", progress_file)
        if step_sleep:
            time.sleep(step_sleep)
    times.close()
    with torch.no_grad():
        eval_last = loss_fn(model, eval_tokens, eval_targets).item()
    stats = opt.client.stats
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    state["_losses"] = torch.tensor(losses)
    state["_eval"] = torch.tensor([eval_first, eval_last])
    state["_pulled_blocks"] = torch.tensor([stats.pulled_blocks])
    state["_shared_steps"] = torch.tensor([stats.shared_steps])   # steps pulled from the host's leader
    state["_version"] = torch.tensor([opt.version])
    state["_start_version"] = torch.tensor([start_version])
    save_file(state, out)
    opt.close()


if __name__ == "__main__":
    main(sys.argv[1:])
