"""Shardline checkpoint benchmark: write throughput, restore time and the step-time cost of
checkpointing, each against a baseline measured in the same run, interleaved.

    .venv/bin/python bench/checkpoint.py --out bench/results/checkpoint.json   # full run (~3-4 min)
    .venv/bin/python bench/checkpoint.py --quick                               # sanity run (~30 s)

Three sections (``--sections write,restore,train`` picks some):

* **write**: ``CheckpointDir.write`` of a full checkpoint of AdamW blocks (1 MiB fp32 value +
  ``exp_avg`` + ``exp_avg_sq`` + a 0-dim ``step`` per block) vs a raw write of the same number of
  bytes to one file with the same durability (``write`` + ``fsync`` + rename + folder ``fsync``).
* **restore**: ``CheckpointDir.load(job, verify=True)`` of a 1 GiB checkpoint, the first load in a
  fresh subprocess (as a restarting PS node), vs a sequential raw read of the same files in a fresh
  subprocess; page-cache warm, and cold too when ``/proc/sys/vm/drop_caches`` can be written.
* **train**: the demo job (examples/demo_job.yaml, fewer steps) on a local cluster of 1 dispatcher,
  2 PS nodes and 2 workers, without checkpoint dirs vs with checkpoint dirs and
  ``checkpoint_every_steps 10``; a fresh cluster, work dir and job name per run, runs alternating.

The machine is shared and noisy, so only the ratios mean much; see bench/README.md. Every process
the script starts is stopped in a ``finally`` block (also on SIGTERM/SIGINT); the data written is
removed at the end, the daemon logs stay in ``/tmp/shardline-ckbench-*/``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from report import run_and_report  # bench/report.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
NODE = "bench-node"
BLOCK_ELEMENTS = 262_144                  # the default block: 1 MiB of fp32
BLOCK_BYTES = BLOCK_ELEMENTS * 4
WRITE_TARGET = 0.8                        # checkpoint write GB/s / raw write GB/s
OVERHEAD_TARGET = 0.05                    # step time with checkpoints / without - 1
CHECKPOINT_EVERY = 10
DEMO_JOB = ROOT / "examples" / "demo_job.yaml"
DROP_CACHES = "/proc/sys/vm/drop_caches"
GB = 1e9


# --------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------
def summary(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values),
            "mean": statistics.fmean(values)}


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def meminfo_kib(field: str) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def machine_info() -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from run import machine_info as data_plane_machine_info  # bench/run.py: same fields in both results
    finally:
        sys.path.pop(0)
    return data_plane_machine_info()


def filesystem_of(path: Path) -> dict:
    """Mount point, type and options of the file system holding ``path`` (from /proc/mounts)."""
    real = os.path.realpath(path)
    best = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype, opts, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and (best is None or len(mnt) > len(best["mount"])):
                best = {"device": dev, "mount": mnt, "type": fstype, "options": opts}
    return best or {}


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rotate(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def ratio_block(num: list[float], den: list[float], target: float | None, higher_is_better: bool = True) -> dict:
    """num/den of the medians and the median of the per-repetition ratios (paired)."""
    paired = [a / b for a, b in zip(num, den)]
    r = statistics.median(num) / statistics.median(den)
    out = {"ratio_of_medians": r, "paired": summary(paired)}
    if target is not None:
        out["target"] = target
        out["meets_target"] = r >= target if higher_is_better else r <= target
    return out


# --------------------------------------------------------------------------------------------
# snapshots of AdamW blocks
# --------------------------------------------------------------------------------------------
def adamw_snapshot(job: str, step: int, n_blocks: int, seed: int = 0):
    """A full JobSnapshot of ``n_blocks`` blocks of 1 MiB, with the state a PS AdamW block holds."""
    import torch

    from shardline.ps_server.checkpoint import BlockSnapshot, JobSnapshot

    gen = torch.Generator().manual_seed(seed)
    blocks = []
    for i in range(n_blocks):
        tensor, index = f"layers.{i // 16}.weight", i % 16
        state = {"step": torch.tensor(float(step)),
                 "exp_avg": torch.randn(BLOCK_ELEMENTS, generator=gen) * 1e-3,
                 "exp_avg_sq": torch.rand(BLOCK_ELEMENTS, generator=gen) * 1e-6}
        blocks.append(BlockSnapshot(tensor, index, step, torch.randn(BLOCK_ELEMENTS, generator=gen), state))
    spec = {"name": job, "sync": "bsp", "world_size": 2, "block_elements": str(BLOCK_ELEMENTS),
            "optimizer": {"kind": "adamw", "lr": 0.002, "beta1": 0.9, "beta2": 0.98, "eps": 1e-8, "weight_decay": 0.01}}
    held = {(b.tensor, b.index): b.version for b in blocks}
    return JobSnapshot(job=job, uid=f"{job}-uid", node_id=NODE, epoch=1, step=step, spec=spec, held=held,
                       blocks=blocks, full=True)


def snapshot_data_bytes(n_blocks: int) -> int:
    return n_blocks * BLOCK_BYTES * 3  # value + exp_avg + exp_avg_sq (+ 4 bytes of step, headers)


# --------------------------------------------------------------------------------------------
# 1. write throughput
# --------------------------------------------------------------------------------------------
WRITE_ROWS = {
    "raw_write": ("raw write + fsync + rename (baseline)",
                  "the checkpoint's byte count from one preallocated buffer: os.write (<= 1 GiB per call) to a new "
                  "temporary in the same folder, fsync, close, rename, folder fsync"),
    "checkpoint_write": ("CheckpointDir.write, full",
                         "full checkpoint of every block: values and state safetensors, each to a temporary, "
                         "sha256-hashed, fsync'ed, renamed; folder fsync; manifest (temporary, fsync, rename); folder fsync"),
    "sha256": ("diag: sha256 of the same bytes, 1 thread",
               "hashlib.sha256 over the block buffers in memory, no I/O (a lower bound of the hashing work)"),
}


def bench_write(args, workdir: Path) -> dict:
    from shardline.ps_server.checkpoint import CheckpointDir
    import torch

    job = "write-bench"
    root = workdir / "write"
    d = CheckpointDir(root, NODE)
    # Steps from 1000 on: versions of equal width, so every rep writes exactly the same byte count.
    snap = adamw_snapshot(job, 1000, args.write_blocks)
    # Warm-up write: also gives the exact byte count the raw baseline writes.
    info = d.write(snap)
    nbytes = info.bytes_written
    d.discard_after(job, -1)
    raw_buf = torch.randn((nbytes + 3) // 4).view(torch.uint8)[:nbytes]
    raw_view = memoryview(raw_buf.numpy())
    raw_dir = str(root / "raw")
    os.makedirs(raw_dir, exist_ok=True)
    parts = [memoryview(t.view(torch.uint8).numpy()) for b in snap.blocks
             for t in (b.value, b.state["exp_avg"], b.state["exp_avg_sq"])]

    step = [1000]

    def checkpoint_write() -> float:
        step[0] += 1
        snap.step = step[0]
        for b in snap.blocks:
            b.version = step[0]
        snap.held = {(b.tensor, b.index): b.version for b in snap.blocks}
        t0 = time.perf_counter()
        got = d.write(snap)
        dt = time.perf_counter() - t0
        if got.bytes_written != nbytes:
            raise RuntimeError(f"checkpoint wrote {got.bytes_written} bytes, the warm-up {nbytes}")
        d.discard_after(job, -1)  # untimed: the next rep writes a full checkpoint again
        return dt

    def raw_write() -> float:
        tmp, final = os.path.join(raw_dir, ".raw.bin.tmp"), os.path.join(raw_dir, "raw.bin")
        t0 = time.perf_counter()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = raw_view
            while view:
                n = os.write(fd, view[:1 << 30])
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(raw_dir)
        dt = time.perf_counter() - t0
        os.unlink(final)
        return dt

    def sha256() -> float:
        t0 = time.perf_counter()
        h = hashlib.sha256()
        for p in parts:
            h.update(p)
        h.hexdigest()
        return time.perf_counter() - t0

    group = [("raw_write", raw_write), ("checkpoint_write", checkpoint_write)]
    times = {k: [] for k in WRITE_ROWS}
    print(f"write: {nbytes / 2**20:.0f} MiB per checkpoint ({args.write_blocks} AdamW blocks), "
          f"{args.warmup} warm-up + {args.write_reps} reps, interleaved", flush=True)
    for rep in range(args.warmup + args.write_reps):
        for key, fn in rotate(group, rep):
            dt = fn()
            if rep >= args.warmup:
                times[key].append(dt)
        dt = sha256()
        if rep >= args.warmup:
            times["sha256"].append(dt)
        if args.verbose and rep >= args.warmup:
            print("  " + " ".join(f"{k}={nbytes / v[-1] / GB:.2f}" for k, v in times.items()), flush=True)
    rows = {}
    for key, (label, what) in WRITE_ROWS.items():
        rows[key] = {"label": label, "what": what, "bytes": nbytes, "gbps": summary([nbytes / s / GB for s in times[key]]),
                     "ms": summary([s * 1e3 for s in times[key]]), "samples_ms": [round(s * 1e3, 3) for s in times[key]]}
    gb_ck = [nbytes / s / GB for s in times["checkpoint_write"]]
    gb_raw = [nbytes / s / GB for s in times["raw_write"]]
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": nbytes, "blocks": args.write_blocks, "reps": args.write_reps, "rows": rows,
            "ratio": {"of": "checkpoint_write / raw_write (GB/s)", **ratio_block(gb_ck, gb_raw, WRITE_TARGET)}}


# --------------------------------------------------------------------------------------------
# 2. restore time
# --------------------------------------------------------------------------------------------
RESTORE_ROWS = {
    "raw_read_warm": ("raw read, page cache warm (baseline)",
                      "fresh subprocess: each file of the checkpoint read sequentially (unbuffered readinto, <= 1 GiB "
                      "per call) into a new torch.empty buffer of its size"),
    "load_warm": ("CheckpointDir.load verify=True, warm",
                  "fresh subprocess: first CheckpointDir.load(job) of the process, sha256 of every file checked, "
                  "each tensor read into its own storage"),
    "load_warm_noverify": ("diag: load verify=False, warm", "as load_warm with verify=False (no hashing)"),
    "load_warm_again": ("diag: 2nd load in that process, warm", "load_warm's process loads once more (process warm)"),
    "raw_read_cold": ("raw read, page cache dropped (baseline)", "as raw_read_warm after sync + drop_caches (3)"),
    "load_cold": ("CheckpointDir.load verify=True, cold", "as load_warm after sync + drop_caches (3)"),
}


def restore_child(argv: list[str]) -> int:
    """``--restore-child load|load-noverify|raw ROOT JOB``: one timed read in this fresh process, JSON on stdout."""
    mode, root, job = argv
    t_start = time.perf_counter()
    import torch

    from shardline.ps_server.checkpoint import CheckpointDir

    imports = time.perf_counter() - t_start
    out: dict = {"mode": mode, "import_seconds": imports}
    if mode == "raw":
        jobdir = os.path.join(root, job)
        names = sorted(os.listdir(jobdir))
        t0 = time.perf_counter()
        total = 0
        bufs = []
        for name in names:
            with open(os.path.join(jobdir, name), "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = torch.empty(size, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                while view:
                    n = f.readinto(view[:1 << 30])
                    if not n:
                        raise RuntimeError(f"{name} ends early")
                    view = view[n:]
                total += size
                bufs.append(buf)
        out.update(seconds=time.perf_counter() - t0, bytes=total, files=names)
    else:
        d = CheckpointDir(root, NODE)
        verify = mode == "load"
        t0 = time.perf_counter()
        loaded = d.load(job, verify=verify)
        out.update(seconds=time.perf_counter() - t0, bytes=loaded.bytes_read, step=loaded.step,
                   blocks=len(loaded.blocks))
        del loaded
        if verify:
            t0 = time.perf_counter()
            again = d.load(job, verify=True)
            out.update(again_seconds=time.perf_counter() - t0, again_bytes=again.bytes_read)
            del again
    print(json.dumps(out), flush=True)
    return 0


class Children:
    """Subprocesses of the restore section; ``stop_all`` ends exactly these, by pid."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def run(self, argv: list[str], timeout: float = 300.0) -> dict:
        p = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            self.stop_all()
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited with {p.returncode}:\n{err[-3000:]}")
        return json.loads(out.strip().splitlines()[-1])

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs = [p for p in self.procs if p.poll() is None]


