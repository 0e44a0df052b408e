"""Push during backward: gradients go to the cluster while backward still computes the rest, in
buckets as DDP's reducer sends them (flat groups: :class:`FlatBackwardPusher`, one bucket per block
of the group's flat tensor).

Contract: one *round* is what one step sends; its weight and learning rates are fixed when its
first bucket goes out, and ``finish()`` returns them so ``step()`` can check them. The first
error of a round (a failed push, a second backward outside ``no_sync()``) stops its later sends,
the commit included, and ``finish()`` raises it. Inside ``no_sync()`` backward only accumulates.
Flat groups leave the commit to ``step()``: their parameters are views of the pulled tensor and
must not change before it.

Design: docs/architecture.md, "Overlap, priority pull and flat parameters",
"Overlap and priority pull".
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from shardline.services.errors import ShardlineConfigError
from shardline.worker.flat_params import FlatGroup

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
    sent: set[int] = field(default_factory=set)     # handed to send (parameters; FlatBackwardPusher: blocks)
    futures: list[Future] = field(default_factory=list)
    ended: bool = False      # its backward ended: everything went out (the commit too, if the pusher commits)
    error: BaseException | None = None
    buffers: dict = field(default_factory=dict)     # FlatBackwardPusher: each flat group's gradient buffer


class BackwardPusher:
    """Hooks on ``params`` (``[(name, parameter)]``) that push their gradients during backward.

    ``send(grads, weight, lrs, commit)`` pushes ``{name: grad}`` (and commits if ``commit``); it
    runs on the communication thread through ``submit`` (an executor's submit with one worker, so
    sends keep their order and never overlap another use of the client). ``round_info()`` is
    called in the training thread when a step's first bucket goes out and returns ``(weight,
    lrs)`` for it (and may raise ShardlineConfigError, which the round then raises at ``finish``).
    """

    commits = True     # the send at the end of backward commits the step
    reorders = True    # buckets follow the order the first backward produced the gradients

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
        self._seen: list[int] | None = [] if self.reorders else None  # the order gradients became final in the first backward
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
            if rnd.ended or i in rnd.ready:
                sent = "went out and were committed" if rnd.ended and self.commits else "went out"
                rnd.error = ShardlineConfigError(
                    f"parameter {self.params[i][0]!r} got a gradient from a second backward after its gradient "
                    f"was pushed for this step (the first backward's gradients {sent}): run every backward but "
                    f"the last of a step inside `with opt.no_sync():` (or pass overlap=False)")
                return
            if self._seen is not None:
                self._seen.append(i)
            rnd.ready.add(i)
            for units in self._completed(rnd, i):
                self._push(rnd, units, commit=False)

    def _completed(self, rnd: _Round, i: int) -> list[list[int]]:
        """What parameter ``i``'s final gradient completes: its bucket, once all of it is final."""
        bucket = self.buckets[self._bucket_of[i]]
        return [bucket] if all(j in rnd.ready for j in bucket) else []

    def _on_backward_end(self) -> None:
        with self._lock:
            self._callback_queued = False
            rnd = self._round
            if rnd is None or rnd.error is not None or rnd.ended:
                return
            rest = self._rest(rnd)
            rnd.ended = True
            if rnd.error is None and (rest or self.commits):
                self._push(rnd, rest, commit=self.commits)
            if self._seen is not None:  # later buckets follow the order backward produced the gradients
                order = self._seen + [i for i in reversed(range(len(self.params))) if i not in set(self._seen)]
                self._seen = None
                self._set_buckets(order)

    def _rest(self, rnd: _Round) -> list[int]:
        """What is left to send when backward ends: gradients whose hook did not fire in this
        backward (accumulated under no_sync, or a bucket a parameter without gradient kept open)."""
        return [i for i, (_, p) in enumerate(self.params) if i not in rnd.sent and p.grad is not None]

    def _push(self, rnd: _Round, units: list[int], *, commit: bool) -> None:
        rnd.sent.update(units)
        rnd.futures.append(self._submit(self._send_or_skip, rnd, self._payload(rnd, units), commit))

    def _payload(self, rnd: _Round, units: list[int]) -> dict:
        """What ``send`` gets for ``units``: ``{name: gradient}``."""
        return {self.params[i][0]: self.params[i][1].grad for i in units}

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
        if not rnd.ended:
            raise ShardlineConfigError("the backward that pushed this step's first gradients did not finish (did it "
                                       "raise?): the step was not committed")
        return rnd.weight, rnd.lrs


