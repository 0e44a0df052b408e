"""services.config: one schema for the three daemons, flag > env > file > default, strict validation."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardline.services import config
from shardline.services.config import OPTIONS, parse_daemon_args, parse_size
from shardline.services.errors import ShardlineConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "shardline.yaml"

REQUIRED_ARGS = {"dispatcher": [], "ps": ["--cluster", "127.0.0.1:7000"],
                 "worker": ["--cluster", "127.0.0.1:7000", "--job", "job.yaml"]}


def daemon_parser(daemon: str) -> argparse.ArgumentParser:
    """The parser the daemon's main builds."""
    if daemon == "dispatcher":
        from shardline.dispatcher.main import build_parser
    elif daemon == "ps":
        from shardline.ps_server.main import build_parser
    else:
        from shardline.jobs.worker_daemon import build_parser
    return build_parser()


def parse(daemon: str, argv=(), env=None, text: str | None = None, tmp_path: Path | None = None):
    argv = list(argv)
    if text is not None:
        path = tmp_path / "shardline.yaml"
        path.write_text(text)
        argv += ["--config", str(path)]
    return parse_daemon_args(daemon_parser(daemon), [*REQUIRED_ARGS[daemon], *argv], environ=env or {})


def error(daemon: str, argv=(), env=None, text: str | None = None, tmp_path: Path | None = None) -> str:
    with pytest.raises(ShardlineConfigError) as err:
        parse(daemon, argv, env, text, tmp_path)
    return str(err.value)


# -- the schema ------------------------------------------------------------------------------------

def test_schema_is_consistent():
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names))
    for o in OPTIONS:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", o.name), o.name
        assert o.daemons and set(o.daemons) <= set(config.DAEMONS), o.name
        assert o.help.strip(), o.name
        if o.kind == "choice":
            assert o.choices, o.name
        for d in o.daemons:  # every default passes its own validation
            default = o.default_for(d)
            if default is not None:
                assert o.convert(default, o.name, text=False) == default, o.name


def test_defaults_match_the_code_that_uses_them():
    from shardline.services import blocks, frame

    assert config.DEFAULT_BLOCK_ELEMENTS == blocks.DEFAULT_BLOCK_ELEMENTS
    assert config.MAX_BLOCK_ELEMENTS == blocks.MAX_BLOCK_ELEMENTS
    assert config.DEFAULT_MAX_PAYLOAD_BYTES == frame.DEFAULT_LIMITS.max_payload_bytes
    from shardline.services.transport import TRANSPORT_NAMES

    assert set(config.BY_NAME["transport"].choices) == set(TRANSPORT_NAMES)
    from shardline.services.transport import shm

    assert config.DEFAULT_SHM_RING_BYTES == shm.DEFAULT_RING_BYTES
    assert (config.BY_NAME["shm_ring_bytes"].minimum, config.BY_NAME["shm_ring_bytes"].maximum) == \
        (shm.MIN_RING_BYTES, shm.MAX_PEER_RING_BYTES)
    from shardline.dispatcher import state_store

    assert config.BY_NAME["state_prefix"].default == state_store.DEFAULT_STATE_PREFIX
    assert config.BY_NAME["connect_timeout"].default == state_store.DEFAULT_CONNECT_TIMEOUT


@pytest.mark.parametrize("daemon", config.DAEMONS)
def test_mains_declare_every_schema_option_and_nothing_else(daemon):
    parser = daemon_parser(daemon)
    dests = {a.dest for a in parser._actions if a.option_strings} - {"help", "config"}
    assert dests == {o.name for o in config.options_for(daemon)}


def test_the_knobs_operators_tune_are_all_there():
    per_daemon = {d: {o.name for o in config.options_for(d)} for d in config.DAEMONS}
    assert {"heartbeat_interval", "heartbeat_timeout", "listen", "metrics_port"} <= per_daemon["dispatcher"]
    assert {"rpc_timeout", "connect_timeout", "transport", "listen", "data_listen", "metrics_port",
            "checkpoint_dir", "max_payload_bytes", "torch_threads"} <= per_daemon["ps"]
    assert {"rpc_timeout", "connect_timeout", "pull_timeout", "transport", "block_elements", "cache_bytes",
            "prefetch_window", "torch_threads", "listen", "metrics_port"} <= per_daemon["worker"]
    for d in config.DAEMONS:
        assert {"log_level", "log_format", "ready_file"} <= per_daemon[d]


