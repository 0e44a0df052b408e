"""services/failpoints.py: the SHARDLINE_FAILPOINTS syntax, each action, and a pause driven from
another process through its release file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shardline.services import failpoints
from shardline.services.errors import ShardlineConfigError, ShardlineConnectionError, ShardlineTimeoutError


@pytest.fixture
def arm(tmp_path):
    """Arm failpoints in this process (``arm(spec)``); all are disarmed afterwards."""
    yield lambda spec: failpoints.configure(spec, tmp_path)
    failpoints.configure("")


# -- syntax ----------------------------------------------------------------------------------------

def test_name_and_name_at_step_still_mean_exit():
    armed = failpoints.parse("worker.after_push, ps.checkpoint.values.tmp ,worker.before_push@6")
    assert {n: (p.action, p.step, p.count) for n, p in armed.items()} == {
        "worker.after_push": ("exit", None, None), "ps.checkpoint.values.tmp": ("exit", None, None),
        "worker.before_push": ("exit", 6, None)}
    assert failpoints.parse("") == {} and failpoints.parse(" , ") == {}


def test_actions_counts_and_arguments(tmp_path):
    armed = failpoints.parse("a=pause,b@3=pause(2.5),c=raise,d=raise(ShardlineConnectionError),"
                             "e=2*sleep(0.5),f@1=off,g=1*exit", str(tmp_path))
    got = {n: (p.step, p.count, p.action, p.argument) for n, p in armed.items()}
    assert got == {"a": (None, None, "pause", failpoints.PAUSE_TIMEOUT), "b": (3, None, "pause", 2.5),
                   "c": (None, None, "raise", failpoints.FailpointError),
                   "d": (None, None, "raise", ShardlineConnectionError), "e": (None, 2, "sleep", 0.5),
                   "f": (1, None, "off", None), "g": (None, 1, "exit", None)}


@pytest.mark.parametrize("entry, why", [
    ("=exit", "expected name[@step]"),
    ("a@", "expected name[@step]"),
    ("a@x", "expected name[@step]"),
    ("a@-1", "expected name[@step]"),
    ("a b", "expected name[@step]"),
    ("a=", "expected name[@step]"),
    ("a=explode", "unknown action 'explode'"),
    ("a=0*exit", "at least 1"),
    ("a=x*exit", "expected name[@step]"),
    ("a=exit(1)", "exit takes no argument"),
    ("a=off(1)", "off takes no argument"),
    ("a=sleep", "sleep needs its seconds"),
    ("a=sleep()", "must be seconds"),
    ("a=sleep(soon)", "must be seconds"),
    ("a=sleep(-1)", "at least 0"),
    ("a=sleep(nan)", "at least 0"),
    ("a=pause(inf)", "finite"),
    ("a=raise(KeyError)", "not an error class of shardline.services.errors"),
    ("a=raise(ErrorCode)", "not an error class"),
    ("a=raise(RemoteError)", "cannot be raised with a message alone"),
])
def test_a_bad_entry_is_a_config_error_quoting_it(entry, why, tmp_path):
    with pytest.raises(ShardlineConfigError) as exc:
        failpoints.parse(f"ok, {entry}", str(tmp_path))
    assert f"SHARDLINE_FAILPOINTS: bad failpoint entry {entry!r}" in str(exc.value) and why in str(exc.value)


def test_a_point_armed_twice_or_a_pause_without_a_directory_is_refused():
    with pytest.raises(ShardlineConfigError, match="'a' is armed twice"):
        failpoints.parse("a@3,b,a=raise")
    with pytest.raises(ShardlineConfigError, match="a pause needs SHARDLINE_FAILPOINTS_DIR"):
        failpoints.parse("a=pause")


def test_a_bad_entry_stops_the_process_at_start():
    out = run_script("from shardline.services import failpoints", {"SHARDLINE_FAILPOINTS": "a@2=explode"})
    assert out.returncode != 0
    assert "ShardlineConfigError" in out.stdout and "'a@2=explode'" in out.stdout, out.stdout


# -- actions, in this process ----------------------------------------------------------------------

def test_unarmed_points_do_nothing(arm):
    arm("")
    failpoints.hit("worker.after_push", 3)
    assert not failpoints.armed("worker.after_push", 3)
    arm("other=raise")
    failpoints.hit("worker.after_push", 3)


def test_raise_fires_from_its_step_on_and_names_the_point(arm):
    arm("a@5=raise,b=raise(ShardlineConnectionError)")
    failpoints.hit("a", 4)
    assert not failpoints.armed("a", 4) and failpoints.armed("a", 5) and failpoints.armed("a")
    with pytest.raises(failpoints.FailpointError, match="failpoint a at step 5"):
        failpoints.hit("a", 5)
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("a", 9)   # a later step too (a node busy when step 5 went by fires at its next)
    with pytest.raises(failpoints.FailpointError):
        failpoints.hit("a")      # a hit that names no step matches
    with pytest.raises(ShardlineConnectionError, match="failpoint b at step 1"):
        failpoints.hit("b", 1)


def test_a_count_fires_that_many_times_then_stays_quiet(arm):
    arm("a=2*raise")
    for _ in range(2):
        assert failpoints.armed("a", 1)
        with pytest.raises(failpoints.FailpointError):
            failpoints.hit("a", 1)
    assert not failpoints.armed("a", 1)
    failpoints.hit("a", 1)


def test_sleep_sleeps_then_goes_on(arm):
    arm("a=1*sleep(0.2)")
    started = time.monotonic()
    failpoints.hit("a", 0)
    assert time.monotonic() - started >= 0.2
    started = time.monotonic()
    failpoints.hit("a", 1)   # its one firing is spent
    assert time.monotonic() - started < 0.1


def test_off_is_listed_but_never_fires(arm):
    arm("a=off")
    assert not failpoints.armed("a")
    failpoints.hit("a", 1)


def test_a_released_pause_does_not_hold(arm, tmp_path):
    arm("a=pause(5)")
    failpoints.release(tmp_path, "a", until_step=3)
    failpoints.hit("a", 2)   # below the release's step: passes at once, no marker left
    failpoints.release(tmp_path, "a")
    failpoints.hit("a", 7)
    assert failpoints.paused(tmp_path, "a") == {}


# -- exit and pause, in a process of their own -----------------------------------------------------

STEPS_SCRIPT = """
    import logging, sys
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    from shardline.services import failpoints
    for step in range({steps}):
        print("step", step, flush=True)
        failpoints.hit("train.before_step", step)
    print("done", flush=True)
