"""Metrics end to end: a real cluster (dispatcher, 2 PS nodes, a worker daemon) with some traffic.

Checks that every metric a Grafana panel queries is exported, that the exposition passes
``promtool check metrics``, that the Prometheus config and rules pass ``promtool``, and that a real
Prometheus server scrapes the cluster and answers a query about a Shardline metric.

promtool and prometheus come from Debian's prometheus package: ``scripts/install-system-deps.sh``
(run by ``make test``) installs it. These tests fail, never skip, without it.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from shardline.services import frame
from shardline.services.daemon import grpc_channel, parse_host_port
from shardline.local_cluster import LocalCluster
from shardline.services.pb import dispatcher_pb2, dispatcher_pb2_grpc
from shardline.services.pb import dataplane_pb2 as dp
from shardline import connect
from ports import free_port

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "shardline-dashboard.json"
DEMO_JOB = Path(__file__).parent / "data" / "demo_short.yaml"
HTTP_TIMEOUT = 5.0
JOB = "metrics"
BLOCK = 16


def load_generator():
    """deploy/grafana/generate.py as a module (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("shardline_dashboard_generate", REPO / "deploy" / "grafana" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = load_generator()


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: run scripts/install-system-deps.sh (installs Debian's prometheus "
                    f"package, which provides promtool and prometheus)", pytrace=False)
    return path


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=HTTP_TIMEOUT) as reply:
        return reply.read().decode()


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset(labels)): value} of an exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels) -> float:
    """Sum of the samples ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and want <= ls)


def has(text: str, name: str, **labels) -> bool:
    want = set(labels.items())
    return any(n == name and want <= ls for (n, ls) in samples(text))


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            last = predicate()
        except (OSError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def run_traffic(cluster: LocalCluster) -> None:
    """init/push/pull through the client, a malformed frame to each PS, a failing gRPC call."""
    client = connect(cluster.address, job=JOB)
    try:
        w0 = torch.arange(100, dtype=torch.float32)
        client.init({"w": w0}, optimizer="sgd", lr=0.5, block_elements=BLOCK)
        client.push({"w": torch.ones(100)})
        got = client.pull(["w"], min_step=1)["w"]
        assert torch.allclose(got, w0 - 0.5)
    finally:
        client.close()
    for _ in range(2):   # two readers through the rack cache: misses, then hits
        reader = connect(cluster.address, job=JOB, rack="r1")
        try:
            assert torch.allclose(reader.pull(["w"], min_step=1)["w"], w0 - 0.5)
        finally:
            reader.close()
    for node in cluster.nodes:  # garbage instead of a frame: BAD_FRAME, connection closed
        host, port = parse_host_port(node.data)
        with socket.create_connection((host, port), timeout=HTTP_TIMEOUT) as s:
            s.sendall(b"\x00GARBAGE" * 16)
            reply = frame.recv_header(s)
            assert reply.op == dp.OP_ERROR and reply.code == dp.BAD_FRAME
    with grpc_channel(cluster.address) as channel:  # unknown job: NOT_FOUND
        stub = dispatcher_pb2_grpc.DispatcherStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetJob(dispatcher_pb2.GetJobRequest(name="no-such-job"), timeout=HTTP_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("metrics-cluster"), start_timeout=45) as c:
        c.start_dispatcher(heartbeat_interval=0.2, heartbeat_timeout=2)
        for node in [c.add_node(node_id=node_id, wait=False) for node_id in ("ps1", "ps2")]:  # in parallel
            c.wait_ready(node)
        c.wait_for_nodes(2, timeout=30)
        cache = c.add_cache("r1", 1 << 20, wait=False)   # the dashboard's rack cache panels
        # A worker daemon training the demo job (BSP, world size 1) keeps data flowing.
        c.add_worker(DEMO_JOB, 0, 1, steps=100000, progress="off", summary="line")
        c.wait_ready(cache)
        yield c


@pytest.fixture(scope="module")
def scrapes(cluster) -> dict[str, str]:
    """Each daemon's /metrics text after traffic, keyed by daemon name."""
    run_traffic(cluster)
    worker = cluster.workers[0]
    wait_for(lambda: value(scrape(worker.metrics), "shardline_worker_steps_total") >= 2, 30, "two worker steps")
    # The dispatcher republishes node state every 0.25 s; PS state is read at scrape time.
    wait_for(lambda: value(scrape(cluster.dispatcher.metrics), "shardline_node_blocks") > 0, 10, "node blocks in heartbeats")
    # and the heatmap's per-job shares (from the nodes' heat reports, every heartbeat or so)
    wait_for(lambda: has(scrape(cluster.dispatcher.metrics), "shardline_job_access_share"), 10, "the heatmap's job shares")
    texts = {h.name: scrape(h.metrics) for h in [cluster.dispatcher, *cluster.nodes, worker, cluster.handles["cache-r1"]]}
    assert cluster.stop(worker) == 0, worker.log_tail()  # free the CPU for the rest; SIGTERM exits 0
    return texts