class FlatBackwardPusher(BackwardPusher):
    """Push during backward for flat groups (module doc). ``buffer(group)`` gives the gradient
    buffer a round gathers ``group`` into (called when its first block is gathered); ``slices``
    are the blocks of each group's flat tensor (``{name: [BlockSlice]}``); ``send`` gets
    ``{name: (buffer, [block index])}``. Every member of a group needs a gradient once any has one
    (a flat step steps all of them); backward ending without one is the round's error."""

    commits = False
    reorders = False   # a block's members are fixed by the layout

    def __init__(self, groups: list[FlatGroup], slices: dict, *, buffer: Callable, send: Callable, submit: Callable,
                 round_info: Callable):
        self._groups, self._slices, self._buffer = groups, slices, buffer
        params = [member for f in groups for member in f.members]
        self._members: list[range] = []   # group -> its parameters' indices in params
        for f in groups:
            first = self._members[-1].stop if self._members else 0
            self._members.append(range(first, first + len(f.members)))
        super().__init__(params, send=send, submit=submit, round_info=round_info, cap_bytes=1)

    def _set_buckets(self, order: list[int]) -> None:
        """One bucket per block of a flat tensor: the parameters overlapping it, each with the
        part of its flattened gradient that falls in the block (they tile the block in order)."""
        self.buckets, self._block_of, self._units_of, self._pieces = [], [], [[] for _ in self.params], []
        for g, f in enumerate(self._groups):
            spans = [(i, offset, offset + p.numel()) for i, offset, (_, p) in zip(self._members[g], f.offsets, f.members)]
            for block in self._slices[f.name]:
                members = [(i, start, end) for i, start, end in spans if start < block.stop and end > block.start]
                for i, _, _ in members:
                    self._units_of[i].append(len(self.buckets))
                self.buckets.append([i for i, _, _ in members])
                self._block_of.append((g, block.index, block.start, block.stop))
                self._pieces.append([(i, max(start, block.start) - start, min(end, block.stop) - start)
                                     for i, start, end in members])

    def _gather(self, rnd: _Round, u: int) -> None:
        """Gather block ``u``'s gradients into its range of its group's buffer for the round."""
        g, _index, start, stop = self._block_of[u]
        buf = rnd.buffers.get(g)
        if buf is None:
            buf = rnd.buffers[g] = self._buffer(self._groups[g])
        parts = [self.params[i][1].grad.detach().reshape(-1)[a:b] for i, a, b in self._pieces[u]]
        torch.cat(parts, out=buf[start:stop])

    def _completed(self, rnd: _Round, i: int) -> list[list[int]]:
        done = [u for u in self._units_of[i] if u not in rnd.sent and all(j in rnd.ready for j in self.buckets[u])]
        return [done] if done else []

    def _rest(self, rnd: _Round) -> list[int]:
        """Blocks not sent yet (with gradients no hook of this backward took: accumulated under
        no_sync); a group some of whose members have a gradient and others none is the round's
        error (ShardlineConfigError)."""
        rest = []
        for g, f in enumerate(self._groups):
            have = [i for i in self._members[g] if i in rnd.ready or self.params[i][1].grad is not None]
            if not have:
                continue
            if len(have) < len(self._members[g]):
                rnd.error = f.missing_grads_error([self.params[i][0] for i in self._members[g] if i not in have])
                return []
            rnd.ready.update(have)
            rest.extend(u for u, (group, *_) in enumerate(self._block_of) if group == g and u not in rnd.sent)
        return rest

    def _payload(self, rnd: _Round, units: list[int]) -> dict:
        payload: dict = {}
        for u in units:
            self._gather(rnd, u)   # here, in the training thread: the gradients are final and unchanged yet
            g, index, _start, _stop = self._block_of[u]
            payload.setdefault(self._groups[g].name, (rnd.buffers[g], []))[1].append(index)
        return payload