def drop_page_cache() -> dict:
    """sync, then drop the page cache (and dentries/inodes); raises OSError if the kernel refuses."""
    before = meminfo_kib("Cached")
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")
    return {"cached_kib_before": before, "cached_kib_after": meminfo_kib("Cached")}


def bench_restore(args, workdir: Path, children: Children) -> dict:
    from shardline.ps_server.checkpoint import CheckpointDir

    job = "restore-bench"
    root = workdir / "restore"
    n_blocks = math.ceil(args.restore_mib * 2**20 / (3 * BLOCK_BYTES))
    snap = adamw_snapshot(job, 7, n_blocks, seed=1)
    info = CheckpointDir(root, NODE).write(snap)
    del snap
    print(f"restore: {info.bytes_written / 2**20:.0f} MiB checkpoint ({n_blocks} AdamW blocks), "
          f"{args.restore_reps} reps, each read in a fresh subprocess", flush=True)

    cold: dict = {"page_cache": "warm only"}
    if args.no_drop_caches:
        cold["reason"] = "--no-drop-caches"
    elif not os.access(DROP_CACHES, os.W_OK):
        cold["reason"] = f"{DROP_CACHES} is not writable: every number is page-cache warm"
    else:
        try:
            cold["first_drop"] = drop_page_cache()
            cold["page_cache"] = f"warm, and dropped before each cold row (sync; echo 3 > {DROP_CACHES})"
        except OSError as exc:
            cold["reason"] = f"writing {DROP_CACHES} failed ({exc.strerror or exc}): every number is page-cache warm"
    can_drop = "first_drop" in cold

    child = [PY, str(Path(__file__).resolve()), "--restore-child"]
    rows_run = [("raw_read_warm", "raw", False), ("load_warm", "load", False), ("load_warm_noverify", "load-noverify", False)]
    if can_drop:
        rows_run += [("raw_read_cold", "raw", True), ("load_cold", "load", True)]
    times: dict[str, list[float]] = {k: [] for k in RESTORE_ROWS}
    nbytes: dict[str, int] = {}
    drops = []
    # Untimed: the first read after the write runs slow once (seen up to 4x); every row reads all
    # the files, so the page cache stays warm for the warm rows after this.
    children.run([*child, "raw", str(root), job])
    for rep in range(args.restore_reps):
        for key, mode, drop in rotate(rows_run, rep):
            if drop:
                drops.append(drop_page_cache())
            r = children.run([*child, mode, str(root), job])
            times[key].append(r["seconds"])
            nbytes[key] = r["bytes"]
            if "again_seconds" in r and not drop:
                times["load_warm_again"].append(r["again_seconds"])
                nbytes["load_warm_again"] = r["again_bytes"]
        if args.verbose:
            print("  " + " ".join(f"{k}={v[-1]:.3f}s" for k, v in times.items() if v), flush=True)
    rows = {}
    for key, (label, what) in RESTORE_ROWS.items():
        if not times[key]:
            continue
        rows[key] = {"label": label, "what": what, "bytes": nbytes[key], "seconds": summary(times[key]),
                     "gbps": summary([nbytes[key] / s / GB for s in times[key]])}
    ratios = {"warm": {"of": "load_warm / raw_read_warm (GB/s)",
                       **ratio_block([nbytes["load_warm"] / s for s in times["load_warm"]],
                                     [nbytes["raw_read_warm"] / s for s in times["raw_read_warm"]], None)}}
    if can_drop:
        ratios["cold"] = {"of": "load_cold / raw_read_cold (GB/s)",
                          **ratio_block([nbytes["load_cold"] / s for s in times["load_cold"]],
                                        [nbytes["raw_read_cold"] / s for s in times["raw_read_cold"]], None)}
        cold["drops"] = drops
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": info.bytes_written, "blocks": n_blocks, "reps": args.restore_reps, "page_cache": cold,
            "rows": rows, "ratios": ratios}