def test_every_dashboard_metric_is_exported(scrapes):
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queried: set[str] = set()
    for expr in GEN.dashboard_exprs(dashboard):
        queried |= GEN.promql_metric_names(expr)
    assert len(queried) >= 25, sorted(queried)
    exported: dict[str, str] = {}
    for text in scrapes.values():
        exported.update(GEN.exported_series(text))
    missing = GEN.unresolved_names(queried, exported)
    assert not missing, f"dashboard panels query metrics no daemon exports: {missing}"


def test_process_and_grpc_metrics_on_every_daemon(scrapes):
    for name, text in scrapes.items():
        for metric in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
            assert value(text, metric) > 0, f"{name} lacks {metric}"
        assert "# TYPE shardline_grpc_server_requests_total counter" in text, f"{name} lacks the gRPC interceptor metrics"


def test_values_reflect_the_traffic(scrapes):
    d = scrapes["dispatcher"]
    assert value(d, "shardline_live_nodes") == 2
    assert value(d, "shardline_dead_nodes") == 0
    assert value(d, "shardline_ring_epoch") >= 2
    assert value(d, "shardline_node_alive", node_id="ps1") == 1
    assert 0 <= value(d, "shardline_node_heartbeat_age_seconds", node_id="ps2") < 2
    assert value(d, "shardline_jobs") == 2
    # The failing GetJob, seen by the gRPC interceptor and by the dispatcher's own counter.
    assert value(d, "shardline_grpc_server_requests_total", method="GetJob", code="NOT_FOUND") >= 1
    assert value(d, "shardline_grpc_server_request_seconds_count", method="RegisterNode") >= 2

    ps = [scrapes["ps-0"], scrapes["ps-1"]]
    # 100 elements in blocks of 16: 7 blocks, each on both nodes (replication 2: primary and replica).
    assert sum(value(t, "shardline_ps_blocks", job_name=JOB) for t in ps) == 14
    assert sum(value(t, "shardline_ps_parameter_bytes", job_name=JOB) for t in ps) == 800
    assert all(value(t, "shardline_ps_job_step", job_name=JOB) == 1 for t in ps if has(t, "shardline_ps_job_step", job_name=JOB))
    assert all(value(t, "shardline_ps_requests_total", op="UNKNOWN", code="BAD_FRAME") == 1 for t in ps)
    assert sum(value(t, "shardline_ps_payload_bytes_total", op="PUSH", direction="received") for t in ps) >= 400
    assert sum(value(t, "shardline_ps_payload_bytes_total", op="PULL", direction="sent") for t in ps) >= 400
    assert all(value(t, "shardline_ps_info") == 1 and value(t, "shardline_ps_ring_epoch") >= 2 for t in ps)
    demo = "demo-short"
    assert sum(value(t, "shardline_ps_optimizer_apply_seconds_count", job_name=demo) for t in ps) >= 2
    assert sum(value(t, "shardline_ps_bsp_barrier_seconds_count", job_name=demo) for t in ps) >= 2
    assert sum(value(t, "shardline_ps_pull_wait_seconds_count", job_name=demo) for t in ps) >= 2

    cache = scrapes["cache-r1"]
    assert value(cache, "shardline_cache_misses_total", rack="r1") == value(cache, "shardline_cache_hits_total") == 7
    assert value(cache, "shardline_cache_served_bytes_total") == 2 * 400
    assert value(cache, "shardline_cache_resident_bytes") == value(cache, "shardline_cache_fetched_bytes_total") == 400

    w = scrapes["worker-0"]
    assert value(w, "shardline_worker_steps_total", job_name=demo, rank="0") >= 2
    assert value(w, "shardline_worker_version", job_name=demo, rank="0") >= 2
    assert value(w, "shardline_worker_tokens_total", job_name=demo) > 0
    assert value(w, "shardline_worker_step_seconds_count", job_name=demo) >= 2


