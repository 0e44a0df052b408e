"""Shardline worker side: ``PSOptimizer`` for torch training loops and the lower-level ``connect``."""

from worker.client import Client, connect
from worker.optim import PSOptimizer

__all__ = ["Client", "PSOptimizer", "connect"]
