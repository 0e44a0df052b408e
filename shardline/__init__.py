"""Shardline: a parameter-server cluster for LLM post-training.

For training scripts::

    from shardline import PSOptimizer, connect
    from shardline import WeightSubscriber        # inference processes that only read weights
    from shardline import balanced_split, CostModel, micro_batches, rank_weights   # imbalanced batches

The wheel installs this one top-level package; the source folders of the tree map under it
(``services/`` is ``shardline.services``, ``ps_server/`` is ``shardline.ps_server``,
``dispatcher/`` is ``shardline.dispatcher``, ``rack_cache/`` is ``shardline.rack_cache``,
``worker/`` is ``shardline.worker``, ``jobs/`` is ``shardline.jobs``). Its own modules sit above
them all: the CLI (``cli.py``), ``LocalCluster`` (``local_cluster.py``) and the dispatcher's entry
point (``dispatcher_daemon.py``); docs/architecture.md, "Layers".
The training API is imported on first use, so the dispatcher daemon never imports torch.
"""

from __future__ import annotations

from importlib import import_module

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "PSOptimizer": "shardline.worker.optim",
    "Client": "shardline.worker.client",
    "connect": "shardline.worker.client",
    # the newest weights of a job, as deltas, for rollout engines (worker/subscriber.py)
    "WeightSubscriber": "shardline.worker.subscriber",
    # length-aware balancing of a global minibatch across ranks (worker/balance.py)
    "balanced_split": "shardline.worker.balance",
    "CostModel": "shardline.worker.balance",
    "micro_batches": "shardline.worker.balance",
    "rank_weights": "shardline.worker.balance",
    "plan_rank": "shardline.worker.balance",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardline' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