"""


def run_script(code: str, env: dict, wait: bool = True):
    """Run ``code`` in a Python process of its own with ``env`` added; its output and errors come in
    one pipe. ``wait``: the finished run, else the running Popen."""
    argv, environ = [sys.executable, "-c", textwrap.dedent(code)], {**os.environ, **env}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if wait:
        return subprocess.run(argv, env=environ, timeout=60, **pipes)
    return subprocess.Popen(argv, env=environ, **pipes)


def test_exit_ends_the_process_as_a_kill_9_would():
    out = run_script(STEPS_SCRIPT.format(steps=5), {"SHARDLINE_FAILPOINTS": "train.before_step@2"})
    assert out.returncode == failpoints.EXIT_CODE == 137
    assert "step 2" in out.stdout and "step 3" not in out.stdout
    assert "failpoint train.before_step hit at step 2: exiting now" in out.stdout, out.stdout


def test_a_pause_holds_until_another_process_releases_it(tmp_path):
    proc = run_script(STEPS_SCRIPT.format(steps=6), {"SHARDLINE_FAILPOINTS": "train.before_step@2=pause",
                                                     "SHARDLINE_FAILPOINTS_DIR": str(tmp_path)}, wait=False)
    try:
        assert failpoints.wait_paused(tmp_path, "train.before_step", timeout=30) == {proc.pid: 2}
        time.sleep(0.2)
        assert proc.poll() is None and failpoints.paused(tmp_path, "train.before_step") == {proc.pid: 2}
        failpoints.release(tmp_path, "train.before_step", until_step=4)   # steps 2 and 3 go; 4 holds
        assert failpoints.wait_paused(tmp_path, "train.before_step", step=4, timeout=30) == {proc.pid: 4}
        failpoints.release(tmp_path, "train.before_step")                 # for good
        output = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, output
    assert output.count("failpoint train.before_step paused at step") == 2, output
    assert "failpoint train.before_step paused at step 2: waiting for" in output
    assert "failpoint train.before_step released at step 4 after" in output
    assert output.index("released at step 2") < output.index("step 3") < output.index("paused at step 4")
    assert "done" in output and failpoints.paused(tmp_path, "train.before_step") == {}


def test_a_pause_never_released_ends_the_process_at_its_timeout(tmp_path):
    started = time.monotonic()
    out = run_script(STEPS_SCRIPT.format(steps=3), {"SHARDLINE_FAILPOINTS": "train.before_step@1=pause(0.3)",
                                                    "SHARDLINE_FAILPOINTS_DIR": str(tmp_path)})
    assert out.returncode == failpoints.PAUSE_TIMEOUT_EXIT_CODE, out.stdout
    assert time.monotonic() - started >= 0.3
    assert "not released within pause timeout 0.3 s: exiting" in out.stdout and "step 2" not in out.stdout


def test_wait_paused_times_out_naming_the_point(tmp_path):
    with pytest.raises(ShardlineTimeoutError, match="not paused at failpoint x within 0.1 s"):
        failpoints.wait_paused(tmp_path, "x", timeout=0.1)
    with pytest.raises(ShardlineTimeoutError, match="not paused at failpoint x at step 3 within 0.1 s"):
        failpoints.wait_paused(tmp_path, "x", step=3, timeout=0.1)


def test_threads_paused_at_one_point_share_their_process_marker(arm, tmp_path):
    arm("a=pause(30)")
    failpoints.release(tmp_path, "a", until_step=5)
    threads = [threading.Thread(target=failpoints.hit, args=("a", step)) for step in (5, 7)]
    try:
        threads[0].start()
        assert failpoints.wait_paused(tmp_path, "a", step=5, timeout=10) == {os.getpid(): 5}
        threads[1].start()
        time.sleep(0.2)   # both paused: the marker names the older pause
        assert failpoints.paused(tmp_path, "a") == {os.getpid(): 5}
        failpoints.release(tmp_path, "a", until_step=6)
        threads[0].join(10)
        assert not threads[0].is_alive() and threads[1].is_alive()
        assert failpoints.wait_paused(tmp_path, "a", step=7, timeout=10) == {os.getpid(): 7}
    finally:
        failpoints.release(tmp_path, "a")
        for thread in threads:
            thread.join(10)
    assert failpoints.paused(tmp_path, "a") == {}


def test_the_daemons_take_the_failpoint_variables_as_known(tmp_path):
    from shardline.ps_server.main import build_parser
    from shardline.services.config import parse_daemon_args

    env = {failpoints.ENV: "ps.after_apply@3=pause", failpoints.DIR_ENV: str(tmp_path), "SHARDLINE_FAILPOINT": "x"}
    args = parse_daemon_args(build_parser(), ["--cluster", "127.0.0.1:7000"], environ=env)
    assert len(args.config_warnings) == 1 and "SHARDLINE_FAILPOINT:" in args.config_warnings[0], args.config_warnings
