"""Push during backward: gradients go to the cluster while backward still computes the rest.

As in DDP's reducer, trainable parameters are grouped into buckets in the reverse of their
registration order (backward produces the last layers' gradients first; after the first backward
the buckets follow the order the gradients actually became final). A post-accumulate-grad hook
marks a parameter's gradient final; once every parameter of a bucket has one, the bucket is pushed
(``commit=False``) from the communication thread while backward continues. When backward ends (a
callback queued on the autograd engine) the gradients not pushed yet go out with the commit, so
``step()`` only waits for it. Inside ``no_sync()`` backward only accumulates; the next backward
outside it pushes the accumulated gradients.

One *round* is what one step sends. Its weight and learning rates are fixed when its first bucket
goes out (every block carries them); ``finish()`` returns them so ``step()`` can check they are
still what it would have sent. The first error of a round (a failed push, a second backward outside
``no_sync()``) stops its later sends, the commit included, and is raised by ``finish()``.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardline.services.errors import ShardlineConfigError

DEFAULT_BUCKET_CAP_MB = 1.0


def plan_buckets(nbytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Consecutive runs of ``range(len(nbytes))`` of at most ``cap_bytes`` each (a tensor larger
    than the cap is a bucket of its own). The caller orders the indices; this only cuts."""
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(nbytes):
        if not buckets or (size + n > cap_bytes and buckets[-1]):
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += n
    return buckets


def bucket_cap_bytes(bucket_cap_mb) -> int:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ShardlineConfigError(f"bucket_cap_mb must be a number > 0 (MiB of gradients per push), got "
                                   f"{bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * 2**20))


@dataclass
class _Round:
    weight: float
    lrs: object
    ready: set[int] = field(default_factory=set)    # final gradient in this round's backward
    sent: set[int] = field(default_factory=set)     # handed to send
    futures: list[Future] = field(default_factory=list)
    committed: bool = False
    error: BaseException | None = None


class BackwardPusher:
    """Hooks on ``params`` (``[(name, parameter)]``) that push their gradients during backward.

    ``send(grads, weight, lrs, commit)`` pushes ``{name: grad}`` (and commits if ``commit``); it
    runs on the communication thread through ``submit`` (an executor's submit with one worker, so
    sends keep their order and never overlap another use of the client). ``round_info()`` is
    called in the training thread when a step's first bucket goes out and returns ``(weight,
    lrs)`` for it (and may raise ShardlineConfigError, which the round then raises at ``finish``).
    """

    def __init__(self, params, *, send: Callable, submit: Callable, round_info: Callable, cap_bytes: int):
        self._send, self._submit, self._round_info, self._cap = send, submit, round_info, cap_bytes
        self._lock = threading.Lock()   # the round is touched by hooks and by the training thread
        self._round: _Round | None = None
        self._no_sync = 0
        self._callback_queued = False
        self._handles: list = []
        self.reset(params)

    # --- set-up -----------------------------------------------------------------------------
    def reset(self, params) -> None:
        """(Re)register the hooks on the trainable ones of ``params`` (after add_param_group)."""
        self.remove()
        self.params = [(n, p) for n, p in params if p.requires_grad]
        self._seen: list[int] | None = []  # the order gradients became final in the first backward
        self._set_buckets(list(reversed(range(len(self.params)))))
        for i, (_, p) in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i)))

    def _set_buckets(self, order: list[int]) -> None:
        cuts = plan_buckets([self.params[i][1].numel() * self.params[i][1].element_size() for i in order], self._cap)
        self.buckets = [[order[j] for j in cut] for cut in cuts]
        self._bucket_of = {i: b for b, members in enumerate(self.buckets) for i in members}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside only accumulates gradients; the next backward outside pushes them."""
        self._no_sync += 1
        try:
            yield
        finally:
            self._no_sync -= 1

    # --- during backward (training thread, or the autograd engine's) ---------------------------
    def _on_grad(self, i: int) -> None:
        if self._no_sync:
            return
        with self._lock:
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            rnd = self._round
            if rnd is None:
                try:
                    rnd = self._round = _Round(*self._round_info())
                except BaseException as exc:  # noqa: BLE001 - raised at step(), not inside backward
                    rnd = self._round = _Round(1.0, None, error=exc)
            if rnd.error is not None:
                return
            if rnd.committed or i in rnd.ready:
                sent = "went out and were committed" if rnd.committed else "went out"
                rnd.error = ShardlineConfigError(
                    f"parameter {self.params[i][0]!r} got a gradient from a second backward after its gradient "
                    f"was pushed for this step (the first backward's gradients {sent}): run every backward but "
                    f"the last of a step inside `with opt.no_sync():` (or pass overlap=False)")
                return
            if self._seen is not None:
                self._seen.append(i)
            bucket = self.buckets[self._bucket_of[i]]
            rnd.ready.add(i)
            if all(j in rnd.ready for j in bucket):
                self._push(rnd, bucket, commit=False)

    def _on_backward_end(self) -> None:
        with self._lock:
            self._callback_queued = False
            rnd = self._round
            if rnd is None or rnd.error is not None or rnd.committed:
                return
            # gradients whose hook did not fire in this backward (accumulated under no_sync, or a
            # bucket a parameter without gradient kept open) go out with the commit
            rest = [i for i, (_, p) in enumerate(self.params) if i not in rnd.sent and p.grad is not None]
            rnd.committed = True
            self._push(rnd, rest, commit=True)
            if self._seen is not None:  # later buckets follow the order backward produced the gradients
                order = self._seen + [i for i in reversed(range(len(self.params))) if i not in set(self._seen)]
                self._seen = None
                self._set_buckets(order)

    def _push(self, rnd: _Round, members: list[int], *, commit: bool) -> None:
        rnd.sent.update(members)
        grads = {self.params[i][0]: self.params[i][1].grad for i in members}
        rnd.futures.append(self._submit(self._send_or_skip, rnd, grads, commit))

    def _send_or_skip(self, rnd: _Round, grads: dict, commit: bool) -> None:
        if rnd.error is not None:  # an earlier send of the round failed: send nothing more, no commit
            raise rnd.error
        try:
            self._send(grads, rnd.weight, rnd.lrs, commit)
        except BaseException as exc:
            rnd.error = exc
            raise

    # --- step() (training thread) -----------------------------------------------------------
    @property
    def active(self) -> bool:
        """True once a backward of this step pushed something (step() then only waits)."""
        return self._round is not None

    def finish(self) -> tuple[float, object] | None:
        """Wait for this step's sends (the commit included) and end the round. Returns its
        ``(weight, lrs)``, or None if no backward pushed anything this step. Raises the round's
        first error (after every send of it finished, so nothing of it is still running)."""
        with self._lock:
            rnd, self._round = self._round, None
            self._callback_queued = False  # a backward that raised never ran its callback
        if rnd is None:
            return None
        for fut in rnd.futures:
            try:
                fut.result()
            except BaseException:  # noqa: BLE001 - the first one is rnd.error, raised below
                pass
        if rnd.error is not None:
            raise rnd.error
        if not rnd.committed:
            raise ShardlineConfigError("the backward that pushed this step's first gradients did not finish (did it "
                                       "raise?): the step was not committed")
        return rnd.weight, rnd.lrs