# --------------------------------------------------------------------------------------------
# 3. step-time overhead on the demo job
# --------------------------------------------------------------------------------------------
METRICS = ("shardline_ps_checkpoints_total", "shardline_ps_checkpoint_bytes_total",
           "shardline_ps_checkpoint_write_seconds_sum", "shardline_ps_checkpoint_snapshot_seconds_sum",
           "process_cpu_seconds_total")


def scrape(addr: str) -> dict[str, float]:
    """Sums of the METRICS series of one daemon's /metrics (over their labels)."""
    out = {k: 0.0 for k in METRICS}
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def write_job_file(path: Path, name: str) -> None:
    import yaml

    spec = yaml.safe_load(DEMO_JOB.read_text())
    spec["job"]["name"] = name
    # Evaluation and sample answers run outside the timed steps; skip them to save wall time.
    spec["train"]["eval_examples"] = 0
    spec["train"]["sample_prompts"] = 0
    path.write_text(yaml.safe_dump(spec, sort_keys=False))


def train_run(workdir: Path, index: int, checkpoints: bool, steps: int, timeout: float) -> dict:
    from shardline.local_cluster import LocalCluster

    mode = "on" if checkpoints else "off"
    wd = workdir / f"train-{index:02d}-{mode}"
    wd.mkdir(parents=True)
    job = f"ckbench-{mode}-{index}-{os.getpid()}"
    job_file = wd / "job.yaml"
    write_job_file(job_file, job)
    run: dict = {"index": index, "checkpoints": checkpoints, "job": job, "loadavg_start": loadavg()}
    t0 = time.monotonic()
    cluster = LocalCluster(wd / "daemons")
    try:
        cluster.start_dispatcher(state_dir=str(wd / "dispatcher-state"))
        node_flags = [dict(checkpoint_dir=str(wd / f"ps{i}-ckpt"), checkpoint_every_steps=CHECKPOINT_EVERY)
                      if checkpoints else {} for i in range(2)]
        nodes = [cluster.add_node(node_id=f"ps{i}", wait=False, **node_flags[i]) for i in range(2)]
        for n in nodes:
            cluster.wait_ready(n)
        cluster.wait_for_nodes(2, timeout=30)
        results = [wd / f"worker-{r}.result.json" for r in range(2)]
        workers = [cluster.add_worker(job_file, r, 2, wait=False, result_file=str(results[r]), steps=steps,
                                      progress="off", summary="line") for r in range(2)]
        for w in workers:
            cluster.wait_ready(w)
        deadline = time.monotonic() + timeout
        for w in workers:
            try:
                code = w.proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{w.name} of {job} did not finish {steps} steps in {timeout:g} s:\n{w.log_tail()}") from None
            if code != 0:
                raise RuntimeError(f"{w.name} of {job} exited with {code}:\n{w.log_tail()}")
        per_worker = []
        for path in results:
            res = json.loads(path.read_text())
            if res.get("status") != "completed" or res.get("steps_done") != steps:
                raise RuntimeError(f"{path}: status {res.get('status')}, {res.get('steps_done')}/{steps} steps")
            per_worker.append({"rank": res["rank"], "train_seconds": res["train_seconds"], "steps_done": res["steps_done"],
                               "step_ms": res["train_seconds"] / res["steps_done"] * 1e3,
                               "tokens_per_s": res.get("tokens_per_s"), "final_loss": res.get("final_loss")})
        run["workers"] = per_worker
        run["step_ms"] = statistics.fmean(w["step_ms"] for w in per_worker)
        run["ps_metrics"] = {n.node_id: scrape(n.metrics) for n in nodes}
        written = sum(m["shardline_ps_checkpoints_total"] for m in run["ps_metrics"].values())
        if checkpoints and not written:
            raise RuntimeError(f"{job}: the PS nodes report no checkpoint written; logs in {wd / 'daemons'}")
    finally:
        run["exit_codes"] = cluster.shutdown()
        for i in range(2):
            shutil.rmtree(wd / f"ps{i}-ckpt", ignore_errors=True)
    run["wall_seconds"] = round(time.monotonic() - t0, 1)
    return run


