"""WeightSubscriber: the newest weights of a job for inference processes that never push
(rollout engines of RL post-training).

    sub = shardline.WeightSubscriber("10.0.0.5:7000", "grpo-1")        # dtype=torch.bfloat16
    version, changed = sub.poll()          # first poll: every tensor
    engine.load_weights(changed)           # vLLM load_weights / SGLang update_weights_from_tensor
    version, changed = sub.wait_for(version + 4, timeout=120)

Contract: a returned version v is one step of the job (every tensor its value after step v on
every PS node); every block is checked against its node's checksum before it is installed.
Double-buffered: tensors a poll returned stay valid and unchanged until the poll after next
starts; memory is twice the job in ``dtype``. Tensors added to the job are followed. ``poll`` and
``wait_for`` raise ShardlineTimeoutError after ``timeout`` (default ``pull_timeout``, seconds).
Not thread-safe: one reader loop drives it.

Design: docs/architecture.md, "Weight subscribers".
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from shardline.services import delta, frame
from shardline.services.dataplane_client import DataPlaneConnection
from shardline.services.errors import (ShardlineChecksumError, ShardlineConfigError, ShardlineConnectionError,
                                       ShardlineError, ShardlineTimeoutError)
from shardline.services.pb import dataplane_pb2 as dp
from shardline.worker.client import CACHE_DTYPES, Client

log = logging.getLogger("shardline.subscriber")

# A block failing its checksum this many pulls in a row is not retried further (the node, or the
# path to it, corrupts it every time).
MAX_CHECKSUM_FAILURES = 3
# A poll out of time asks the nodes their step for this long, to name those behind in its error.
PROBE_TIMEOUT_SECONDS = 1.0
# How often a poll asks the dispatcher for a newer job revision when no reply named one (replies
# through a rack cache name none).
SPEC_CHECK_SECONDS = 2.0


@dataclass
class SubscriberStats:
    polls: int = 0
    pulled_bytes: int = 0          # payload bytes received, all polls
    last_poll_bytes: int = 0       # payload bytes of the last poll
    dense_blocks: int = 0
    delta_blocks: int = 0
    checksum_failures: int = 0     # blocks that failed their checksum (pulled again, never installed)


class _SubscriberClient(Client):
    """A Client whose pulls ask for checksums and element-level deltas, received here."""

    subscriber_pulls = True
    seen_revision = 0   # the newest job revision a node's reply named (set per instance once one does)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sub_stats = SubscriberStats()
        self.failed: dict[tuple[str, int], int] = {}   # block -> checksum failures in a row
        # (step, the step it waited for) of each pull reply since cleared: a pull retried in part
        # (a node lost, NOT_OWNER) has replies of one node from different steps
        self.replies: list[tuple[int, int]] = []
        self._spec_checked = time.monotonic()

    def follow_revision(self) -> bool:
        """Take the job's spec again when a reply named a newer revision, or SPEC_CHECK_SECONDS
        passed: True if it added tensors."""
        if self.seen_revision <= self.revision and time.monotonic() - self._spec_checked < SPEC_CHECK_SECONDS:
            return False
        self._spec_checked = time.monotonic()
        try:
            info = self.dispatcher.get_job(self.job)
        except ShardlineError as exc:  # the weights it holds stay usable; asked again next time
            log.debug("job %s: no newer spec from the dispatcher: %s", self.job, exc)
            return False
        if info is None or len(info.spec.extensions) <= self.revision:
            return False
        known = set(self._shapes)
        self._load_spec(info.spec, info.uid)
        return set(self._shapes) != known

    def _pull_cache(self, keys: list):
        # A block that failed its checksum is pulled again from its node: the rack cache would send
        # the same entry if its copy is what went bad.
        if any(key in self.failed for key in keys):
            return None
        return super()._pull_cache(keys)

    def _receive_blocks(self, conn: DataPlaneConnection, node_id: str, reply, expected: dict,
                        placed: set = frozenset()) -> None:
        """Receive a subscriber pull reply into the cache (the back buffer): a dense block straight
        into place, a delta through a scratch buffer; each is checked against its checksum. A block
        that fails is forgotten (its next pull is dense); the block in the back buffer is then
        garbage, but it is never the one the reader uses. (A subscriber's pull asks for no block
        to be placed in shared memory: ``placed`` is empty, and a reply flagging one is refused.)"""
        self.replies.append((reply.step, reply.min_step))
        self.seen_revision = max(self.seen_revision, reply.revision)
        try:
            self._receive_checked(conn, node_id, reply, expected)
        except BaseException:  # the rest of the reply is unread: the connection is off its frame boundary
            conn.close()
            self._conns.pop(node_id, None)
            raise

    def _receive_checked(self, conn: DataPlaneConnection, node_id: str, reply, expected: dict) -> None:
        for ref in reply.blocks:
            key = (ref.tensor, ref.index)
            s = expected.pop(key, None)
            dest = None if s is None else self._values[ref.tensor][s.start:s.stop]
            is_delta = ref.dtype == dp.BF16_DELTA
            if dest is None or ref.numel != s.numel or ref.zero or ref.placed or not (
                    ref.dtype == frame.WIRE_DTYPE[dest.dtype] or (
                        is_delta and dest.dtype == torch.bfloat16 and key in self._versions
                        and ref.base_version == self._versions[key])):
                raise ShardlineConnectionError(f"node {node_id!r} sent an unexpected block {ref.tensor}[{ref.index}]")
            # not held until checked: a block cut off mid-receive is pulled (or copied) whole again
            self._versions.pop(key, None)
            if is_delta:
                payload = bytearray(ref.nbytes)
                frame.recv_exactly_into(conn.sock, memoryview(payload))
                try:
                    delta.apply_delta(dest, int(ref.delta_elements), payload)
                    good = delta.checksum(dest) == ref.checksum
                except delta.DeltaError as exc:
                    log.warning("node %r sent a bad delta of %s[%d]: %s", node_id, ref.tensor, ref.index, exc)
                    good = False
                self.sub_stats.delta_blocks += 1
            else:
                frame.recv_exactly_into(conn.sock, frame.tensor_bytes(dest))
                good = delta.checksum(dest) == ref.checksum
                self.sub_stats.dense_blocks += 1
            self.stats.pulled_bytes += ref.nbytes
            self.sub_stats.last_poll_bytes += ref.nbytes
            self.stats.pulled_blocks += 1
            if good:
                self._versions[key] = ref.version
                self.failed.pop(key, None)
                continue
            self.sub_stats.checksum_failures += 1   # not held: pulled again, dense
            self.failed[key] = self.failed.get(key, 0) + 1
            log.warning("block %s[%d] from node %r failed its checksum (version %d, %s); pulling it again",
                        ref.tensor, ref.index, node_id, ref.version, "delta" if is_delta else "dense")
            if self.failed[key] >= MAX_CHECKSUM_FAILURES:
                raise ShardlineChecksumError(f"block {ref.tensor}[{ref.index}] of job {self.job!r} from node "
                                               f"{node_id!r} failed its checksum {self.failed[key]} times in a row")


def _check_timeout(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ShardlineConfigError(f"{what} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class WeightSubscriber:
    """The newest weights of ``job`` on the cluster at ``cluster``, as deltas (module doc).

    ``dtype``: torch.bfloat16 (default; element-level deltas) or torch.float32. ``rack``: the
    reader's rack (default ``$SHARDLINE_RACK``), whose cache serves its reads where the client
    supports rack caches. ``pull_timeout``: the default timeout of poll and wait_for;
    ``connect_timeout``: reaching the dispatcher and waiting for the job to be ready.
    """

    def __init__(self, cluster: str, job: str, *, dtype: torch.dtype = torch.bfloat16, rack: str | None = None,
                 pull_timeout: float = 60.0, connect_timeout: float = 60.0, transport: str = "auto",
                 cluster_token: bytes | None = None, tls_ca: bytes | None = None):
        if dtype not in CACHE_DTYPES:
            raise ShardlineConfigError(f"WeightSubscriber dtype must be torch.bfloat16 or torch.float32, got {dtype!r}")
        self.pull_timeout = _check_timeout(pull_timeout, "pull_timeout")
        self.dtype = dtype
        self.job = job
        self.rack = rack if rack is not None else (os.environ.get("SHARDLINE_RACK") or None)
        kwargs = dict(transport=transport, connect_timeout=_check_timeout(connect_timeout, "connect_timeout"),
                      cluster_token=cluster_token, tls_ca=tls_ca, straggler_warning_seconds=0)
        if "rack" in inspect.signature(Client.__init__).parameters:  # clients that know rack caches
            kwargs["rack"] = self.rack
        self._client = _SubscriberClient(cluster, job, **kwargs)
        try:
            self._client.wait_ready(connect_timeout)
        except BaseException:
            self._client.close()
            raise
        self.version: int | None = None   # the version the last poll returned
        self._buffers: list[dict[str, torch.Tensor]] = [{}, {}]
        self._held: list[dict[tuple[str, int], int]] = [{}, {}]   # block versions each buffer holds
        self._front = 1   # the buffer the reader uses; the first poll fills 0
        self._last_steps: dict[str, int] = {}   # node -> its job step at the last pull reply

    @property
    def stats(self) -> SubscriberStats:
        return self._client.sub_stats

    # --- the reader API ---------------------------------------------------------------------
    def poll(self, timeout: float | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """``(version, [(name, tensor), ...])``: the job's newest version and the tensors that
        changed since the version this subscriber holds (every tensor on the first poll), full
        tensors of ``dtype`` shaped as the job's. Valid until the poll after next (module doc)."""
        return self._update(None, timeout)

    def wait_for(self, version: int, timeout: float | None = None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """As poll, once the job reached ``version`` (the version returned may be newer)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ShardlineConfigError(f"wait_for version must be an integer >= 0, got {version!r}")
        return self._update(version, timeout)

    def current(self) -> dict[str, torch.Tensor]:
        """Every tensor at ``version`` (views of the reader's buffer, valid as poll's): for a reader
        that uses the tensors in place rather than loading the changed ones into its own."""
        if self.version is None:
            raise ShardlineConfigError(f"WeightSubscriber of job {self.job!r} holds nothing yet: poll() first")
        return dict(self._buffers[self._front])

    def close(self) -> None:
        self._client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- one poll ---------------------------------------------------------------------------
    def _update(self, version: int | None, timeout: float | None) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        total = self.pull_timeout if timeout is None else _check_timeout(timeout, "timeout")
        deadline = time.monotonic() + total
        client = self._client
        client.follow_revision()
        names = list(client._shapes)
        front, back = self._front, 1 - self._front
        self._prepare_back(names, front, back)
        client.sub_stats.last_poll_bytes = 0
        target = version
        try:
            while True:
                client.replies.clear()
                step = self._pull_once(names, target, deadline, total)
                newest = max(client._versions.values(), default=0)
                # Done when every reply came from one step and waited for it (so every block is
                # visible at it) and no block is newer; else pull what changed again, at the newest
                # step seen (a pull that straddled a step boundary or was retried in part after a
                # node failed, or a block that failed its checksum).
                if client.follow_revision():  # tensors added meanwhile: pulled too, with the version that has them
                    names = list(client._shapes)
                    self._prepare_back(names, front, back, keep=True)
                elif step is not None and newest <= step and not client.failed and all(
                        r == (step, step) for r in client.replies):
                    break
                target = max(target or 0, newest, *self._last_steps.values(), *(r[0] for r in client.replies))
        except ShardlineTimeoutError as exc:
            raise self._timeout(target, total, exc) from None
        finally:  # what the back buffer holds now, also after a failed poll (a block cut off mid-receive is not held)
            self._held[back] = dict(client._versions)
        changed = [n for n in names if any(self._held[back].get((n, s.index)) != self._held[front].get((n, s.index))
                                           for s in client._slices[n])]
        if changed:  # nothing changed: the reader's buffer stays the current one
            self._front = back
        self.version = step
        client.sub_stats.polls += 1
        client.sub_stats.pulled_bytes += client.sub_stats.last_poll_bytes
        return step, [(n, self._buffers[back][n]) for n in changed]

    def _prepare_back(self, names: list[str], front: int, back: int, keep: bool = False) -> None:
        """Make the back buffer hold what the front holds (only the blocks the last poll changed
        are copied) and point the client's cache at it, naming the front's versions: the pull
        then moves only what changed since the reader's version, into the back buffer. ``keep``:
        mid-poll, only buffers for tensors added to the job (what was pulled stays)."""
        client = self._client
        for n in names:
            for i in (front, back):
                if n not in self._buffers[i]:
                    self._buffers[i][n] = torch.zeros(client._shapes[n], dtype=self.dtype)
        if keep:
            client._values = {n: self._buffers[back][n].view(-1) for n in names}
            return
        held_front, held_back = self._held[front], self._held[back]
        for n in names:
            f, b = self._buffers[front][n].view(-1), self._buffers[back][n].view(-1)
            for s in client._slices[n]:
                v = held_front.get((n, s.index))
                if v is not None and held_back.get((n, s.index)) != v:
                    b[s.start:s.stop].copy_(f[s.start:s.stop])
        client._values = {n: self._buffers[back][n].view(-1) for n in names}
        client._versions = dict(held_front)
        client.failed.clear()

    def _pull_once(self, names: list[str], target: int | None, deadline: float, total: float) -> int | None:
        """One pull of every block newer than held, at a step >= ``target`` (None: the newest
        step any node is at). Returns the common step of the nodes, None if they differ."""
        client = self._client
        left = deadline - time.monotonic()
        if left <= 0:
            raise ShardlineTimeoutError(f"{total:g} s passed")
        client.recovery_timeout = client.pull_timeout = left  # a lost node is waited for within the poll's time
        try:
            # (the pull itself reports the nodes' steps: a pull naming no blocks is refused while a
            # node is still taking blocks over)
            steps = client._pull(names, min_step=target or 0, timeout=left)
        except ShardlineConnectionError as exc:
            if time.monotonic() < deadline and "did not come back" not in str(exc):
                raise
            raise ShardlineTimeoutError(str(exc)) from exc
        self._last_steps = steps
        values = set(steps.values())
        return values.pop() if len(values) == 1 else None

    def _timeout(self, target: int | None, total: float, cause: Exception) -> ShardlineTimeoutError:
        """The error of a poll out of time: the job, the version waited for, the nodes behind it."""
        client = self._client
        try:  # the nodes' steps now (this also pulls what changed meanwhile, into the back buffer)
            client.recovery_timeout = client.pull_timeout = PROBE_TIMEOUT_SECONDS
            self._last_steps = client._pull(list(client._shapes), min_step=0, timeout=PROBE_TIMEOUT_SECONDS)
        except ShardlineError as exc:
            log.debug("no node steps for the timeout's message: %s", exc)
        late = {node: step for node, step in sorted(self._last_steps.items()) if target is not None and step < target}
        behind = "; nodes behind it: " + ", ".join(f"{node} (at {step})" for node, step in late.items()) if late else ""
        wanted = "the job's newest version" if target is None else f"version {target}"
        return ShardlineTimeoutError(f"WeightSubscriber of job {self.job!r}: {wanted} was not pulled within "
                                     f"{total:g} s{behind} ({cause})")
