"""Prometheus metrics of a training worker daemon (``shardline-worker``).

Every series carries ``job_name`` and ``rank`` (bounded by the job's world size), so dashboards can
aggregate per job and show the spread between ranks. (``job_name``, not ``job``: Prometheus
reserves ``job`` for the scrape job.) :class:`WorkerMetrics` binds the labels once.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LABELS = ["job_name", "rank"]

STEPS = Counter("shardline_worker_steps_total", "Training steps this worker completed", _LABELS)
STEP_SECONDS = Histogram("shardline_worker_step_seconds", "Wall time of one training step (forward, backward, push, pull)",
                         _LABELS, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
LOSS = Gauge("shardline_worker_loss", "Training loss of the last step", _LABELS)
TOKENS = Counter("shardline_worker_tokens_total", "Non-padding input tokens trained on", _LABELS)
VERSION = Gauge("shardline_worker_version", "Job step (version) of the parameters this worker holds", _LABELS)


class WorkerMetrics:
    """The metric children of one worker: ``steps``, ``step_seconds``, ``loss``, ``tokens``, ``version``.

    Creating it makes every series visible (at 0) before the first step.
    """

    def __init__(self, job: str, rank: int):
        labels = (job, str(rank))
        self.steps = STEPS.labels(*labels)
        self.step_seconds = STEP_SECONDS.labels(*labels)
        self.loss = LOSS.labels(*labels)
        self.tokens = TOKENS.labels(*labels)
        self.version = VERSION.labels(*labels)
        self.loss.set(float("nan"))  # no step yet: a gap, not a loss of 0