# -- precedence ------------------------------------------------------------------------------------

def test_default_when_nothing_is_set():
    args = parse("dispatcher")
    assert args.heartbeat_timeout == 5.0 and args.listen == "127.0.0.1:7000" and args.log_format == "text"
    assert args.config_sources["heartbeat_timeout"] == "default"
    assert parse("ps").listen == "127.0.0.1:7100"
    assert parse("worker").listen == "127.0.0.1:0"


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    text = "dispatcher:\n  heartbeat_timeout: 3\n  vnodes_per_capacity: 16\n  metrics_port: 9400\n"
    env = {"SHARDLINE_HEARTBEAT_TIMEOUT": "4", "SHARDLINE_VNODES_PER_CAPACITY": "32"}
    args = parse("dispatcher", ["--heartbeat-timeout", "6"], env, text, tmp_path)
    assert args.heartbeat_timeout == 6.0          # flag beats env and file
    assert args.vnodes_per_capacity == 32         # env beats file
    assert args.metrics_port == 9400              # file beats default
    assert args.log_level == "INFO"               # default
    src = args.config_sources
    assert src["heartbeat_timeout"] == "flag"
    assert src["vnodes_per_capacity"] == "env SHARDLINE_VNODES_PER_CAPACITY"
    assert src["metrics_port"] == "file dispatcher.metrics_port"
    assert src["log_level"] == "default"


def test_own_section_beats_common_and_common_beats_default(tmp_path):
    text = "common:\n  rpc_timeout: 3\n  log_level: debug\nps:\n  rpc_timeout: 7\n"
    ps = parse("ps", text=text, tmp_path=tmp_path)
    assert ps.rpc_timeout == 7.0 and ps.log_level == "DEBUG"
    worker = parse("worker", text=text, tmp_path=tmp_path)
    assert worker.rpc_timeout == 3.0 and worker.config_sources["rpc_timeout"] == "file common.rpc_timeout"


def test_empty_environment_variable_counts_as_unset(tmp_path):
    args = parse("dispatcher", env={"SHARDLINE_HEARTBEAT_TIMEOUT": ""}, text="heartbeat_timeout: 2\n", tmp_path=tmp_path)
    assert args.heartbeat_timeout == 2.0


