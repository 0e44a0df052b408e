"""Shardline worker side: ``PSOptimizer`` for torch training loops and the lower-level ``connect``."""

from shardline.worker.client import Client, connect
from shardline.worker.optim import PSOptimizer

__all__ = ["Client", "PSOptimizer", "connect"]
