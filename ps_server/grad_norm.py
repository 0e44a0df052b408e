"""Global gradient clipping across PS nodes (a BSP job's ``max_grad_norm``), equal to
``torch.nn.utils.clip_grad_norm_`` over the mean gradient.

Contract: each primary computes its share (sum of squares, float64) and sends it to the job's
other primaries (``ReportGradNorm``) at its routing epoch; every node combines the shares of every
primary at its own epoch in node-id order, so one step is taken with one coefficient everywhere.
Shares of other epochs are never combined (a routing change shares again); a node that already
stepped answers a later share with the coefficient it used. A primary that never reports holds
the step; after ``STALL_WARNING_SECONDS`` the share is sent again and the wait logged.

Design: docs/architecture.md, "BSP step" ("Parameter groups, learning rates, clipping").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from shardline.services.placement import place
from shardline.ps_server.store import JobStore
from shardline.services.pb import ps_pb2

log = logging.getLogger("shardline.ps.grad_norm")

# torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
CLIP_EPS = 1e-6
STALL_WARNING_SECONDS = 10.0


def clip_coefficient(max_norm: float, sum_squares: float) -> float:
    """``min(1, max_norm / (sqrt(sum_squares) + 1e-6))``, as clip_grad_norm_ scales gradients."""
    return min(1.0, max_norm / (math.sqrt(sum_squares) + CLIP_EPS))


def primaries_of(view, job: JobStore) -> set[str]:
    """Nodes that apply at least one block of ``job`` under ``view``."""
    return {owners[0] for owners in place(view, job.spec).owners.values() if owners}


class GradNormExchange:
    """Shares of clipped steps, sent to and received from the job's other primaries.

    ``send(address, share)`` delivers a GradNormShare to the node whose gRPC address is ``address``
    (raises on failure; the peer then learns nothing, and sends its own share regardless).
    """

    def __init__(self, node, send: Callable[[str, ps_pb2.GradNormShare], None]):
        self.node = node
        self._send = send
        self._lock = threading.Lock()
        self._shares: dict[tuple[str, int], dict[str, tuple[int, float]]] = {}
        self._since: dict[tuple[str, int], float] = {}
        self._decided: dict[tuple[str, int], float] = {}   # coefficients peers stepped with
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grad-norm")

    def attach(self, job: JobStore) -> None:
        if job.max_grad_norm:
            job.norm_hooks.append(self._on_own_share)

    def _on_own_share(self, job: JobStore, step: int, share: float) -> None:
        """Hook, called under the job's lock: record, send, and try to step (off the lock)."""
        view = self.node.routing
        me = self.node.node_id
        self._record(job.name, step, me, view.epoch, share)
        message = ps_pb2.GradNormShare(job=job.name, step=step, epoch=view.epoch, node=me, sum_squares=share)
        self._send_to(view, primaries_of(view, job) - {me}, message)
        self._pool.submit(self.try_apply, job.name, step)
        self._check_again(STALL_WARNING_SECONDS + 0.5, job.name, step)  # names the primaries missing by then

    def _send_to(self, view, peers, message) -> None:
        """Send ``message`` to each of ``peers`` (node ids of ``view``), off the caller's thread."""
        for peer in sorted(peers):
            info = view.nodes.get(peer)
            if info is not None:
                self._pool.submit(self._deliver, peer, info.grpc_address, message)

    def _check_again(self, delay: float, job_name: str, step: int) -> None:
        timer = threading.Timer(delay, self.try_apply, args=(job_name, step))
        timer.daemon = True
        timer.start()

    def _deliver(self, peer: str, address: str, message) -> None:
        try:
            self._send(address, message)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot be told will say so itself
            log.debug("could not send the gradient-norm share of %s step %d to %s: %s", message.job, message.step,
                      peer, exc)

    def receive(self, share: ps_pb2.GradNormShare) -> None:
        """A peer's share, or the coefficient it stepped with (ReportGradNorm)."""
        key = (share.job, int(share.step))
        if share.decided:
            with self._lock:
                self._decided[key] = float(share.coef)
            self.try_apply(*key)
            return
        self._record(share.job, int(share.step), share.node, int(share.epoch), float(share.sum_squares))
        job = self.node.store.get(share.job)
        coef = job.decided_coef(int(share.step)) if job is not None else None
        if coef is not None:  # stepped already: the late sender takes the same coefficient
            view = self.node.routing
            answer = ps_pb2.GradNormShare(job=share.job, step=share.step, node=self.node.node_id, decided=True,
                                          coef=coef, epoch=view.epoch)
            self._send_to(view, {share.node}, answer)
            return
        self.try_apply(*key)

    def _record(self, job: str, step: int, node: str, epoch: int, share: float) -> None:
        with self._lock:
            self._shares.setdefault((job, step), {})[node] = (epoch, share)
            self._since.setdefault((job, step), time.monotonic())

    def try_apply(self, job_name: str, step: int) -> None:
        """Step ``job_name`` at ``step`` if this node and every other primary shared at its epoch."""
        job = self.node.store.get(job_name)
        if job is None:
            return
        view = self.node.routing
        expected = primaries_of(view, job)
        with self._lock:
            coef = self._decided.get((job_name, step))
            shares = self._shares.get((job_name, step), {})
            got = {n: s for n, (epoch, s) in shares.items() if epoch == view.epoch}
        if coef is None:
            if self.node.node_id not in got or not expected <= got.keys():
                self._stalled(job, step, expected - got.keys())
                return
            coef = clip_coefficient(job.max_grad_norm, math.fsum(got[n] for n in sorted(expected)))
        job.apply_clipped(step, coef)  # a no-op until this node's own share is known
        if job.decided_coef(step) is None:
            return
        with self._lock:
            for table in (self._shares, self._since, self._decided):
                for key in [k for k in table if k[0] == job_name and k[1] <= step]:
                    table.pop(key, None)

    def _stalled(self, job: JobStore, step: int, missing: set) -> None:
        """Still waiting: past STALL_WARNING_SECONDS, send this node's share again to the primaries
        missing (a share may have been lost) and say whom the step waits for."""
        with self._lock:
            since = self._since.get((job.name, step))
            own = self._shares.get((job.name, step), {}).get(self.node.node_id)
        if since is None or not missing or time.monotonic() - since <= STALL_WARNING_SECONDS:
            return
        log.warning("job %s step %d waits %.0f s for the gradient-norm shares of %s", job.name, step,
                    time.monotonic() - since, ", ".join(sorted(missing)))
        view = self.node.routing
        if own is not None and own[0] == view.epoch:
            message = ps_pb2.GradNormShare(job=job.name, step=step, epoch=own[0], node=self.node.node_id,
                                           sum_squares=own[1])
            self._send_to(view, missing, message)
        self._check_again(STALL_WARNING_SECONDS, job.name, step)

    def on_routing_change(self) -> None:
        """Blocks may have changed primaries: every clipped step not applied yet is shared again."""
        for job in self.node.store.jobs():
            if job.max_grad_norm:
                job.reshare_norms()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
