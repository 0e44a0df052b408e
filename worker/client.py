"""Worker-side client of a Shardline cluster: job set-up, push, commit, (delta) pull.

Locating blocks is local: the client fetches the routing table from the dispatcher, builds the
same CityHash64 ring as the PS nodes, and talks to each owning node over one data-plane
connection. A ``NOT_OWNER`` reply makes it refresh routing and resend only the refused blocks.

The client keeps an L1 cache: one flat tensor per job tensor plus the version of each block it
holds. Pulls name those versions, so nodes send only blocks that changed (delta pull), and the
reply payload is received straight into the cached tensor (``bind`` lets that tensor be a model
parameter, so pulls land in the parameter itself). The cache is fp32, or bf16 for a tensor bound
to a bf16 parameter: its pulls ask for bf16 (the node converts its fp32 master, round to nearest
even), so the parameter holds exactly ``master.to(torch.bfloat16)`` and half the bytes travel.
Gradients are pushed in their own dtype (bf16 gradients as bf16; the nodes accumulate in fp32),
or as the job's ``compression`` encodes them (worker/compressor.py).

``Client`` is the facade of the worker's step protocol; its parts live beside it: the steps in
flight and their replay and recovery (worker/recovery.py, with the state diagrams), the shm
exchange (worker/shm_exchange.py), the lease (worker/lease.py). Design: docs/architecture.md,
"The worker's step protocol".
"""

from __future__ import annotations

import itertools
import logging
import uuid
import weakref
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from shardline.services import failpoints, frame
from shardline.services.blocks import DEFAULT_BLOCK_ELEMENTS, block_slices
from shardline.services.compression import SignBlock, check_compression, compression_of
from shardline.services.tensor_checks import all_finite, zero_parts
from shardline.services.copy_reads import copies_may_serve
from shardline.services.daemon import parse_host_port
from shardline.services.dataplane_client import REPLY_LIMITS, DataPlaneConnection
from shardline.services.dispatcher_client import REACHABLE_WARNING_SECONDS, DispatcherClient
from shardline.services.errors import (ErrorCode, NotOwnerError, RemoteError, ShardlineConfigError,
                                       ShardlineConnectionError, ShardlineError, ShardlineStateError,
                                       ShardlineTimeoutError, ShardlineWorkerLostError, StepTimeoutError)
from shardline.services.pb import common_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.pb import dispatcher_pb2
from shardline.services.routing import RoutingView
from shardline.services.security import client_credentials
from shardline.services.stragglers import StragglerReport, ask_commits, lease_text, straggler_report
from shardline.services.transport import get_transport
from shardline.services.transport.shm import is_local_host
from shardline.worker.compressor import GradientCompressor
from shardline.worker.node_watch import WATCH_INTERVAL_SECONDS, NodeWatch
from shardline.worker.recovery import (BUSY_CODES, RECOVERY_CONNECT_TIMEOUT_SECONDS, Replay, StepsInFlight,
                                       ask_while_lacking, recover_node, resend_to_node, wait_for_ring)
from shardline.worker.lease import WorkerLease
from shardline.worker.shm_exchange import SharedMemory, region_holding, share_region
from shardline.worker.read_router import CACHE_TIMEOUT_SECONDS, NODE_ANSWERS, ReadRouter, default_rack

log = logging.getLogger("shardline.worker")

# One GetCommits/GetNodeStatus call of the straggler report may take this long.
STRAGGLER_QUERY_TIMEOUT_SECONDS = 2.0
# A waiting pull is asked for in slices of this many seconds (the routing is checked in between).
PULL_SLICE_SECONDS = 5.0
# A PS node remembers that a job name does not exist for ps_server.admission.DEFAULT_MISS_TTL_SECONDS.
UNKNOWN_JOB_RETRY_SECONDS = 1.2
# A BSP step still waiting after straggler_warning_seconds logs who it waits for, then again at
# doubling intervals up to this.
MAX_STRAGGLER_WARNING_INTERVAL_SECONDS = 300.0
DEFAULT_STRAGGLER_WARNING_SECONDS = 30.0
# No byte from a node for this long (beyond a pull's own wait) means it stopped answering (a node
# that leaves the ring meanwhile is given up at once: worker/node_watch.py).
IO_TIMEOUT_SECONDS = 30.0
# What a tensor's cache (and so a bound parameter) may be: pulls ask the nodes for this dtype.
CACHE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class TransferStats:
    pushed_bytes: int = 0
    pulled_bytes: int = 0
    pushed_zero_blocks: int = 0
    pulled_blocks: int = 0
    placed_blocks: int = 0   # of pulled_blocks: copied by the node straight into this client's cache (shm)
    taken_blocks: int = 0    # pushed blocks the node copied straight out of a gradient_buffer (shm)
    carried_steps: int = 0   # steps whose blocks came with this worker's commit (pull_on_commit): no pull sent
    shared_steps: int = 0    # steps whose blocks came from the host's leader (adopt_host_pull): no pull sent


class CarriedPull(NamedTuple):
    """What a BSP commit that carried the step's pull (``pull_on_commit``) brought."""

    step: int                          # the step the commit made
    answered: dict[str, list]          # node -> the keys its reply brought
    node_steps: dict[str, int]         # node -> the step its commit reply reported


@dataclass(frozen=True)
class HostAggregate:
    """What a host's leader pushes for several ranks of its host at once (``Client.push(...,
    aggregate=)``): ``ranks`` (ascending, distinct, at least two, the leader's own among them),
    each one's weight in the same order (the leader's equal to its push's ``weight``), and
    ``sums``: per tensor, ``sum_i(weights[i] * gradient_i)`` over the ranks, weighted already
    (None: none of them has a gradient for it). Each node counts the push as every one of these
    ranks' push of its blocks (docs/architecture.md, "Aggregated pushes")."""

    ranks: tuple[int, ...]
    weights: tuple[float, ...]
    sums: dict[str, torch.Tensor | None]


class _AggregatedBlocks(dict):
    """The blocks a host's aggregated push sends ((tensor, index) -> block) and the HostAggregate
    they sum: only frames of this very dict carry ``agg_ranks``. What a replay or a node's recovery
    within the push resends is a record of this rank's own blocks, a plain dict: it goes alone."""

    def __init__(self, blocks: dict, aggregate: HostAggregate):
        super().__init__(blocks)
        self.aggregate = aggregate


class _NonFiniteGradient(ShardlineConfigError):
    """A gradient block held NaN or Inf (found by this client, or by the node it was pushed to)."""


def storage_dtype(tensor: torch.Tensor, trainable: bool) -> str:
    """The dtype a job stores ``tensor`` in on the PS nodes: a frozen bfloat16 tensor as it is (2
    bytes per parameter, never stepped), everything else float32 (a trainable tensor's master)."""
    return "bfloat16" if not trainable and tensor.dtype == torch.bfloat16 else "float32"


def _check_weight(weight: float) -> None:
    """A rank's weight in a step's mean (a push's, or one the host's leader pushed for it)."""
    if not (math.isfinite(weight) and weight > 0):
        raise ShardlineConfigError(f"weight must be a finite number > 0, got {weight!r}")


def _check_finite(name: str, grad: torch.Tensor) -> None:
    if not all_finite(grad):
        raise _NonFiniteGradient(f"gradient for tensor {name!r} contains NaN or Inf; not pushed")