def bench_train(args, workdir: Path) -> dict:
    steps = args.train_steps
    print(f"train: demo job, {steps} steps per run, 1 dispatcher + 2 PS + 2 workers; up to {args.train_pairs} "
          f"pairs of runs without/with checkpoints (every {CHECKPOINT_EVERY} steps), alternating", flush=True)
    index = 0
    warmup = None
    if args.train_warmup_steps:
        warmup = train_run(workdir, index, False, args.train_warmup_steps, args.train_timeout)
        index += 1
        print(f"  warm-up run (untimed): {warmup['step_ms']:.1f} ms/step", flush=True)
    pairs = []
    t_start = time.monotonic()
    for k in range(args.train_pairs):
        if k >= min(2, args.train_pairs) and time.monotonic() - t_start > args.train_budget:
            print(f"  time budget of {args.train_budget:g} s spent: stopping after {k} pairs", flush=True)
            break
        pair = {}
        # Alternate the order inside the pair (off,on / on,off / ...): a drifting load hits both.
        for checkpoints in ((False, True) if k % 2 == 0 else (True, False)):
            run = train_run(workdir, index, checkpoints, steps, args.train_timeout)
            index += 1
            pair["on" if checkpoints else "off"] = run
        ratio = pair["on"]["step_ms"] / pair["off"]["step_ms"]
        pairs.append(pair)
        print(f"  pair {k + 1}: off {pair['off']['step_ms']:.2f} ms/step, on {pair['on']['step_ms']:.2f} ms/step "
              f"(x{ratio:.3f}; load {loadavg()})", flush=True)
    off = [p["off"]["step_ms"] for p in pairs]
    on = [p["on"]["step_ms"] for p in pairs]
    paired = [b / a for a, b in zip(off, on)]
    ck = [sum(m["shardline_ps_checkpoints_total"] for m in p["on"]["ps_metrics"].values()) for p in pairs]
    ck_bytes = [sum(m["shardline_ps_checkpoint_bytes_total"] for m in p["on"]["ps_metrics"].values()) for p in pairs]
    ck_write = [sum(m["shardline_ps_checkpoint_write_seconds_sum"] for m in p["on"]["ps_metrics"].values()) for p in pairs]
    ck_snap = [sum(m["shardline_ps_checkpoint_snapshot_seconds_sum"] for m in p["on"]["ps_metrics"].values()) for p in pairs]
    cpu = {mode: [sum(m["process_cpu_seconds_total"] for m in p[mode]["ps_metrics"].values()) for p in pairs]
           for mode in ("off", "on")}
    overhead = statistics.median(paired) - 1
    return {
        "steps_per_run": steps, "checkpoint_every_steps": CHECKPOINT_EVERY, "pairs": len(pairs),
        "rows": {"off": {"label": "no checkpoint dir", "step_ms": summary(off)},
                 "on": {"label": f"checkpoint dirs, every {CHECKPOINT_EVERY} steps", "step_ms": summary(on)}},
        "overhead": {"of": "on step_ms / off step_ms - 1, per pair of adjacent runs",
                     "paired_median": overhead, "paired": summary([r - 1 for r in paired]),
                     "of_means": statistics.fmean(on) / statistics.fmean(off) - 1,
                     "target_max": OVERHEAD_TARGET, "meets_target": overhead <= OVERHEAD_TARGET},
        "checkpointing_per_on_run": {"checkpoints_both_nodes": summary(ck), "bytes_both_nodes": summary(ck_bytes),
                                     "write_seconds_both_nodes": summary(ck_write),
                                     "snapshot_seconds_both_nodes": summary(ck_snap)},
        "ps_cpu_seconds_both_nodes": {mode: summary(v) for mode, v in cpu.items()},
        "warmup_run": warmup, "runs": pairs,
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def print_table(r: dict) -> None:
    m = r["machine"]
    print()
    print(f"Shardline checkpoint benchmark  {r['timestamp']}  torch {m.get('torch')}  {m.get('cpu_count')} CPUs  "
          f"load {r['loadavg_start']} -> {r['loadavg_end']}  {'QUICK ' if r['quick'] else ''}wall {r['wall_seconds']} s")
    fs = r["filesystem"]
    print(f"files in {r['config']['dir']} ({fs.get('type')} on {fs.get('device')}); GB/s = 1e9 B/s; "
          f"command: {r['command']}")
    if "write" in r:
        w = r["write"]
        print(f"\nWrite, full checkpoint of {w['blocks']} AdamW blocks = {w['bytes'] / 2**20:.1f} MiB, "
              f"{w['reps']} interleaved reps")
        print(f"  {'row':44s} {'GB/s med':>8s} {'min':>6s} {'max':>6s} {'ms(med)':>8s}")
        for row in w["rows"].values():
            g = row["gbps"]
            print(f"  {row['label']:44s} {g['median']:8.2f} {g['min']:6.2f} {g['max']:6.2f} {row['ms']['median']:8.1f}")
        q = w["ratio"]
        p = q["paired"]
        print(f"  ratio checkpoint/raw: of medians {q['ratio_of_medians']:.2f}, paired median {p['median']:.2f} "
              f"(min {p['min']:.2f}, max {p['max']:.2f})  target >= {q['target']}"
              f"{'  ok' if q['meets_target'] else '  BELOW TARGET'}")
    if "restore" in r:
        s = r["restore"]
        print(f"\nRestore, {s['bytes'] / 2**20:.0f} MiB checkpoint ({s['blocks']} blocks), {s['reps']} reps, "
              f"each a fresh subprocess; page cache: {s['page_cache']['page_cache']}")
        print(f"  {'row':44s} {'s med':>7s} {'min':>7s} {'max':>7s} {'GB/s med':>8s}")
        for row in s["rows"].values():
            t = row["seconds"]
            print(f"  {row['label']:44s} {t['median']:7.3f} {t['min']:7.3f} {t['max']:7.3f} {row['gbps']['median']:8.2f}")
        for key, q in s["ratios"].items():
            p = q["paired"]
            print(f"  ratio load/raw read, {key}: of medians {q['ratio_of_medians']:.2f}, paired median "
                  f"{p['median']:.2f} (min {p['min']:.2f}, max {p['max']:.2f})")
        if "reason" in s["page_cache"]:
            print(f"  cold rows skipped: {s['page_cache']['reason']}")
    if "train" in r:
        t = r["train"]
        print(f"\nStep time, demo job ({t['steps_per_run']} steps, 2 workers, 2 PS), {t['pairs']} pairs of "
              f"alternating runs; mean of the workers' train_seconds / steps_done")
        print(f"  {'row':44s} {'ms med':>7s} {'min':>7s} {'max':>7s}")
        for row in t["rows"].values():
            x = row["step_ms"]
            print(f"  {row['label']:44s} {x['median']:7.2f} {x['min']:7.2f} {x['max']:7.2f}")
        o = t["overhead"]
        print(f"  overhead: paired median {o['paired_median'] * 100:+.1f} % (pairs {o['paired']['min'] * 100:+.1f} .. "
              f"{o['paired']['max'] * 100:+.1f} %), of means {o['of_means'] * 100:+.1f} %  target <= "
              f"{o['target_max'] * 100:.0f} %{'  ok' if o['meets_target'] else '  ABOVE TARGET'}")
        c = t["checkpointing_per_on_run"]
        cpu = t["ps_cpu_seconds_both_nodes"]
        print(f"  per 'on' run (both PS): {c['checkpoints_both_nodes']['median']:.0f} checkpoints, "
              f"{c['bytes_both_nodes']['median'] / 2**20:.1f} MiB, writer busy {c['write_seconds_both_nodes']['median']:.2f} s, "
              f"job lock held for snapshots {c['snapshot_seconds_both_nodes']['median'] * 1e3:.0f} ms; "
              f"PS CPU s off/on {cpu['off']['median']:.2f}/{cpu['on']['median']:.2f}")
    print()


def run(args) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="shardline-ckbench-", dir=args.dir))
    result: dict = {
        "benchmark": "shardline checkpoints: write vs raw write, restore vs raw read, step time with vs without",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(PY).name, *sys.argv]),
        "quick": args.quick,
        "machine": machine_info(),
        "filesystem": filesystem_of(workdir),
        "loadavg_start": loadavg(),
        "config": {"dir": str(workdir), "sections": args.sections, "block_elements": BLOCK_ELEMENTS,
                   "write_blocks": args.write_blocks, "write_reps": args.write_reps, "warmup_reps": args.warmup,
                   "restore_mib": args.restore_mib, "restore_reps": args.restore_reps,
                   "train_steps": args.train_steps, "train_pairs": args.train_pairs,
                   "train_warmup_steps": args.train_warmup_steps, "train_budget_seconds": args.train_budget,
                   "checkpoint_every_steps": CHECKPOINT_EVERY, "gbps_unit": "1e9 bytes/s"},
    }
    t_start = time.monotonic()
    children = Children()
    try:
        if "write" in args.sections:
            result["write"] = bench_write(args, workdir)
        if "restore" in args.sections:
            result["restore"] = bench_restore(args, workdir, children)
        if "train" in args.sections:
            result["train"] = bench_train(args, workdir)
    finally:
        children.stop_all()
        for name in ("write", "restore"):
            shutil.rmtree(workdir / name, ignore_errors=True)
    result["loadavg_end"] = loadavg()
    result["wall_seconds"] = round(time.monotonic() - t_start, 1)
    print(f"daemon logs in {workdir}", flush=True)
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--restore-child"]:
        return restore_child(argv[1:])
    p = argparse.ArgumentParser(description="Shardline checkpoint benchmark against raw file I/O baselines")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--quick", action="store_true", help="fast sanity run: small sizes, few reps, one pair of runs")
    p.add_argument("--sections", default="write,restore,train", help="comma-separated subset of write,restore,train")
    p.add_argument("--dir", default=None, help="where the files go (default: the system temp dir)")
    p.add_argument("--write-blocks", type=int, default=None, help="AdamW blocks per written checkpoint (default 64 = 192 MiB, quick 16)")
    p.add_argument("--write-reps", type=int, default=None, help="timed write repetitions (default 15, quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="untimed write repetitions first (default 2, quick 1)")
    p.add_argument("--restore-mib", type=int, default=None, help="size of the restored checkpoint (default 1024, quick 256)")
    p.add_argument("--restore-reps", type=int, default=None, help="restore repetitions per row (default 3, quick 1)")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache (cold rows skipped)")
    p.add_argument("--train-steps", type=int, default=None, help="demo job steps per run (default 150, quick 40)")
    p.add_argument("--train-pairs", type=int, default=None, help="pairs of runs without/with checkpoints (default 10, quick 1)")
    p.add_argument("--train-warmup-steps", type=int, default=None, help="steps of an untimed first run (default 40, quick 0)")
    p.add_argument("--train-budget", type=float, default=180.0,
                   help="soft limit in s for the train section; stops after >= 2 pairs once spent (default 180)")
    p.add_argument("--train-timeout", type=float, default=300.0, help="limit in s for one run's training")
    p.add_argument("-v", "--verbose", action="store_true", help="print every repetition")
    args = p.parse_args(argv)

    def pick(value, full, quick):
        return value if value is not None else (quick if args.quick else full)

    args.write_blocks = pick(args.write_blocks, 64, 16)
    args.write_reps = pick(args.write_reps, 15, 3)
    args.warmup = pick(args.warmup, 2, 1)
    args.restore_mib = pick(args.restore_mib, 1024, 256)
    args.restore_reps = pick(args.restore_reps, 3, 1)
    args.train_steps = pick(args.train_steps, 150, 40)
    args.train_pairs = pick(args.train_pairs, 10, 1)
    args.train_warmup_steps = pick(args.train_warmup_steps, 40, 0)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if not set(args.sections) <= {"write", "restore", "train"} or not args.sections:
        p.error("--sections takes a comma-separated subset of write,restore,train")
    if min(args.write_blocks, args.write_reps, args.restore_mib, args.restore_reps, args.train_steps, args.train_pairs) < 1 \
            or args.warmup < 0 or args.train_warmup_steps < 0:
        p.error("sizes, reps, steps and pairs must be >= 1, warm-ups >= 0")

    return run_and_report(run, print_table, args, stopped='processes')

if __name__ == "__main__":
    sys.exit(main())
