#!/usr/bin/env python3
"""Generate the Shardline Grafana dashboard: ``deploy/grafana/shardline-dashboard.json``.

    python deploy/grafana/generate.py            # (re)write the JSON next to this script
    python deploy/grafana/generate.py --check    # exit 1 if the committed JSON is out of date

Edit the panels here, not in the JSON (a test checks the committed JSON equals this script's
output, and that every metric a panel queries is exported by a running cluster). Standard library
only. The dashboard uses a ``datasource`` variable (any Prometheus data source) and a ``job_name``
variable (Shardline jobs; ``job`` is Prometheus's scrape job: shardline-dispatcher, shardline-ps,
shardline-worker, as in deploy/prometheus/prometheus.yml).

The module also holds the small PromQL helpers the tests use: :func:`promql_metric_names`,
:func:`dashboard_exprs`, :func:`exported_series` and :func:`unresolved_names`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

OUTPUT = Path(__file__).resolve().parent / "shardline-dashboard.json"
SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
JOB = 'job_name=~"$job_name"'          # selector of the dashboard's job_name variable
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))


# --- PromQL helpers (pure; unit-tested) ----------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME = re.compile(r"(?<![A-Za-z0-9_:$])((?:shardline|process)_[A-Za-z0-9_]*)(?![A-Za-z0-9_:])")
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def promql_metric_names(expr: str) -> set[str]:
    """Shardline (``shardline_*``) and process (``process_*``) metric names an expression selects.

    String literals (label values, regexes) are ignored, so ``{job_name="shardline_x"}`` names
    nothing; label names never carry those prefixes. Names are returned as written, with any
    ``_bucket``/``_count``/``_sum``/``_total`` suffix (see :func:`unresolved_names`).
    """
    return set(_NAME.findall(_STRING.sub('""', expr)))


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets (rows included) and query variables."""
    exprs: list[str] = []

    def visit(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    exprs.append(target["expr"])
            visit(panel.get("panels", []))

    visit(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            exprs.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return [e for e in exprs if e]


def exported_series(text: str) -> dict[str, str]:
    """Sample names in a Prometheus text exposition -> the type of their metric family.

    A histogram ``x`` contributes ``x_bucket``, ``x_count``, ``x_sum`` (type ``histogram``), a counter
    ``x`` contributes ``x_total``; these are the names PromQL selects.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = family.type
    return out


def unresolved_names(names, exported: dict[str, str]) -> list[str]:
    """The queried ``names`` that ``exported`` (from :func:`exported_series`) does not resolve.

    A ``_bucket`` name must belong to a histogram family; ``_count``/``_sum`` to a histogram or
    summary; any other name must be exported as written (counters as ``x_total``).
    """
    missing = []
    for name in sorted(set(names)):
        kind = exported.get(name)
        if kind is None:
            missing.append(name)
        elif name.endswith("_bucket") and kind != "histogram":
            missing.append(f"{name} (is a {kind}, not a histogram)")
        elif name.endswith(("_count", "_sum")) and kind not in ("histogram", "summary"):
            missing.append(f"{name} (is a {kind}, not a histogram or summary)")
    return missing


# --- panel builders -------------------------------------------------------------------------------

def target(expr: str, legend: str = "", ref: str = "A") -> dict:
    return {"datasource": DS, "editorMode": "code", "expr": expr, "legendFormat": legend or "__auto",
            "range": True, "refId": ref}


def _targets(queries) -> list[dict]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def timeseries(title: str, queries, *, unit: str = "short", description: str = "", min_zero: bool = True,
               stack: bool = False, thresholds: list | None = None) -> dict:
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
              "spanNulls": False, "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    defaults: dict = {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}}
    if min_zero:
        defaults["min"] = 0
    if thresholds:
        custom["thresholdsStyle"] = {"mode": "line"}
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": _targets(queries)}


def stat(title: str, expr: str, *, unit: str = "short", description: str = "", thresholds: list | None = None,
         decimals: int | None = None) -> dict:
    defaults: dict = {"unit": unit, "color": {"mode": "thresholds"},
                      "thresholds": {"mode": "absolute", "steps": thresholds or [{"color": "green", "value": None}]}}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "justifyMode": "auto", "orientation": "auto",
                        "textMode": "auto", "wideLayout": True, "showPercentChange": False},
            "targets": [target(expr, title)]}


def quantiles(metric: str, by: str, legend: str, selector: str = "", qs=QUANTILES) -> list[tuple[str, str]]:
    """histogram_quantile queries of ``metric`` (a histogram base name) grouped by ``by``."""
    sel = "{" + selector + "}" if selector else ""
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{sel}[{RATE}])))", f"{legend} {name}")
            for name, q in qs]


RED_ABOVE_0 = [{"color": "green", "value": None}, {"color": "red", "value": 1}]


class Layout:
    """Places panels left to right in a 24-column grid, rows of equal height."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = 0
        self.row_h = 0
        self.next_id = 1

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, title: str) -> None:
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": self._id(),
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def add(self, panel: dict, w: int = 12, h: int = 8) -> None:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        panel = {"id": self._id(), "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y}, **panel}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)


# --- the dashboard ------------------------------------------------------------------------------------

def build() -> dict:
    g = Layout()

    g.row("Cluster health")
    g.add(stat("Live PS nodes", "sum(shardline_live_nodes)", description="PS nodes the dispatcher considers alive."), w=4, h=4)
    g.add(stat("Dead PS nodes", "sum(shardline_dead_nodes)", thresholds=RED_ABOVE_0,
               description="PS nodes declared dead (missed heartbeats past the timeout) that have not registered again."), w=4, h=4)
    g.add(stat("Ring epoch", "max(shardline_ring_epoch)",
               description="Bumped by every change of the routing table (node joins, deaths, capacity changes)."), w=4, h=4)
    g.add(stat("Jobs", "max(shardline_jobs)", description="Jobs registered with the dispatcher."), w=4, h=4)
    g.add(stat("Data-plane error ratio",
               'sum(rate(shardline_ps_requests_total{code!~"OK|NOT_OWNER"}[5m])) / clamp_min(sum(rate(shardline_ps_requests_total[5m])), 1e-9)',
               unit="percentunit", decimals=2,
               thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 0.01}, {"color": "red", "value": 0.05}],
               description="Share of data-plane requests over 5 minutes that failed, NOT_OWNER (routine after ring changes) excluded."),
          w=4, h=4)
    g.add(stat("Daemons up", 'sum(up{job=~"shardline-.*"})',
               description="Shardline daemons Prometheus scraped successfully (finished workers drop out)."), w=4, h=4)
    g.add(timeseries("Heartbeat age per node", [
        ("shardline_node_heartbeat_age_seconds", "{{node_id}} ({{rack}})"),
        ("max(shardline_heartbeat_timeout_seconds)", "failure timeout"),
    ], unit="s", description="Seconds since each PS node's last heartbeat, as the dispatcher sees it; "
                             "a node past the failure timeout is declared dead."))
    g.add(timeseries("PS nodes alive / dead and ring epoch", [
        ("sum(shardline_live_nodes)", "alive"),
        ("sum(shardline_dead_nodes)", "dead"),
        ("max(shardline_ring_epoch)", "ring epoch (dispatcher)"),
        ("shardline_ps_ring_epoch", "epoch seen by {{instance}}"),
        ("max(shardline_ring_change_waiting_nodes)", "nodes a ring change waits for"),
        ("max(shardline_dispatcher_isolated)", "dispatcher suspects its isolation"),
        ("max(shardline_nodes_kept_silent)", "silent nodes kept for their blocks"),
    ], description="Node counts and the routing epoch; PS nodes follow the dispatcher's epoch within a heartbeat. "
                   "During a join, drain or rebalance: the nodes it still waits for (shardline status names them). "
                   "1 while most nodes went silent together (the dispatcher declares none dead); silent nodes kept "
                   "in the ring because no other live node holds their blocks."))

    g.row("Throughput")
    g.add(timeseries("Push / pull throughput", [
        (f"sum by (op, direction) (rate(shardline_ps_payload_bytes_total[{RATE}]))", "{{op}} {{direction}}"),
    ], unit="Bps", description="Tensor payload bytes per second on the data plane, cluster-wide: PUSH/INIT received, PULL sent."))
    g.add(timeseries("Throughput per PS node", [
        (f"sum by (instance, direction) (rate(shardline_ps_payload_bytes_total[{RATE}]))", "{{instance}} {{direction}}"),
    ], unit="Bps", description="Payload bytes per second per PS node; a hot or overloaded node stands out here."))
    g.add(timeseries("Data-plane requests by operation", [
        (f"sum by (op) (rate(shardline_ps_requests_total[{RATE}]))", "{{op}}"),
    ], unit="reqps", description="Data-plane requests per second, all result codes."))
    g.add(timeseries("Payload per request", quantiles("shardline_ps_request_payload_bytes", "op", "{{op}}",
                                                      qs=(("p50", 0.5), ("p99", 0.99))),
                     unit="bytes", description="Tensor bytes moved by one successful request; sparse pushes and delta pulls are small."))

    g.row("Latency")
    g.add(timeseries("Data-plane latency by operation", quantiles("shardline_ps_request_seconds", "op", "{{op}}"), unit="s",
                     description="Request handling time on the PS, header received to reply sent. PULL includes the server-side "
                                 "wait for the step it asks for (BSP: the slowest worker)."))
    g.add(timeseries("gRPC latency by method (p99)", [
        (f"histogram_quantile(0.99, sum by (job, method, le) (rate(shardline_grpc_server_request_seconds_bucket[{RATE}])))",
         "{{job}} {{method}}"),
    ], unit="s", description="Control-plane RPC handling time (WaitJobReady waits by design)."))
    g.add(timeseries("Optimizer apply time", quantiles("shardline_ps_optimizer_apply_seconds", "job_name", "{{job_name}}", JOB,
                                                       qs=(("p50", 0.5), ("p99", 0.99))),
                     unit="s", description="Time to apply one optimizer update on a PS node: a whole step in BSP, one push in ASP."))
    g.add(timeseries("Sync waits (p99)", [
        (f"histogram_quantile(0.99, sum by (job_name, le) (rate(shardline_ps_bsp_barrier_seconds_bucket{{{JOB}}}[{RATE}])))",
         "{{job_name}} BSP barrier"),
        (f"histogram_quantile(0.99, sum by (job_name, le) (rate(shardline_ps_pull_wait_seconds_bucket{{{JOB}}}[{RATE}])))",
         "{{job_name}} pull wait"),
    ], unit="s", description="BSP barrier: first commit of a step to its application (how long the fastest worker waits for the "
                             "slowest). Pull wait: time a pull blocked server-side for its step."))

    g.row("Training progress")
    g.add(timeseries("Step per job", [
        (f"max by (job_name) (shardline_ps_job_step{{{JOB}}})", "{{job_name}} (PS)"),
        (f"max by (job_name) (shardline_worker_version{{{JOB}}})", "{{job_name}} (workers)"),
    ], description="Job step (applied updates) on the PS nodes and the newest version a worker holds."))
    g.add(timeseries("Step lag per job", [
        (f"max by (job_name) (shardline_ps_job_step{{{JOB}}}) - min by (job_name) (shardline_ps_job_step{{{JOB}}})",
         "{{job_name}} across PS nodes"),
        (f"max by (job_name) (shardline_worker_version{{{JOB}}}) - min by (job_name) (shardline_worker_version{{{JOB}}})",
         "{{job_name}} across workers"),
    ], description="Max minus min step. BSP keeps PS nodes within 1 step; workers that fall behind show up here."))
    g.add(timeseries("Steps per second", [
        (f"sum by (job_name) (rate(shardline_worker_steps_total{{{JOB}}}[{RATE}]))", "{{job_name}} (all ranks)"),
    ], unit="ops", description="Training steps completed per second, summed over a job's workers."))
    g.add(timeseries("Worker step time", quantiles("shardline_worker_step_seconds", "job_name", "{{job_name}}", JOB,
                                                   qs=(("p50", 0.5), ("p99", 0.99))),
                     unit="s", description="Wall time of a training step (forward, backward, push, wait, pull)."))
    g.add(timeseries("Loss", [
        (f"shardline_worker_loss{{{JOB}}}", "{{job_name}} rank {{rank}}"),
    ], min_zero=False, description="Training loss of each worker's last step."))
    g.add(timeseries("Tokens per second", [
        (f"sum by (job_name) (rate(shardline_worker_tokens_total{{{JOB}}}[{RATE}]))", "{{job_name}}"),
    ], unit="short", description="Non-padding input tokens trained on per second, summed over a job's workers."))
    g.add(timeseries("BSP barrier fill", [
        (f"shardline_ps_bsp_committed_workers{{{JOB}}} / shardline_ps_job_world_size{{{JOB}}}", "{{job_name}} {{instance}}"),
    ], unit="percentunit", description="Share of a job's workers that committed the step being collected; stuck below 100% "
                                       "means the barrier waits for a worker."))
    g.add(timeseries("Worker versions per rank", [
        (f"shardline_worker_version{{{JOB}}}", "{{job_name}} rank {{rank}}"),
    ], description="Version (job step) of the parameters each worker holds."))
    g.add(timeseries("Worker push / pull throughput", [
        (f"sum by (job_name) (rate(shardline_worker_push_bytes_total{{{JOB}}}[{RATE}]))", "{{job_name}} push"),
        (f"sum by (job_name) (rate(shardline_worker_pull_bytes_total{{{JOB}}}[{RATE}]))", "{{job_name}} pull"),
    ], unit="Bps", description="Tensor payload bytes per second a job's workers push (gradients; all-zero blocks "
                               "are free) and pull (changed blocks only), as the workers count them."))
    g.add(timeseries("Worker pull wait", quantiles("shardline_worker_pull_wait_seconds", "job_name", "{{job_name}}", JOB,
                                                   qs=(("p50", 0.5), ("p99", 0.99))),
                     unit="s", description="Time a worker's training thread waited for a step's pull after its commit: "
                                           "the slowest worker, the update on the PS nodes and the transfer (with "
                                           "prefetch_window 1, what the next forward still waited)."))

    g.row("Storage and ring")
    g.add(timeseries("Blocks per node", [
        ("shardline_node_blocks", "{{node_id}}"),
    ], description="Parameter blocks each PS node holds (from its heartbeats)."), w=8)
    g.add(timeseries("Parameter bytes per node", [
        ("shardline_node_parameter_bytes", "{{node_id}}"),
    ], unit="bytes", description="Bytes of fp32 parameter values each PS node holds (from its heartbeats)."), w=8)
    g.add(timeseries("Parameter bytes per job", [
        (f"sum by (job_name) (shardline_ps_parameter_bytes{{{JOB}}})", "{{job_name}}"),
    ], unit="bytes", description="Bytes of fp32 parameter values per job, summed over PS nodes."), w=8)
    g.add(timeseries("PS memory by kind", [
        (f"sum by (kind) (shardline_ps_memory_bytes{{{JOB}}})", "{{kind}}"),
        ('sum(shardline_ps_process_anon_bytes) - sum(shardline_ps_memory_bytes{kind!="frozen_files"})',
         "process, not the jobs' tensors"),
    ], unit="bytes", description="Bytes the PS nodes' jobs keep by kind (values, optimizer state, gradient buffers, "
                                 "kept values, ...; frozen_files: frozen values in files, the page cache: "
                                 "docs/operations.md, \"Memory\"), and the rest of their anonymous "
                                 "memory (interpreter, receive buffers, allocator slack)."), w=8)
    g.add(timeseries("PS bytes per parameter held", [
        (f'sum by (instance) (shardline_ps_memory_bytes{{{JOB},kind!="frozen_files"}}) / sum by (instance) '
         f"(shardline_ps_memory_parameters{{{JOB}}})", "tensors in memory {{instance}}"),
        (f"sum by (instance) (shardline_ps_process_anon_bytes) / sum by (instance) "
         f"(shardline_ps_memory_parameters{{{JOB}}})", "anonymous memory {{instance}}"),
    ], description="Per parameter a PS node holds (primaries and copies): the bytes its jobs' tensors account for "
                   "in memory (frozen values in files left out), and its whole anonymous memory."), w=8)
    g.add(timeseries("Ring share per node", [
        ("shardline_node_vnodes / on (instance) group_left () sum by (instance) (shardline_node_vnodes)", "{{node_id}}"),
    ], unit="percentunit", description="Share of the ring's virtual nodes (about the share of keys) each PS node owns."), w=8)
    g.add(timeseries("Node load (data plane)", [
        ('sum by (node_id) (shardline_node_load_bytes_per_second)', "{{node_id}}"),
    ], unit="Bps", description="Bytes per second each PS node receives (pushes) and sends (pulls), decayed with the "
                               "dispatcher's heat_half_life: the load rebalancing evens out."), w=8)
    g.add(timeseries("Hot-shard share", [
        (f"shardline_job_hottest_shard_share{{{JOB}}}", "hottest block {{job_name}}"),
        (f"shardline_job_access_share{{{JOB}}}", "heatmap blocks {{job_name}}"),
    ], unit="percentunit", description="Share of all block accesses (reads + writes) that go to a job's hottest block, "
                                       "and to the blocks of the job in the dispatcher's heatmap (shardline status "
                                       "--hot lists them)."), w=8)
    g.add(timeseries("Load imbalance and rebalances", [
        ("shardline_load_imbalance", "max / mean node load"),
        (f"sum(increase(shardline_rebalances_total[{RATE}]))", "rebalances started"),
    ], description="Max over mean data-plane load of the serving PS nodes, and ring rebalances the leading dispatcher "
                   "started from it (rebalance_interval)."), w=8)
    g.add(timeseries("Data-plane connections", [
        ("shardline_ps_dataplane_connections", "{{instance}}"),
        (f"sum by (instance) (increase(shardline_ps_dataplane_connections_refused_total[{RATE}]))",
         "refused {{instance}}"),
    ], description="Open data-plane connections per PS node (one per worker and node in use), and connections "
                   "turned away at max_connections."), w=8)
    g.add(timeseries("Payload buffers in flight", [
        ("shardline_ps_inflight_payload_bytes / shardline_ps_inflight_payload_limit_bytes", "{{instance}}"),
    ], unit="percentunit", description="Share of max_inflight_bytes that data-plane connections hold in payload "
                                       "buffers; at 100% frames wait, then get RESOURCE_EXHAUSTED."), w=8)
    g.add(timeseries("Heartbeat failures and node deaths", [
        (f"sum by (instance) (increase(shardline_ps_heartbeat_failures_total[{RATE}]))", "failed heartbeats {{instance}}"),
        (f"sum(increase(shardline_nodes_declared_dead_total[{RATE}]))", "nodes declared dead"),
    ], description="Heartbeats a PS node could not deliver, and nodes the dispatcher declared dead."), w=8)

    g.row("Rack caches")
    hits, misses, coalesced = (f"sum by (rack) (rate(shardline_cache_{name}_total[{RATE}]))"
                               for name in ("hits", "misses", "coalesced_misses"))
    g.add(timeseries("Rack cache hit ratio", [
        (f"{hits} / ({hits} + {misses} + {coalesced})", "{{rack}}"),
    ], unit="percentunit", description="Share of the blocks a rack cache's readers pulled that it answered from memory "
                                       "(misses and pulls that waited for another pull's fetch count against it)."), w=8)
    g.add(timeseries("Rack cache bytes served vs fetched", [
        (f"sum by (rack) (rate(shardline_cache_served_bytes_total[{RATE}]))", "served to readers {{rack}}"),
        (f"sum by (rack) (rate(shardline_cache_fetched_bytes_total[{RATE}]))", "fetched from PS {{rack}}"),
    ], unit="Bps", description="Block bytes per second a rack cache sends its rack's readers, and receives from the PS "
                               "nodes (only changed blocks): the gap is PS egress the cache saves."), w=8)
    g.add(timeseries("Rack cache resident bytes", [
        ("sum by (rack) (shardline_cache_resident_bytes)", "resident {{rack}}"),
        ("sum by (rack) (shardline_cache_capacity_bytes)", "cache_bytes {{rack}}"),
    ], unit="bytes", description="Block bytes each rack cache holds against its bound (cache_bytes); beyond it the "
                                 "least recently used blocks are evicted."), w=8)

    g.row("Errors")
    g.add(timeseries("Data-plane errors by code", [
        (f'sum by (code, op) (rate(shardline_ps_requests_total{{code!="OK"}}[{RATE}]))', "{{code}} {{op}}"),
    ], unit="reqps", description="Failed data-plane requests per second. NOT_OWNER follows ring changes (clients refresh "
                                 "and retry); STALE_STEP, INVALID_ARGUMENT, NONFINITE and BAD_FRAME point at clients."))
    g.add(timeseries("gRPC errors by method and code", [
        (f'sum by (job, method, code) (rate(shardline_grpc_server_requests_total{{code!="OK"}}[{RATE}]))',
         "{{job}} {{method}} {{code}}"),
    ], unit="reqps", description="Control-plane RPCs that ended with a status other than OK."))

    g.row("Processes")
    g.add(timeseries("Resident memory per daemon", [
        ('process_resident_memory_bytes{job=~"shardline-.*"}', "{{job}} {{instance}}"),
    ], unit="bytes", description="RSS of each daemon (PS nodes hold fp32 values plus optimizer state)."), w=8)
    g.add(timeseries("CPU per daemon", [
        (f'rate(process_cpu_seconds_total{{job=~"shardline-.*"}}[{RATE}])', "{{job}} {{instance}}"),
    ], unit="percentunit", description="CPU time per second (1 = one core busy)."), w=8)
    g.add(timeseries("Open file descriptors", [
        ('process_open_fds{job=~"shardline-.*"}', "{{job}} {{instance}}"),
    ], description="Sockets and files each daemon holds open."), w=8)

    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": "Shardline parameter-server cluster: throughput, latency, training progress, ring and node health, "
                       "storage, rack caches, errors and processes. Generated by deploy/grafana/generate.py.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": g.panels,
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": ["shardline"],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1, "regex": ""},
            {"name": "job_name", "label": "Job", "type": "query", "datasource": DS,
             "definition": "label_values(shardline_ps_job_step, job_name)",
             "query": {"query": "label_values(shardline_ps_job_step, job_name)", "qryType": 1,
                       "refId": "PrometheusVariableQueryEditor-VariableQuery"},
             "current": {}, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True, "options": [],
             "refresh": 2, "regex": "", "sort": 1},
        ]},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "Shardline",
        "uid": "shardline-cluster",
        "version": 1,
        "weekStart": "",
    }


def render(dashboard: dict | None = None) -> str:
    return json.dumps(build() if dashboard is None else dashboard, indent=2) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON file differs from the generator output")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