def test_config_file_from_the_environment(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dispatcher:\n  vnodes_per_capacity: 8\n")
    args = parse("dispatcher", env={"SHARDLINE_CONFIG": str(path)})
    assert args.vnodes_per_capacity == 8 and args.config == str(path)


def test_flat_per_daemon_file_still_works(tmp_path):
    args = parse("dispatcher", text="heartbeat-timeout: 2\nheartbeat_interval: 0.5\n", tmp_path=tmp_path)
    assert args.heartbeat_timeout == 2.0 and args.heartbeat_interval == 0.5


def test_worker_threads_alias_and_sizes(tmp_path):
    args = parse("worker", ["--threads", "3", "--cache-bytes", "2GiB"])
    assert args.torch_threads == 3 and args.cache_bytes == 2 * 1024 ** 3
    assert parse("worker", env={"SHARDLINE_CACHE_BYTES": "512M"}).cache_bytes == 512 * 1024 ** 2
    assert parse("ps", text="ps:\n  max_payload_bytes: 64MiB\n", tmp_path=tmp_path).max_payload_bytes == 64 << 20


@pytest.mark.parametrize("text, expected", [(1024, 1024), ("1024", 1024), ("1K", 1024), ("1KiB", 1024),
                                            ("1KB", 1000), ("1.5 GiB", 3 << 29), ("2t", 2 << 40)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "1.5B", "-1", "1 XB", True, 1.5, None])
def test_parse_size_rejects_and_quotes(bad):
    with pytest.raises(ShardlineConfigError, match=re.escape(repr(bad))):
        parse_size(bad, "cache_bytes")


# -- errors name the key and quote the value -------------------------------------------------------

def test_unknown_key_in_own_section_is_an_error_naming_it(tmp_path):
    msg = error("dispatcher", text="dispatcher:\n  heartbeat_timout: 2\n", tmp_path=tmp_path)
    assert "'heartbeat_timout'" in msg and "section 'dispatcher'" in msg and "did you mean 'heartbeat_timeout'" in msg


def test_other_sections_are_validated_too(tmp_path):
    # A typo in the worker section stops the dispatcher and the PS as well.
    text = "dispatcher:\n  heartbeat_timeout: 5\nworker:\n  cache_byte: 1G\n"
    for daemon in config.DAEMONS:
        msg = error(daemon, text=text, tmp_path=tmp_path)
        assert "'cache_byte'" in msg and "section 'worker'" in msg, daemon
    bad_value = "ps:\n  capacity: 0\n"
    msg = error("dispatcher", text=bad_value, tmp_path=tmp_path)
    assert "ps.capacity" in msg and "got 0" in msg


def test_unknown_section_is_an_error_naming_it(tmp_path):
    msg = error("ps", text="common:\n  log_level: INFO\nps-server:\n  rack: a\n", tmp_path=tmp_path)
    assert "unknown section 'ps-server'" in msg
    msg = error("ps", text="common:\n  log_level: INFO\nrack: a\n", tmp_path=tmp_path)
    assert "'rack'" in msg and "ps:" in msg  # says where the key belongs


def test_per_daemon_keys_are_refused_in_common(tmp_path):
    msg = error("ps", text="common:\n  listen: 0.0.0.0:7100\n", tmp_path=tmp_path)
    assert "'listen'" in msg and "section 'common'" in msg


def test_flat_file_key_of_another_daemon(tmp_path):
    msg = error("ps", text="vnodes_per_capacity: 4\n", tmp_path=tmp_path)
    assert "'vnodes_per_capacity'" in msg and "dispatcher" in msg


@pytest.mark.parametrize("daemon, text, fragments", [
    ("dispatcher", "dispatcher:\n  heartbeat_timeout: yes\n", ["dispatcher.heartbeat_timeout", "must be a number", "True"]),
    ("dispatcher", "dispatcher:\n  vnodes_per_capacity: 1.5\n", ["vnodes_per_capacity", "an integer", "1.5"]),
    ("dispatcher", "dispatcher:\n  metrics_port: 70000\n", ["metrics_port", "0..65535", "70000"]),
    ("ps", "common:\n  transport: infiniband\n", ["common.transport", "tcp, rdma, auto", "'infiniband'"]),
    ("ps", "common:\n  cluster: nowhere\n", ["common.cluster", "HOST:PORT", "'nowhere'"]),
    ("ps", "ps:\n  rack: 3\n", ["ps.rack", "a string", "got 3"]),
    ("ps", "ps:\n  max_payload_bytes: huge\n", ["ps.max_payload_bytes", "'huge'"]),
    ("worker", "worker:\n  block_elements: 0\n", ["worker.block_elements", "0"]),
    ("worker", "worker:\n  prefetch_window: -1\n", ["worker.prefetch_window", "0..1", "-1"]),
    ("worker", "worker:\n  prefetch_window: 2\n", ["worker.prefetch_window", "0..1", "2"]),
    ("worker", "common:\n  log_format: xml\n", ["common.log_format", "'xml'"]),
    ("ps", "ps: [1, 2]\n", ["section 'ps'", "mapping"]),
    ("ps", "- a\n- b\n", ["mapping"]),
    ("ps", "ps:\n  rack: a\n  rack: b\n", ["duplicate key 'rack'"]),
    ("ps", "ps:\n  rack: [a\n", ["not valid YAML"]),
])
def test_bad_values_name_the_key_and_quote_the_value(tmp_path, daemon, text, fragments):
    msg = error(daemon, text=text, tmp_path=tmp_path)
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_bad_flag_and_env_values_name_the_option(tmp_path):
    msg = error("dispatcher", ["--heartbeat-timeout", "-1"])
    assert "--heartbeat-timeout" in msg and "heartbeat_timeout" in msg and "'-1'" in msg
    msg = error("ps", env={"SHARDLINE_CAPACITY": "many"})
    assert "SHARDLINE_CAPACITY" in msg and "'many'" in msg
    msg = error("worker", env={"SHARDLINE_TRANSPORT": "carrier-pigeon"})
    assert "SHARDLINE_TRANSPORT" in msg and "'carrier-pigeon'" in msg


def test_required_options(tmp_path):
    with pytest.raises(ShardlineConfigError, match="cluster is required"):
        parse_daemon_args(daemon_parser("ps"), [], environ={})
    with pytest.raises(ShardlineConfigError, match="job is required"):
        parse_daemon_args(daemon_parser("worker"), ["--cluster", "h:1"], environ={})
    # ... from the common section of a shared file
    path = tmp_path / "c.yaml"
    path.write_text("common:\n  cluster: 10.0.0.5:7000\n")
    assert parse_daemon_args(daemon_parser("ps"), ["--config", str(path)], environ={}).cluster == "10.0.0.5:7000"


def test_missing_file_is_an_error_quoting_the_path(tmp_path):
    msg = error("dispatcher", ["--config", str(tmp_path / "absent.yaml")])
    assert "absent.yaml" in msg


def test_unknown_shardline_environment_variables_are_reported():
    args = parse("dispatcher", env={"SHARDLINE_HEARTBEAT_TIMOUT": "1", "SHARDLINE_RACK": "a"})
    assert args.heartbeat_timeout == 5.0
    assert len(args.config_warnings) == 1  # SHARDLINE_RACK is a PS option: fine in a shared env file
    assert "SHARDLINE_HEARTBEAT_TIMOUT" in args.config_warnings[0]


def test_dispatcher_cross_check():
    from shardline.dispatcher.main import parse_args

    with pytest.raises(ShardlineConfigError, match="heartbeat_interval"):
        parse_args(["--heartbeat-interval", "2", "--heartbeat-timeout", "1"])
    assert parse_args(["--heartbeat-timeout", "0.9"]).heartbeat_interval == pytest.approx(0.3)


# -- the shared example file -----------------------------------------------------------------------

@pytest.mark.parametrize("daemon", config.DAEMONS)
def test_every_daemon_parses_the_shared_example(daemon):
    # The cluster address comes from common:; a worker's job file is per instance (environment).
    args = parse_daemon_args(daemon_parser(daemon), ["--config", str(EXAMPLE)],
                             environ={"SHARDLINE_JOB": "/etc/shardline/jobs/sft-1.yaml"})
    assert args.log_format == "json"
    if daemon != "dispatcher":
        assert args.cluster == "10.0.0.5:7000"
    expected_metrics = {"dispatcher": 9400, "ps": 9401, "worker": 9402}[daemon]
    assert args.metrics_port == expected_metrics


def test_shared_example_mentions_every_option():
    text = EXAMPLE.read_text()
    missing = [o.name for o in OPTIONS if not re.search(rf"^\s*#?\s*{o.name}:", text, re.M)]
    assert not missing, f"deploy/shardline.yaml does not show {missing}"


def test_env_examples_use_known_variables():
    known = {o.env for o in OPTIONS} | {"SHARDLINE_CONFIG"}
    files = sorted((REPO / "deploy" / "env").glob("*.env"))
    assert files
    for path in files:
        for line in path.read_text().splitlines():
            m = re.match(r"^#?(SHARDLINE_[A-Z_]+)=(.*)$", line.strip())
            if m:
                assert m.group(1) in known, (path.name, line)
                opt = config.BY_NAME.get(m.group(1)[len("SHARDLINE_"):].lower())
                if opt is not None and m.group(2):
                    opt.convert(m.group(2), f"{path.name}: {m.group(1)}", text=True)


def test_check_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shardline.services.config", "--check", str(EXAMPLE)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ps: " in out.stdout and "OK" in out.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("worker:\n  pull_timeout: soon\n")
    out = subprocess.run([sys.executable, "-m", "shardline.services.config", "--check", str(bad)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "worker.pull_timeout" in out.stderr and "'soon'" in out.stderr


# -- docs ------------------------------------------------------------------------------------------

def test_configuration_page_is_up_to_date():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == config.render_markdown(), (
        "docs/configuration.md is stale: run `python -m shardline.services.config --markdown > docs/configuration.md`")


def test_configuration_page_documents_every_option_with_its_default():
    page = config.render_markdown()
    for o in OPTIONS:
        rows = [line for line in page.splitlines() if line.startswith(f"| `{o.name}` |")]
        assert rows, o.name
        assert all(o.env in row and o.flag in row for row in rows), o.name


# -- wiring: the values reach the code that uses them ----------------------------------------------

class _FakeDispatcher:
    rpc_timeout = 10.0


class _FakeClient:
    def __init__(self):
        self.dispatcher = _FakeDispatcher()


class FakePSOptimizer:
    """Records what the worker passes to PSOptimizer (same signature shape, no cluster)."""

    def __init__(self, named_parameters, cluster, job, *, optimizer="adamw", sync="bsp", world_size=None, rank=None,
                 block_elements=None, transport="auto", pull_timeout=600.0, connect_timeout=60.0, **optimizer_kwargs):
        self.kwargs = dict(cluster=cluster, job=job, block_elements=block_elements, transport=transport,
                           pull_timeout=pull_timeout, connect_timeout=connect_timeout, **optimizer_kwargs)
        self.client = _FakeClient()


def _params(numel: int):
    import torch

    return [("w", torch.nn.Parameter(torch.zeros(numel)))]


def test_worker_passes_its_knobs_to_the_client():
    from shardline.jobs.worker_daemon import _make_ps_optimizer

    args = parse("worker", ["--block-elements", "1024", "--transport", "tcp", "--pull-timeout", "30",
                            "--connect-timeout", "5", "--rpc-timeout", "2.5", "--cache-bytes", "1MiB"])
    opt = _make_ps_optimizer(FakePSOptimizer, args, _params(1000), cluster=args.cluster, job="j")
    assert opt.kwargs["block_elements"] == 1024 and opt.kwargs["transport"] == "tcp"
    assert opt.kwargs["pull_timeout"] == 30.0 and opt.kwargs["connect_timeout"] == 5.0
    assert opt.kwargs["rpc_timeout"] == 2.5 and opt.kwargs["prefetch_window"] == 0


def test_worker_cache_bound_refuses_a_job_that_does_not_fit():
    from shardline.jobs.worker_daemon import _make_ps_optimizer

    args = parse("worker", ["--cache-bytes", "4KiB"])
    _make_ps_optimizer(FakePSOptimizer, args, _params(1024), cluster=args.cluster, job="j")  # exactly 4 KiB
    with pytest.raises(ShardlineConfigError, match="cache_bytes=4,096"):
        _make_ps_optimizer(FakePSOptimizer, args, _params(1025), cluster=args.cluster, job="j")
    unbounded = parse("worker")
    _make_ps_optimizer(FakePSOptimizer, unbounded, _params(10**6), cluster=unbounded.cluster, job="j")


def test_ps_checkpoint_dir_is_created_and_must_be_writable(tmp_path):
    from shardline.ps_server.main import open_checkpoint_dir

    assert open_checkpoint_dir(None, "n1") is None
    target = tmp_path / "ckpt" / "nested"
    assert open_checkpoint_dir(str(target), "n1") is not None and target.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ShardlineConfigError, match="checkpoint_dir") as err:
        open_checkpoint_dir(str(blocker / "sub"), "n1")
    assert str(blocker) in str(err.value)
    with pytest.raises(ShardlineConfigError, match="n1") as err:  # another node's directory
        open_checkpoint_dir(str(target), "n2")
    assert str(target) in str(err.value)


def test_log_configuration_reports_sources_and_env_typos(tmp_path, caplog):
    import logging

    path = tmp_path / "c.yaml"
    path.write_text("dispatcher:\n  vnodes_per_capacity: 16\n")
    args = parse("dispatcher", ["--config", str(path), "--heartbeat-timeout", "4"],
                 env={"SHARDLINE_LOG_FORMAT": "json", "SHARDLINE_HEARTBEAT_TIMOUT": "1"})
    log = logging.getLogger("shardline.test-config")
    with caplog.at_level(logging.DEBUG, logger="shardline.test-config"):
        config.log_configuration(log, args)
    by_level = {}
    for r in caplog.records:
        by_level.setdefault(r.levelname, []).append(r.getMessage())
    assert any("SHARDLINE_HEARTBEAT_TIMOUT" in m for m in by_level["WARNING"])
    (info,) = by_level["INFO"]
    assert str(path) in info and "vnodes_per_capacity=16 (file dispatcher.vnodes_per_capacity)" in info
    assert "log_format=json (env SHARDLINE_LOG_FORMAT)" in info and "heartbeat_timeout" not in info
    assert any("heartbeat_timeout=4.0 (flag)" in m for m in by_level["DEBUG"])
