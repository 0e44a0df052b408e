"""Failpoints: crash a process at a chosen point of a chosen step, for fault tests.

``SHARDLINE_FAILPOINTS`` lists ``name`` or ``name@step`` entries separated by commas. When the
code passes ``hit(name, step)`` for an armed name (at that step or a later one, if a step was
given: a node that was busy joining when the step went by fires at its next), the process ends
at once with ``os._exit(EXIT_CODE)`` — as a ``kill -9`` would, without cleanup — after one log
line naming the failpoint. Unset (production), ``hit`` costs a dictionary lookup.

Names in use (where a crash splits a protocol step):

* ``worker.before_push`` / ``worker.after_push`` — a worker before its step's pushes / between
  its pushes and its commit;
* ``worker.commit_partial`` — a worker that committed its step on one node only;
* ``ps.after_apply`` — a primary that applied a step before replicating it;
* ``ps.checkpoint.<stage>`` — a node in the middle of writing a checkpoint
  (ps_server/checkpoint.py write stages).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("shardline.failpoints")

ENV = "SHARDLINE_FAILPOINTS"
EXIT_CODE = 137  # what a shell reports for SIGKILL


def _parse(value: str) -> dict[str, int | None]:
    armed: dict[str, int | None] = {}
    for entry in filter(None, (e.strip() for e in value.split(","))):
        name, _, step = entry.partition("@")
        armed[name] = int(step) if step else None
    return armed


_ARMED = _parse(os.environ.get(ENV, ""))


def armed(name: str, step: int | None = None) -> bool:
    if name not in _ARMED:
        return False
    at = _ARMED[name]
    return at is None or step is None or step >= at


def hit(name: str, step: int | None = None) -> None:
    """End the process here if ``name`` (at ``step``) is armed."""
    if _ARMED and armed(name, step):
        log.error("failpoint %s hit at step %s: exiting now", name, step)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(EXIT_CODE)
