"""BSP/SSP commits: a rank finished pushing step ``v`` on every node.

Once all ``world_size`` ranks committed ``v``, every block that received a push of it (a payload
or a zero flag) from any rank is stepped with the weighted mean ``sum(w_i * g_i) / sum(w_i)``
over *all* committed ranks (ps_server/store/apply.py). A rank's pushes and commit of a step carry
one weight and name one lr; a repeated commit (its reply was lost, the rank resends after a
routing change, or the step was applied meanwhile) is acknowledged again. A block taken over
counts commits made at an epoch >= its ``since_epoch`` (workers resend the step in flight when
the routing epoch changes), and those of the ranks whose gradients its handover brought.

Methods of :class:`~shardline.ps_server.store.job.JobStore`, over its ``cond``.
The design: docs/architecture.md, "Block store".
"""

from __future__ import annotations

from shardline.ps_server.store.common import LRs, StoreError
from shardline.services.errors import ErrorCode


class Commits:
    """The commit half of JobStore (see the module docstring)."""

    @property
    def committed(self) -> dict[int, float]:
        """Ranks that committed the step being collected, and their weights."""
        return {rank: weight for rank, (weight, _epoch) in self.commits.get(self.step, {}).items()}

    def commit(self, rank: int, step: int, weight: float, lr: float | tuple | None = None, epoch: int = 0) -> int:
        """BSP: rank finished step ``step`` on every node. Applies what the step completes. Returns the job step.

        ``lr`` overrides the job's learning rates for this step (schedules): one per parameter group,
        or one number for every group (see group_lrs); all ranks must agree.
        ``epoch`` is the routing epoch the rank committed at: a block this node took over at a
        later epoch waits for commits at that epoch (the rank resent the step's pushes first).
        A resent commit (its reply was lost, the rank resends after a routing change, or the step
        was applied meanwhile) is acknowledged again.
        """
        lr = self.group_lrs(lr)
        if not self.collects:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"commit is only used in BSP and SSP; job {self.name!r} is {self.sync!r}")
        self._check_rank_and_weight(rank, weight)
        with self.cond:
            self._check_open("commit")
            if step > self.step and not self.blocks and not self.commits:
                self.step = step  # a node that holds nothing of the job yet joins at the job's step
            if step > self.step:
                self._check_ahead(step, f"commit for step {step} but job {self.name!r} is collecting step "
                                        f"{self.step} on this node")
            record = self.commits.get(step)
            if record is None:
                if step < self.step and not any(b.primary and b.step == step for b in self.blocks.values()):
                    return self.step  # applied already, and no block here still collects it
                record = self.commits[step] = {}
            previous = record.get(rank)
            self._check_commit(rank, step, weight, lr, record, previous)
            self.step_lrs.setdefault(step, lr)
            record[rank] = (weight, max(epoch, previous[1] if previous else 0))
            if self.parking_blocks:
                self._fold_settled()
            self._apply_ready(step)
            return self.step

    def _check_commit(self, rank: int, step: int, weight: float, lr: LRs, record: dict,
                      previous: tuple | None) -> None:
        """A commit agrees with the rank's earlier commit and pushes of the step, and names the
        lrs the other ranks named. Lock held."""
        if previous is not None and previous[0] != weight:
            raise StoreError(ErrorCode.STALE_STEP,
                             f"rank {rank} already committed step {step} with weight {previous[0]!r}, not {weight!r}")
        self._check_push_weight("commit", rank, step, weight)
        self._check_push_lr("commit", rank, step, lr)
        if record and step in self.step_lrs and lr != self.step_lrs[step] and previous is None:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"rank {rank} commits step {step} with lr {lr!r}, other ranks with "
                             f"{self.step_lrs[step]!r}")

    def adopt_commits(self, step: int, commits: dict[int, tuple[float, int]], lr: "LRs | float") -> int:
        """Commits of ``step`` learned from another node (a rank died between its commits to the
        nodes: every commit means the rank finished pushing everywhere). Returns the job step."""
        with self.cond:
            if step != self.step or not self.collects:
                return self.step
            record = self.commits.setdefault(step, {})
            for rank, (weight, epoch) in commits.items():
                if rank not in record and 0 <= rank < self.world_size:
                    record[rank] = (weight, epoch)
            if step not in self.step_lrs:
                self.step_lrs[step] = self.group_lrs(lr)
            if self.parking_blocks:
                self._fold_settled()
            self._apply_ready(step)
            return self.step

    def commits_of(self, step: int) -> tuple[dict[int, tuple[float, int]], LRs]:
        """The commit record of ``step`` (for a node that missed a rank's commit), and its lr."""
        with self.cond:
            return dict(self.commits.get(step, {})), self.step_lrs.get(step)

    def missing_ranks(self, step: int | None = None) -> list[int]:
        """Ranks that did not commit ``step`` (default: the step being collected) on this node."""
        step = self.step if step is None else step
        with self.cond:
            return sorted(set(range(self.world_size)) - set(self.commits.get(step, {})))

    def _check_push_weight(self, what: str, rank: int, step: int, weight: float) -> None:
        """A rank's pushes and commit of a step carry one weight. Call with the lock held."""
        pushed = self.push_weights.get(step, {}).get(rank)
        if pushed is not None and pushed != weight:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"rank {rank}'s {what} for step {step} has weight {weight!r}, its pushes had {pushed!r}")

    def _check_push_lr(self, what: str, rank: int, step: int, lrs: LRs) -> None:
        """A rank's pushes and commit of a step name one lr (its pushes' lrs may step blocks before
        the commits: a commit naming others is refused, never applied). Call with the lock held."""
        pushed = self.push_lrs.get(step, {}).get(rank)
        if pushed is not None and pushed != lrs:
            raise StoreError(ErrorCode.INVALID_ARGUMENT,
                             f"rank {rank}'s {what} for step {step} has lr {lrs!r}, its pushes had {pushed!r}")

    def _forget_old_steps(self) -> None:
        oldest = min((b.step for b in self.blocks.values() if b.primary), default=self.step)
        oldest = min(oldest, self.step)
        for table in (self.commits, self.step_lrs, self.push_weights, self.push_lrs, self.norm_shares, self.clip_coefs):
            # keep the last two applied steps' records: adoption, and a block taken over may recompute
            # them (the workers may have read a step its holders did not acknowledge yet)
            for s in [s for s in table if s < oldest - 2]:
                del table[s]
