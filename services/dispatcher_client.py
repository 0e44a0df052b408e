"""Client of the dispatcher's control plane, shared by PS nodes, workers and the CLI.

gRPC status codes become Shardline errors: NOT_FOUND -> ``None`` from getters, INVALID_ARGUMENT
-> ShardlineConfigError, FAILED_PRECONDITION -> ShardlineStateError, DEADLINE_EXCEEDED ->
ShardlineTimeoutError, UNAVAILABLE -> ShardlineConnectionError (NotLeaderError when the last
dispatcher asked was a follower).

Following the leader. ``address`` is one dispatcher's ``HOST:PORT`` or several, comma-separated
(dispatchers sharing an etcd state store, one of them elected leader). The client keeps a channel
per address and calls the last known leader. A follower answers UNAVAILABLE with trailing
metadata ``shardline-leader: HOST:PORT``: the client switches to that address (learning it if it
was not listed) and calls again. When the dispatcher called cannot be reached, or does not
answer within ``attempt_timeout`` (a paused process), the client moves on to the next address.
It pauses briefly between tries and gives up when the call's own timeout (``rpc_timeout`` unless
given) has passed, raising the last error. A single address and no follower reply: the call is
made once, as it always was.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shardline.services.config import parse_address_list
from shardline.services.daemon import grpc_channel
from shardline.services.errors import (
    NotLeaderError,
    ShardlineConfigError,
    ShardlineConnectionError,
    ShardlineError,
    ShardlineStateError,
    ShardlineTimeoutError,
)
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from shardline.services.security import tls_hint

log = logging.getLogger("shardline.client")

# Trailing metadata of a follower's UNAVAILABLE reply: the leader's address ('' while none is known).
LEADER_METADATA_KEY = "shardline-leader"
# How long one try may wait for an answer when other addresses could answer instead (a paused
# dispatcher accepts connections but never replies). Calls that wait on purpose (WaitJobReady,
# CheckpointJob) get their whole timeout.
DEFAULT_ATTEMPT_TIMEOUT = 2.0
RETRY_PAUSE_SECONDS = 0.05
MAX_RETRY_PAUSE_SECONDS = 0.5
# A try with less time left than this could not get an answer: the last error is raised instead.
MIN_ATTEMPT_SECONDS = 0.05
# wait_until_reachable: a WARNING says what is retried once it failed this long, then at doubling
# intervals up to the maximum.
REACHABLE_WARNING_SECONDS = 4.0
MAX_REACHABLE_WARNING_INTERVAL_SECONDS = 60.0
# A restarted dispatcher is dialled again within this (gRPC's default backoff grows to 120 s); each
# channel has subchannels of its own, so a channel made by reconnect() opens a new connection.
_CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000),
                    ("grpc.use_local_subchannel_pool", 1)]

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: ShardlineConfigError,
    grpc.StatusCode.FAILED_PRECONDITION: ShardlineStateError,
    grpc.StatusCode.ALREADY_EXISTS: ShardlineStateError,
    grpc.StatusCode.DEADLINE_EXCEEDED: ShardlineTimeoutError,
    grpc.StatusCode.UNAVAILABLE: ShardlineConnectionError,
    grpc.StatusCode.UNAUTHENTICATED: ShardlineConfigError,  # a token is missing or wrong
}


def _translate(exc: grpc.RpcError, what: str, tls: bool = False) -> ShardlineError:
    leader = leader_hint(exc)
    if leader is not None:
        return NotLeaderError(f"{what}: {exc.details()} ({exc.code().name})", leader)
    cls = _ERRORS.get(exc.code(), ShardlineError)
    return cls(f"{what}: {exc.details()} ({exc.code().name}){tls_hint(exc.details(), tls)}")


def unreachable_reason(exc: grpc.RpcError, address: str = "") -> str:
    """Why the dispatcher at ``address`` did not answer, in an operator's words, from gRPC's error."""
    code, details = exc.code(), (exc.details() or "")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer in time (overloaded, paused or not a Shardline dispatcher?)"
    if code == grpc.StatusCode.UNAVAILABLE:
        lowered = details.lower()
        if "connection refused" in lowered:
            return "connection refused (nothing listens there yet)"
        if "resolv" in lowered or "dns" in lowered or "domain name not found" in lowered:
            what = details.rsplit(": ", 1)[-1].rstrip("]").strip() if ": " in details else details
            host = address.rpartition(":")[0].strip("[]") or "the host name"
            return f"DNS cannot resolve {host!r} ({what})"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the cluster token is missing or wrong ({details})"
    return f"{details or code.name} ({code.name})"


def _reasons_text(reasons: dict[str, str]) -> str:
    if not reasons:
        return "no answer"
    if len(reasons) == 1:
        return next(iter(reasons.values()))
    return "; ".join(f"{address}: {why}" for address, why in reasons.items())


def leader_hint(exc: grpc.RpcError) -> str | None:
    """The leader a follower's reply names ('' if it knows none); None if ``exc`` is no follower's reply."""
    if exc.code() != grpc.StatusCode.UNAVAILABLE:
        return None
    try:
        metadata = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - errors raised before any reply carry no metadata
        return None
    for key, value in metadata:
        if key == LEADER_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


class DispatcherClient:
    """Calls to the dispatcher(s) at ``address`` (module docstring). Thread-safe.

    Raises ShardlineConfigError at construction if ``address`` is not ``HOST:PORT[,HOST:PORT...]``.
    ``address`` afterwards is the normalized list; ``leader`` the address calls go to first. Calls
    carry ``cluster_token``; with ``tls_ca`` (PEM) channels speak TLS and verify the dispatchers with it.
    """

    def __init__(self, address: str, *, rpc_timeout: float = 10.0, cluster_token: bytes | None = None,
                 attempt_timeout: float = DEFAULT_ATTEMPT_TIMEOUT, tls_ca: bytes | None = None):
        self.addresses = parse_address_list(address, what="cluster")
        self.address = ",".join(self.addresses)
        self.rpc_timeout = rpc_timeout
        self.attempt_timeout = attempt_timeout
        self._token = cluster_token
        self._tls_ca = tls_ca
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, dispatcher_pb2_grpc.DispatcherStub] = {}
        self._leader = self.addresses[0]
        self._closed = False
        self._reconnects = 0   # reconnect() calls: a call its channel's close cancelled is made again

    @property
    def leader(self) -> str:
        with self._lock:
            return self._leader

    def close(self) -> None:
        """Close every channel; later calls raise ShardlineConnectionError (no channel is opened again)."""
        with self._lock:
            self._closed = True
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            channel.close()

    def __enter__(self) -> "DispatcherClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reconnect(self) -> None:
        """Close every channel; the next call dials afresh. After calls that got no answer (a
        network that was cut): a new connection gets through as soon as the network is back, where
        the old one's retransmissions wait out TCP's growing backoff (seconds). Calls in flight on
        the old channels are cancelled."""
        with self._lock:
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
            self._reconnects += 1
        for channel in channels:
            channel.close()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise ShardlineConnectionError(f"the client of dispatcher {self.address} is closed")
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = grpc_channel(address, self._token, tls_ca=self._tls_ca,
                                                                 options=_CHANNEL_OPTIONS)
                self._stubs[address] = dispatcher_pb2_grpc.DispatcherStub(channel)
                if address not in self.addresses:  # a leader a follower named: follow it from now on
                    self.addresses.append(address)
            return channel

    def _stub(self, address: str) -> dispatcher_pb2_grpc.DispatcherStub:
        self._channel(address)
        with self._lock:
            return self._stubs[address]

    def _move_on(self, failed: str, named: str | None, unreachable: set[str]) -> None:
        """After a try at ``failed``: go to the ``named`` leader (learning its address), else to the
        next address, preferring ones that did not just fail to answer."""
        if named and named != failed and named not in unreachable:
            self._channel(named)
        with self._lock:
            if self._leader != failed:  # another thread already moved on
                return
            if named and named != failed and named not in unreachable:
                self._leader = named
                return
            at = self.addresses.index(failed)
            order = self.addresses[at + 1:] + self.addresses[:at + 1]
            fresh = [a for a in order if a not in unreachable and a != failed]
            self._leader = fresh[0] if fresh else order[0]

    def _call(self, name: str, request, *, timeout: float | None = None, not_found_none: bool = False,
              waits: bool = False):
        """``name`` on the leader, following redirects until ``timeout`` (default ``rpc_timeout``).

        ``waits``: the call itself may take its whole timeout, so a try is never cut short."""
        deadline = time.monotonic() + (timeout or self.rpc_timeout)
        pause = RETRY_PAUSE_SECONDS
        unreachable: set[str] = set()
        while True:
            address = self.leader
            remaining = max(0.0, deadline - time.monotonic())
            several = len(self.addresses) > 1
            attempt = remaining if waits or not several else min(remaining, self.attempt_timeout)
            reconnects = self._reconnects
            try:
                return getattr(self._stub(address), name)(request, timeout=attempt)
            except grpc.RpcError as exc:
                code = exc.code()
                if not_found_none and code == grpc.StatusCode.NOT_FOUND:
                    return None
                if code == grpc.StatusCode.CANCELLED and self._reconnects != reconnects and not self._closed \
                        and deadline - time.monotonic() > MIN_ATTEMPT_SECONDS:
                    continue   # another thread's reconnect() closed the channel under it: again, on the new one
                named = leader_hint(exc)
                cut_short = code == grpc.StatusCode.DEADLINE_EXCEEDED and attempt < remaining
                if named is None and not ((code == grpc.StatusCode.UNAVAILABLE or cut_short) and several):
                    raise _translate(exc, f"dispatcher {address} {name}", self._tls_ca is not None) from None
                if named is None:
                    unreachable.add(address)
                self._move_on(address, named, unreachable)
                if len(unreachable) >= len(self.addresses):
                    unreachable.clear()  # every one failed once: start over
                left = deadline - time.monotonic() - MIN_ATTEMPT_SECONDS
                if left <= 0:
                    raise _translate(exc, f"dispatcher {address} {name}", self._tls_ca is not None) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, MAX_RETRY_PAUSE_SECONDS)

    def wait_until_reachable(self, connect_timeout: float, *, stop: threading.Event | None = None,
                             warn_after: float = REACHABLE_WARNING_SECONDS, timeout_name: str = "connect_timeout") -> None:
        """Retry until a dispatcher answers as the leader (its health service says SERVING; daemons
        may start in any order); a leader a follower names is learned. Raises ShardlineTimeoutError
        naming the addresses and why they did not answer.

        Not silent: the first failed try logs at INFO that it waits (and for how long), and a WARNING
        after ``warn_after`` seconds (then again, less and less often) says what is retried and why
        it fails (connection refused, a host name DNS cannot resolve, no answer). A host name that
        does not resolve is retried like a refused connection: DNS names of daemons started together
        may appear only once their hosts are up. ``stop`` set: raise ShardlineConnectionError at once.
        ``timeout_name``: what the messages call ``connect_timeout`` (the caller's option name)."""
        started = time.monotonic()
        deadline = started + connect_timeout
        pause = RETRY_PAUSE_SECONDS
        warn_at, warn_every = started + warn_after, warn_after
        reasons: dict[str, str] = {}
        while True:
            with self._lock:
                first = self._leader
                order = [first] + [a for a in self.addresses if a != first]
            for address in order:
                remaining = deadline - time.monotonic()
                try:
                    reply = health_pb2_grpc.HealthStub(self._channel(address)).Check(
                        health_pb2.HealthCheckRequest(service=""), timeout=max(0.1, min(2.0, remaining)))
                except grpc.RpcError as exc:
                    reasons[address] = unreachable_reason(exc, address) + tls_hint(exc.details(), self._tls_ca is not None)
                    continue
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    with self._lock:
                        self._leader = address
                    if reasons:
                        log.info("dispatcher at %s answers (after %.1f s)", address, time.monotonic() - started)
                    return
                reasons[address] = "a follower (no leader elected yet)"
                self._learn_leader_from(address, remaining)
            now = time.monotonic()
            if now + pause >= deadline:
                raise ShardlineTimeoutError(f"{self._describe()} not reachable within {connect_timeout:g} s "
                                            f"({timeout_name}): {_reasons_text(reasons)}")
            if stop is not None and stop.is_set():
                raise ShardlineConnectionError(f"stopped while waiting for the {self._describe()}")
            if len(reasons) and pause == RETRY_PAUSE_SECONDS:
                log.info("waiting for the %s (%s); retrying for up to %g s (%s)", self._describe(),
                         _reasons_text(reasons), connect_timeout, timeout_name)
            # the pause ends early when the WARNING falls due within it: it comes on time
            delay = min(pause, max(0.0, warn_at - now)) if warn_at > now else pause
            if stop is not None:
                stop.wait(delay)
            else:
                time.sleep(delay)
            now = time.monotonic()
            if now >= warn_at:
                log.warning("%s still not reachable after %.0f s: %s; retrying until %s (%g s) runs out",
                            self._describe(), now - started, _reasons_text(reasons), timeout_name, connect_timeout)
                warn_every = min(warn_every * 2, MAX_REACHABLE_WARNING_INTERVAL_SECONDS)
                warn_at = now + warn_every
            pause = min(pause * 2, MAX_RETRY_PAUSE_SECONDS)

    def _describe(self) -> str:
        with self._lock:
            many = len(self.addresses) > 1
            return f"{'leader among the dispatchers' if many else 'dispatcher'} at {','.join(self.addresses)}"

    def _learn_leader_from(self, follower: str, remaining: float) -> None:
        """Ask a follower (health NOT_SERVING) who leads; a leader not listed yet is added and asked next."""
        try:
            self._stub(follower).GetRouting(dispatcher_pb2.GetRoutingRequest(), timeout=max(0.1, min(1.0, remaining)))
        except grpc.RpcError as exc:
            named = leader_hint(exc)
            if named and named not in self.addresses:
                self._channel(named)
                with self._lock:
                    self._leader = named

    def register_node(self, **fields) -> dispatcher_pb2.RegisterNodeResponse:
        return self._call("RegisterNode", dispatcher_pb2.RegisterNodeRequest(**fields))

    def heartbeat(self, *, timeout: float | None = None, **fields) -> dispatcher_pb2.HeartbeatResponse:
        return self._call("Heartbeat", dispatcher_pb2.HeartbeatRequest(**fields), timeout=timeout)

    def get_routing(self, *, known_epoch: int = 0, known_pending_epoch: int = 0,
                    timeout: float | None = None) -> common_pb2.RoutingTable:
        """The routing table; naming the epochs held (``known_epoch``...), a table that did not
        change comes back as ``unchanged`` with only its epochs."""
        return self._call("GetRouting", dispatcher_pb2.GetRoutingRequest(known_epoch=known_epoch,
                                                                          known_pending_epoch=known_pending_epoch),
                          timeout=timeout)

    def get_job(self, name: str) -> dispatcher_pb2.JobInfo | None:
        return self._call("GetJob", dispatcher_pb2.GetJobRequest(name=name), not_found_none=True)

    def create_job(self, spec: common_pb2.JobSpec) -> dispatcher_pb2.CreateJobResponse:
        return self._call("CreateJob", dispatcher_pb2.CreateJobRequest(spec=spec))

    def wait_job_ready(self, name: str, timeout: float, revision: int = 0) -> dispatcher_pb2.JobInfo:
        """Once the job is ready (``revision``: and that revision's new tensors are initialized)."""
        return self._call("WaitJobReady", dispatcher_pb2.WaitJobReadyRequest(name=name, timeout_seconds=timeout,
                                                                             revision=revision),
                          timeout=timeout + self.rpc_timeout, waits=True)

    def mark_job_ready(self, name: str, revision: int = 0) -> dispatcher_pb2.JobInfo:
        return self._call("MarkJobReady", dispatcher_pb2.MarkJobReadyRequest(name=name, revision=revision))

    def extend_job(self, name: str, uid: str, extension: common_pb2.JobExtension) -> dispatcher_pb2.ExtendJobResponse:
        """Make (or find made) revision ``extension.revision`` of the job (idempotent)."""
        return self._call("ExtendJob", dispatcher_pb2.ExtendJobRequest(name=name, uid=uid, extension=extension))

    def cluster_status(self) -> dispatcher_pb2.ClusterStatus:
        return self._call("GetClusterStatus", dispatcher_pb2.GetClusterStatusRequest())

    def hot_shards(self, limit: int = 0, job: str = "") -> dispatcher_pb2.HeatMap:
        """The dispatcher's access heatmap: the ``limit`` hottest blocks (0: its default) and node loads."""
        return self._call("GetHotShards", dispatcher_pb2.HeatRequest(limit=limit, job=job))

    def delete_job(self, name: str) -> dispatcher_pb2.DeleteJobResponse | None:
        """Delete a job; None if there is no such job."""
        return self._call("DeleteJob", dispatcher_pb2.DeleteJobRequest(name=name), not_found_none=True)

    def checkpoint_job(self, name: str, timeout: float) -> dispatcher_pb2.CheckpointJobResponse:
        """Returns once every node holding the job has one same step durable (the response's step)."""
        return self._call("CheckpointJob", dispatcher_pb2.CheckpointJobRequest(name=name, timeout_seconds=timeout),
                          timeout=timeout + self.rpc_timeout, waits=True)

    def restore_job(self, spec: common_pb2.JobSpec, uid: str, node_id: str) -> dispatcher_pb2.JobInfo:
        return self._call("RestoreJob", dispatcher_pb2.RestoreJobRequest(spec=spec, uid=uid, node_id=node_id))

    def worker_heartbeat(self, **fields) -> dispatcher_pb2.WorkerHeartbeatResponse:
        return self._call("WorkerHeartbeat", dispatcher_pb2.WorkerHeartbeatRequest(**fields))

    def register_cache(self, info: common_pb2.CacheInfo) -> dispatcher_pb2.CacheRegisterResponse:
        return self._call("RegisterCache", dispatcher_pb2.CacheRegisterRequest(cache=info))

    def cache_heartbeat(self, **fields) -> dispatcher_pb2.CacheHeartbeatResponse:
        return self._call("CacheHeartbeat", dispatcher_pb2.CacheHeartbeatRequest(**fields))

    def drain_node(self, node_id: str, *, leaving: bool = False) -> dispatcher_pb2.DrainNodeResponse:
        return self._call("DrainNode", dispatcher_pb2.DrainNodeRequest(node_id=node_id, leaving=leaving))
