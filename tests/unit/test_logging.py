"""services.daemon.setup_logging: one line per event, text or JSON, levels, journald priorities.

The last tests run a real dispatcher and PS node (subprocesses on 127.0.0.1) with
``--log-format json`` and check that every stdout line is a JSON event and that requests do not
produce log lines at INFO.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from shardline.services.daemon import LogFormatter, setup_logging
from shardline.services.errors import ShardlineConfigError

REPO = Path(__file__).resolve().parents[2]
REQUIRED = {"ts", "level", "component", "logger", "msg", "pid"}


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def emit(fmt: str, level: str = "DEBUG", **env) -> tuple[io.StringIO, logging.Logger]:
    stream = io.StringIO()
    setup_logging(level, "ps", fmt, stream=stream)
    return stream, logging.getLogger("shardline.test")


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_json_lines_parse_with_required_fields(restore_logging):
    stream, log = emit("json")
    log.info("node %s registered", "a1", extra={"node_id": "a1", "epoch": 7})
    log.warning("heartbeat failed: %s", "timeout")
    out = [json.loads(line) for line in lines(stream)]
    assert len(out) == 2
    for event in out:
        assert REQUIRED <= set(event), event
        assert event["component"] == "ps" and event["logger"] == "shardline.test" and event["pid"] == os.getpid()
        assert event["ts"].endswith("Z") and "T" in event["ts"]
    assert out[0]["level"] == "INFO" and out[0]["msg"] == "node a1 registered"
    assert out[0]["node_id"] == "a1" and out[0]["epoch"] == 7
    assert out[1]["level"] == "WARNING" and out[1]["msg"] == "heartbeat failed: timeout"


def test_json_exception_is_one_line_with_exc_field(restore_logging):
    stream, log = emit("json")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        log.exception("internal error handling %s", "PUSH")
    out = lines(stream)
    assert len(out) == 1
    event = json.loads(out[0])
    assert event["level"] == "ERROR" and "Traceback" in event["exc"] and "ValueError: bad\nthing" in event["exc"]


def test_json_non_serializable_fields_become_strings(restore_logging):
    stream, log = emit("json")
    log.info("path", extra={"where": Path("/tmp/x"), "obj": object()})
    event = json.loads(lines(stream)[0])
    assert event["where"] == "/tmp/x" and isinstance(event["obj"], str)


def test_text_is_one_line_per_event_with_fields(restore_logging):
    stream, log = emit("text")
    log.info("job %s created", "sft-1", extra={"tensors": 3, "sync": "bsp"})
    log.error("multi\nline message")
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("failed")
    out = lines(stream)
    assert len(out) == 3
    assert " INFO ps[" in out[0] and "shardline.test: job sft-1 created" in out[0]
    assert "tensors=3" in out[0] and "sync=bsp" in out[0]
    assert out[1].endswith("multi\\nline message")
    assert "exc=Traceback" in out[2] and "ZeroDivisionError" in out[2]


def test_levels_filter(restore_logging):
    stream, log = emit("json", level="warning")
    log.debug("per request")
    log.info("lifecycle")
    log.warning("problem")
    assert [json.loads(line)["msg"] for line in lines(stream)] == ["problem"]


def test_python_warnings_are_logged(restore_logging):
    stream, _ = emit("json")
    warnings.warn("deprecated thing", DeprecationWarning, stacklevel=1)
    event = json.loads(lines(stream)[-1])
    assert event["level"] == "WARNING" and "deprecated thing" in event["msg"]


def test_reconfiguring_replaces_the_handler(restore_logging):
    first = io.StringIO()
    setup_logging("INFO", "ps", "text", stream=first)
    second = io.StringIO()
    setup_logging("INFO", "ps", "json", stream=second)
    logging.getLogger("shardline.test").info("once")
    assert first.getvalue() == "" and len(lines(second)) == 1


@pytest.mark.parametrize("level, fmt", [("LOUD", "text"), ("INFO", "xml")])
def test_bad_level_or_format_is_a_config_error(restore_logging, level, fmt):
    with pytest.raises(ShardlineConfigError, match=repr(level) if level == "LOUD" else repr(fmt)):
        setup_logging(level, "ps", fmt, stream=io.StringIO())


def test_journald_stream_gets_priority_prefix_and_no_timestamp(restore_logging, tmp_path, monkeypatch):
    path = tmp_path / "journal"
    with open(path, "w") as fh:
        st = os.fstat(fh.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        setup_logging("DEBUG", "ps", "json", stream=fh)
        log = logging.getLogger("shardline.test")
        log.error("broken")
        log.info("fine")
        log.debug("detail")
    out = path.read_text().splitlines()
    assert [line[:3] for line in out] == ["<3>", "<6>", "<7>"]
    assert json.loads(out[0][3:])["msg"] == "broken"
    with open(path, "w") as fh:
        setup_logging("INFO", "ps", "text", stream=fh)
        logging.getLogger("shardline.test").warning("careful")
    text = path.read_text()
    assert text.startswith("<4>WARNING ps[")  # journald adds the time itself


def test_not_journald_without_matching_stream(monkeypatch):
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    fmt = LogFormatter("ps", "text")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", (), None)
    assert not fmt.format(record).startswith("<")


# -- real daemons ----------------------------------------------------------------------------------

def _start(module: str, workdir: Path, name: str, *args: str) -> tuple[subprocess.Popen, dict, Path]:
    ready, out = workdir / f"{name}.json", workdir / f"{name}.out"
    with open(out, "wb") as fh, open(workdir / f"{name}.err", "wb") as err:
        env = {**os.environ, "SHARDLINE_LOG_FORMAT": "json"}  # the environment form of --log-format json
        proc = subprocess.Popen([sys.executable, "-m", module, "--listen", "127.0.0.1:0", "--metrics-port", "0",
                                 "--log-level", "INFO", "--ready-file", str(ready), *args],
                                cwd=REPO, stdout=fh, stderr=err, env=env)
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{module} did not start: {(workdir / f'{name}.err').read_text()}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text()), out


@pytest.mark.timeout(90)
def test_daemons_log_json_events_and_no_line_per_request(tmp_path):
    import torch

    from shardline.services.errors import ShardlineError
    from shardline import connect

    procs = []
    try:
        disp, dinfo, dout = _start("shardline.dispatcher.main", tmp_path, "dispatcher", "--heartbeat-timeout", "3")
        procs.append(disp)
        ps, _pinfo, pout = _start("shardline.ps_server.main", tmp_path, "ps", "--cluster", dinfo["grpc"], "--node-id", "log-1",
                                  "--transport", "tcp")
        procs.append(ps)
        time.sleep(0.5)
        before = {p: len(p.read_text().splitlines()) for p in (dout, pout)}
        client = connect(dinfo["grpc"], job="logjob", transport="tcp")
        client.init({"w": torch.zeros(64)}, optimizer="sgd", lr=0.1)
        for _ in range(40):  # 40 push/commit/pull rounds, 120+ data-plane requests
            client.step_sync({"w": torch.ones(64)})
        for _ in range(20):  # failing requests (a pull that times out server-side) are DEBUG events
            with pytest.raises(ShardlineError):
                client.pull(["w"], min_step=10**6, timeout=0.01)
        client.close()
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=15) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for path in (dout, pout):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert events, path.name
        for event in events:
            assert REQUIRED <= set(event), event
        assert {e["component"] for e in events} == {"dispatcher" if path == dout else "ps"}
        assert any(e["msg"].startswith("configuration:") and "log_format=json (env SHARDLINE_LOG_FORMAT)" in e["msg"]
                   for e in events)
        # Requests (hundreds of them) added only a handful of event lines: job created/ready, stopping...
        added = len(events) - before[path]
        assert added <= 8, [e["msg"] for e in events[before[path]:]]
