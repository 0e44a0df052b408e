"""Block store and synchronization for one PS node: pure logic, no sockets.

A node holds, per job, the blocks the ring assigns it: fp32 master values, optimizer state and a
version (the job step that last changed the block; initial values are version 0).

Sync modes (SPEC "Training semantics"):

* **BSP** — workers push gradients for step ``v`` then commit ``v``. Once all ``world_size``
  workers committed ``v``, every block that received a push (a payload or a zero flag) from any
  worker is stepped with the weighted mean ``sum(w_i * g_i) / sum(w_i)`` over *all* committed
  workers (a worker that pushed nothing for a block contributes zero), and moves to version
  ``v + 1``; blocks nobody pushed are not stepped, as ``torch.optim`` skips ``grad is None``.
  The job step becomes ``v + 1`` and waiting pulls wake up.
* **ASP** — each push frame is applied on arrival as one update (weights ignored); the job step
  counts applied frames and touched blocks take the new step as their version.

Every mutating call validates the whole request before changing anything, so a rejected frame
leaves no partial update behind.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch

from ps_server.optimizer import OptimizerConfig, make_optimizer
from services.blocks import block_slice, num_blocks
from services.errors import ShardlineError
from services.tensor_checks import all_finite
from services.pb import common_pb2


class StoreError(ShardlineError):
    """A request the store refuses; ``code`` is a dataplane ErrorCode name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    numel: int
    trainable: bool
    blocks: int


@dataclass
class Block:
    value: torch.Tensor                      # 1-D fp32 master copy
    state: dict
    version: int = 0
    # Sum of weight * grad for the step being collected; the buffer lives as long as the block
    # (allocated once, not per step) and holds data only while has_grad is set.
    grad_buf: torch.Tensor | None = None
    has_grad: bool = False
    pushed_by: set = field(default_factory=set)


@dataclass
class PushItem:
    tensor: str
    index: int
    grad: torch.Tensor | None  # None: the block's gradient is exactly zero (sent as a flag)


