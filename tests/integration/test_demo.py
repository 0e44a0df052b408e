"""`shardline up`: a whole local cluster trains a short demo job, summarizes it and leaves no process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)

DATA = Path(__file__).parent / "data"
DEMO_SHORT = DATA / "demo_short.yaml"


def shardline_cmd() -> list[str]:
    script = Path(sys.executable).parent / "shardline"
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardline.cli"]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if text.encode() in fh.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def run_up(workdir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `shardline up` with its workdir; whatever happens, nothing of it outlives the test."""
    proc = subprocess.Popen([*shardline_cmd(), "up", "--workdir", str(workdir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)   # the CLI shuts its cluster down on SIGINT
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in processes_mentioning(str(workdir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_up_trains_the_demo_and_cleans_up(tmp_path):
    workdir = tmp_path / "up"
    res = run_up(workdir, "--ps", "2", "--workers", "2", "--job", str(DEMO_SHORT), "--timeout", "100")
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    out = res.stdout
    # rank 0's progress was streamed live
    assert re.search(r"step 12/12 loss \d", out), out
    # the summary: every worker completed all steps, both nodes hold blocks, rank 0's samples
    assert "== summary: job demo-short" in out
    for rank in (0, 1):
        assert re.search(rf"rank {rank}\s+completed\s+0\s+12/12\s+\d+\.\d+", out), out
    for node in ("ps-0", "ps-1"):
        m = re.search(rf"^{node}\s+default\s+alive\s+(\d+)\s", out, re.M)
        assert m and int(m.group(1)) > 0, out
    assert "before  ->  after" in out and "exact-match accuracy" in out
    assert "cluster shut down" in out
    # machine-readable results of each worker
    results = [json.loads((workdir / f"worker-{r}.result.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in results] == ["completed", "completed"]
    assert [r["version"] for r in results] == [12, 12]
    assert results[0]["before_samples"] and results[0]["after_samples"]
    assert processes_mentioning(str(workdir)) == []


def test_up_reports_a_failing_worker(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEMO_SHORT.read_text().replace("steps: 12", "steps: 12\n  stpes: 3"))
    workdir = tmp_path / "up"
    res = run_up(workdir, "--ps", "1", "--workers", "2", "--job", str(bad), "--timeout", "100")
    assert res.returncode == 1, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert re.search(r"worker-\d \(rank \d\) exited with code 2", res.stderr), res.stderr
    assert "stpes" in res.stderr  # the worker's own error, from its log
    assert processes_mentioning(str(workdir)) == []


def test_ctrl_c_mid_training_shuts_everything_down(tmp_path):
    long_job = tmp_path / "long.yaml"
    long_job.write_text(DEMO_SHORT.read_text().replace("steps: 12", "steps: 100000"))
    workdir = tmp_path / "up"
    proc = subprocess.Popen([*shardline_cmd(), "up", "--workdir", str(workdir), "--ps", "2", "--workers", "2",
                             "--job", str(long_job), "--timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:  # wait until rank 0 is training
            seen.append(line)
            if re.search(r"step \d+/100000", line):
                break
        else:
            pytest.fail("training never started:\n" + "".join(seen))
        assert len(processes_mentioning(str(workdir))) >= 5  # dispatcher, 2 PS, 2 workers
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, "".join(seen) + rest
        assert processes_mentioning(str(workdir)) == [], "daemons outlived shardline up after Ctrl-C"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in processes_mentioning(str(workdir)):
            os.kill(pid, signal.SIGKILL)


def test_interrupted_up_resumes_and_reaches_the_same_result(tmp_path):
    """Ctrl-C in the middle of `shardline up`, then the same command again: it resumes the job where
    it stopped (same data order, lr schedule at the right step) and ends where an uninterrupted run
    ends, against the single-process reference."""
    from shardline.jobs.runner import run_local
    from shardline.jobs.spec import load_job

    job_file = tmp_path / "resume.yaml"
    job_file.write_text(DEMO_SHORT.read_text().replace("name: demo-short", "name: demo-resume")
                        .replace("steps: 12", "steps: 60\n  lr_schedule: cosine\n  warmup_steps: 5"))
    workdir = tmp_path / "up"
    args = [*shardline_cmd(), "up", "--workdir", str(workdir), "--ps", "2", "--workers", "2", "--job", str(job_file),
            "--timeout", "120", "--checkpoint-every", "7"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            m = re.search(r"step (\d+)/60", line)
            if m and int(m.group(1)) >= 20:
                break
        else:
            pytest.fail("training never got going:\n" + "".join(seen))
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, "".join(seen) + rest
        assert "to resume the job" in rest, rest
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert processes_mentioning(str(workdir)) == []
    res = run_up(workdir, "--ps", "2", "--workers", "2", "--job", str(job_file), "--timeout", "120",
                 "--checkpoint-every", "7")
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr}"
    assert "resuming job demo-resume from the state of an earlier run" in res.stdout
    m = re.search(r"resuming job demo-resume at step (\d+) of 60", res.stdout)
    assert m and int(m.group(1)) >= 20, res.stdout
    results = [json.loads((workdir / f"worker-{r}.result.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in results] == ["completed", "completed"]
    assert [r["version"] for r in results] == [60, 60]
    reference = run_local(load_job(job_file), world_size=2)
    assert results[0]["after_accuracy"] == reference.after_accuracy
    # The nodes' final checkpoints (kept in the workdir) hold the parameters of the reference.
    from shardline.ps_server.checkpoint import read_job_tensors

    step, _spec, tensors = read_job_tensors([workdir / "ps-0-checkpoints", workdir / "ps-1-checkpoints"], "demo-resume")
    assert step == 60
    expected = dict(reference.model.named_parameters())
    assert set(tensors) == set(expected)
    for name, value in tensors.items():
        diff = (value - expected[name].detach()).abs().max().item()
        assert diff <= 1e-5, f"{name}: max abs diff {diff}"
