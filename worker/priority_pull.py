"""Priority pull: the new version of the parameters arrives in the order the forward uses them.

With ``prefetch_window=1`` the pull after a step runs on the communication thread. Instead of
one pull of everything that the next forward waits for, it pulls consecutive chunks of the
parameters in forward order, and a parameter's ready event is set once its chunk landed; a
module's forward pre-hook waits only for the module's own parameters (``recurse=False``), so the
next forward starts as soon as its first layer arrived and the rest streams in meanwhile.

The forward order is learnt from the first forward (the order modules' pre-hooks reach the
parameters); until then, and for parameters no forward reached, it is the registration order.
A parameter read outside its own module's forward (a parent reading a child's weight, code
between steps) is not waited for here: such code calls ``wait()``.
"""

from __future__ import annotations

import threading
from typing import Callable

from shardline.worker.overlap import plan_buckets


class PriorityPull:
    """Ready events and forward order of ``params`` (``[(name, parameter)]``, the optimizer's order)."""

    def __init__(self, params, cap_bytes: int):
        self.params = list(params)
        self._cap = cap_bytes
        self._index = {id(p): i for i, (_, p) in enumerate(self.params)}
        self._ready = [threading.Event() for _ in self.params]
        for event in self._ready:
            event.set()
        self._seen: list[int] | None = []   # forward order being learnt (None: learnt)
        self._seen_set: set[int] = set()
        self.order: list[int] = list(range(len(self.params)))
        self.failed = False

    def before_forward(self, module) -> bool:
        """A module's forward is about to run: wait until its own parameters are pulled (and learn
        the order). Returns False if the pull failed (the caller raises its error)."""
        for p in module._parameters.values():
            i = self._index.get(id(p)) if p is not None else None
            if i is None:
                continue
            if self._seen is not None and i not in self._seen_set:
                self._seen_set.add(i)
                self._seen.append(i)
            self._ready[i].wait()
        return not self.failed

    def begin(self) -> list[list[int]]:
        """A pull is about to start (training thread, before it is submitted): mark every
        parameter not ready and return the chunks to pull, in forward order."""
        if self._seen:  # the first forward ran: its order from now on
            self.order = self._seen + [i for i in range(len(self.params)) if i not in self._seen_set]
            self._seen = None
        self.failed = False
        for event in self._ready:
            event.clear()
        nbytes = [self.params[i][1].numel() * self.params[i][1].element_size() for i in self.order]
        return [[self.order[j] for j in chunk] for chunk in plan_buckets(nbytes, self._cap)]

    def run(self, chunks: list[list[int]], pull: Callable[[list[int]], None]) -> None:
        """On the communication thread: ``pull(indices)`` each chunk in turn, setting its
        parameters ready. On an error every waiter is released (``failed``) and it is re-raised."""
        try:
            for chunk in chunks:
                pull(chunk)
                for i in chunk:
                    self._ready[i].set()
        except BaseException:
            self.failed = True
            raise
        finally:
            for event in self._ready:
                event.set()