def test_label_cardinality_is_bounded(scrapes):
    from prometheus_client.parser import text_string_to_metric_families

    for name, text in scrapes.items():
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("shardline_"):
                continue
            labels = {k for s in family.samples for k in s.labels}
            assert not labels & {"tensor", "block", "index", "key", "request_id", "peer"}, (name, family.name, labels)
            assert "job" not in labels, f"{family.name}: 'job' clashes with Prometheus's scrape job; use job_name"
            assert len(family.samples) < 300, (name, family.name, len(family.samples))


def test_promtool_check_metrics(scrapes):
    promtool = require_tool("promtool")
    for name, text in scrapes.items():
        out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), \
            f"promtool check metrics on {name}:\n{out.stdout}{out.stderr}"


def test_promtool_check_config_rules_and_rule_tests():
    promtool = require_tool("promtool")
    for args in (["check", "config", str(PROMETHEUS_DIR / "prometheus.yml")],
                 ["check", "rules", str(PROMETHEUS_DIR / "rules.yml")],
                 ["test", "rules", str(PROMETHEUS_DIR / "rules_test.yml")]):
        out = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=PROMETHEUS_DIR)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"


def query(base: str, promql: str) -> list:
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    try:
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as reply:
            body = json.load(reply)
    except urllib.error.HTTPError as exc:  # 400: bad PromQL; 422: cannot evaluate
        raise AssertionError(f"Prometheus refused {promql!r}: {exc.read().decode(errors='replace')}") from None
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_server_scrapes_the_cluster(cluster, scrapes, tmp_path):
    prometheus = require_tool("prometheus")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(PROMETHEUS_DIR / "rules.yml")],
        "scrape_configs": [
            {"job_name": "shardline-dispatcher", "static_configs": [{"targets": [cluster.dispatcher.metrics]}]},
            {"job_name": "shardline-ps", "static_configs": [{"targets": [n.metrics for n in cluster.nodes]}]},
        ],
    }))
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        def epoch():
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}:\n{(tmp_path / 'prometheus.log').read_text()}")
            return query(base, 'shardline_ring_epoch{job="shardline-dispatcher"}')

        result = wait_for(epoch, 30, "Prometheus to scrape shardline_ring_epoch")
        assert float(result[0]["value"][1]) >= 2
        steps = wait_for(lambda: query(base, f'shardline_ps_job_step{{job_name="{JOB}"}}'), 15, "PS job steps")
        assert {r["metric"]["job"] for r in steps} == {"shardline-ps"}
        assert {float(r["value"][1]) for r in steps} == {1.0}
        # Our rules load and evaluate against real series.
        lag = wait_for(lambda: query(base, f'shardline:ps_job_step_lag{{job_name="{JOB}"}}'), 15, "the step-lag recording rule")
        assert float(lag[0]["value"][1]) == 0
        def rules_healthy():
            with urllib.request.urlopen(f"{base}/api/v1/rules", timeout=HTTP_TIMEOUT) as reply:
                rules = [r for g in json.load(reply)["data"]["groups"] for r in g["rules"]]
            bad = [(r["name"], r["health"], r.get("lastError")) for r in rules if r["health"] != "ok"]
            assert not any(health == "err" for _, health, _ in bad), f"rules failing on real series: {bad}"
            return len(rules) >= 10 and not bad

        wait_for(rules_healthy, 15, "every rule evaluated")
        # Every panel query is valid PromQL that this Prometheus evaluates (Grafana variables filled in).
        dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
        for expr in GEN.dashboard_exprs(dashboard):
            if expr.startswith("label_values("):
                continue  # a Grafana variable function, not PromQL
            query(base, expr.replace("$__rate_interval", "1m").replace("$job_name", ".*"))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