class JobStore:
    """Blocks and sync state of one job on this node. Thread-safe; pulls wait on ``cond``."""

    def __init__(self, spec: common_pb2.JobSpec, *, allow_nonfinite: bool | None = None):
        self.name = spec.name
        self.sync = spec.sync
        self.world_size = int(spec.world_size)
        self.block_elements = int(spec.block_elements)
        self.allow_nonfinite = spec.allow_nonfinite if allow_nonfinite is None else allow_nonfinite
        self.optimizer_config = OptimizerConfig.from_proto(spec.optimizer)
        self.optimizer = make_optimizer(self.optimizer_config)
        self.tensors: dict[str, TensorMeta] = {}
        for t in spec.tensors:
            numel = math.prod(t.shape)
            self.tensors[t.name] = TensorMeta(t.name, tuple(t.shape), numel, t.trainable,
                                              num_blocks(numel, self.block_elements))
        self.blocks: dict[tuple[str, int], Block] = {}
        self.step = 0                 # BSP: the step being collected == number of applied steps
        self.committed: dict[int, float] = {}
        self.push_weight: dict[int, float] = {}
        self.cond = threading.Condition()
        self.bytes = 0

    # --- validation -------------------------------------------------------------------------
    def expected_numel(self, tensor: str, index: int) -> int:
        meta = self.tensors.get(tensor)
        if meta is None:
            raise StoreError("UNKNOWN_TENSOR", f"job {self.name!r} has no tensor {tensor!r}")
        if not 0 <= index < meta.blocks:
            raise StoreError("INVALID_ARGUMENT",
                             f"tensor {tensor!r} has {meta.blocks} blocks, block index {index} is out of range")
        return block_slice(meta.numel, self.block_elements, index).numel

    def _block(self, tensor: str, index: int) -> Block:
        self.expected_numel(tensor, index)
        block = self.blocks.get((tensor, index))
        if block is None:
            raise StoreError("UNKNOWN_TENSOR", f"block {tensor}[{index}] of job {self.name!r} was never initialized on this node")
        return block

    # --- operations -------------------------------------------------------------------------
    def init_blocks(self, items: list[tuple[str, int, torch.Tensor]]) -> int:
        """Set values of blocks this node lacks (existing blocks keep theirs). Returns how many were set."""
        for tensor, index, value in items:
            numel = self.expected_numel(tensor, index)
            if value.numel() != numel:
                raise StoreError("INVALID_ARGUMENT",
                                 f"block {tensor}[{index}] must have {numel} elements, got {value.numel()}")
            if not all_finite(value):
                raise StoreError("NONFINITE", f"initial value of tensor {tensor!r} block {index} contains NaN or Inf")
        created = 0
        with self.cond:
            for tensor, index, value in items:
                if (tensor, index) in self.blocks:
                    continue
                v = value.detach().to(torch.float32).clone()
                self.blocks[(tensor, index)] = Block(v, self.optimizer.init_state(v.numel()))
                self.bytes += v.numel() * 4
                created += 1
        return created

    def push(self, rank: int, step: int, weight: float, items: list[PushItem]) -> int:
        """Accept gradients. BSP: accumulate for ``step``; ASP: apply now. Returns the job step after."""
        if not (math.isfinite(weight) and weight > 0):
            raise StoreError("INVALID_ARGUMENT", f"weight must be a finite number > 0, got {weight!r}")
        if not 0 <= rank < self.world_size:
            raise StoreError("INVALID_ARGUMENT", f"rank {rank} out of range for world_size {self.world_size}")
        for item in items:
            numel = self.expected_numel(item.tensor, item.index)
            if not self.tensors[item.tensor].trainable:
                raise StoreError("INVALID_ARGUMENT", f"tensor {item.tensor!r} is frozen: it takes no gradients")
            if item.grad is not None:
                if item.grad.numel() != numel:
                    raise StoreError("INVALID_ARGUMENT",
                                     f"gradient for {item.tensor}[{item.index}] must have {numel} elements, got {item.grad.numel()}")
                if not self.allow_nonfinite and not all_finite(item.grad):
                    raise StoreError("NONFINITE", f"gradient for tensor {item.tensor!r} (block {item.index}) contains NaN or Inf")
        with self.cond:
            blocks = [self._block(item.tensor, item.index) for item in items]
            if self.sync == "asp":
                self._apply_asp(items, blocks)
                return self.step
            if step != self.step:
                raise StoreError("STALE_STEP", f"push for step {step} but job {self.name!r} is collecting step {self.step} on this node")
            if rank in self.committed:
                raise StoreError("STALE_STEP", f"rank {rank} already committed step {step}")
            if self.push_weight.setdefault(rank, weight) != weight:
                raise StoreError("INVALID_ARGUMENT",
                                 f"rank {rank} pushed step {step} with weight {weight!r} after weight {self.push_weight[rank]!r}")
            seen = set()
            for item, block in zip(items, blocks):
                key = (item.tensor, item.index)
                if rank in block.pushed_by or key in seen:
                    raise StoreError("INVALID_ARGUMENT", f"rank {rank} pushed block {item.tensor}[{item.index}] twice in step {step}")
                seen.add(key)
            for item, block in zip(items, blocks):
                block.pushed_by.add(rank)
                if item.grad is None:
                    continue
                if block.grad_buf is None:
                    block.grad_buf = torch.empty_like(block.value)
                if not block.has_grad:
                    block.grad_buf.copy_(item.grad)  # also converts fp16/bf16 pushes to fp32
                    if weight != 1.0:
                        block.grad_buf.mul_(weight)
                    block.has_grad = True
                elif weight != 1.0:
                    block.grad_buf.add_(item.grad.to(torch.float32), alpha=weight)
                else:
                    block.grad_buf.add_(item.grad.to(torch.float32))
            return self.step

    def commit(self, rank: int, step: int, weight: float) -> int:
        """BSP: rank finished step ``step``. Applies the step when all workers committed. Returns the job step."""
        if self.sync != "bsp":
            raise StoreError("INVALID_ARGUMENT", f"commit is only used in BSP; job {self.name!r} is {self.sync!r}")
        if not (math.isfinite(weight) and weight > 0):
            raise StoreError("INVALID_ARGUMENT", f"weight must be a finite number > 0, got {weight!r}")
        if not 0 <= rank < self.world_size:
            raise StoreError("INVALID_ARGUMENT", f"rank {rank} out of range for world_size {self.world_size}")
        with self.cond:
            if step != self.step:
                raise StoreError("STALE_STEP", f"commit for step {step} but job {self.name!r} is collecting step {self.step} on this node")
            if rank in self.committed:
                raise StoreError("STALE_STEP", f"rank {rank} already committed step {step}")
            pushed = self.push_weight.get(rank)
            if pushed is not None and pushed != weight:
                raise StoreError("INVALID_ARGUMENT", f"rank {rank} commits step {step} with weight {weight!r} but pushed with {pushed!r}")
            self.committed[rank] = weight
            if len(self.committed) == self.world_size:
                self._apply_bsp()
            return self.step

    def _apply_bsp(self) -> None:
        total = sum(self.committed.values())
        new_version = self.step + 1
        for block in self.blocks.values():
            if not block.pushed_by:
                continue
            grad = None
            if block.has_grad:
                grad = block.grad_buf.div_(total) if total != 1.0 else block.grad_buf
            self.optimizer.step(block.value, grad, block.state)
            block.version = new_version
            block.has_grad = False
            block.pushed_by = set()
        self.step = new_version
        self.committed = {}
        self.push_weight = {}
        self.cond.notify_all()

    def _apply_asp(self, items: list[PushItem], blocks: list[Block]) -> None:
        new_version = self.step + 1
        for item, block in zip(items, blocks):
            grad = None if item.grad is None else item.grad.to(torch.float32)
            self.optimizer.step(block.value, grad, block.state)
            block.version = new_version
        self.step = new_version
        self.cond.notify_all()

    def wait_for_step(self, min_step: int, timeout: float) -> int:
        """Block until the job step is >= ``min_step``; raises StoreError(TIMEOUT). No busy polling."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.step >= min_step, timeout=timeout):
                raise StoreError("TIMEOUT", f"job {self.name!r} did not reach step {min_step} within {timeout:g} s (at {self.step})")
            return self.step

    def changed_blocks(self, wanted: list[tuple[str, int, int | None]], *, copy: bool) -> tuple[int, list[tuple[str, int, int, torch.Tensor]]]:
        """Blocks whose version is newer than the client's (``None`` = client has nothing).

        Returns (job step, [(tensor, index, version, value)]). ``copy`` snapshots values under the
        lock (needed in ASP, where another push may step a block while it is being sent).
        """
        for tensor, index, _ in wanted:
            self.expected_numel(tensor, index)
        with self.cond:
            out = []
            for tensor, index, have in wanted:
                block = self._block(tensor, index)
                if have is None or block.version > have:
                    out.append((tensor, index, block.version, block.value.clone() if copy else block.value))
            return self.step, out


class NodeStore:
    """All jobs on a node."""

    def __init__(self):
        self._jobs: dict[str, JobStore] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> JobStore | None:
        return self._jobs.get(name)

    def add(self, spec: common_pb2.JobSpec) -> JobStore:
        with self._lock:
            job = self._jobs.get(spec.name)
            if job is None:
                job = self._jobs[spec.name] = JobStore(spec)
            return job

    def jobs(self) -> list[JobStore]:
        with self._lock:
            return list(self._jobs.values())

    def totals(self) -> tuple[int, int]:
        jobs = self.jobs()
        return sum(len(j.blocks) for j in jobs), sum(j.bytes for j in jobs)