class _Immediate:
    """A call run on the spot with the ``result()`` interface of a Future."""

    def __init__(self, fn, *args):
        try:
            self._value, self._error = fn(*args), None
        except BaseException as exc:  # re-raised from result(), like a Future
            self._value, self._error = None, exc

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class Client:
    """Connection of one worker to one job. Not thread-safe: one training loop drives it.

    ``subscriber_pulls``: pulls ask for checksums and element-level deltas (worker/subscriber.py,
    whose client receives them).

    Timeouts: ``rpc_timeout`` for control-plane calls, ``pull_timeout`` for a waiting pull (how long
    a worker waits for the slowest worker of a BSP step), ``connect_timeout`` for data-plane
    connections and for waiting on the job creator, ``recovery_timeout`` for a PS node that went
    away (restart, graceful stop) to come back.

    Node restarts (worker/recovery.py): until a BSP step is applied the client keeps what it sent
    for it (its gradient blocks, weight, whether it committed); SSP keeps this for each of the up to
    ``staleness + 1`` steps in flight, and every mechanism below resends each of them, oldest first. When a node
    drops the connection or answers
    ``UNAVAILABLE``, the client waits for the node to be back (refreshing routing: a restarted node
    registers new addresses), asks it its job step and, if the node is still collecting the step in
    flight (it restored the checkpoint of that step and lost what was sent since), sends it this
    worker's part of the step again; pushes and commits are idempotent on the node, so resending
    what the node kept is harmless. Then the interrupted request is retried. When the routing
    epoch changes while a step is in flight (a node failed over to its replica, a ring change
    switched), the client resends the step's pushes of blocks whose primary changed to the new
    primaries and, if it had committed, commits again on every node at the new epoch.

    SSP (``sync: ssp``, ``staleness`` s): after committing step v the client pulls parameters of any
    version >= v + 1 - s (the pull waits only until the job applied step v - s), so the step it
    computes next is never more than s steps ahead of the parameters it computes on;
    ``held_step`` is the version the last pull brought: the oldest job step among the nodes (while
    a block taken over mid-step catches up with its new node's step it may be one step older,
    still no older than the pull's ``min_step``).

    Stragglers: a BSP pull still waiting after ``straggler_warning_seconds`` (0: never) logs a
    WARNING naming the ranks that have not committed the step and the PS nodes waiting for them
    (asked over gRPC), again at doubling intervals; when ``pull_timeout`` runs out,
    StepTimeoutError (a ShardlineTimeoutError) names them.

    Leases: while it trains the client renews its lease of (job, rank) with the dispatcher; if the
    job fails because another rank was lost (``on_worker_failure: fail``), its next request raises
    ShardlineWorkerLostError naming the rank.

    Rack caches: with ``rack`` (default ``$SHARDLINE_RACK``) pulls go through the rack's cache (L2)
    when the routing lists one, and straight to the PS nodes when it is gone or does not answer
    within ``cache_timeout`` beyond the pull's wait (worker/read_router.py).

    Credentials: ``cluster_token`` (bytes) and ``tls_ca`` (PEM bytes of the CA that signed the
    cluster's gRPC certificates); each not given is read from the file that
    ``SHARDLINE_CLUSTER_TOKEN_FILE`` / ``SHARDLINE_TLS_CA_FILE`` names, if set (services/security.py).
    """

    subscriber_pulls = False
    # BSP: each commit carries the pull of the step it may complete (FrameHeader.pull_applied): the
    # rank whose commit applies the step has the new values in the commit's replies, and
    # pull_changed() then asks nothing. PSOptimizer turns it on where it pulls whole steps.
    pull_on_commit = False
    _carried: CarriedPull | None = None   # the last commit's carried pull, until pull_changed() looks at it
    _resent = None   # the InflightStep being resent: its lrs go with the requests (_resending)
    lr = None        # the current step's lrs (PSOptimizer sets them before each step's pushes)

    def __init__(self, cluster: str, job: str, *, rank: int = 0, transport: str = "auto",
                 rpc_timeout: float = 10.0, pull_timeout: float = 600.0, connect_timeout: float = 60.0,
                 max_retries: int = 5, cluster_token: bytes | None = None, recovery_timeout: float = 120.0,
                 tls_ca: bytes | None = None,
                 straggler_warning_seconds: float = DEFAULT_STRAGGLER_WARNING_SECONDS, rack: str | None = None,
                 cache_timeout: float = CACHE_TIMEOUT_SECONDS):
        if isinstance(straggler_warning_seconds, bool) or not isinstance(straggler_warning_seconds, (int, float)) \
                or not math.isfinite(straggler_warning_seconds) or straggler_warning_seconds < 0:
            raise ShardlineConfigError(f"straggler_warning_seconds must be a finite number >= 0 (0: no warning), "
                                       f"got {straggler_warning_seconds!r}")
        self.straggler_warning_seconds = float(straggler_warning_seconds)
        self.job = job
        self.recovery_timeout = recovery_timeout
        # The BSP/SSP steps in flight, kept until every node applied them, and their replay after
        # the routing moved under them (worker/recovery.py)
        self._inflight = StepsInFlight()
        self._durable_steps: dict[str, int] = {}   # BSP: node -> its replies' durable_step (_note_durable)
        self._replay = Replay(self._inflight)
        self.incarnation = uuid.uuid4().hex[:16]       # this process's identity as its rank
        self.cluster_token, self.tls_ca = client_credentials(cluster_token, tls_ca)
        self.rank = rank
        self.pull_timeout = pull_timeout
        self.connect_timeout = connect_timeout
        self.max_retries = max_retries
        # A wrong address fails here, at once; an unreachable one is retried (with a WARNING) below.
        self.dispatcher = DispatcherClient(cluster, rpc_timeout=rpc_timeout, cluster_token=self.cluster_token,
                                           tls_ca=self.tls_ca)
        self._transport = get_transport(transport)
        self._reads = ReadRouter(default_rack(rack), cache_timeout=cache_timeout)
        self._local_addresses: dict[str, bool] = {}   # data address -> on this host (on_this_host)
        self._lease = WorkerLease(job, rank, self.incarnation, lambda **kw: self.dispatcher.worker_heartbeat(**kw),
                                  lambda: self.step or 0)
        self.dispatcher.wait_until_reachable(connect_timeout)
        self.routing = RoutingView.from_proto(self.dispatcher.get_routing())
        self.spec: common_pb2.JobSpec | None = None
        self.uid = ""                      # the job incarnation (JobInfo.uid), once known
        self.step: int | None = None
        self.held_step: int | None = None   # the oldest job step among the nodes at the last pull
        # Learning rate sent with each commit (BSP) or push (ASP): one number (every group), one per
        # parameter group (a tuple), or None: the job's own.
        self.lr: float | tuple[float, ...] | None = None
        self._commit_follows = False   # the push being sent is followed by this worker's commit
        self._pulling_at_step = False  # the pull being sent asks for values of its step (_pull_at)
        self._unchecked: dict = {}     # (tensor, index) -> block of the push being sent, left to the node's NaN/Inf check
        self.stats = TransferStats()
        self._values: dict[str, torch.Tensor] = {}
        # The caches and gradient buffers in shared memory a local node copies blocks into and
        # out of (shm transport: worker/shm_exchange.py)
        self._shm = SharedMemory()
        self._grad_buffers: dict[str, torch.Tensor] = {}   # gradient_buffer's tensors
        self._staging_buffers: dict[str, torch.Tensor] = {}   # those of them in a shared region (stage_gradients)
        self._compressor: GradientCompressor | None = None   # the job's compression (None: none)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._slices: dict[str, list] = {}
        self._versions: dict[tuple[str, int], int] = {}
        self._oldest: dict[str, int] = {}   # node -> the oldest step it still collects (last pull reply)
        self._conns: dict = {}   # node id (or _cache_key) -> DataPlaneConnection
        self._request_ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="shardline-io")
        # requests waiting on a node are given up once it leaves the ring (worker/node_watch.py); the
        # watch asks the dispatcher on a client of its own (it dials afresh while it fails, which
        # must not cancel this client's calls), and holds this client weakly (a client nobody
        # closed is still collected)
        this = weakref.ref(self)
        self._watch_dispatcher = DispatcherClient(cluster, rpc_timeout=rpc_timeout, cluster_token=self.cluster_token,
                                                  tls_ca=self.tls_ca)
        self._watch = NodeWatch(lambda known: this()._routing_since(known), lambda: this().routing,
                                on_unreachable=self._watch_dispatcher.reconnect,
                                on_reachable_again=lambda: this().dispatcher.reconnect())
        self._lacking: dict[tuple[str, str, int], float] = {}  # (node, tensor, index) -> first seen lacking it
        info = self.dispatcher.get_job(job)
        if info is not None and info.ready:
            self._load_spec(info.spec, info.uid)

    # --- job set-up -------------------------------------------------------------------------
    def _load_spec(self, spec: common_pb2.JobSpec, uid: str = "") -> None:
        """Take the job's spec (a later revision of it adds tensors: their caches start empty)."""
        self.spec = spec
        self.uid = uid or self.uid
        kind = compression_of(spec)
        if (self._compressor.kind if self._compressor else "none") != kind:
            self._compressor = None if kind == "none" else GradientCompressor(kind)
        new = []
        for t in spec.tensors:
            shape = tuple(int(d) for d in t.shape)
            numel = math.prod(shape)
            self._shapes[t.name] = shape
            self._slices[t.name] = block_slices(numel, int(spec.block_elements))
            if t.name not in self._values:
                new.append((t.name, numel))
        self._allocate_caches(new)

    def _allocate_caches(self, tensors: list[tuple[str, int]]) -> None:
        """Zeroed float32 caches of ``tensors`` (name, numel): in one shared region when the
        transport can reach a node over shm (the node then copies pulled blocks straight into
        them, one copy instead of two through the ring), else ordinary tensors."""
        self._values.update(self._shm.allocate(self._transport, tensors, "cache"))

    def gradient_buffer(self, name: str) -> torch.Tensor:
        """A float32 tensor shaped like trainable tensor ``name`` (zeroed at first), the same one
        on every call, to compute or copy its gradient into before ``push``.

        Over shm a node on this host copies a pushed gradient straight out of it: no bytes go
        through the ring or a socket (one copy, by the node, instead of two). Elsewhere it is an
        ordinary tensor. Leave it unchanged while a push of it is in flight (``push`` returns once
        every node has it).
        """
        spec = self._require_spec()
        if name not in self._grad_buffers:
            trainable = {t.name: t.trainable for t in spec.tensors}
            if not trainable.get(name, False):
                raise ShardlineConfigError(f"job {self.job!r} has no trainable tensor {name!r}")
            missing = [(n, math.prod(self._shapes[n])) for n, yes in trainable.items()
                       if yes and n not in self._grad_buffers]
            for n, flat in self._shm.allocate(self._transport, missing, "gradient buffer").items():
                self._grad_buffers[n] = flat.view(self._shapes[n])
        return self._grad_buffers[name]

    def stage_gradients(self, grads: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor | None]:
        """``grads`` with each float32 CPU gradient copied into its ``gradient_buffer`` (one
        multi-tensor copy for all of them) where those lie in shared memory and a node of the
        routing is on this host: the node then copies the push out of the buffer itself, a checked
        copy of every block in one pass, instead of each block going through the ring (a copy on
        each side and messages per block). Others are left as they are (``push`` checks them).

        Only where the push's record may hold the buffer until the next step writes it again:
        BSP (the step's pull drops the record) and ASP (none is kept); SSP keeps the records of
        ``staleness`` steps, and a compressed push sends no bytes of the buffer.
        """
        if self.staleness or self._compressor is not None or not self._transport.capabilities.shares_memory \
                or not any(map(self.on_this_host, self.routing.nodes)):
            return grads
        names, sources, buffers = [], [], []
        for name, g in grads.items():
            if g is None or g.dtype != torch.float32 or not g.is_cpu or g.shape != self._shapes.get(name):
                continue
            buffer = self._staging_buffers.get(name)
            if buffer is None:
                buffer = self._staging_buffer(name)
            if buffer is None or buffer.data_ptr() == g.data_ptr():   # not shared, or the gradient is in it already
                continue
            names.append(name)
            sources.append(g)
            buffers.append(buffer)
        if not names:
            return grads
        with torch.no_grad():   # a gradient that requires grad (create_graph) is copied as its values
            torch._foreach_copy_(buffers, sources)
        return {**grads, **dict(zip(names, buffers))}

    def _staging_buffer(self, name: str) -> torch.Tensor | None:
        """``name``'s gradient buffer if it lies in a shared region (kept: buffers never move); None
        for a tensor the job does not train (``push`` refuses its gradient) or a buffer in ordinary memory."""
        if not any(t.name == name and t.trainable for t in self._require_spec().tensors):
            return None
        buffer = self.gradient_buffer(name)
        if not self._shm.in_grad_region(buffer):
            return None
        self._staging_buffers[name] = buffer
        return buffer

    @property
    def sync(self) -> str:
        return self._require_spec().sync

    @property
    def staleness(self) -> int:
        """SSP: how many steps the parameters a step is computed on may lag it (0: BSP, ASP)."""
        spec = self._require_spec()
        return int(spec.staleness) if spec.sync == "ssp" else 0

    @property
    def _resends_previous(self) -> bool:
        """BSP: a step's record stays until the nodes call it durable, and is resent after a
        failover: reads of a new step need not wait for the copy holders' acknowledgement."""
        return self.spec is not None and self.spec.sync == "bsp"

    @property
    def _collects(self) -> bool:
        """BSP and SSP: each step is pushed, then committed, and applied once every rank committed it."""
        return self._require_spec().sync in ("bsp", "ssp")

    def _require_spec(self) -> common_pb2.JobSpec:
        if self.spec is None:
            raise ShardlineStateError(f"job {self.job!r} is not ready on the cluster; call init() first")
        return self.spec

    def init(self, tensors: dict[str, torch.Tensor], *, optimizer: str = "sgd", sync: str = "bsp",
             staleness: int = 0, world_size: int = 1, block_elements: int | None = None,
             trainable: dict[str, bool] | None = None,
             allow_nonfinite: bool = False, ready_timeout: float | None = None, replication: int | None = None,
             worker_lease_timeout: float | None = None, on_worker_failure: str | None = None,
             param_groups: list[dict] | None = None, tensor_groups: dict[str, int] | None = None,
             max_grad_norm: float | None = None, compression: str | None = None, exact_restarts: bool = True,
             replicate_gradients: bool | None = None, **optimizer_kwargs) -> bool:
        """Create the job with ``tensors`` if the cluster lacks it; otherwise wait until it is ready.

        ``staleness`` (``sync="ssp"``, >= 1): how many steps a worker may run ahead (class doc).
        ``max_grad_norm`` (BSP): the PS nodes clip each step's mean gradient by its global norm
        before the optimizer step, as ``clip_grad_norm_`` on one process would.
        ``compression``: how this job's gradients travel, "none" (default; None: as an existing
        job has it), "bf16" or "sign" (docs/architecture.md, "Gradient compression"; BSP no longer
        equals torch.optim with them).
        ``exact_restarts=False`` (BSP): the PS nodes keep no value from before a block's last step
        (one copy of the values per step and 4 bytes per parameter less); a rank restarted after a
        half-made commit whose missing node died too then redoes its step on partly stepped values.
        ``replicate_gradients`` (BSP/SSP): a primary sends its replicas each step's mean gradient
        and lr, and they run the step themselves, instead of the new value and optimizer state (a
        third of the bytes for Adam); every PS node must compute it bit for bit alike. None (the
        default): the dispatcher decides, replay for BSP/SSP when every PS node reports one build
        fingerprint, copies otherwise (as an existing job has it, for a job that exists). True on
        nodes of different fingerprints: ShardlineConfigError. False: copies.
        ``param_groups``: hyperparameters per parameter group (torch.optim names; the first group's
        are the job's defaults and ``optimizer_kwargs`` are ignored), ``tensor_groups`` the group
        index of each tensor (default 0). Returns True if this call created the job (and so wrote
        the initial values). A job that exists must have the same tensors (names, shapes, groups),
        or ShardlineStateError is raised.
        """
        from shardline.services.optimizer_config import OptimizerConfig  # validation shared with the PS

        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ShardlineConfigError(f"staleness must be an integer >= 0 (>= 1 with sync 'ssp'), got {staleness!r}")
        groups = [OptimizerConfig.from_kwargs(optimizer, **g) for g in param_groups or ()]
        opt = groups[0] if groups else OptimizerConfig.from_kwargs(optimizer, **optimizer_kwargs)
        tensor_groups = tensor_groups or {}
        trainable = trainable or {}
        spec = common_pb2.JobSpec(name=self.job, optimizer=opt.to_proto(), sync=sync, staleness=staleness,
                                  world_size=world_size,
                                  block_elements=block_elements or DEFAULT_BLOCK_ELEMENTS, allow_nonfinite=allow_nonfinite,
                                  replication=replication or 0,
                                  worker_lease_timeout_seconds=worker_lease_timeout or 0.0,
                                  on_worker_failure=on_worker_failure or "", max_grad_norm=max_grad_norm or 0.0,
                                  compression="" if compression is None else check_compression(compression),
                                  inexact_restarts=not exact_restarts)
        if replicate_gradients is not None:   # unset: the dispatcher decides (replay where it can)
            if not isinstance(replicate_gradients, bool):
                raise ShardlineConfigError(f"replicate_gradients must be True, False or None, got {replicate_gradients!r}")
            spec.replicate_gradients = replicate_gradients
        if len(groups) > 1:
            spec.param_groups.extend(g.to_proto() for g in groups)
        for name, t in tensors.items():
            spec.tensors.add(name=name, shape=list(t.shape), dtype=storage_dtype(t, trainable.get(name, True)),
                             trainable=trainable.get(name, True),
                             group=tensor_groups.get(name, 0) if len(groups) > 1 else 0)
        resp = self.dispatcher.create_job(spec)
        if resp.created and spec.compression == "sign" and opt.kind != "sgd":
            log.warning("job %s: compression 'sign' with %s: the PS's second moment sees each block's +-scale, not "
                        "the gradient's own magnitudes, so training may stall well above the uncompressed loss "
                        "(docs/architecture.md, \"Gradient compression\")", self.job, opt.kind)
        if resp.created:
            self._initialize(resp.job, tensors, 0)
            self.step = 0
            return True
        self.wait_ready(ready_timeout)
        have = {t.name: tuple(t.shape) for t in self.spec.tensors}
        want = {n: tuple(t.shape) for n, t in tensors.items()}
        if have != want:
            raise ShardlineStateError(f"job {self.job!r} exists with tensors {have}, not {want}")
        return False

    def wait_ready(self, timeout: float | None = None) -> common_pb2.JobSpec:
        """Wait until the job exists and its creator initialized it."""
        timeout = self.connect_timeout if timeout is None else timeout
        started = time.monotonic()
        deadline, warn_at = started + timeout, started + REACHABLE_WARNING_SECONDS
        while self.dispatcher.get_job(self.job) is None:
            now = time.monotonic()
            if now > deadline:
                raise ShardlineTimeoutError(f"job {self.job!r} was not created within {timeout:g} s (connect_timeout): "
                                            f"rank 0 creates it; is rank 0 running against {self.dispatcher.address}?")
            if warn_at is not None and now >= warn_at:
                log.warning("job %r does not exist on the cluster at %s yet: waiting up to %g s (connect_timeout) "
                            "for rank 0 to create it", self.job, self.dispatcher.address, timeout)
                warn_at = None
            time.sleep(0.1)
        info = self.dispatcher.wait_job_ready(self.job, max(0.1, deadline - time.monotonic()))
        self._load_spec(info.spec, info.uid)
        return info.spec

    @property
    def revision(self) -> int:
        """The job revision this client holds (JobSpec.extensions; 0 before any)."""
        return len(self.spec.extensions) if self.spec is not None else 0

    def extend(self, tensors: dict[str, torch.Tensor], *, unfreeze=(), group: dict | None = None,
               trainable: dict[str, bool] | None = None, initialize: bool = False,
               ready_timeout: float | None = None) -> bool:
        """Add a parameter group to the BSP job before the step this client runs next: the job's
        next revision (docs/architecture.md, "Extending a job"). Every rank calls this with the same
        arguments before the same step; the dispatcher makes the revision once and refuses a rank
        whose request differs, naming the difference.

        ``tensors``: tensors new to the job, trainable unless ``trainable`` says otherwise;
        ``unfreeze``: names of frozen tensors of the job that train in the new group; ``group``: its
        hyperparameters (torch.optim names of the job's optimizer; those it leaves out are the
        job's, as torch's ``add_param_group`` takes the optimizer's defaults). With ``initialize`` (the job's
        creator, rank 0) this client sends the new tensors' initial values and marks the revision
        ready; the others wait for that, up to ``ready_timeout`` (default ``pull_timeout``), and
        then pull them like any tensor. Returns True if this call made the revision.
        """
        from shardline.services.optimizer_config import OptimizerConfig  # validation shared with the PS

        spec = self._require_spec()
        if spec.sync != "bsp":
            raise ShardlineStateError(f"job {self.job!r} is {spec.sync!r}: parameter groups are added during training "
                                      f"only to BSP jobs")
        trainable = trainable or {}
        step = self._current_step()
        ext = common_pb2.JobExtension(revision=self.revision + 1, step=step, unfreeze=list(unfreeze),
                                      group=OptimizerConfig.from_kwargs(spec.optimizer.kind, **{
                                          **OptimizerConfig.from_proto(spec.optimizer).torch_kwargs(), **(group or {})
                                      }).to_proto())
        for name, t in tensors.items():
            ext.tensors.add(name=name, shape=list(t.shape), dtype=storage_dtype(t, trainable.get(name, True)),
                            trainable=trainable.get(name, True))
        resp = self.dispatcher.extend_job(self.job, self.uid, ext)
        log.info("job %s: revision %d (a parameter group from step %d: %d new tensor(s), %d unfrozen) %s", self.job,
                 ext.revision, step, len(tensors), len(ext.unfreeze), "made" if resp.applied else "already made")
        if not tensors:
            self._load_spec(resp.job.spec, resp.job.uid)
        elif initialize:
            self._initialize(resp.job, tensors, step, ext.revision)
        else:
            timeout = self.pull_timeout if ready_timeout is None else ready_timeout
            info = self.dispatcher.wait_job_ready(self.job, timeout, revision=ext.revision)
            self._load_spec(info.spec, info.uid)
        return resp.applied

    def _initialize(self, job: dispatcher_pb2.JobInfo, tensors: dict[str, torch.Tensor], step: int,
                    *revision: int) -> None:
        """This client made the job (or its ``revision``): send ``tensors``' initial values at
        ``step`` to their owners and mark it ready for the other ranks."""
        self._load_spec(job.spec, job.uid)
        self._fill_caches(tensors)
        self._scatter(dp.OP_INIT, [(n, s.index) for n in tensors for s in self._slices[n]], step=step)
        for name in tensors:
            for s in self._slices[name]:
                self._versions[(name, s.index)] = 0
        self.dispatcher.mark_job_ready(self.job, *revision)

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The shape of the job's tensor ``name``."""
        return tuple(self._shapes[name])

    def shared_cache(self, name: str) -> torch.Tensor | None:
        """The cache of ``name``, shaped like the job's tensor, if it is in shared memory (a local
        node copies pulled blocks straight into it); None otherwise."""
        if name not in self._shm.placement:
            return None
        return self._values[name].view(self._shapes[name])

    def _fill_caches(self, tensors: dict[str, torch.Tensor]) -> None:
        """The caches of a job's new ``tensors`` take their initial values (in place: a cache in a
        shared region stays there)."""
        with torch.no_grad():
            for name, t in tensors.items():
                cache = self._values[name]
                if cache.dtype == torch.float32 and cache.numel() == t.numel():
                    cache.copy_(t.detach().reshape(-1))
                else:
                    self._values[name] = t.detach().to(torch.float32).reshape(-1).clone()
                    self._shm.placement.pop(name, None)

    @staticmethod
    def bindable(tensor: torch.Tensor) -> bool:
        """True if ``tensor`` can be a cache (see bind): contiguous, on the CPU, float32 or bfloat16."""
        return tensor.dtype in CACHE_DTYPES and tensor.device.type == "cpu" and tensor.is_contiguous()

    def bind(self, name: str, tensor: torch.Tensor, *, same_contents: bool = False) -> None:
        """Make ``tensor`` (contiguous CPU float32 or bfloat16 of the tensor's shape) the cache of ``name``.

        Pulls then write into it directly, in its dtype: a bfloat16 tensor receives the nodes'
        bf16 conversion of the fp32 masters. Unless ``same_contents`` (the caller guarantees it
        holds exactly the cached values, converted to its dtype), its contents are unknown, so the
        next pull transfers every block of it once. The client's own cache in shared memory
        (``shared_cache``) stays where it is: local nodes go on copying pulls straight into it.
        """
        self._require_spec()
        if name not in self._shapes:
            raise ShardlineConfigError(f"job {self.job!r} has no tensor {name!r}")
        if not self.bindable(tensor):
            raise ShardlineConfigError(f"bind({name!r}) needs a contiguous CPU float32 or bfloat16 tensor, got "
                                       f"{tensor.dtype} on {tensor.device}")
        if tuple(tensor.shape) != self._shapes[name]:
            raise ShardlineConfigError(f"bind({name!r}): shape {tuple(tensor.shape)} != job shape {self._shapes[name]}")
        if name not in self._shm.placement or tensor.dtype != torch.float32 \
                or tensor.data_ptr() != self._values[name].data_ptr():
            self._values[name] = tensor.view(-1)
            self._shm.placement.pop(name, None)  # the caller's tensor is not in a shared region
        if same_contents:
            return
        for s in self._slices[name]:
            self._versions.pop((name, s.index), None)

    # --- data path --------------------------------------------------------------------------
    def pull(self, names=None, *, min_step: int | None = None, timeout: float | None = None,
             copy: bool = True, out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Fetch tensors (default: all of the job, or the names of ``out``). Only blocks newer than
        the cached ones move.

        BSP: waits server-side until the nodes are at ``min_step`` (default: this client's step;
        SSP: this client's step - staleness).
        Returns tensors shaped like the job's; with ``copy=False`` they are views of the client's
        cache, which later pulls overwrite in place (no 64 MB copy per pull). ``out``: the caller's
        tensors (name -> a tensor of the job's shape, any float dtype, CPU) to fill and return,
        reused from pull to pull, so no new memory is allocated (and faulted in) for the result.
        Checked before anything is pulled: ShardlineConfigError names a wrong name, shape or dtype.
        """
        if out is not None:
            names = list(out) if names is None else names
            self._check_out(out, self._names(names))
        names = self._names(names)
        self._pull(names, min_step=min_step, timeout=timeout)
        values = {n: self._values[n].view(self._shapes[n]) for n in names}
        if out is not None:
            with torch.no_grad():
                for n in names:
                    out[n].copy_(values[n])
            return {n: out[n] for n in names}
        return {n: v.clone() for n, v in values.items()} if copy else values

    def _check_out(self, out: dict, names: list[str]) -> None:
        missing = [n for n in names if n not in out]
        if missing or set(out) - set(names):
            raise ShardlineConfigError(f"out= must hold exactly the pulled tensors {names}; it has {sorted(out)}")
        for n in names:
            t = out[n]
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_floating_point():
                raise ShardlineConfigError(f"out[{n!r}] must be a floating-point CPU tensor, got {type(t).__name__}"
                                           f"{'' if not isinstance(t, torch.Tensor) else f' {t.dtype} on {t.device}'}")
            if tuple(t.shape) != self._shapes[n]:
                raise ShardlineConfigError(f"out[{n!r}] has shape {tuple(t.shape)}, the job's tensor {self._shapes[n]}")

    def push(self, grads: dict[str, torch.Tensor | None], *, weight: float = 1.0, commit: bool = True,
             blocks: dict[str, list[int]] | None = None, aggregate: HostAggregate | None = None,
             before_commit: Callable[[], None] | None = None) -> None:
        """Contribute gradients for the current step.

        BSP: push to the owning nodes, then (unless ``commit=False``) commit the step on every
        node; the step is applied once all workers committed, and the client's step advances.
        Several ``push(..., commit=False)`` calls for different tensors may precede ``commit()``.
        ASP: applied on arrival. ``None`` gradients are not sent (the tensor is not stepped unless
        another worker sends one). ``blocks`` (``{name: [block index]}``) sends only those blocks
        of the named tensors (the rest of each go in other pushes of the step, as a flat group's
        blocks do while backward completes them).

        ``aggregate`` (BSP/SSP, a host's leader): send ``aggregate.sums`` for ``aggregate.ranks``
        instead of ``grads``, in one push per node (checked as ``grads`` would be; ``blocks``
        applies to them alike). ``grads`` stay this rank's own gradients, which a replay or a
        node's recovery resends alone; every tensor they have a gradient for needs one in the
        sums. The other ranks then call ``record_pushed`` and ``commit``, once this returned. A
        node that holds a block of the sums from some but not all of the ranks (one pushed alone)
        refuses the whole push: RemoteError AGGREGATE_CONFLICT, and the ranks push alone instead
        (``grads`` stay recorded: pushing them again alone is a resend where the aggregate was taken).

        ``before_commit``: called once every node acknowledged the push, before the commit (a
        host's leader tells its members there, so that their commits follow at once; the push
        still tells the nodes that this rank commits next).
        """
        self._commit_follows = commit
        try:
            self._push(grads, weight, blocks, aggregate)
        finally:
            self._commit_follows = False
        if before_commit is not None:
            before_commit()
        if commit and self._collects:
            self._commit(weight)

    def record_pushed(self, grads: dict[str, torch.Tensor | None], *, weight: float = 1.0) -> None:
        """BSP/SSP: record ``grads`` as this rank's gradients of the current step without sending
        anything: the host's leader pushed them, summed with others', in an aggregated push naming
        this rank with ``weight`` (``push(aggregate=...)``), and it was acknowledged. A replay or a
        node's recovery resends them alone, like any step in flight. Then call
        ``commit(weight=weight)``. Not checked for NaN/Inf here: the nodes checked the sum, which
        is finite only if every gradient in it is."""
        spec = self._require_spec()
        if not self._collects:
            raise ShardlineStateError(f"record_pushed() is for BSP and SSP jobs; job {self.job!r} is {spec.sync!r}")
        _check_weight(weight)
        self._check_aggregates(spec)
        payload, _flats = self._push_payload(spec, grads, None)
        self.start_lease()
        step = self._current_step()
        if self._compressor is not None:
            payload = self._compressor.encode(payload, step)
        self._inflight.record(step, weight, self.staleness, self.lr).grads.update(payload)

    def check_finite(self, grads: dict[str, torch.Tensor | None]) -> None:
        """Raise what a push of ``grads`` would for a NaN/Inf among them (unless the job allows
        them), sending nothing: a host's member checks its own before it hands them to its
        leader, so a bad gradient fails its own step, not the host's push."""
        if self._require_spec().allow_nonfinite:
            return
        for name, g in grads.items():
            if g is not None:
                _check_finite(name, g)

    def _check_aggregates(self, spec) -> None:
        """Aggregated pushes are for BSP/SSP jobs whose gradients are not sign-compressed (a sum of
        several ranks' gradients has no one rank's error feedback)."""
        if spec.sync not in ("bsp", "ssp") or (self._compressor is not None and self._compressor.kind == "sign"):
            raise ShardlineConfigError(f"job {self.job!r} ({spec.sync}, compression "
                                       f"{compression_of(spec)!r}) takes no aggregated pushes: they are for BSP "
                                       f"and SSP jobs without sign compression")

    def _aggregate_payload(self, spec, payload: dict, weight: float, blocks: dict | None,
                           aggregate: HostAggregate) -> tuple[dict, list]:
        """The blocks an aggregated push sends and the flat sums for the NaN/Inf check (as
        ``_push_payload``), after checking ``aggregate`` against this rank, its ``weight`` and its
        own blocks ``payload`` (each must be in the sums)."""
        self._check_aggregates(spec)
        ranks, weights = tuple(aggregate.ranks), tuple(aggregate.weights)
        problem = frame.aggregate_problem(self.rank, weight, ranks, weights)
        if problem:
            raise ShardlineConfigError(problem)
        if ranks[-1] >= spec.world_size:
            raise ShardlineConfigError(f"aggregate names ranks {list(ranks)}: job {self.job!r} has world_size "
                                       f"{spec.world_size}")
        sent, flats = self._push_payload(spec, aggregate.sums, blocks)
        uncovered = [key for key in payload if key not in sent]
        if uncovered:
            name, index = uncovered[0]
            raise ShardlineConfigError(f"aggregate of ranks {list(ranks)} has no sum for block {name}[{index}], "
                                       f"which rank {self.rank}'s own gradients have")
        return sent, flats

    def commit(self, *, weight: float = 1.0, carry_pull: bool = True) -> int:
        """BSP/SSP: declare this worker's pushes for the current step complete. Returns the new step.
        ``carry_pull=False``: this commit carries no pull even with ``pull_on_commit`` (the step's
        values come otherwise: the host's shared pull)."""
        if not self._collects:
            raise ShardlineStateError(f"commit() is for BSP and SSP jobs; job {self.job!r} is {self.sync!r}")
        self._commit(weight, carry_pull=carry_pull)
        return self.step

    def step_sync(self, grads: dict[str, torch.Tensor | None], *, weight: float = 1.0, pull_names=None) -> int:
        """One training step: push, commit (BSP), then pull what changed. Returns the new step."""
        self.push(grads, weight=weight)
        self.pull_changed(pull_names)
        return self.step

    def pull_changed(self, names=None) -> None:
        """Bring the cache (and bound tensors) to the client's step: the second half of step_sync.
        With ``pull_on_commit``, nothing is asked if the commit's replies already brought it."""
        names = self._names(names)
        if not self._took_carried_pull():
            self._pull(names, min_step=None, timeout=None)
        self._forget_pulled_steps()

    def _forget_pulled_steps(self) -> None:
        """The caches hold the client's step. SSP: every block holds the steps before the pull's
        min_step, replicas included, so nothing of them is resent. BSP: the nodes may have served
        the step before their copy holders acknowledged it; the records of steps no reply called
        durable yet stay (at most the previous step), in memory of their own, since the next step
        writes the gradient buffers they were sent from (docs/architecture.md, "Reads before the
        acknowledgement")."""
        if not self._inflight or self.step is None:
            return
        if not self._resends_previous:
            self._inflight.forget_before(self.step - self.staleness)
            return
        self._inflight.forget_before(min(self.step, self.durable_step()))
        self._inflight.detach_before(self.step)

    def durable_step(self) -> int:
        """BSP: the nodes' replies said every step before this one is held by every copy holder
        (the least over the nodes of the routing; 0 for a node that did not say yet)."""
        return min((self._durable_steps.get(node, 0) for node in self.routing.nodes), default=0)

    def reads_cross_hosts(self) -> bool:
        """Whether a BSP pull of a new step would read some block of the job from a node on
        another host (its nearest holder is not on this one)."""
        route = self._route(dp.OP_PULL, max(self.step or 0, 1))
        return any(not self.on_this_host(route(key)) for key in self._job_keys())

    def host_pull_state(self) -> tuple[dict[str, torch.Tensor], dict[tuple[str, int], int]]:
        """The caches (name -> flat tensor) and their block versions, as the host's shared pull
        reads them (the leader) or writes them (a member: ``adopt_host_pull`` then)."""
        return self._values, self._versions

    def adopt_host_pull(self, held_step: int, durable_step: int = 0) -> None:
        """BSP: the caches hold this client's step, copied from the host's leader's pull of it
        (worker/host_step.py), whose oldest node step was ``held_step`` and whose replies called
        the steps before ``durable_step`` durable: what ``pull_changed`` would have left, without
        a request."""
        self.held_step = held_step
        self._durable_steps = dict.fromkeys(self.routing.nodes, durable_step)
        self.stats.shared_steps += 1
        self._forget_pulled_steps()

    def _took_carried_pull(self) -> bool:
        """Whether this worker's last commit brought the step it made: every block of the job came
        in a reply that applied it (blocks are counted, not nodes: a node that failed mid-reply,
        whose blocks others own now, answered for none), and every node of the routing reported
        the step. Then the caches hold it as a pull would leave them."""
        carried, self._carried = self._carried, None
        if carried is None or self._replay.state.due:
            return False
        step, answered, node_steps = carried
        if step != self.step or any(node_steps.get(node, -1) < step for node in self.routing.nodes):
            return False
        # the caches must still be what the replies left: a tensor added since, or blocks whose
        # bytes became unknown (their versions are gone: bound since, a copy broken off), are pulled
        held = self._job_keys()
        if {key for keys in answered.values() for key in keys} != set(held) \
                or any(key not in self._versions for key in held):
            return False
        self.held_step = min(node_steps[node] for node in self.routing.nodes)
        self.stats.carried_steps += 1
        return True

    def _carried_pull_keys(self) -> list[tuple[str, int]]:
        """The blocks a BSP commit carries a pull of (``pull_on_commit``): every block of the job."""
        if not (self.pull_on_commit and self.sync == "bsp" and not self.subscriber_pulls):
            return []
        return self._job_keys()

    def _job_keys(self) -> list[tuple[str, int]]:
        """Every block of the job this client holds the spec of, as (tensor, index)."""
        return [(n, s.index) for n in self._shapes for s in self._slices[n]]

    def join(self, names=None) -> int:
        """Pull the job as the cluster holds it and return the step to run next: the oldest step
        any block still collects (see ``_resume_at``)."""
        self._resume_at(self._names(names))
        self.start_lease()
        return self.step or 0

    def _resume_at(self, names: list[str]) -> None:
        """Pull ``names`` as the cluster holds them and take the step of a (re)started worker from
        the nodes' replies: BSP, the oldest step any block still collects. Redoing it is harmless
        where it was applied or this rank's push arrived (the node ignores the resend), and
        completes it where the rank's push or commit is missing (it died after committing on some
        nodes only, or a block changed owner mid-step)."""
        self._oldest.clear()
        steps = self._pull(names, min_step=0, timeout=None)
        if not steps:
            return
        if not self._collects:
            self.step = max(steps.values())
            return
        oldest = min(min(step, self._oldest.get(node, step)) for node, step in steps.items())
        if oldest < max(steps.values()):
            log.info("job %s: nodes at steps %s, a block still collects step %d: this worker resumes there",
                     self.job, steps, oldest)
            if not self.staleness:
                self._pull_at(names, oldest)
        self.step = oldest

    def _pull_at(self, names: list[str], step: int) -> None:
        """BSP: bring the cached blocks of ``names`` that a node already stepped past ``step`` back
        to their values after exactly ``step`` steps, which that node keeps, so this (restarted)
        worker redoes ``step`` on the parameters its previous incarnation computed it on. A block
        whose node no longer holds them (it restarted meanwhile) stays newer, and is named."""
        ahead = [(n, s.index) for n in names for s in self._slices[n]
                 if self._versions.get((n, s.index), 0) > step]
        if not ahead:
            return
        self._pulling_at_step = True
        try:
            self._scatter(dp.OP_PULL, ahead, step=step, timeout=0.001)
        finally:
            self._pulling_at_step = False
        newer = [key for key in ahead if self._versions.get(key, 0) > step]
        log.info("job %s: %d block(s) a node stepped past step %d pulled as of that step", self.job,
                 len(ahead) - len(newer), step)
        if newer:
            log.warning("job %s: the nodes no longer hold blocks %s as of step %d (a node restarted): this worker "
                        "redoes the step on newer values of them, so its gradient may differ from its first "
                        "incarnation's", self.job, [f"{n}[{i}]" for n, i in newer[:4]], step)

    def _names(self, names) -> list[str]:
        self._require_spec()
        if names is None:
            return list(self._shapes)
        names = [names] if isinstance(names, str) else list(names)
        for n in names:
            if n not in self._shapes:
                raise ShardlineConfigError(f"job {self.job!r} has no tensor {n!r}")
        return names

    def _current_step(self) -> int:
        if self.step is None:
            self._resume_at([])  # learn the step from the nodes
        return self.step or 0

    def _push_payload(self, spec, grads: dict[str, torch.Tensor | None], blocks: dict | None) -> tuple[dict, list]:
        """The blocks a push of ``grads`` sends (``blocks``: only those of each named tensor), checked
        against the job: (key -> a contiguous CPU block of a wire dtype, None for an all-zero one;
        [(name, the part of its flat gradient the push covers)] for the NaN/Inf check)."""
        trainable = {t.name: t.trainable for t in spec.tensors}
        if blocks is not None and not set(blocks) <= set(grads):
            raise ShardlineConfigError(f"blocks= names tensors the push has no gradient for: {sorted(set(blocks) - set(grads))}")
        payload: dict[tuple[str, int], torch.Tensor | None] = {}
        flats: list[tuple[str, torch.Tensor]] = []
        for name, g in grads.items():
            if g is None:
                continue
            if name not in self._shapes:
                raise ShardlineConfigError(f"job {self.job!r} has no tensor {name!r}")
            if not trainable[name]:
                raise ShardlineConfigError(f"tensor {name!r} is frozen in job {self.job!r}; it takes no gradient")
            if g.shape != self._shapes[name]:  # torch.Size is a tuple
                raise ShardlineConfigError(f"gradient for {name!r} has shape {tuple(g.shape)}, tensor is {self._shapes[name]}")
            if g.requires_grad:   # (detach, is_cpu, no reshape of a 1-D one: a step pays these per tensor)
                g = g.detach()
            if not g.is_cpu:
                g = g.to("cpu")
            flat = g if g.dim() == 1 else g.reshape(-1)
            if flat.dtype not in frame.WIRE_DTYPE:
                flat = flat.to(torch.float32)
            if not flat.is_contiguous():
                flat = flat.contiguous()
            slices = self._slices[name]
            # the blocks tile the tensor in order (blocks.block_slices): one split makes every
            # block's view, at a third of the cost of a slice each; a one-block tensor's is itself
            parts = flat.split_with_sizes([s.stop - s.start for s in slices]) if len(slices) > 1 else (flat,)
            if blocks is not None and name in blocks:
                wanted = set(blocks[name])
                if not wanted <= {s.index for s in slices}:
                    raise ShardlineConfigError(f"tensor {name!r} has blocks 0..{len(slices) - 1}, the push names "
                                               f"{sorted(wanted)}")
                if not wanted:
                    continue
                slices, parts = zip(*[(s, part) for s, part in zip(slices, parts) if s.index in wanted])
                flats.extend((name, part) for part in parts)
            else:
                flats.append((name, flat))
            for s, part, zero in zip(slices, parts, zero_parts(flat, [(s.start, s.stop) for s in slices])):
                payload[(name, s.index)] = None if zero else part
        return payload, flats

    def _push(self, grads: dict[str, torch.Tensor | None], weight: float, blocks: dict | None = None,
              aggregate: HostAggregate | None = None) -> None:
        spec = self._require_spec()
        _check_weight(weight)
        payload, flats = self._push_payload(spec, grads, blocks)
        # An aggregated push sends the sums (``sent``) and records this rank's own blocks (``payload``).
        sent = payload
        if aggregate is not None:
            sent, flats = self._aggregate_payload(spec, payload, weight, blocks, aggregate)
        # A push that goes to one node in one frame is checked for NaN/Inf by that node alone: it
        # checks each block as its bytes arrive (cache-hot, on the side of the stream with slack)
        # and refuses the whole push (NONFINITE), keeping nothing of it. A push spread over several
        # nodes is checked whole here first, or some would keep their part; so is a compressed one
        # (the error feedback must not take in a NaN).
        self._wait_for_ring()
        owner, job = self.routing.owner, self.job
        node_checks = (not spec.allow_nonfinite and self._compressor is None
                       and len({owner(job, name, index) for (name, index), g in sent.items()
                                if g is not None}) == 1)
        if not spec.allow_nonfinite and not node_checks:
            for name, flat in flats:
                _check_finite(name, flat)
        self.start_lease()
        step = self._current_step()
        failpoints.hit("worker.before_push", step)
        if self._compressor is not None:
            payload = self._compressor.encode(payload, None if spec.sync == "asp" else step)
            sent = payload if aggregate is None else self._compressor.encode(sent, step)
        if aggregate is not None:
            sent = _AggregatedBlocks(sent, aggregate)
        record = self._inflight.record(step, weight, self.staleness, self.lr).grads if self._collects else {}
        replaced = {key: record[key] for key in payload if key in record}
        record.update(payload)
        if node_checks:
            self._unchecked = {key: g for key, g in sent.items() if g is not None}
        try:
            try:
                self._scatter(dp.OP_PUSH, list(sent), step=step, weight=weight, grads=sent)
            except _NonFiniteGradient:
                raise
            except BaseException:
                # The push failed before a node said it checked it (a node died mid-frame...): the
                # record, which a replay resends, must not keep a NaN that no node refused yet.
                self._check_unchecked()
                raise
        except _NonFiniteGradient:  # nothing of this push stayed anywhere: neither does its record
            for key in payload:
                record.pop(key, None)
            record.update(replaced)
            raise
        finally:
            self._unchecked = {}
        failpoints.hit("worker.after_push", step)

    def _push_checks(self, keys: list) -> None:
        """Before a push frame of ``keys`` goes out (frames to several nodes go out in parallel):
        the blocks left to the node's check (``_unchecked``) stay so while one frame carries them
        all; a frame that carries only some of them (the routing moved mid-push and they now span
        several nodes) checks all of them here first."""
        carried = self._unchecked.keys() & set(keys)
        if carried and carried != self._unchecked.keys():
            self._check_unchecked()

    def _check_unchecked(self) -> None:
        """Check the blocks left to the node's check here, and leave none."""
        for (name, _index), g in list(self._unchecked.items()):  # a copy: another frame's thread may clear it
            _check_finite(name, g)
        self._unchecked.clear()

    def _commit(self, weight: float, *, carry_pull: bool = True) -> None:
        step = self._current_step()
        if failpoints.armed("worker.commit_partial", step):
            first = sorted(self.routing.nodes)[0]
            try:
                self._exchange(first, [], dp.OP_COMMIT, step, weight, None, 0, 0.0)
            except (RemoteError, ShardlineConnectionError) as exc:  # the routing moved on: die all the same
                log.info("worker.commit_partial: the commit to %s failed (%s)", first, exc)
            failpoints.hit("worker.commit_partial", step)
        self._inflight.record(step, weight, self.staleness, self.lr).committed = True
        keys = self._carried_pull_keys() if carry_pull else []
        self._carried = None
        answered: dict[str, list] = {}
        node_steps = self._scatter(dp.OP_COMMIT, keys, step=step, weight=weight, all_nodes=True, carried=answered)
        self.step = step + 1
        if keys:
            self._carried = CarriedPull(self.step, answered, node_steps)

    def _pull(self, names: list[str], *, min_step: int | None, timeout: float | None) -> dict[str, int]:
        if self._reads.wants_routing(self.routing):  # to find the rack's cache (a pull does not need it)
            try:
                self.refresh_routing()
            except ShardlineError as exc:
                log.debug("routing refresh for the rack cache failed: %s", exc)
        if min_step is None:
            # SSP: the step computed next may run up to staleness steps ahead of its parameters.
            min_step = max(0, self.step - self.staleness) if (self.step is not None and self._collects) else 0
        keys = [(n, s.index) for n in names for s in self._slices[n]]
        # A BSP pull of a new step asks every node, also those owning none of these blocks, so every
        # worker sees every node reach the step (and notices a node that restarted behind it); so
        # does every SSP pull (held_step, and the steps in flight it may forget, are over all nodes).
        every_node = not keys or (self._collects and (min_step > 0 or self.staleness > 0))
        total = timeout or self.pull_timeout
        started = time.monotonic()
        deadline = started + total
        # A BSP pull of a new step waits for the slowest rank's commit of the step before it.
        collecting = min_step - 1 if self._collects and min_step > 0 else None
        warn_every = self.straggler_warning_seconds if collecting is not None else 0.0
        warn_at = started + warn_every if warn_every > 0 else None
        # The wait is asked for in slices: between two, the client looks at the routing again (a
        # node that stopped answering, e.g. paused, is found out by the socket timeout meanwhile).
        while True:
            until = deadline if warn_at is None else min(deadline, warn_at)
            wait = max(0.0, min(PULL_SLICE_SECONDS, until - time.monotonic()))
            try:
                node_steps = self._scatter(dp.OP_PULL, keys, min_step=min_step, timeout=wait or 0.001,
                                           all_nodes=every_node)
                if node_steps:
                    self.held_step = min(node_steps.values())
                return node_steps
            except RemoteError as exc:
                if exc.code != ErrorCode.TIMEOUT:
                    raise
                now = time.monotonic()
                if now >= deadline:
                    raise self._step_timeout(collecting, total, exc) from None
                if warn_at is not None and now >= warn_at:
                    _, who = self._who_is_missing(collecting)
                    log.warning("job %s: step %d still waits after %.0f s (pull_timeout %g s): %s", self.job,
                                collecting, now - started, total, who)
                    warn_every = max(warn_every, min(2 * warn_every, MAX_STRAGGLER_WARNING_INTERVAL_SECONDS))
                    warn_at = now + warn_every
                self.refresh_routing()

    def stragglers(self, step: int) -> StragglerReport:
        """Who BSP ``step`` waits for: every PS node of the routing table is asked which ranks'
        commits of it it holds; the dispatcher's leases tell what is known of the missing ranks."""
        nodes = {node_id: info.grpc_address for node_id, info in self.routing.nodes.items()}
        answers = ask_commits(nodes, self.job, step, cluster_token=self.cluster_token, tls_ca=self.tls_ca,
                              timeout=min(STRAGGLER_QUERY_TIMEOUT_SECONDS, self.dispatcher.rpc_timeout))
        report = straggler_report(step, self._require_spec().world_size, answers)
        if not report.missing:
            return report
        try:
            leases = [w for w in self.dispatcher.cluster_status().workers if w.job == self.job]
        except ShardlineError as exc:  # the report goes out without what the dispatcher knows
            log.debug("no worker leases for the straggler report: %s", exc)
            return report
        known = {int(w.rank): lease_text(w) for w in leases}
        return straggler_report(step, self.spec.world_size, answers, known)

    def _who_is_missing(self, step: int) -> tuple[StragglerReport | None, str]:
        """``stragglers(step)`` and its description; (None, why) if asking failed (the warning or
        the timeout goes out all the same)."""
        try:
            report = self.stragglers(step)
        except Exception as err:  # noqa: BLE001 - a report is extra information, never a new failure
            return None, f"asking the PS nodes who is missing failed: {err}"
        return report, report.describe()

    def _step_timeout(self, step: int | None, total: float, exc: RemoteError) -> ShardlineTimeoutError:
        """The error of a pull that waited ``pull_timeout`` (``exc``: the last slice's TIMEOUT)."""
        if step is None:  # not a BSP step: an SSP/ASP pull or one of an explicit min_step 0
            return ShardlineTimeoutError(f"job {self.job!r}: pull waited {total:g} s in all (pull_timeout): "
                                         f"{exc.remote_message}")
        report, why = self._who_is_missing(step)
        if report is None:
            why = f"{exc.remote_message} ({why})"
        elif not (report.missing or report.complete or report.unreachable):
            why = exc.remote_message  # the nodes moved on meanwhile: what the last one said
        return StepTimeoutError(f"job {self.job!r}: step {step} was not applied within {total:g} s (pull_timeout): "
                                f"{why}", ranks=report.missing if report is not None else (), step=step)

    def consistent_pull(self, names=None, *, attempts: int = 50) -> tuple[int, dict[str, torch.Tensor]]:
        """``(step, tensors)``: every tensor as of one same step, also while a BSP job trains (a node
        that applied a step the others have not yet, or a block newer than the step, means the
        pull straddled a step boundary: pull what changed again). Copies, shaped like the job's."""
        names = self._names(names)
        for _ in range(attempts):
            node_steps = self._pull(names, min_step=0, timeout=None)
            step = min(node_steps.values())
            newest = max((self._versions.get((n, s.index), 0) for n in names for s in self._slices[n]), default=0)
            if max(node_steps.values()) == step and newest <= step:
                return step, {n: self._values[n].view(self._shapes[n]).clone() for n in names}
            time.sleep(0.05)
        raise ShardlineStateError(f"job {self.job!r} kept moving: no pull of one consistent step in {attempts} attempts "
                                  f"(checkpoint it and export from the checkpoint directories instead)")

    # --- scatter/gather over nodes ------------------------------------------------------------
    def _conn(self, node_id: str, via=None, connect_timeout: float | None = None) -> DataPlaneConnection:
        """The connection to ``node_id`` (``via``: to that rack cache, for the pulls routed to
        ``node_id``: one per node, so groups of a pull go out in parallel as they would to the nodes).
        ``connect_timeout``: for a new connection, instead of the client's."""
        key, address = (node_id, self.routing.data_address(node_id)) if via is None else (_cache_key(via, node_id),
                                                                                           via.data_address)
        conn = self._conns.get(key)
        if conn is None or conn.address != address:
            if conn is not None:
                conn.close()
            timeout = (self.connect_timeout if connect_timeout is None else connect_timeout) if via is None \
                else self._reads.cache_timeout
            conn = self._conns[key] = DataPlaneConnection(address, self._transport, timeout, self.cluster_token)
        return conn

    def _routing_since(self, known: RoutingView) -> RoutingView:
        """The routing now (``known`` itself if it did not move): the node watch's question."""
        table = self._watch_dispatcher.get_routing(known_epoch=known.epoch, known_pending_epoch=known.pending_epoch,
                                                   timeout=max(1.0, 4 * WATCH_INTERVAL_SECONDS))
        return known if table.unchanged else RoutingView.from_proto(table)

    def refresh_routing(self) -> None:
        old = self.routing
        self.routing = RoutingView.from_proto(self.dispatcher.get_routing())
        if self.routing.epoch != old.epoch:
            self._forget_moved_primaries(old)
            self._replay.epoch_moved()

    def _forget_moved_primaries(self, old: RoutingView) -> None:
        """BSP: blocks whose primary changed are pulled whole next time. This worker may hold a step
        its old primary served before the copy holders had it; the new primary recomputes that step
        from the resent records, in rank order as the first time, but a host's aggregated push is
        resent rank by rank (another grouping of the sum: float32 round-off), and no cache may keep
        bits the cluster no longer has."""
        if not self._resends_previous or not self._versions:
            return
        if not old.nodes or not self.routing.nodes:   # no ring to compare with: pull everything whole
            self._forget_versions(list(self._versions))
            return
        job, before, now = self.job, old.owner, self.routing.owner
        self._forget_versions([key for key in list(self._versions) if before(job, *key) != now(job, *key)])

    def _replay_after_epoch_change(self) -> bool:
        """The epoch changed while a BSP step (SSP: steps) was in flight: push each step's blocks
        again, and commit again on every node if this worker had committed, oldest step first.
        True if it did (worker/recovery.py)."""
        return self._replay.run(
            self.spec is not None and self._collects,
            push=lambda r: self._resending(r, lambda: self._scatter(dp.OP_PUSH, list(r.grads), step=r.step,
                                                                    weight=r.weight, grads=r.grads)),
            commit=lambda r: self._resending(r, lambda: self._scatter(dp.OP_COMMIT, [], step=r.step, weight=r.weight,
                                                                      all_nodes=True)),
            epoch=lambda: self.routing.epoch)

    def _scatter(self, op: int, keys: list[tuple[str, int]], *, step: int = 0, weight: float = 1.0, grads=None,
                 min_step: int = 0, timeout: float = 0.0, all_nodes: bool = False,
                 carried: dict | None = None) -> dict[str, int]:
        """Send ``op`` for ``keys`` to their owners in parallel; on NOT_OWNER refresh and resend those.
        Returns the job step each node that answered reported. A COMMIT's ``keys`` are the pull it
        carries; ``carried`` gets, for each node whose reply brought their blocks, the keys it answered for."""
        if self._lease.lost is not None:
            raise self._lease.lost
        pending = list(keys)
        done_nodes: set[str] = set()
        node_steps: dict[str, int] = {}
        refreshes = 0
        # A node's recovery resends this rank's own blocks alone, not an aggregated push's sums:
        # those go again (the node ignores them where it took them, or refuses a conflict).
        again_after_recovery = op == dp.OP_PULL or self._aggregate_of(op, grads) is not None
        while True:
            if self._replay.state.due and self._replay_after_epoch_change():
                if op == dp.OP_COMMIT:
                    return node_steps  # the replay committed on every node at the new epoch
                done_nodes.clear()
            self._wait_for_ring()
            groups: dict[str, list] = {}
            route = self._route(op, min_step) if pending else None
            for key in pending:
                groups.setdefault(route(key), []).append(key)
            if all_nodes:
                for node_id in self.routing.nodes:
                    if node_id not in done_nodes:
                        groups.setdefault(node_id, [])
            args = (op, step, weight, grads, min_step, timeout, carried)
            if len(groups) == 1:  # no thread hand-off for the common single-node request
                (node_id, blocks), = groups.items()
                futures = {node_id: _Immediate(self._exchange, node_id, blocks, *args)}
            else:
                futures = {node_id: self._pool.submit(self._exchange, node_id, blocks, *args)
                           for node_id, blocks in groups.items()}
            retry, lost, steps, refused, behind = [], [], [], False, False
            for node_id, fut in futures.items():
                try:
                    steps.append(fut.result())
                    node_steps[node_id] = steps[-1]
                    done_nodes.add(node_id)
                except NotOwnerError:
                    refused = True
                    retry.extend(groups[node_id])
                except RemoteError as exc:
                    if exc.code == ErrorCode.COPY_BEHIND:  # read those blocks from their primaries
                        self._reads.copy_behind(node_id, exc)
                        behind = True
                        retry.extend(groups[node_id])
                        continue
                    if exc.code == ErrorCode.WORKER_LOST:
                        self._lease.lost = ShardlineWorkerLostError(f"job {self.job!r} failed: {exc.remote_message}",
                                                                    _ranks_in(exc.remote_message))
                        raise self._lease.lost from None
                    if exc.code not in BUSY_CODES:
                        raise
                    lost.append((node_id, exc))
                except (ShardlineConnectionError, ConnectionError, OSError) as exc:
                    lost.append((node_id, exc))
            gone = False
            for node_id, exc in lost:
                node_step = self._recover(node_id, exc)
                if node_step is None:  # the node left the ring: its blocks have other owners now
                    retry.extend(groups[node_id])
                    gone = True
                elif again_after_recovery:
                    # the recovery re-sent pushes and commits; pulls (and an aggregate's sums) go again
                    retry.extend(groups[node_id])
                else:
                    done_nodes.add(node_id)
                    steps.append(node_step)
                    node_steps[node_id] = node_step
            if steps and self.step is None:
                self.step = max(steps)
            if not refused and not gone and not behind and not (lost and again_after_recovery):
                return node_steps
            if refused:
                refreshes = self._refresh_after_refusal(op, len(retry), refreshes)
            pending = retry

    def _route(self, op: int, min_step: int) -> Callable[[tuple[str, int]], str]:
        """The node each block of an ``op`` request goes to: for a BSP read of a new step, the
        nearest node that holds the block (worker/read_router.py; through a rack cache, the
        primary); for everything else, the block's primary."""
        owner, job = self.routing.owner, self.job
        reads = op in (dp.OP_PULL, dp.OP_COMMIT) and self.spec is not None and copies_may_serve(
            op, self.sync, min_step=min_step, subscriber=self.subscriber_pulls, at_step=self._pulling_at_step,
            pull_applied=op == dp.OP_COMMIT)
        if not reads or self._reads.cache_for(self.routing) is not None:
            return lambda key: owner(job, key[0], key[1])
        sources = self._reads.sources(self.routing, self.spec, self.rank, self.on_this_host)
        return lambda key: sources.get(key) or owner(job, key[0], key[1])

    def on_this_host(self, node_id: str) -> bool:
        """Whether PS node ``node_id`` runs on this host (its data address is one of this host's)."""
        address = self.routing.data_address(node_id)
        local = self._local_addresses.get(address)
        if local is None:
            local = self._local_addresses[address] = is_local_host(parse_host_port(address)[0])
        return local

    def _refresh_after_refusal(self, op: int, resending: int, refreshes: int) -> int:
        """A node refused blocks as NOT_OWNER: take the routing again before ``resending`` them.
        Returns the refreshes in a row that found the ring where it was (``refreshes`` before);
        past ``max_retries`` of them, ShardlineStateError."""
        sent_at = (self.routing.epoch, self.routing.pending_epoch)
        log.info("routing changed (NOT_OWNER); refreshing and resending %d blocks", resending)
        self.refresh_routing()
        if (self.routing.epoch, self.routing.pending_epoch) != sent_at:
            return 0  # the ring moved on (a waiting pull is interrupted by every change): not stuck
        refreshes += 1
        if refreshes > self.max_retries:
            raise ShardlineStateError(f"{dp.Op.Name(op)} still refused as NOT_OWNER after {self.max_retries} "
                                      f"routing refreshes (epoch {self.routing.epoch})")
        time.sleep(min(1.0, 0.05 * 2 ** refreshes))  # the node's routing lags the dispatcher's
        return refreshes

    def _wait_for_ring(self) -> None:
        """Every PS node was declared dead (the ring this client holds is empty): wait until one
        serves again, up to ``recovery_timeout`` (worker/recovery.py)."""
        if self.routing.ring is None:
            wait_for_ring(self.job, lambda: self.routing, self.refresh_routing, recovery_timeout=self.recovery_timeout)

    def _recover(self, node_id: str, cause: Exception) -> int | None:
        """A node dropped out (``cause``): wait until it answers again, then replay this worker's
        part of the steps in flight on it, and return the node's job step. None if the node left
        the routing table instead (declared dead: its replicas own its blocks now)."""
        def in_ring() -> bool:
            self.refresh_routing()
            if node_id in self.routing.nodes:
                return True
            log.info("PS node %r left the ring (epoch %d); its blocks have other owners", node_id, self.routing.epoch)
            return False

        def probe() -> int:   # a node that does not answer a connect is asked again after the routing was checked
            self._conn(node_id, connect_timeout=min(self.connect_timeout, RECOVERY_CONNECT_TIMEOUT_SECONDS))
            return self._exchange(node_id, [], dp.OP_PULL, 0, 1.0, None, 0, 0.0)   # its job step

        return recover_node(node_id, cause, recovery_timeout=self.recovery_timeout, in_ring=in_ring, probe=probe,
                            resend=lambda node_step: self._resend_inflight(node_id, node_step))

    def _resend_inflight(self, node_id: str, node_step: int) -> int:
        """``node_id`` answers again at ``node_step``: resend it this worker's pushes (and commit)
        of the steps in flight that it does not hold. Returns the node's job step."""
        if self.spec is None or not self._collects:
            log.info("PS node %r is back at step %d", node_id, node_step)
            return node_step
        return resend_to_node(self._inflight, node_id, node_step, lambda key: self.routing.owner(self.job, *key),
                              lambda *request: self._resending(self._inflight[request[3]],
                                                               lambda: self._exchange(*request, 0, 0.0)),
                              oldest_step=self._oldest.get(node_id))   # the probe's answer (_recover)

    def _exchange(self, node_id: str, keys: list, op: int, *args) -> int:
        """One request to ``node_id``; a pull goes through the rack's cache when there is one, and
        to the node if the cache fails (worker/read_router.py)."""
        via = self._pull_cache(keys) if op == dp.OP_PULL and not self._pulling_at_step else None
        if via is not None:
            try:
                step = self._exchange_retrying(node_id, keys, op, *args, via=via)
                self._reads.succeeded(via)
                return step
            except RemoteError as exc:
                if exc.code in NODE_ANSWERS:
                    raise
                self._reads.refused(via, exc)
            except (ShardlineConnectionError, ShardlineTimeoutError, ConnectionError, OSError) as exc:
                conn = self._conns.pop(_cache_key(via, node_id), None)
                if conn is not None:
                    conn.close()
                self._reads.failed(via, exc)
        return self._exchange_retrying(node_id, keys, op, *args)

    def _pull_cache(self, keys: list):
        """The rack cache a pull of ``keys`` goes through (CacheInfo), or None: the node."""
        return self._reads.cache_for(self.routing)

    def _exchange_retrying(self, node_id: str, keys: list, op: int, *args, via=None) -> int:
        """One request to ``node_id`` (see _exchange_once); UNKNOWN_JOB for a job this client holds
        is asked once more after a pause: the node may remember a miss of the name from just before
        the job was created (it is forgotten after UNKNOWN_JOB_RETRY_SECONDS). UNKNOWN_TENSOR for
        blocks of this job's own tensors means the node lacks them (a new owner still bringing
        them in sync): asked again until it has them (see _while_lacking)."""
        try:
            return self._exchange_once(node_id, keys, op, *args, via=via)
        except RemoteError as exc:
            if exc.code == ErrorCode.UNKNOWN_TENSOR and via is None and keys \
                    and all(k[0] in self._slices for k in keys):
                return self._while_lacking(node_id, keys, op, args, exc)
            if exc.code != ErrorCode.UNKNOWN_JOB or self.spec is None:
                raise
        time.sleep(UNKNOWN_JOB_RETRY_SECONDS)
        return self._exchange_once(node_id, keys, op, *args, via=via)

    def _while_lacking(self, node_id: str, keys: list, op: int, args: tuple, exc: RemoteError) -> int:
        """``node_id`` answered that it lacks a block of ``keys`` (``exc``): ask again until it has
        it, up to ``recovery_timeout`` from the first such answer (worker/recovery.py)."""
        lacking = (node_id, *keys[0])
        first = self._lacking.setdefault(lacking, time.monotonic())
        return ask_while_lacking(node_id, self.job, exc, first, lambda: self._exchange_once(node_id, keys, op, *args),
                                 lambda: self._lacking.pop(lacking, None), recovery_timeout=self.recovery_timeout)

    @staticmethod
    def _aggregate_of(op: int, grads) -> HostAggregate | None:
        """The HostAggregate a push of ``grads`` sends the sums of (None: this rank's own blocks)."""
        return grads.aggregate if op == dp.OP_PUSH and isinstance(grads, _AggregatedBlocks) else None

    def _request_header(self, node_id: str, keys: list, op: int, step: int, weight: float, min_step: int,
                        timeout: float, via) -> frame.FrameHeader:
        """The header of one request to ``node_id`` (``via``: through that rack cache), without its blocks."""
        header = frame.FrameHeader(op=op, request_id=next(self._request_ids), job=self.job, epoch=self.routing.epoch,
                                   step=step, rank=self.rank, weight=weight, min_step=min_step, wait_timeout_seconds=timeout,
                                   incarnation=self.incarnation, revision=self.revision)
        if via is not None:
            header.via_node = node_id
        header.commit_follows = op == dp.OP_PUSH and self._commit_follows
        header.subscriber = op == dp.OP_PULL and self.subscriber_pulls
        header.at_step = op == dp.OP_PULL and self._pulling_at_step
        header.pull_applied = op == dp.OP_COMMIT and bool(keys)
        # BSP: this worker keeps its previous step's record until the nodes say it is durable, so a
        # primary may serve a read of a new step before its holders acknowledged it
        header.resends_previous_step = self._resends_previous and (
            header.pull_applied or (op == dp.OP_PULL and min_step > 0 and not header.subscriber and not header.at_step))
        if op == dp.OP_PULL and self._reads.rack:
            header.reader_rack = self._reads.rack  # where this job's reads come from (ps_server/heat.py)
        # Pushes carry the lrs under BSP too: a node that steps a block once every rank pushed it
        # needs them before the commits arrive.
        lr = self.lr if self._resent is None else self._resent.lr
        if lr is not None and op in (dp.OP_COMMIT, dp.OP_PUSH):
            if isinstance(lr, tuple):
                header.group_lrs.extend(lr)
            else:
                header.has_lr, header.lr = True, lr
        return header

    def _resending(self, record, send: Callable[[], int]) -> int:
        """``send()`` a resend of ``record`` (a replay or a node's recovery): its requests carry the
        lrs the record was sent with, not the current step's (an lr schedule moved on since)."""
        outer, self._resent = self._resent, record
        try:
            return send()
        finally:
            self._resent = outer

    def _exchange_once(self, node_id: str, keys: list, op: int, step: int, weight: float, grads, min_step: int,
                       timeout: float, carried: dict | None = None, via=None) -> int:
        header = self._request_header(node_id, keys, op, step, weight, min_step, timeout, via)
        aggregate = self._aggregate_of(op, grads)
        if aggregate is not None:
            header.agg_ranks.extend(aggregate.ranks)
            header.agg_weights.extend(aggregate.weights)
        payloads = []
        expected: dict[tuple[str, int], object] = {}
        taken = taken_bytes = 0   # a push's blocks the node takes from a shared region: how many, their bytes
        shared: set = set()  # the ids of the regions shared on this connection for this frame
        conn = self._conn(node_id, via)
        sources = self._shm.push_sources(conn) if op == dp.OP_PUSH else ()
        for name, index in keys:
            s = self._slices[name][index]
            if op == dp.OP_PUSH:
                g = grads[(name, index)]
                if g is None:
                    header.blocks.append(frame.block_ref(name, index, None, zero=True, numel=s.numel))
                    self.stats.pushed_zero_blocks += 1
                elif isinstance(g, SignBlock):
                    header.blocks.append(g.block_ref(name, index))
                    payloads.append(g.payload())
                else:
                    # _push made every block a CPU tensor of a wire dtype; added in place (block_ref
                    # and an append, which copies the message, cost twice as much per block)
                    numel = g.numel()
                    dtype, nbytes = frame.WIRE_DTYPE[g.dtype], numel * g.element_size()
                    source = region_holding(sources, g.data_ptr(), nbytes) if sources else None
                    if source is None:
                        payloads.append(frame.tensor_bytes(g))
                        header.blocks.add(tensor=name, index=index, dtype=dtype, numel=numel, nbytes=nbytes)
                    else:
                        region, offset = source
                        if region.id not in shared:
                            share_region(conn, region, shared)
                        header.blocks.add(tensor=name, index=index, dtype=dtype, numel=numel, nbytes=nbytes,
                                          src_region=region.id, src_offset=offset)
                        taken += 1
                        taken_bytes += nbytes
            elif op == dp.OP_INIT:
                v = self._values[name][s.start:s.stop]
                header.blocks.append(frame.block_ref(name, index, v))
                payloads.append(frame.tensor_bytes(v))
            else:  # pull, in the cache's dtype (unset: FLOAT32); one of values at a step wants them all
                have = None if self._pulling_at_step else self._versions.get((name, index))
                want = frame.WIRE_DTYPE[self._values[name].dtype]
                header.blocks.add(tensor=name, index=index, version=have or 0, has=have is not None,
                                  want_dtype=0 if want == dp.FLOAT32 else want)
                expected[(name, index)] = s
        key = node_id if via is None else _cache_key(via, node_id)
        if op == dp.OP_PUSH:
            self._push_checks(keys)
        pulls = frame.asks_blocks(header)
        if pulls:
            self._shm.begin_cache_write()
        try:
            step = self._exchange_locked(conn, key, node_id, header, payloads, expected, op, timeout, via, carried)
        finally:
            if pulls:
                self._shm.end_cache_write(self._conns.values(), self.job)
        if op == dp.OP_PUSH:  # blocks the node took from a shared region count too
            self.stats.pushed_bytes += header.payload_bytes + taken_bytes
            self.stats.taken_blocks += taken
        return step

    def _exchange_locked(self, conn, key, node_id: str, header, payloads, expected: dict, op: int, timeout: float,
                         via, carried: dict | None = None) -> int:
        with conn.lock:
            if via is not None:   # a rack cache: bounded by its own cache_timeout, not by the ring
                return self._exchange_on(conn, key, node_id, header, payloads, expected, op, timeout, via, carried)
            what = f"{dp.Op.Name(op)}{f' of step {header.step}' if op != dp.OP_PULL else ''}"
            with self._watch.waiting(node_id, conn.address, conn, what, self.step or header.step,
                                     waits=op == dp.OP_PULL and timeout > 0) as wait:
                return self._exchange_on(conn, key, node_id, header, payloads, expected, op, timeout, via, carried,
                                         wait)

    def _exchange_on(self, conn, key, node_id: str, header, payloads, expected: dict, op: int, timeout: float,
                     via, carried: dict | None = None, wait=None) -> int:
        """One request and its reply on ``conn`` (its lock held). ``wait``: the node watch's entry
        of this request (it aborts the connection if the node leaves the ring meanwhile)."""
        placed: set = set()
        receiving = False   # the reply's payload (a node's connection breaking then is handled alike)
        try:
            if frame.asks_blocks(header) and via is None:
                placed = self._shm.ask_placement(conn, header, self._slices)   # may meet a broken socket
            # a node that stops answering (paused, partitioned) is given up on after this, or as
            # soon as it leaves the ring (the node watch)
            io_timeout = IO_TIMEOUT_SECONDS if via is None else self._reads.cache_timeout
            conn.sock.settimeout(io_timeout + (timeout if op == dp.OP_PULL else 0.0))
            frame.send_frame(conn.sock, header, payloads)
            reply = frame.recv_header(conn.sock, REPLY_LIMITS)
            receiving = reply.op != dp.OP_ERROR
            if receiving and op == dp.OP_PULL:
                self._receive_blocks(conn, key, reply, expected, placed)
                self._oldest[node_id] = reply.oldest_step
                if header.resends_previous_step:
                    self._note_durable(node_id, header.min_step, reply)
            elif receiving and op == dp.OP_COMMIT:  # the blocks of the pull it carried, if the node applied the step
                self._receive_blocks(conn, key, reply, expected if reply.pull_applied else {}, placed)
                if header.pull_applied and reply.pull_applied and carried is not None:
                    carried.setdefault(node_id, []).extend((ref.tensor, ref.index) for ref in header.blocks)
                if header.resends_previous_step and reply.pull_applied:
                    self._note_durable(node_id, header.step + 1, reply)
        except (OSError, ConnectionError) as exc:
            if receiving and isinstance(exc, ShardlineError):
                raise   # an unexpected block: named, and its connection closed already
            if placed:  # the node may be copying into them still (stalled, not dead): worker/shm_exchange.py
                self._forget_versions(placed)
                self._shm.given_up_mid_pull()
            conn.close()
            self._conns.pop(key, None)
            who = f"node {node_id!r}" if via is None else f"rack cache {via.cache_id} (pulling for node {node_id!r})"
            raise ShardlineConnectionError(f"{who} at {conn.address}: "
                                           f"{wait.abandoned if wait is not None and wait.abandoned else exc}") from exc
        if reply.op == dp.OP_ERROR:
            code = ErrorCode(dp.ErrorCode.Name(reply.code))
            if reply.code == dp.INTERNAL:
                self._forget_versions(placed)
            if reply.code == dp.NOT_OWNER:
                raise NotOwnerError(code, reply.message, epoch=reply.epoch, step=reply.step)
            if reply.code == dp.NONFINITE and op == dp.OP_PUSH:  # the node's check of a push left to it
                raise _NonFiniteGradient(f"{reply.message}; not pushed (refused by node {node_id!r})")
            if reply.code in (dp.BAD_FRAME, dp.TOO_LARGE):
                conn.close()
                self._conns.pop(key, None)
            raise RemoteError(code, reply.message, epoch=reply.epoch, step=reply.step)
        return reply.step

    def _note_durable(self, node_id: str, read_step: int, reply) -> None:
        """``node_id`` served a read of ``read_step`` to this worker, which resends its previous
        step: the steps before its reply's ``durable_step`` are held by every copy holder there
        (a node that served the read strictly, e.g. through a rack cache, echoes no
        ``resends_previous_step``: then before ``read_step``). One entry per node: a dict
        assignment, safe from the scatter's threads."""
        self._durable_steps[node_id] = reply.durable_step if reply.resends_previous_step else read_step

    def _forget_versions(self, keys) -> None:
        """The cached bytes of ``keys`` are unknown now (a node's copy into them broke off): the
        next pull moves them whole."""
        for key in keys:
            self._versions.pop(key, None)

    def _receive_blocks(self, conn: DataPlaneConnection, node_id: str, reply, expected: dict,
                        placed: set = frozenset()) -> None:
        """Receive a pull reply's payload straight into the cached tensors, validating each block
        first: one the pull asked for, once, in the cache's dtype (so a reply is never larger than
        what was asked); a block the node placed in the shared cache (``placed``: asked so) has
        no payload bytes."""
        stats, versions = self.stats, self._versions
        blocks = placed_blocks = nbytes = 0   # counted once at the end (a stats update per block adds up)
        cache_bytes: dict[str, memoryview] = {}   # a byte view per cache: slicing it costs ~1/70 of a tensor slice's view
        try:
            for ref in reply.blocks:
                key = (ref.tensor, ref.index)
                s = expected.pop(key, None)
                cache = None if s is None else self._values[key[0]]
                if cache is None or ref.dtype != frame.WIRE_DTYPE[cache.dtype] or ref.numel != s.numel or ref.zero \
                        or (ref.placed and key not in placed):
                    conn.close()
                    self._conns.pop(node_id, None)
                    raise ShardlineConnectionError(f"node {node_id!r} sent an unexpected block {key[0]}[{key[1]}]")
                if ref.placed:  # already in the cache: no view of it needed
                    placed_blocks += 1
                else:
                    whole = cache_bytes.get(key[0])
                    if whole is None:
                        whole = cache_bytes[key[0]] = frame.tensor_bytes(cache)
                    size = cache.element_size()
                    frame.recv_exactly_into(conn.sock, whole[s.start * size:s.stop * size])
                versions[key] = ref.version
                nbytes += ref.nbytes
                blocks += 1
        finally:
            stats.placed_blocks += placed_blocks
            stats.pulled_bytes += nbytes
            stats.pulled_blocks += blocks

    # --- lease ------------------------------------------------------------------------------
    def start_lease(self) -> None:
        """Renew this worker's lease of (job, rank) in the background (idempotent; worker/lease.py)."""
        if self.spec is not None:
            self._lease.start()

    def close(self) -> None:
        self._lease.stop_renewing()
        self._watch.close()
        self._lease.release()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._pool.shutdown(wait=False)
        self._shm.close()
        self.dispatcher.close()
        self._watch_dispatcher.close()
        self._lease.join()   # its call in flight was cancelled by the close above

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cache_key(info, node_id: str) -> tuple:
    """The key of the connection to a rack cache for pulls routed to ``node_id`` (a tuple: never
    equal to a node id, the key of a connection to a node)."""
    return ("cache", info.cache_id, node_id)


def _ranks_in(message: str) -> tuple[int, ...]:
    """The ranks a WORKER_LOST message names ("rank 1 ...", "ranks [1, 3] ...")."""
    import re

    match = re.search(r"ranks? \[?([\d, ]+)\]?", message)
    return tuple(int(r) for r in re.findall(r"\d+", match.group(1))) if match else ()


def connect(cluster: str, job: str, **kwargs) -> Client:
    """Connect to the cluster whose dispatcher is at ``cluster`` (HOST:PORT) for ``job``."""
    return Client(cluster, job, **kwargs)
