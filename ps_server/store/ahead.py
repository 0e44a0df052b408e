"""SSP: pushes and commits of steps after the one a block (or the node) collects.

A block takes pushes (and the node commits) of steps up to ``job step + staleness``, each step
ahead collected in its own :class:`~shardline.ps_server.store.blocks.Collection`
(``Primary.ahead``) and folded in rank order as the block's own step is (a push that arrives
before a lower rank's is parked there; pushes.py); steps are applied in order, each once every
rank committed it, and a block that reaches a step takes what was collected ahead for it, parked
contributions included (``Primary.applied``). A push or commit
beyond ``job step + staleness`` is refused (STALE_STEP): a worker following the pull rule (it
computes step v on parameters of version >= v - s) never sends one. Pulls may be served while a
step is applied, so they wait until the replicas hold each block's newest step.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

from shardline.ps_server.store.blocks import Block
from shardline.ps_server.store.common import StoreError
from shardline.services.errors import ErrorCode

# How long a pull, once wait_for_step let it through, waits for a step applied just then to be
# held by the replicas (a TIMEOUT reply: the worker asks again).
VISIBILITY_TIMEOUT_SECONDS = 10.0


class AheadSteps:
    """The SSP half of JobStore (see the module docstring)."""

    def _check_ahead(self, step: int, refusal: str) -> None:
        """A push or commit of ``step``, after the step its block (or this node) collects: SSP takes
        steps up to ``job step + staleness``; BSP up to the job step (a block taken over lags it
        by the steps its previous primary applied and its holders had not: the workers resend
        them, oldest first, and the next one's pushes may come before the last commit of the one
        before: docs/architecture.md, "Reads before the acknowledgement"); anything else is
        refused with ``refusal``."""
        if step <= self.step + self.staleness and (self.staleness or self.collects):
            return
        bound = (f" (SSP: at most staleness {self.staleness} steps after it, up to step "
                 f"{self.step + self.staleness})") if self.staleness else ""
        raise StoreError(ErrorCode.STALE_STEP, refusal + bound)

    def _wait_visible(self, blocks: list[Block]) -> None:
        """A step may be applied while a pull is served; wait until every primary of ``blocks`` is
        visible at its newest step (its replicas hold it). Call with the lock held."""
        if not self.cond.wait_for(lambda: all(b.visible >= b.step or not b.primary for b in blocks),
                                  timeout=VISIBILITY_TIMEOUT_SECONDS):
            raise StoreError(ErrorCode.TIMEOUT, f"the replicas of job {self.name!r} did not acknowledge its newest "
                                                f"step within {VISIBILITY_TIMEOUT_SECONDS:g} s")
