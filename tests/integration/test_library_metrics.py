"""Metrics from the library: a training script's PSOptimizer records its steps in the default
registry and, with ``metrics_port=0``, serves them; the dashboard's worker panels find what they
query there (issue "Metrics from the library")."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from torch import nn

from shardline import PSOptimizer
from shardline.worker import metrics as WM
from test_metrics import DASHBOARD, GEN, scrape, value

pytestmark = pytest.mark.timeout(120)

STEPS = 4


def train(address: str, job: str, prefetch_window: int) -> tuple[str, str, int]:
    """A few steps of a small model the way a script does; returns (scrape, metrics address, version)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = PSOptimizer(model, cluster=address, job=job, optimizer="sgd", lr=0.1, world_size=1, rank=0,
                      block_elements=16, connect_timeout=30, pull_timeout=60, prefetch_window=prefetch_window,
                      metrics_port=0)
    try:
        g = torch.Generator().manual_seed(1)
        for _ in range(opt.version, STEPS):
            x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        opt.wait()
        return scrape(opt.metrics_address), opt.metrics_address, opt.version
    finally:
        opt.close()


@pytest.mark.parametrize("prefetch_window", [0, 1])
def test_psoptimizer_serves_its_step_metrics(cluster, prefetch_window):
    job = f"library-metrics-{prefetch_window}"
    text, address, version = train(cluster.address, job, prefetch_window)
    assert address.startswith("127.0.0.1:") and version == STEPS
    labels = {"job_name": job, "rank": "0"}
    assert value(text, "shardline_worker_steps_total", **labels) == STEPS
    assert value(text, "shardline_worker_version", **labels) == STEPS
    assert value(text, "shardline_worker_push_bytes_total", **labels) > 0
    assert value(text, "shardline_worker_pull_bytes_total", **labels) > 0
    assert value(text, "shardline_worker_step_seconds_count", **labels) == STEPS
    # one wait per step: in the step (window 0) or in the next use of the parameters (window 1)
    assert value(text, "shardline_worker_pull_wait_seconds_count", **labels) == STEPS
    assert value(text, "shardline_worker_pull_wait_seconds_sum", **labels) > 0
    # the dashboard's worker panels resolve here, but for the daemon's task panels (loss, tokens)
    daemon_only = {m._name for m in WM.DAEMON_METRICS}
    queried = {n for e in GEN.dashboard_exprs(json.loads(DASHBOARD.read_text(encoding="utf-8")))
               for n in GEN.promql_metric_names(e)
               if n.startswith("shardline_worker_") and not n.startswith(tuple(daemon_only))}
    assert queried and GEN.unresolved_names(queried, GEN.exported_series(text)) == []
    with pytest.raises((urllib.error.URLError, ConnectionError)):   # close() stopped serving
        urllib.request.urlopen(f"http://{address}/metrics", timeout=5)


def test_a_non_loopback_metrics_host_needs_a_cluster_token(monkeypatch):
    from shardline.services.errors import ShardlineConfigError

    monkeypatch.delenv("SHARDLINE_CLUSTER_TOKEN_FILE", raising=False)
    with pytest.raises(ShardlineConfigError, match="refusing to serve metrics on 0.0.0.0:0"):
        # refused before the optimizer contacts the cluster (nothing listens on port 1)
        PSOptimizer(nn.Linear(2, 2), cluster="127.0.0.1:1", job="x", metrics_port=0, metrics_host="0.0.0.0")
