"""``shardline-ps``: a PS node daemon.

Starts the data plane (frames get UNAVAILABLE until the node is ready), restores every job of its
``checkpoint_dir`` (ps_server/restore.py), starts gRPC, registers with the dispatcher
(``--cluster``), heartbeats, keeps its routing table at the dispatcher's epoch, writes the ready
file, and serves until SIGTERM; then it freezes its jobs, writes a final checkpoint of what changed
and reports it before exiting.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Callable

from shardline.ps_server import metrics as M
from shardline.ps_server.checkpoint import CheckpointDir, CheckpointError
from shardline.ps_server.checkpointer import Checkpointer
from shardline.ps_server.commit_relay import CommitRelay
from shardline.ps_server.delta_history import DeltaHistory
from shardline.ps_server.grad_norm import GradNormExchange
from shardline.ps_server.heat import heat_report, rack_reads_report
from shardline.ps_server.node import HANDOVER_TIMEOUT_SECONDS, PSNode
from shardline.ps_server.replication import PeerLinks, Replicator
from shardline.ps_server.restore import restore_all
from shardline.ps_server.server import create_server
from shardline.services import build_fingerprint, failpoints, frame, sdnotify
from shardline.services.allocator import bound_freed_memory
from shardline.services.config import log_configuration, parse_daemon_args
from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
from shardline.services.daemon import (add_common_args, format_host_port, exit_after_stop, install_stop_handlers, parse_host_port,
                             setup_logging, start_metrics_server, announce_ready)
from shardline.services.disconnects import DisconnectWatcher
from shardline.services.dispatcher_client import DispatcherClient
from shardline.services.errors import (ErrorCode, ShardlineConfigError, ShardlineConnectionError, ShardlineError,
                                       ShardlineTimeoutError)
from shardline.services.payload_budget import PayloadBudget
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.security import daemon_security
from shardline.services.transport import get_transport

log = logging.getLogger("shardline.ps")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardline-ps", description="Shardline parameter-server node")
    add_common_args(p, "ps")  # every option is declared in services/config.py
    return p


# A graceful stop writes what changed since the last checkpoint; the unit's TimeoutStopSec allows it.
STOP_CHECKPOINT_TIMEOUT_SECONDS = 240.0
# How long a stopping node tries to tell the dispatcher its final durable steps.
FINAL_REPORT_TIMEOUT_SECONDS = 3.0
# Durable checkpoints are reported at once, but heartbeats come at most this often.
MIN_HEARTBEAT_SPACING_SECONDS = 0.25
# How long a stopping node waits for the others to take its blocks over (its unit allows it).
LEAVE_TIMEOUT_SECONDS = 30.0
# ... unless no dispatcher answers for this long meanwhile (longer than a leader failover, whose
# lease is 3 s by default): with the dispatchers stopping too, nobody can switch the ring.
LEAVE_UNREACHABLE_TIMEOUT_SECONDS = 6.0
PEER_STATUS_TIMEOUT_SECONDS = 2.0


def heartbeat_deadline(interval: float, failure_timeout: float, rpc_timeout: float) -> float:
    """How long one heartbeat may wait for its reply: half the dispatcher's failure timeout (no
    less than the interval, no more than ``rpc_timeout``), so a heartbeat that went into a cut
    network is given up, and the next one sent, well before the node would be declared dead, and
    a node whose network returns reaches the dispatcher within about a heartbeat interval.
    ``failure_timeout`` 0 (a dispatcher that does not say): ``rpc_timeout``."""
    if not failure_timeout:
        return rpc_timeout
    return max(interval, min(rpc_timeout, failure_timeout / 2))


def open_checkpoint_dir(path: str | None, node_id: str) -> CheckpointDir | None:
    """The node's CheckpointDir (created if missing, checked writable and not another node's)."""
    if not path:
        return None
    try:
        return CheckpointDir(os.path.abspath(os.path.expanduser(path)), node_id,
                             failpoint=lambda stage: failpoints.hit(f"ps.checkpoint.{stage}"))
    except CheckpointError as exc:
        raise ShardlineConfigError(f"checkpoint_dir: {exc}") from None


def filesystem_of(path: str, mounts: str) -> str:
    """The file system type of the mount holding ``path`` (absolute, resolved) in ``mounts`` (the
    text of /proc/self/mounts); "" if none matches."""
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


def open_spill_dir(args) -> str | None:
    """The directory of the node's frozen-value files (created if missing, checked writable), or
    None where frozen values stay in memory (``frozen_values: memory``). A WARNING if it is a
    tmpfs (the files would be shared memory: out of the heap, not out of RAM)."""
    if args.frozen_values != "files":
        return None
    path = os.path.abspath(os.path.expanduser(args.spill_dir))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ShardlineConfigError(f"spill_dir {args.spill_dir!r} cannot hold the node's frozen-value files: {exc} "
                                   f"(or set frozen_values: memory)") from None
    try:
        with open("/proc/self/mounts") as f:
            kind = filesystem_of(os.path.realpath(path), f.read())
    except OSError:
        kind = ""
    if kind == "tmpfs":
        log.warning("spill_dir %s is on a tmpfs: frozen values there are shared memory, out of the heap but not "
                    "out of RAM; point spill_dir at a disk", path)
    return path


class HeartbeatLoop(threading.Thread):
    """Heartbeats carry the node's storage and its held jobs (steps, durable checkpoints); replies
    tell it which jobs to drop and which checkpoint steps the cluster still needs. ``wake()`` sends
    one at once (a checkpoint just became durable).

    ``client`` is the loop's own: after a failed heartbeat it dials afresh for the next (the old
    connection's retransmissions wait out TCP's growing backoff), without cancelling the node's
    other calls; once heartbeats get through again, ``shared`` (the client the node's other
    threads call the dispatcher with) dials afresh too, once. ``deadline``: of each heartbeat in
    the loop (None: the client's rpc_timeout)."""

    def __init__(self, client: DispatcherClient, node: PSNode, registration: dict, interval: float, stop: threading.Event,
                 deadline: float | None = None, shared: DispatcherClient | None = None):
        super().__init__(name="heartbeat", daemon=True)
        self.client, self.node, self.registration = client, node, registration
        self.interval, self.stop = interval, stop
        self.deadline, self.shared = deadline, shared
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one heartbeat at a time (loop, wake-ups, the final report)
        M.watch_node(node, registration.get("node_id"), registration.get("rack"))
        M.heartbeat(ok=True)  # registration just reached the dispatcher

    def wake(self) -> None:
        self._wake.set()

    def beat(self, timeout: float | None = None) -> None:
        """One heartbeat and what its reply asks for. Raises ShardlineError."""
        with self._lock:
            blocks, nbytes = self.node.store.totals()
            load, hot = heat_report(self.node.heat, self.node.node_id, self.registration.get("rack", ""))
            # The jobs first: the dispatcher counts the readiness only if they are all it has, so
            # a job learnt between the two must already be in the sync ready_epoch checks.
            held = self.node.held_jobs()
            ready = self.node.ready_epoch()
            resp = self.client.heartbeat(node_id=self.node.node_id, blocks=blocks, bytes=nbytes,
                                         epoch=self.node.routing.epoch, jobs=held, ready_epoch=ready,
                                         insecure=bool(self.registration.get("insecure")), timeout=timeout,
                                         build_fingerprint=self.registration.get("build_fingerprint", ""),
                                         load=load, hot=hot, rack_reads=rack_reads_report(self.node.heat))
            if not resp.registered:
                log.warning("dispatcher does not know this node; registering again")
                remembered = self.node.remembered_routing()   # a dispatcher that lost its state takes it back
                self.client.register_node(**self.registration, **({"remembered": remembered} if remembered else {}))
                self.node.refresh_routing()
            elif resp.epoch != self.node.routing.epoch:
                self.node.refresh_routing()
                log.info("routing updated to epoch %d", self.node.routing.epoch)
        for job in resp.drop_jobs:
            self.node.drop_job(job)
        # A ring change: hold every job, to sync the blocks this node will own; then report at
        # once (not a heartbeat interval later) if that is all the pending ring waited for here.
        if self.node.hold_jobs(resp.jobs, resp.job_revisions):
            self.wake()
        for name, why in resp.failed_jobs.items():
            job = self.node.store.get(name)
            if job is not None and job.failed is None:
                log.warning("job %s failed: %s", name, why)
                job.fail(ErrorCode.WORKER_LOST, why)
        if self.node.replicator is not None:
            self.node.replicator.retry_failed()
            self.node.replicator.invite_dropped()
            self.node.replicator.sweep()
        self.node.store.release_frozen_pages()
        for name in resp.unknown_jobs:  # the dispatcher lost its state: it learns the job back from us
            job = self.node.store.get(name)
            if job is not None:
                self.client.restore_job(job.spec, job.uid, self.node.node_id)
                log.warning("job %s was unknown to the dispatcher; registered it again from this node", name)
        if self.node.checkpointer is not None:
            for entry in resp.checkpoint_steps:
                self.node.checkpointer.protect(entry.job, entry.step)

    def run(self) -> None:
        failing = False  # log outages once, not once per heartbeat (journald floods otherwise)
        last = time.monotonic()
        while not self.stop.is_set():
            self._wake.wait(self.interval)
            # a wake-up (a checkpoint became durable) beats early, but not more often than this
            time.sleep(max(0.0, MIN_HEARTBEAT_SPACING_SECONDS - (time.monotonic() - last)))
            self._wake.clear()
            if self.stop.is_set():
                return
            last = time.monotonic()
            try:
                self.beat(timeout=self.deadline)
                M.heartbeat(ok=True)
                if failing:
                    log.info("heartbeats reach the dispatcher again")
                    failing = False
                    if self.shared is not None:
                        self.shared.reconnect()
            except ShardlineError as exc:
                M.heartbeat(ok=False)
                (log.debug if failing else log.warning)("heartbeat failed: %s", exc)
                failing = True
                if isinstance(exc, (ShardlineTimeoutError, ShardlineConnectionError)):
                    self.client.reconnect()   # the next heartbeat dials afresh (a cut network may be back)


def peer_job_steps(node: PSNode, token: bytes | None, tls_ca: bytes | None = None) -> Callable[[str], int | None]:
    """``step(job)``: the highest step other alive nodes hold the job at (None: nobody holds it).
    Calls carry ``token`` and use TLS with ``tls_ca``."""
    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2, ps_pb2_grpc

    cache: dict[str, dict[str, int]] = {}

    def status_of(info) -> dict[str, int]:
        if info.node_id not in cache:
            try:
                with grpc_channel(info.grpc_address, token, tls_ca=tls_ca) as channel:
                    reply = ps_pb2_grpc.ParameterServerStub(channel).GetNodeStatus(
                        ps_pb2.GetNodeStatusRequest(), timeout=PEER_STATUS_TIMEOUT_SECONDS)
                # an address may outlive its node (a stale registration): trust only the node itself
                cache[info.node_id] = {j.job: int(j.step) for j in reply.jobs} if reply.node_id == info.node_id else {}
            except Exception:  # noqa: BLE001 - a peer that cannot answer (down, restoring) holds nothing live
                cache[info.node_id] = {}
        return cache[info.node_id]

    def step(job: str) -> int | None:
        steps = [status_of(info).get(job) for node_id, info in node.routing.nodes.items() if node_id != node.node_id]
        steps = [s for s in steps if s is not None]
        return max(steps) if steps else None

    return step


def peer_commits(node: PSNode, token: bytes | None, tls_ca: bytes | None = None) -> Callable[[str, int], list]:
    """``ask(job, step)`` for the commit relay: every other node's commit record of the step
    (calls carry ``token`` and use TLS with ``tls_ca``)."""
    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2, ps_pb2_grpc

    def ask(job: str, step: int) -> list:
        records = []
        for node_id, info in list(node.routing.nodes.items()):
            if node_id == node.node_id:
                continue
            try:
                with grpc_channel(info.grpc_address, token, tls_ca=tls_ca) as channel:
                    reply = ps_pb2_grpc.ParameterServerStub(channel).GetCommits(
                        ps_pb2.GetCommitsRequest(job=job, step=step), timeout=PEER_STATUS_TIMEOUT_SECONDS)
            except Exception:  # noqa: BLE001 - an unreachable peer has nothing to tell
                continue
            lrs = tuple(reply.group_lrs) if reply.group_lrs else (reply.lr if reply.has_lr else None)
            records.append(({c.rank: (c.weight, c.epoch) for c in reply.commits}, lrs))
        return records

    return ask


def grad_norm_sender(token: bytes | None, tls_ca: bytes | None = None) -> Callable[[str, object], None]:
    """``send(address, share)`` for the gradient-norm exchange: one channel per peer, kept (a share
    goes out every clipped step)."""
    from shardline.services.daemon import grpc_channel
    from shardline.services.pb import ps_pb2_grpc

    stubs: dict[str, object] = {}
    lock = threading.Lock()

    def send(address: str, share) -> None:
        with lock:
            stub = stubs.get(address)
            if stub is None:
                stub = stubs[address] = ps_pb2_grpc.ParameterServerStub(grpc_channel(address, token, tls_ca=tls_ca))
        stub.ReportGradNorm(share, timeout=PEER_STATUS_TIMEOUT_SECONDS)

    return send


def _extend_systemd_timeout(what: str) -> None:
    """Under systemd, say what the node is doing and push its start/stop timeout out (one job's
    restore or final checkpoint may take long on a large node)."""
    sdnotify.notify(sdnotify.format_message(f"EXTEND_TIMEOUT_USEC={int(STOP_CHECKPOINT_TIMEOUT_SECONDS * 1e6)}",
                                            STATUS=what))


def leave_ring(node: PSNode, client: DispatcherClient, timeout: float = LEAVE_TIMEOUT_SECONDS,
               unreachable_timeout: float = LEAVE_UNREACHABLE_TIMEOUT_SECONDS) -> bool:
    """Move this node's blocks to the others before it stops (a drain: two-phase, the others hold
    them in sync before the ring switches; training goes on meanwhile). False if the dispatcher
    refused (the last node, or every node stopping at once), the move did not finish within
    ``timeout``, or no dispatcher answered for ``unreachable_timeout`` meanwhile (they are
    stopping too: only a leader switches the ring)."""
    try:
        client.drain_node(node.node_id, leaving=True)
    except ShardlineError as exc:
        log.info("stopping without moving blocks away: %s", exc)
        return False
    log.info("leaving the ring: waiting until the other nodes hold this node's blocks")
    deadline = time.monotonic() + timeout
    answered = time.monotonic()
    while time.monotonic() < deadline:
        try:
            view = node.refresh_routing()
            answered = time.monotonic()
        except ShardlineError as exc:
            if time.monotonic() - answered >= unreachable_timeout:
                log.warning("no dispatcher answered for %g s while this node left the ring (%s); stopping "
                            "without waiting for the others to take its blocks over", unreachable_timeout, exc)
                return False
            view = node.routing
        if node.node_id not in view.nodes and not view.pending_epoch:
            log.info("left the ring at epoch %d", view.epoch)
            # The handovers of the step in flight are queued (maybe by the heartbeat's thread,
            # still at it): a node that exits before they go out loses the gradients it collected
            # and the values a restarted rank would redo the step on.
            settled = time.monotonic() + HANDOVER_TIMEOUT_SECONDS
            while node.roles_epoch < view.epoch and time.monotonic() < settled:
                time.sleep(0.01)
            if node.replicator is not None and not node.replicator.links.flush(HANDOVER_TIMEOUT_SECONDS):
                log.warning("the handovers to the blocks' new primaries did not go out within %g s; they take "
                            "the pushes workers resend", HANDOVER_TIMEOUT_SECONDS)
            return True
        if node.node_id in view.nodes and not view.pending_epoch:
            log.info("the drain was called off (other nodes are stopping too)")
            return False
        time.sleep(0.2)
    log.warning("the other nodes did not take this node's blocks over within %.0f s; stopping anyway", timeout)
    return False


def graceful_stop(node: PSNode, heartbeats: HeartbeatLoop | None) -> None:
    """Freeze every job, write what changed since the last checkpoint, report the durable steps."""
    node.freeze("the node is stopping")
    if node.checkpointer is None:
        return
    for job in node.store.jobs():
        _extend_systemd_timeout(f"writing the final checkpoint of job {job.name}")
        try:
            step = node.checkpointer.checkpoint_now(job.name, STOP_CHECKPOINT_TIMEOUT_SECONDS)
            if step is not None:
                log.info("job %s: durable at step %d before stopping", job.name, step)
        except ShardlineError as exc:
            log.error("job %s: final checkpoint failed: %s", job.name, exc)
    node.checkpointer.close()
    if heartbeats is not None:
        try:
            heartbeats.beat(timeout=FINAL_REPORT_TIMEOUT_SECONDS)
        except ShardlineError as exc:
            log.warning("could not report the final checkpoints to the dispatcher: %s", exc)


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parse_daemon_args(parser, argv)  # validates types and bounds; cluster is required
        setup_logging(args.log_level, "ps", args.log_format)
        log_configuration(log, args)
        host, _ = parse_host_port(args.listen, what="listen")
        data_host, data_port = parse_host_port(args.data_listen or f"{format_host_port(host, 0)}", what="data_listen")
        transport = get_transport(args.transport, shm_ring_bytes=args.shm_ring_bytes)
        if args.checkpoint_dir and not args.node_id and data_port == 0:
            raise ShardlineConfigError("checkpoint_dir needs a stable node id: set node_id (the default, host name and "
                                       "data port, changes from run to run when the data port is 0)")
        if args.max_inflight_bytes < args.max_payload_bytes:
            raise ShardlineConfigError(f"max_inflight_bytes ({args.max_inflight_bytes}) must be at least "
                                       f"max_payload_bytes ({args.max_payload_bytes}): one largest frame must fit")
        # Every bind: gRPC, data plane, metrics (on the listen host; its port does not matter to the policy).
        security = daemon_security(args, {"listen": args.listen, "data_listen": format_host_port(data_host, data_port),
                                          "metrics": format_host_port(host, args.metrics_port)})
        cluster_token = security.token
    except ShardlineConfigError as exc:
        print(f"shardline-ps: error: {exc}", file=sys.stderr)
        return 2

    if args.malloc == "bounded":
        tuned = bound_freed_memory()
        if tuned:
            log.debug("malloc: %s", ", ".join(f"{k}={v}" for k, v in tuned.items()))

    import torch

    torch.set_num_threads(args.torch_threads)
    stop = install_stop_handlers()
    client = DispatcherClient(args.cluster, rpc_timeout=args.rpc_timeout, cluster_token=cluster_token,
                              tls_ca=security.tls_ca)

    def fetch_job(name):
        return client.get_job(name)

    node_holder: dict = {}
    ps_metrics = M.PSMetrics()
    M.INFLIGHT_LIMIT.set(args.max_inflight_bytes)
    hangups = DisconnectWatcher()
    policy = ConnectionPolicy(limits=frame.FrameLimits(max_payload_bytes=args.max_payload_bytes),
                              cluster_token=cluster_token, payload_timeout=args.payload_timeout,
                              budget=PayloadBudget(args.max_inflight_bytes, on_change=M.INFLIGHT_BYTES.set),
                              hangups=hangups)

    def on_connection(sock, peer):
        M.CONNECTIONS.inc()
        try:
            serve_connection(sock, peer, node_holder["node"], policy, ps_metrics)
        finally:
            M.CONNECTIONS.dec()

    def refuse_connection(sock, peer):
        M.CONNECTIONS_REFUSED.inc()
        policy.complaints.log(logging.WARNING, f"max_connections:{peer.rpartition(':')[0]}",
                              "turned away a data-plane connection from %s: %d open (max_connections)",
                              peer, args.max_connections)
        frame.send_frame(sock, frame.error_header(0, dp.RESOURCE_EXHAUSTED, f"PS node has {args.max_connections} "
                                                  f"data-plane connections open (max_connections); retry later"))

    listener = transport.listen(data_host, data_port, on_connection, max_connections=args.max_connections,
                                refuse=refuse_connection)
    node_id = args.node_id or f"{socket.gethostname()}-{listener.port}"
    try:
        ckdir = open_checkpoint_dir(args.checkpoint_dir, node_id)
        spill_dir = open_spill_dir(args)
    except ShardlineConfigError as exc:
        print(f"shardline-ps: error: {exc}", file=sys.stderr)
        listener.close()
        return 2
    node = node_holder["node"] = PSNode(node_id, fetch_job, client.get_routing, metrics=ps_metrics)
    node.store.spill_dir = spill_dir
    node.payload_budget = policy.budget
    node.serving.clear()  # frames get UNAVAILABLE until the checkpoints are restored
    node.delta_history = DeltaHistory(args.delta_history_bytes)
    node.replicator = Replicator(node, PeerLinks(lambda peer: node.routing.address_of(peer), transport, cluster_token),
                                 metrics=ps_metrics, check_interval=args.replica_check_interval)
    node.grad_norms = GradNormExchange(node, grad_norm_sender(cluster_token, security.tls_ca))
    heartbeats: HeartbeatLoop | None = None
    if ckdir is not None:
        node.checkpointer = Checkpointer(ckdir, node_id, every_steps=args.checkpoint_every_steps,
                                         full_every=args.checkpoint_full_every, keep=args.checkpoint_keep,
                                         epoch=lambda: node.routing.epoch, metrics=ps_metrics,
                                         on_durable=lambda: heartbeats.wake() if heartbeats is not None else None)
    # gRPC answers at once (health, status: jobs appear as they are restored, each at its final step)
    server, grpc_port, health = create_server(args.listen, node, cluster_token=cluster_token, tls=security.server_tls)
    _, metrics_port = start_metrics_server(host, args.metrics_port)
    try:
        client.wait_until_reachable(args.connect_timeout, stop=stop)  # logs that it waits, and why
        node.refresh_routing()
        if ckdir is not None:
            restore_all(ckdir, node_id=node_id, get_job=client.get_job, restore_job_rpc=client.restore_job,
                        live_step=peer_job_steps(node, cluster_token, security.tls_ca), add_job=node.add_job,
                        metrics=ps_metrics, before_job=lambda job: _extend_systemd_timeout(f"restoring job {job}"))
    except ShardlineError as exc:
        stopped = stop.is_set()  # SIGTERM while it waited for the dispatcher: a clean stop
        (log.info if stopped else log.error)("cannot join cluster %s: %s", args.cluster, exc)
        listener.close()
        server.stop(0)
        return 0 if stopped else 1

    registration = dict(node_id=node_id, rack=args.rack, grpc_address=format_host_port(host, grpc_port),
                        data_address=listener.address, capacity=args.capacity, incarnation=os.urandom(8).hex(),
                        insecure=security.insecure, build_fingerprint=build_fingerprint.fingerprint())
    try:
        resp = client.register_node(**registration)
        node.refresh_routing()  # a restarted node rejoins: it applies nothing until it is in sync again
    except ShardlineError as exc:
        log.error("cannot join cluster %s: %s", args.cluster, exc)
        listener.close()
        server.stop(0)
        return 1
    # Heartbeats and the commit relay go on while the node leaves the ring after SIGTERM.
    serving_done = threading.Event()
    node.serving.set()
    interval = resp.heartbeat_interval_seconds or 1.0
    heartbeat_client = DispatcherClient(args.cluster, rpc_timeout=args.rpc_timeout, cluster_token=cluster_token,
                                        tls_ca=security.tls_ca)
    heartbeats = HeartbeatLoop(heartbeat_client, node, registration, interval, serving_done,
                               heartbeat_deadline(interval, resp.heartbeat_timeout_seconds, args.rpc_timeout),
                               shared=client)
    heartbeats.start()
    relay = CommitRelay(node.store.jobs, peer_commits(node, cluster_token, security.tls_ca), serving_done)
    node.settle_commits = relay.settle
    relay.start()
    log.info("node %s serving: grpc %s, data %s (%s), rack %s, epoch %d; %s", node_id, registration["grpc_address"],
             listener.address, transport.NAME, args.rack, node.routing.epoch, security.summary)
    announce_ready(args.ready_file, {"grpc": registration["grpc_address"], "metrics": format_host_port(host, metrics_port),
                                     "data": listener.address, "node_id": node_id})
    stop.wait()
    started = time.monotonic()
    if node.store.jobs():
        leave_ring(node, client)
    graceful_stop(node, heartbeats)
    serving_done.set()
    node.replicator.links.close()
    listener.close()
    hangups.close()
    node.grad_norms.close()
    server.stop(grace=2).wait(5)
    client.close()
    heartbeat_client.close()
    log.info("stopped in %.2f s", time.monotonic() - started)
    exit_after_stop(0)


if __name__ == "__main__":
    sys.exit(main())
