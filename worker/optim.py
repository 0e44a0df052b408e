"""``PSOptimizer``: a drop-in optimizer for torch training loops backed by a Shardline cluster.

``step()`` pushes the gradients (blocks whose gradient is exactly zero go as a flag), commits the
step under BSP, waits server-side for the cluster to apply it, and pulls only the blocks that
changed straight into the parameters. The optimizer math runs on the PS nodes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

import torch

from shardline.services.errors import ShardlineConfigError
from shardline.worker.client import DEFAULT_STRAGGLER_WARNING_SECONDS, Client


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ShardlineConfigError(f"environment variable {name} must be an integer, got {value!r}") from None


class PSOptimizer:
    """Optimizer whose state and update live on the parameter servers.

    ``named_parameters``: (name, parameter) pairs, as ``model.named_parameters()`` gives. Frozen
    parameters (``requires_grad=False``) are registered too, so workers that did not create the job
    get them from the cluster; they never change, so after the first pull they cost nothing.

    Rank 0 creates the job from its parameters if the cluster lacks it; every other rank (and every
    rank of a resumed job) starts from the values the cluster holds.
    ``world_size``/``rank`` default to ``WORLD_SIZE``/``RANK`` (as torchrun sets them), else 1/0.

    ``prefetch_window``: 0, ``step()`` returns once the parameters hold the new version; 1,
    ``step()`` returns after the commit and the pull runs in the background (a fast BSP worker
    prepares its next batch while the slowest finishes) until the parameters are next used: any
    ``nn.Module`` forward, ``zero_grad()``, ``step()`` or ``wait()`` first waits for it. Code that
    reads the parameters outside a module's forward must call ``wait()``. ``close()`` when done.
    ``cluster_token``/``tls_ca`` default to the files named by ``SHARDLINE_CLUSTER_TOKEN_FILE`` /
    ``SHARDLINE_TLS_CA_FILE`` (what ``shardline up`` prints), else none.
    ``straggler_warning_seconds``: a step still waiting this long for other ranks logs a WARNING
    naming the ranks that have not committed it (0: no warning); when ``pull_timeout`` runs out,
    StepTimeoutError names them. A wrong ``cluster`` fails at once (ShardlineConfigError); an
    unreachable one logs a WARNING after 5 s and fails after ``connect_timeout``.
    Remaining keyword arguments are the optimizer's hyperparameters with torch.optim's names.
    """

    def __init__(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]], cluster: str, job: str, *,
                 optimizer: str = "adamw", sync: str = "bsp", world_size: int | None = None, rank: int | None = None,
                 block_elements: int | None = None, transport: str = "auto", pull_timeout: float = 600.0,
                 connect_timeout: float = 60.0, rpc_timeout: float = 10.0, allow_nonfinite: bool = False, cluster_token: bytes | None = None,
                 prefetch_window: int = 0, recovery_timeout: float = 120.0, replication: int | None = None,
                 worker_lease_timeout: float | None = None, on_worker_failure: str | None = None,
                 tls_ca: bytes | None = None, straggler_warning_seconds: float = DEFAULT_STRAGGLER_WARNING_SECONDS,
                 **optimizer_kwargs):
        if prefetch_window not in (0, 1) or isinstance(prefetch_window, bool):
            raise ShardlineConfigError(
                f"prefetch_window must be 0 (step() returns with fresh parameters) or 1 (the pull runs until "
                f"the parameters are next used); a BSP worker cannot run further ahead, got {prefetch_window!r}")
        self.prefetch_window = prefetch_window
        self._pending = None        # background pull of the last step (prefetch_window 1)
        self._pending_lock = threading.Lock()
        self._hook = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardline-prefetch")
        self.params = list(named_parameters)
        if not self.params:
            raise ShardlineConfigError("PSOptimizer got no parameters")
        names = [n for n, _ in self.params]
        if len(set(names)) != len(names):
            raise ShardlineConfigError("parameter names must be unique")
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        self.rank = _env_int("RANK", 0) if rank is None else int(rank)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ShardlineConfigError(f"rank {self.rank!r} must be in [0, world_size={self.world_size!r})")
        self.client = Client(cluster, job, rank=self.rank, transport=transport, pull_timeout=pull_timeout,
                             connect_timeout=connect_timeout, rpc_timeout=rpc_timeout, cluster_token=cluster_token,
                             recovery_timeout=recovery_timeout, tls_ca=tls_ca,
                             straggler_warning_seconds=straggler_warning_seconds)
        created = False
        if self.rank == 0:
            created = self.client.init({n: p.detach() for n, p in self.params}, optimizer=optimizer, sync=sync,
                             world_size=self.world_size, block_elements=block_elements,
                             trainable={n: p.requires_grad for n, p in self.params},
                             allow_nonfinite=allow_nonfinite, replication=replication,
                             worker_lease_timeout=worker_lease_timeout, on_worker_failure=on_worker_failure,
                             **optimizer_kwargs)
        else:
            self.client.wait_ready(connect_timeout)
        spec = self.client.spec
        if spec.world_size != self.world_size:
            raise ShardlineConfigError(f"job {job!r} has world_size {spec.world_size}, this worker says {self.world_size}")
        # Pulls land directly in parameters that are contiguous CPU fp32; others go through the cache.
        self._copy_back = []
        for name, p in self.params:
            if p.dtype == torch.float32 and p.device.type == "cpu" and p.data.is_contiguous():
                # The creator's parameters are exactly what it initialized the job with.
                self.client.bind(name, p.data, same_contents=created)
            else:
                self._copy_back.append((name, p))
        self.client.join([n for n, _ in self.params])
        self._sync_copies()
        # One group, as torch.optim has: schedules set param_groups[0]["lr"] (or call set_lr) and
        # the next step's commit carries it to the servers.
        self.param_groups = [{"params": [p for _, p in self.params], "lr": float(spec.optimizer.lr)}]

    def _sync_copies(self) -> None:
        with torch.no_grad():
            for name, p in self._copy_back:
                p.copy_(self.client._values[name].view(p.shape))

    @property
    def version(self) -> int:
        """The job step whose parameters the model holds (with a pull pending: once ``wait()`` returns)."""
        return self.client.step or 0

    def step(self, weight: float | None = None) -> int:
        """Push gradients, commit (BSP), wait for the applied step and pull changed blocks.

        ``weight`` is this worker's weight in the mean over workers (default 1); pass the number of
        tokens of an imbalanced batch. Returns the new version.
        """
        self.wait()
        grads = {n: p.grad for n, p in self.params if p.requires_grad and p.grad is not None}
        self.client.lr = float(self.param_groups[0]["lr"])
        self.client.push(grads, weight=1.0 if weight is None else float(weight))
        if self.prefetch_window == 0:
            self._pull()
            return self.version
        # The pull of the new version runs while the caller prepares the next batch; whatever reads
        # the parameters next (a module's forward, zero_grad, step, wait) waits for it first.
        with self._pending_lock:
            self._pending = self._executor.submit(self._pull)
        if self._hook is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda _m, _a: self.wait())
        return self.version

    def _pull(self) -> None:
        self.client.pull_changed()
        self._sync_copies()

    @property
    def pending(self) -> bool:
        """True while the pull of the last step is still running (prefetch_window 1)."""
        with self._pending_lock:
            return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the parameters hold the last step's result (a no-op without prefetch)."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # re-raises the pull's error in the training thread

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        """Learning rate for the following steps (all workers of a BSP job must set the same)."""
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0):
            raise ShardlineConfigError(f"lr must be a number >= 0, got {lr!r}")
        self.param_groups[0]["lr"] = float(lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.wait()
        for _, p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            self._executor.shutdown(wait=True)
            self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
