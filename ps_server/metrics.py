"""Prometheus metrics of a PS node (module-level: one node per process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("shardline_ps_requests_total", "Data-plane requests by operation and result code", ["op", "code"])
REQUEST_SECONDS = Histogram("shardline_ps_request_seconds", "Data-plane request handling time, including pull waits", ["op"],
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
PAYLOAD_BYTES = Counter("shardline_ps_payload_bytes_total", "Tensor payload bytes received and sent", ["direction"])
BLOCKS = Gauge("shardline_ps_blocks", "Blocks held by this node")
BYTES_HELD = Gauge("shardline_ps_bytes", "Bytes of fp32 master values held by this node")
JOB_STEP = Gauge("shardline_ps_job_step", "Job step (applied updates) on this node", ["job"])
CONNECTIONS = Gauge("shardline_dataplane_connections", "Open data-plane connections")
EPOCH = Gauge("shardline_ps_ring_epoch", "Ring epoch this node routes with")


class PSMetrics:
    def request(self, op: str | None, code: str, *, seconds: float | None = None, bytes_in: int = 0, bytes_out: int = 0) -> None:
        op = op or "UNKNOWN"
        REQUESTS.labels(op, code).inc()
        if seconds is not None:
            REQUEST_SECONDS.labels(op).observe(seconds)
        if bytes_in:
            PAYLOAD_BYTES.labels("in").inc(bytes_in)
        if bytes_out:
            PAYLOAD_BYTES.labels("out").inc(bytes_out)
