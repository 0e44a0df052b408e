"""The Grafana dashboard: committed JSON == generator output, sound structure, and the PromQL helpers."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "deploy" / "grafana"

spec = importlib.util.spec_from_file_location("shardline_dashboard_generate", GRAFANA / "generate.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


@pytest.fixture(scope="module")
def dashboard():
    return json.loads((GRAFANA / "shardline-dashboard.json").read_text(encoding="utf-8"))


def test_committed_json_is_the_generator_output():
    committed = (GRAFANA / "shardline-dashboard.json").read_text(encoding="utf-8")
    assert committed == gen.render(), "deploy/grafana/shardline-dashboard.json is stale: run python deploy/grafana/generate.py"
    assert gen.main(["--check"]) == 0


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "d.json"
    stale.write_text("{}\n")
    assert gen.main(["--check", "--output", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert gen.main(["--output", str(stale)]) == 0
    assert gen.main(["--check", "--output", str(stale)]) == 0


def panels(dashboard):
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_structure(dashboard):
    assert dashboard["schemaVersion"] == 39
    assert dashboard["uid"] and dashboard["title"] == "Shardline"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job_name"]["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panel {p['title']!r} overlaps another"
                cells.add((x, y))
    for p in panels(dashboard):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert t["expr"].count("{") == t["expr"].count("}"), t["expr"]


def test_dashboard_covers_what_operators_watch(dashboard):
    queried = set()
    for expr in gen.dashboard_exprs(dashboard):
        queried |= gen.promql_metric_names(expr)
    for name in ("shardline_ps_payload_bytes_total", "shardline_ps_request_seconds_bucket", "shardline_ps_job_step",
                 "shardline_worker_version", "shardline_ring_epoch", "shardline_live_nodes", "shardline_dead_nodes",
                 "shardline_node_heartbeat_age_seconds", "shardline_node_blocks", "shardline_node_parameter_bytes",
                 "process_resident_memory_bytes", "process_cpu_seconds_total", "shardline_ps_optimizer_apply_seconds_bucket",
                 "shardline_ps_bsp_barrier_seconds_bucket", "shardline_grpc_server_requests_total"):
        assert name in queried, name
    exprs = " ".join(gen.dashboard_exprs(dashboard))
    assert "histogram_quantile(0.99" in exprs and 'code!="OK"' in exprs
    titles = {p["title"] for p in panels(dashboard)}
    assert {"Push / pull throughput", "Data-plane latency by operation", "Step lag per job",
            "Heartbeat age per node", "Resident memory per daemon", "Data-plane errors by code"} <= titles


@pytest.mark.parametrize("expr, names", [
    ("shardline_ring_epoch", {"shardline_ring_epoch"}),
    ('sum by (op) (rate(shardline_ps_requests_total{code!="OK", job_name=~"$job_name"}[$__rate_interval]))',
     {"shardline_ps_requests_total"}),
    ("histogram_quantile(0.99, sum by (op, le) (rate(shardline_ps_request_seconds_bucket[5m])))",
     {"shardline_ps_request_seconds_bucket"}),
    ('rate(process_cpu_seconds_total{job=~"shardline-.*"}[1m]) + process_open_fds', {"process_cpu_seconds_total", "process_open_fds"}),
    ('shardline_x{job_name="shardline_not_a_metric", q=\'process_nope\'}', {"shardline_x"}),
    ("max by (job_name) (shardline_ps_job_step) - min by (job_name) (shardline_ps_job_step)", {"shardline_ps_job_step"}),
    ("shardline:ps_job_step_lag > 1", set()),                       # recording rules are not raw metrics
    ("label_values(shardline_ps_job_step, job_name)", {"shardline_ps_job_step"}),
    ("up == 0", set()),
])
def test_promql_metric_names(expr, names):
    assert gen.promql_metric_names(expr) == names


def test_dashboard_exprs_include_nested_panels_and_variables():
    d = {"panels": [{"type": "row", "panels": [{"targets": [{"expr": "a_1"}]}]}, {"targets": [{"expr": "b"}, {"expr": ""}]}],
         "templating": {"list": [{"type": "query", "query": {"query": "label_values(c, x)"}},
                                 {"type": "query", "query": "label_values(d, y)"}, {"type": "datasource", "query": "prometheus"}]}}
    assert gen.dashboard_exprs(d) == ["a_1", "b", "label_values(c, x)", "label_values(d, y)"]


EXPOSITION = """\
# HELP shardline_h_seconds A histogram
# TYPE shardline_h_seconds histogram
shardline_h_seconds_bucket{le="1.0"} 1.0
shardline_h_seconds_bucket{le="+Inf"} 1.0
shardline_h_seconds_count 1.0
shardline_h_seconds_sum 0.5
# HELP shardline_c_total A counter
# TYPE shardline_c_total counter
shardline_c_total{code="OK"} 3.0
# HELP shardline_g A gauge
# TYPE shardline_g gauge
shardline_g 2.0
# HELP shardline_empty A labelled gauge with no series yet
# TYPE shardline_empty gauge
"""


def test_exported_series_and_unresolved_names():
    exported = gen.exported_series(EXPOSITION)
    assert exported["shardline_h_seconds_bucket"] == "histogram"
    assert exported["shardline_c_total"] == "counter"
    assert exported["shardline_g"] == "gauge"
    assert "shardline_empty" not in exported  # declared but no series: PromQL would find nothing
    assert gen.unresolved_names({"shardline_h_seconds_bucket", "shardline_h_seconds_sum", "shardline_c_total", "shardline_g"},
                                exported) == []
    assert gen.unresolved_names({"shardline_c", "shardline_empty", "shardline_h_seconds"}, exported) == \
        ["shardline_c", "shardline_empty", "shardline_h_seconds"]
    bogus = {**exported, "shardline_g_bucket": "gauge", "shardline_g_sum": "gauge"}
    assert gen.unresolved_names({"shardline_g_bucket", "shardline_g_sum"}, bogus) == [
        "shardline_g_bucket (is a gauge, not a histogram)", "shardline_g_sum (is a gauge, not a histogram or summary)"]


def _exported_names(metrics) -> dict[str, str]:
    """Sample names PromQL selects for prometheus-client metric objects -> the metric's name."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {m._name + s: m._name for m in metrics for s in suffixes[m._type]}


def test_worker_panels_work_for_library_users(dashboard):
    """Every worker series a panel queries is defined in worker/metrics.py; all but the daemon's task
    metrics (loss, tokens) are what PSOptimizer records, and no panel mixes the two kinds."""
    from shardline.worker import metrics as WM

    library, daemon = _exported_names(WM.LIBRARY_METRICS), _exported_names(WM.DAEMON_METRICS)
    worker_panels = {}
    for p in panels(dashboard):
        names = set().union(*(gen.promql_metric_names(t["expr"]) for t in p["targets"]))
        names = {n for n in names if n.startswith("shardline_worker_")}
        if names:
            worker_panels[p["title"]] = names
    queried = set().union(*worker_panels.values())
    assert queried <= set(library) | set(daemon), sorted(queried - set(library) - set(daemon))
    assert {library[n] for n in queried if n in library} == {m._name for m in WM.LIBRARY_METRICS}  # all on show
    daemon_panels = {title for title, names in worker_panels.items() if names & set(daemon)}
    assert daemon_panels == {"Loss", "Tokens per second"}
    for title in daemon_panels:
        assert worker_panels[title] <= set(daemon), title
