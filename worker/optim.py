"""``PSOptimizer``: a drop-in optimizer for torch training loops backed by a Shardline cluster.

``step()`` pushes the gradients (blocks whose gradient is exactly zero go as a flag), commits the
step under BSP, waits server-side for the cluster to apply it, and pulls only the blocks that
changed straight into the parameters. The optimizer math runs on the PS nodes. With ``overlap``
the push and the commit already go out during backward (worker/overlap.py), and with
``prefetch_window=1`` the pull streams in forward order (worker/priority_pull.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from shardline.services.optimizer_config import OptimizerConfig, group_configs
from shardline.services.config import parse_address_list
from shardline.services.errors import ShardlineConfigError, ShardlineStateError
from shardline.services.security import client_credentials
from shardline.worker.client import DEFAULT_STRAGGLER_WARNING_SECONDS, Client
from shardline.worker import metrics
from shardline.worker.options import (ConnectionOptions, JobOptions, PerformanceOptions, check_job_matches,
                                      check_options)
from shardline.worker.flat_params import FlatGroup, flat_layout, groups_that_could_be_flat, is_flat_name
from shardline.worker.overlap import DEFAULT_BUCKET_CAP_MB, BackwardPusher, FlatBackwardPusher, bucket_cap_bytes
from shardline.worker.priority_pull import PriorityPull
from shardline.worker.host_group import HostGroup, PullLayout
from shardline.worker.host_step import aggregation_wanted, pull_shared, pull_step, push_step
from shardline.services.compression import compression_of

log = logging.getLogger("shardline.worker")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ShardlineConfigError(f"environment variable {name} must be an integer, got {value!r}") from None


def tuple_or(value):
    """A list (betas restored from a state dict or JSON) compares as the tuple torch.optim keeps."""
    return tuple(value) if isinstance(value, list) else value


def _named_groups(params) -> list[dict]:
    """``params`` as torch.optim param-group dicts whose "params" are (name, parameter) pairs.

    Accepts a module, an iterable of (name, parameter) pairs, or a list of group dicts whose
    "params" is a module or such pairs. Plain tensors have no names: a clear error says what to pass.
    """
    what = ("PSOptimizer needs named parameters (the cluster stores them by name): pass the model, "
            "model.named_parameters(), or param groups whose \"params\" are (name, parameter) pairs")
    if isinstance(params, torch.Tensor):
        raise ShardlineConfigError(f"{what}; got a single tensor")
    if isinstance(params, torch.nn.Module):
        return [{"params": list(params.named_parameters())}]
    items = list(params)
    if not items:
        raise ShardlineConfigError("PSOptimizer got no parameters")
    if all(isinstance(i, dict) for i in items):
        groups = []
        for i, group in enumerate(items):
            group = dict(group)
            if "params" not in group:
                raise ShardlineConfigError(f"param group {i} has no \"params\"")
            members = group["params"]
            members = list(members.named_parameters()) if isinstance(members, torch.nn.Module) else list(members)
            if not all(_is_named(m) for m in members):
                raise ShardlineConfigError(f"{what}; param group {i} lists unnamed parameters")
            group["params"] = members
            groups.append(group)
        return groups
    if all(_is_named(i) for i in items):
        return [{"params": items}]
    raise ShardlineConfigError(f"{what}; got {type(items[0]).__name__} items (model.parameters()?)")


def _is_named(item) -> bool:
    return (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor))


class PSOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose state and update live on the parameter servers.

    ``params``: the model, ``model.named_parameters()``, or a list of param-group dicts whose
    ``"params"`` are (name, parameter) pairs, with per-group options (``lr``, ``weight_decay``,
    ``betas``, ``eps``, ``momentum``...: torch.optim's names for ``optimizer``). The other keyword
    arguments of the optimizer are every group's defaults. Each group's hyperparameters are stepped
    on the PS, exactly as ``torch.optim.<Opt>`` steps the same groups. Frozen parameters
    (``requires_grad=False``) are registered too, so workers that did not create the job get them
    from the cluster; they never change, so after the first pull they cost nothing.

    Gradient clipping: ``max_grad_norm`` (BSP) makes the PS nodes clip each step's *mean*
    gradient by its global norm over every tensor before the optimizer step, which is what
    ``clip_grad_norm_`` followed by ``step()`` does on one process. Do not call ``clip_grad_norm_``
    on a worker's gradient as well: it clips the local gradient, not the mean (with the
    ``transformers.Trainer``, set ``max_grad_norm=0`` in its arguments and pass it here).

    Compression: ``compression="bf16"`` or ``"sign"`` (1-bit signs with error feedback) makes the
    job's workers push compressed gradients (docs/architecture.md, "Gradient compression"): fewer
    bytes per step, and BSP no longer equals torch.optim. Default ``"none"``; a worker joining a job
    takes the job's.

    Restarts: a rank restarted to redo a step that some PS node already applied (it died after
    committing on some nodes, and a node without its commit died too) recomputes it on that step's
    parameters, which the nodes keep for it: one copy of the values per step and 4 bytes per
    parameter on the PS. ``exact_restarts=False`` saves both; that double fault then perturbs the
    run by the difference of one rank's gradient. Default True; a worker joining a job takes the job's.

    Replication: with replicas (the default: two copies of every block), a BSP or SSP job's primary
    sends them each step's mean gradient and lr, and the replicas run the same step (a third of
    the bytes of a copy of value and Adam's moments), when every PS node reports the same build
    fingerprint (the dispatcher decides at job creation; docs/architecture.md, "Replication").
    ``replicate_gradients=False`` sends copies of value and optimizer state instead (equal by
    construction, whatever the builds); ``True`` asks for replay and is refused on nodes of mixed
    builds. Default None: the dispatcher's choice; a worker joining a job takes the job's. Under
    BSP a worker reads each block from the nearest node holding it (its own host's first).

    Learning rates: LR schedulers from ``torch.optim.lr_scheduler`` (or code) set
    ``param_groups[i]["lr"]``; each step's commit carries every group's lr to the servers. The other
    hyperparameters are fixed when the job is created: changing one later raises
    ShardlineConfigError at ``step()`` (e.g. OneCycleLR needs ``cycle_momentum=False``).

    ``add_param_group`` during training (BSP): a new group of (name, parameter) pairs, tensors new
    to the job and/or frozen ones (registered with ``requires_grad=False``, set to True before the
    call) that train from now on; they leave the group they were registered in. Every rank must make
    the same call before the same step (a rank that differs is refused, naming the difference; so is
    a rank that skips it). The new group's optimizer state starts fresh, as in torch.optim.

    ``state_dict()`` holds what a training script restores with its own checkpoint: the job name,
    its version (steps applied) and every group's hyperparameters (the scheduler's lr included);
    the optimizer state itself (moments, momentum buffers) stays on the cluster, which checkpoints
    it. ``load_state_dict`` restores the groups' hyperparameters of the same job.

    Rank 0 creates the job from its parameters if the cluster lacks it; every other rank (and every
    rank of a resumed job) starts from the values the cluster holds.
    ``world_size``/``rank`` default to ``WORLD_SIZE``/``RANK`` (as torchrun sets them), else 1/0.

    SSP: ``sync="ssp"`` with ``staleness=s`` (s >= 1) lets a worker run up to s steps ahead of the
    slowest: after committing step v, ``step()`` (or, with ``prefetch_window=1``, the next forward)
    waits only until the job applied step v - s, and pulls the newest parameters there are, so the
    step computed next (``version``) runs on parameters of a version (``held_version``) at least
    ``version - s``. Each step is still applied once every rank committed it, with the mean of the
    ranks' gradients of that step, but those gradients may come from parameters up to s steps old:
    BSP's equality with torch.optim no longer holds (docs/architecture.md, "SSP").

    ``overlap=True`` (opt-in; default False): push during backward, as DDP's reducer all-reduces.
    It is off by default because it changes what a script must do (below) and, where a rank has no
    spare core, the sends take CPU from its backward (bench/README.md, vs_ddp). Post-accumulate-
    grad hooks push each bucket of about ``bucket_cap_mb`` MiB of gradients (reverse layer order,
    then the order the first backward produced them) from a background thread as soon as all its
    gradients are final, while backward goes on; when backward ends the rest goes out with the
    commit, and ``step()`` only waits for it (and for the pull). What went out must be what
    ``step()`` would send: the lrs of ``param_groups`` are read when backward starts pushing (set
    them, i.e. step the scheduler, before backward; a change made after is a ShardlineConfigError
    at ``step()``), and so is the weight: declare it before backward with
    ``opt.set_step_weight(w)`` (``step(weight=w)`` then only checks it). Gradient accumulation:
    run every backward but the last of a step inside ``with opt.no_sync():`` (a second backward
    outside it is refused at ``step()``). Gradients changed after backward (scaled, clipped on
    the worker) are not seen: use ``overlap=False`` for that. ``step()`` with gradients but no
    backward since the last step (set by hand, or accumulated only under ``no_sync``) pushes them
    itself. An error of a background push (NaN gradient, node lost past ``recovery_timeout``) is
    raised by ``step()``; the step is then not committed.

    ``flatten=True`` (opt-in): the job stores each param group's trainable parameters as one float32
    tensor, as DDP buckets gradients and FSDP flattens parameters (worker/flat_params.py): the
    parameters become views of it, ``step()`` gathers their gradients into one buffer, and a step
    moves and applies a few large blocks instead of one block per parameter (each costs Python
    work on the worker and the node: bench/step_overhead.py). BSP still equals torch.optim (the
    optimizers are elementwise). It needs float32 CPU parameters, every trainable parameter of a
    group with a gradient at each ``step()`` (or none of them: torch.optim skips one without, a
    flat step cannot); the pull is not by priority, and groups cannot be added during training.
    With ``overlap=True`` too, the buckets are the flat tensor's blocks (``block_elements``): a
    block is gathered into the buffer and goes out once all of its gradients are final, as DDP's
    gradient bucket views; the commit then goes from ``step()``, which gets the new parameters in
    its replies (the rules for lrs, weight and ``no_sync`` above hold). The job's tensors are then
    named ``flat<group>.<digest>`` (frozen parameters keep their names): weight subscribers, which
    read parameters by name, need the default layout; ``shardline export --hf-dir`` splits a
    one-group job back. Default False, since only the script knows whether every step gives all
    of a group's parameters a gradient and the layout is fixed when the job is created; rank 0's
    first step logs (INFO) the groups that had one for every parameter this time
    (docs/architecture.md, "Flat parameters"). Every worker of a job must pass the same.

    ``prefetch_window``: 0, ``step()`` returns once the parameters hold the new version; 1,
    ``step()`` returns after the commit and the pull runs in the background (a fast BSP worker
    prepares its next batch while the slowest finishes) until the parameters are next used.
    With ``priority_pull`` (default True) it pulls in forward order (learnt from the first
    forward) and each module's forward waits only for its own parameters, so the next forward
    starts once its first layer arrived; ``step()``, ``wait()`` and ``zero_grad(set_to_none=False)``
    wait for all of it. Without it (and with ``flatten``) the forward of any module holding one of
    the optimizer's parameters, and ``zero_grad()``, wait for the whole pull; every thread that
    waits returns only once it landed. Code that reads the parameters outside their own module's
    forward must call ``wait()``.
    ``opt.forward_wait_seconds`` adds up what module forwards waited for pulls. ``close()`` when done.
    ``cluster_token``/``tls_ca`` default to the files named by ``SHARDLINE_CLUSTER_TOKEN_FILE`` /
    ``SHARDLINE_TLS_CA_FILE`` (what ``shardline up`` prints), else none.
    ``straggler_warning_seconds``: a step still waiting this long for other ranks logs a WARNING
    naming the ranks that have not committed it (0: no warning); when ``pull_timeout`` runs out,
    StepTimeoutError names them. A wrong ``cluster`` fails at once (ShardlineConfigError); an
    unreachable one logs a WARNING after 5 s and fails after ``connect_timeout``.
    ``rack`` (default ``$SHARDLINE_RACK``): pulls go through that rack's cache (L2) when the routing
    lists one, and to the PS nodes when it fails (docs/architecture.md, "Rack caches (L2)").

    Metrics (docs/metrics.md, worker/metrics.py): every step is recorded in prometheus-client's
    default registry (a script's own exporter shows them): ``shardline_worker_steps_total``, step
    time, push/pull bytes, pull wait and version, labelled with the job and rank.
    ``metrics_port=N`` also serves that registry on ``metrics_host:N`` (0: a free port; the address
    is ``opt.metrics_address``) until ``close()``; a ``metrics_host`` other than loopback needs a
    cluster token.
    """

    def __init__(self, params, cluster: str, job: str, *,
                 optimizer: str = "adamw", sync: str = "bsp", staleness: int | None = None,
                 world_size: int | None = None, rank: int | None = None,
                 block_elements: int | None = None, transport: str = "auto", pull_timeout: float = 600.0,
                 connect_timeout: float = 60.0, rpc_timeout: float = 10.0, allow_nonfinite: bool = False, cluster_token: bytes | None = None,
                 prefetch_window: int = 0, recovery_timeout: float = 120.0, replication: int | None = None,
                 worker_lease_timeout: float | None = None, on_worker_failure: str | None = None,
                 tls_ca: bytes | None = None, straggler_warning_seconds: float = DEFAULT_STRAGGLER_WARNING_SECONDS,
                 max_grad_norm: float | None = None, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 overlap: bool = False, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, priority_pull: bool = True,
                 compression: str | None = None, rack: str | None = None, exact_restarts: bool | None = None,
                 replicate_gradients: bool | None = None, flatten: bool = False,
                 host_aggregation: bool | None = None, **optimizer_kwargs):
        check_options({"prefetch_window": prefetch_window, "overlap": overlap, "priority_pull": priority_pull,
                       "flatten": flatten, "exact_restarts": exact_restarts,
                       "replicate_gradients": replicate_gradients, "host_aggregation": host_aggregation})
        # Checked here, not first by the client: the first torch.optim.Optimizer built in a process
        # imports torch._dynamo (about 1 s), and a typo in the address should fail at once.
        parse_address_list(cluster, what="cluster")
        cap_bytes = bucket_cap_bytes(bucket_cap_mb)
        defaults_config = OptimizerConfig.from_kwargs(optimizer, **optimizer_kwargs)
        cluster_token, tls_ca = client_credentials(cluster_token, tls_ca)
        if metrics_port is not None:  # refuse a bad metrics address before joining the job
            metrics.check_bind(metrics_host, metrics_port, has_token=cluster_token is not None)
        connection = ConnectionOptions(transport=transport, pull_timeout=pull_timeout, connect_timeout=connect_timeout,
                                       rpc_timeout=rpc_timeout, recovery_timeout=recovery_timeout,
                                       cluster_token=cluster_token, tls_ca=tls_ca,
                                       straggler_warning_seconds=straggler_warning_seconds, rack=rack)
        performance = PerformanceOptions(prefetch_window=prefetch_window, overlap=overlap, bucket_cap_mb=bucket_cap_mb,
                                         priority_pull=priority_pull, host_aggregation=host_aggregation)
        self._metrics_server, self.metrics_address = None, None
        self.kind = defaults_config.kind
        self._hyper_keys = tuple(defaults_config.torch_kwargs())  # what the servers step with
        self._constructed = False
        super().__init__(_named_groups(params), defaults_config.torch_kwargs())
        self._group_configs = [self._group_config(i, g) for i, g in enumerate(self.param_groups)]
        self._constructed = True
        self.prefetch_window = prefetch_window
        self._pending = None        # background pull of the last step (prefetch_window 1)
        self._pending_lock = threading.Lock()
        self._hook = None
        # The one thread that talks to the cluster while the training thread computes (pushes
        # during backward, the prefetching pull): the client is never used by two threads at once.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardline-comm")
        self._cap_bytes = cap_bytes
        self._step_weight: float | None = None   # set_step_weight(), for the next step
        self._pusher: BackwardPusher | None = None
        self._host_group: HostGroup | None = None   # this worker's host aggregation group, if any
        self._priority: PriorityPull | None = None
        self.forward_wait_seconds = 0.0  # spent in module forward pre-hooks waiting for pulls (benchmarks)
        self._forward_wait_observed = 0.0  # ... of which the pull-wait metric has seen
        job_tensors, trainable, groups_of = self._job_layout(flatten)
        self.world_size = _env_int("WORLD_SIZE", 1) if world_size is None else int(world_size)
        self.rank = _env_int("RANK", 0) if rank is None else int(rank)
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ShardlineConfigError(f"rank {self.rank!r} must be in [0, world_size={self.world_size!r})")
        self.job_options = JobOptions(
            world_size=self.world_size, rank=self.rank, sync=sync, staleness=staleness, block_elements=block_elements,
            allow_nonfinite=allow_nonfinite, replication=replication, worker_lease_timeout=worker_lease_timeout,
            on_worker_failure=on_worker_failure, max_grad_norm=max_grad_norm, compression=compression,
            exact_restarts=exact_restarts, replicate_gradients=replicate_gradients, flatten=flatten)
        self.client = Client(cluster, job, rank=self.rank, **connection.client_kwargs())
        created = self._create_or_join(job_tensors, trainable, groups_of)
        # Pulls land directly in parameters that are contiguous CPU fp32 or bf16 (bf16 ones are pulled
        # as bf16: half the bytes); others go through the fp32 cache.
        self._copy_back = []
        for f in self._flat:
            self._attach_flat(f, job_tensors[f.name], same_contents=created)
        for name, p in self.params:
            if name not in self._flat_members:
                self._attach_cache(name, p, same_contents=created)  # the creator initialized the job with them
        self.client.join(list(job_tensors))
        self._sync_copies()
        self._start_overlap(performance, cap_bytes)
        self._host_group = self._join_host_group(cluster, performance)
        self._flat_hint_due = not self.flatten and self.rank == 0   # once, at the first step with gradients
        self._metrics = metrics.StepMetrics(job, self.rank)
        self._metrics.transferred(self.client.stats, self.version)
        if metrics_port is not None:
            try:
                self._metrics_server, self.metrics_address = metrics.serve(
                    metrics_host, metrics_port, has_token=self.client.cluster_token is not None)
            except BaseException:
                self.close()
                raise

    def _job_layout(self, flatten: bool) -> tuple[dict, dict, dict]:
        """The job's tensors as this worker lays them out: (name -> initial values, name -> whether
        it trains, name -> its param group): a flat group (``flatten``) under its flat name, each
        other parameter under its own."""
        self._index_params()
        names = [n for n, _ in self.params]
        if len(set(names)) != len(names):
            raise ShardlineConfigError("parameter names must be unique")
        # flatten: the job stores each group's trainable parameters as one tensor (worker/flat_params.py)
        self.flatten = flatten
        self._flat: list[FlatGroup] = flat_layout(self.param_groups) if flatten else []
        self._flat_grads: dict[str, torch.Tensor] = {}   # each flat group's gradient buffer (BSP)
        self._flat_members = flat_members = {name for f in self._flat for name, _ in f.members}
        plain = [(n, p) for n, p in self.params if n not in flat_members]
        groups_of = {name: i for i, g in enumerate(self.param_groups) for name in g["param_names"]}
        job_tensors = {**{f.name: f.values() for f in self._flat}, **{n: p.detach() for n, p in plain}}
        trainable = {**{f.name: True for f in self._flat}, **{n: p.requires_grad for n, p in plain}}
        groups_of = {**{f.name: f.group for f in self._flat},
                     **{n: i for n, i in groups_of.items() if n not in flat_members}}
        return job_tensors, trainable, groups_of

    def _create_or_join(self, job_tensors: dict, trainable: dict, groups_of: dict) -> bool:
        """Rank 0 creates the job from ``job_tensors`` if the cluster lacks it; every rank then
        checks the job is what its options and parameters say. True if this call created it."""
        created = False
        several = len(self.param_groups) > 1
        if self.rank == 0:
            created = self.client.init(
                job_tensors, optimizer=self.kind, trainable=trainable,
                param_groups=[c.torch_kwargs() for c in self._group_configs] if several else None,
                tensor_groups=groups_of if several else None, **self.job_options.create_kwargs(),
                **({} if several else self._group_configs[0].torch_kwargs()))
        else:
            self.client.wait_ready(self.client.connect_timeout)
        spec = self.client.spec
        check_job_matches(spec, self.job_options)
        self._check_job_tensors(spec, job_tensors)
        self._check_job_groups(spec, groups_of)
        return created

    def _start_overlap(self, performance: PerformanceOptions, cap_bytes: int) -> None:
        """Push during backward (``overlap``) and pull in forward order (``priority_pull``) as asked."""
        if performance.overlap and self.flatten:
            self._pusher = FlatBackwardPusher(self._flat, {f.name: self.client._slices[f.name] for f in self._flat},
                                              buffer=self._flat_grad_buffer, send=self._send_flat,
                                              submit=self._executor.submit, round_info=self._round_info)
        elif performance.overlap:
            self._pusher = BackwardPusher(self.params, send=self._send, submit=self._executor.submit,
                                          round_info=self._round_info, cap_bytes=cap_bytes)
        if performance.prefetch_window == 1 and performance.priority_pull and not self.flatten:
            self._priority = PriorityPull(self.params, cap_bytes)   # a flat group arrives whole
            self._install_forward_hook()  # the first forward teaches the order
        # A whole-step pull rides on the commit: the rank that completes a step (the one every
        # other waits for) gets it in the commit's replies, a round trip sooner. Not where overlap
        # commits when backward ends: the parameters must not change before step().
        self.client.pull_on_commit = self._priority is None and (self._pusher is None or not self._pusher.commits)

    def _join_host_group(self, cluster: str, performance: PerformanceOptions) -> HostGroup | None:
        """This worker's place in its host's aggregation group (worker/host_step.py says when it
        has one): the job's trainable tensors, in the job's order, are what the group sums."""
        spec = self.client.spec
        if not aggregation_wanted(performance.host_aggregation, sync=spec.sync, compression=compression_of(spec),
                                  overlap=performance.overlap, nodes=self.client.routing.nodes,
                                  is_local=self.client.on_this_host):
            return None
        layout = [(t.name, math.prod(self.client.shape_of(t.name))) for t in spec.tensors if t.trainable]
        # the host's shared pull (pull_step): every tensor of the job, as this worker caches it
        caches, _ = self.client.host_pull_state()
        pull_layout = PullLayout([(t.name, caches[t.name].numel(), str(caches[t.name].dtype)) for t in spec.tensors],
                                 int(spec.block_elements))
        return HostGroup(f"{cluster}|{spec.name}|{self.client.uid}", self.rank, layout,
                         incarnation=self.client.incarnation, pull_layout=pull_layout)

    def _attach_cache(self, name: str, p: torch.Tensor, *, same_contents: bool) -> None:
        """Make pulls of ``name`` land in parameter ``p``. An fp32 parameter takes the client's
        cache as its storage where that is in shared memory (a local node then copies pulled
        blocks straight into it: one copy); another contiguous CPU fp32/bf16 one becomes the
        cache (``bind``); any other is copied back after each pull. ``same_contents``: ``p`` holds
        what the job was initialized with (the cache holds it too)."""
        shared = self.client.shared_cache(name)
        if shared is not None and p.dtype == torch.float32 and p.device.type == "cpu" \
                and tuple(p.shape) == tuple(shared.shape):
            with torch.no_grad():
                if not same_contents:
                    shared.copy_(p.data)
                p.data = shared
            self.client.bind(name, shared, same_contents=same_contents)
        elif self.client.bindable(p.data):
            self.client.bind(name, p.data, same_contents=same_contents)
        else:
            self._copy_back.append((name, p))

    def _index_params(self) -> None:
        """``params``: (name, parameter) of every group, in order; ``_param_ids``: whose module's
        forward waits for a pull (_before_forward)."""
        self.params = [(name, p) for g in self.param_groups for name, p in zip(g["param_names"], g["params"])]
        self._param_ids = {id(p) for _, p in self.params}

    def _attach_flat(self, flat: FlatGroup, values: torch.Tensor, *, same_contents: bool) -> None:
        """Make ``flat``'s parameters views of one float32 tensor that is the group's cache (the
        client's shared one where there is one: a local node copies pulls straight into it),
        holding ``values`` (``flat.values()``) until the next pull."""
        storage = self.client.shared_cache(flat.name)
        if storage is None:
            storage = torch.empty(flat.numel, dtype=torch.float32)
        with torch.no_grad():
            storage.copy_(values)
        self.client.bind(flat.name, storage, same_contents=same_contents)
        flat.view_into(storage)

    def _check_job_tensors(self, spec, job_tensors: dict) -> None:
        """The job must store what this worker pushes and pulls: a flat group (``flatten``) under
        the name its parameters' names and shapes give, each other parameter under its own name."""
        have = {t.name for t in spec.tensors}
        missing = [n for n in job_tensors if n not in have]
        if not missing:
            return
        flat_names = {f.name for f in self._flat}
        if any(n in flat_names for n in missing):
            raise ShardlineConfigError(
                f"job {spec.name!r} stores no flat tensor {missing[0]!r} for this worker's param group: it was created "
                f"without flatten=True, or from parameters with other names, shapes or groups")
        raise ShardlineConfigError(
            f"job {spec.name!r} has no tensor {missing[0]!r}"
            + (" (it was created with flatten=True: pass flatten=True)" if any(map(is_flat_name, have)) else ""))

    def _gathered_grads(self) -> dict[str, torch.Tensor]:
        """``flatten``: each flat group's gradients gathered into one tensor (groups without any
        are left out). BSP reuses a buffer per group (the client's shared gradient buffer over shm:
        the node copies the push straight out of it); the step's record, which a replay resends,
        is dropped by the pull before the next step writes it again. SSP keeps the records of
        ``staleness`` steps, so each step gathers into a tensor of its own."""
        self._check_flat_frozen()
        grads = {}
        for f in self._flat:
            out = self._flat_grad_buffer(f)
            if f.gather_grads(out):
                grads[f.name] = out
        return grads

    def _check_flat_frozen(self) -> None:
        for name, p in self.params:  # frozen when the job was made: a flat job cannot train it later
            if name not in self._flat_members and p.requires_grad and p.grad is not None:
                raise ShardlineConfigError(
                    f"parameter {name!r} has a gradient but was frozen (requires_grad=False) when job "
                    f"{self.client.job!r} was created; with flatten=True the parameters a job trains are fixed then")

    def _flat_grad_buffer(self, f: FlatGroup) -> torch.Tensor:
        """Where a step gathers flat group ``f``'s gradients: BSP reuses one buffer per group (the
        client's shared gradient buffer over shm); SSP keeps the records of ``staleness`` steps, so
        each step has a tensor of its own."""
        if self.client.staleness:
            return torch.empty(f.numel, dtype=torch.float32)
        out = self._flat_grads.get(f.name)
        if out is None:
            out = self._flat_grads[f.name] = self.client.gradient_buffer(f.name).view(-1)
        return out

    # --- param groups -----------------------------------------------------------------------
    def _group_config(self, index: int, group: dict) -> OptimizerConfig:
        hyper = {k: tuple_or(group[k]) for k in self._hyper_keys}
        try:
            return OptimizerConfig.from_kwargs(self.kind, **hyper)
        except ShardlineConfigError as exc:
            raise ShardlineConfigError(f"param group {index}: {exc}") from None

    def _check_job_groups(self, spec, groups_of: dict[str, int]) -> None:
        """A worker that did not create the job must group its parameters as the job does, with
        the same hyperparameters (the servers step with the job's)."""
        job_groups = group_configs(spec)
        if len(job_groups) != len(self.param_groups):
            raise ShardlineConfigError(f"job {spec.name!r} has {len(job_groups)} parameter groups, this worker has "
                                       f"{len(self.param_groups)}")
        for t in spec.tensors:
            if t.name in groups_of and groups_of[t.name] != t.group:
                raise ShardlineConfigError(f"job {spec.name!r} steps {t.name!r} in parameter group {t.group}, this "
                                           f"worker has it in group {groups_of[t.name]}")
        for i, (theirs, mine) in enumerate(zip(job_groups, self._group_configs)):
            if dataclasses.replace(theirs, lr=mine.lr) != mine:
                raise ShardlineConfigError(f"job {spec.name!r} parameter group {i} has hyperparameters "
                                           f"{theirs.torch_kwargs()}, this worker {mine.torch_kwargs()}")

    def add_param_group(self, param_group: dict) -> None:
        """Add a group: while the optimizer is built (torch.optim's constructor calls this), or
        during training, where it makes the job's next revision on the cluster (class doc).

        During training ``param_group["params"]`` are (name, parameter) pairs: names the job does not
        have are new tensors (rank 0 sends their values, the other ranks wait for them and pull);
        names of the job's frozen tensors are unfrozen into this group (their parameters must have
        ``requires_grad=True`` now). From the next ``step()`` on their gradients are pushed and the
        step carries this group's lr."""
        if not getattr(self, "_constructed", False):
            super().add_param_group(param_group)
            return
        if self.flatten:
            raise ShardlineConfigError("add_param_group during training is not supported with flatten=True (the job "
                                       "stores each group as one tensor): create the optimizer with every group")
        self.wait()
        group = _named_groups([param_group])[0]
        members = group["params"]
        names = [n for n, _ in members]
        if not members:
            raise ShardlineConfigError("add_param_group got no parameters")
        if len(set(names)) != len(names):
            raise ShardlineConfigError(f"add_param_group names a parameter twice: {sorted(names)}")
        job_tensors = {t.name: t for t in self.client.spec.tensors}
        mine = {name: p for name, p in self.params}
        unfreeze, new = [], {}
        for name, p in members:
            tensor = job_tensors.get(name)
            if tensor is None:
                if any(p is q for q in mine.values()):
                    raise ShardlineConfigError(f"parameter {name!r} is already in this optimizer under another name")
                new[name] = p
            elif tensor.trainable:
                raise ShardlineConfigError(f"parameter {name!r} already trains in parameter group {tensor.group} of job "
                                           f"{self.client.job!r}; only new or frozen parameters go in a new group")
            elif not p.requires_grad:
                raise ShardlineConfigError(f"parameter {name!r} is frozen in job {self.client.job!r} and still has "
                                           f"requires_grad=False: set requires_grad=True to train it in the new group")
            elif name not in mine or mine[name] is not p:
                raise ShardlineConfigError(f"parameter {name!r} is not the tensor this optimizer registered under that name")
            else:
                unfreeze.append(name)
        index = len(self.param_groups)
        config = self._group_config(index, {**self.defaults, **{k: v for k, v in group.items() if k != "params"}})
        self.client.extend({n: p.detach() for n, p in new.items()}, unfreeze=unfreeze, group=config.torch_kwargs(),
                           trainable={n: p.requires_grad for n, p in new.items()}, initialize=self.rank == 0)
        for old in self.param_groups:  # unfrozen parameters move to the new group
            keep = [(n, p) for n, p in zip(old["param_names"], old["params"]) if n not in unfreeze]
            old["param_names"], old["params"] = [n for n, _ in keep], [p for _, p in keep]
        super().add_param_group(group)
        self._group_configs.append(config)
        self._index_params()
        for name, p in new.items():
            self._attach_cache(name, p, same_contents=self.rank == 0)
        self._check_job_groups(self.client.spec, {n: i for i, g in enumerate(self.param_groups) for n in g["param_names"]})
        if self._pusher is not None:  # hooks on the parameters that train now
            self._pusher.reset(self.params)
        if self._priority is not None:
            self._priority = PriorityPull(self.params, self._cap_bytes)
        self._pull()  # the other ranks receive the new tensors

    def _step_lrs(self) -> float | tuple[float, ...]:
        """Every group's lr for this step; any other hyperparameter changed since creation is an error."""
        for i, (group, config) in enumerate(zip(self.param_groups, self._group_configs)):
            for key in self._hyper_keys:
                if key != "lr" and tuple_or(group[key]) != getattr(config, key):
                    raise ShardlineConfigError(
                        f"param_groups[{i}][{key!r}] changed from {getattr(config, key)!r} to {group[key]!r}: only lr can "
                        f"change during training (each step carries it); the other hyperparameters are fixed when the "
                        f"job is created (OneCycleLR: pass cycle_momentum=False)")
            lr = group["lr"]
            if isinstance(lr, torch.Tensor):
                lr = lr.item()
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr >= 0:
                raise ShardlineConfigError(f"param_groups[{i}]['lr'] must be a number >= 0, got {lr!r}")
        lrs = tuple(float(g["lr"]) for g in self.param_groups)
        return lrs if len(lrs) > 1 else lrs[0]

    def state_dict(self) -> dict:
        """torch's optimizer state-dict layout (``state`` stays empty: the moments live on the
        cluster) plus ``"shardline"``: the job, its version and the optimizer kind."""
        out = super().state_dict()
        out["shardline"] = {"job": self.client.job, "version": self.version, "optimizer": self.kind}
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the groups' hyperparameters (a scheduler's lr) saved by :meth:`state_dict` for the
        same job; the cluster keeps the optimizer state and the version (``opt.version``)."""
        info = state_dict.get("shardline")
        if not isinstance(info, dict) or info.get("job") != self.client.job:
            raise ShardlineStateError(f"this state dict is not of a PSOptimizer of job {self.client.job!r} "
                                      f"(it names {info.get('job') if isinstance(info, dict) else None!r})")
        rest = {k: v for k, v in state_dict.items() if k != "shardline"}
        super().load_state_dict(rest)
        self._step_lrs()  # the same fixed hyperparameters, else a clear error now

    def _sync_copies(self, names=None) -> None:
        with torch.no_grad():
            for name, p in self._copy_back:
                if names is None or name in names:
                    p.copy_(self.client._values[name].view(p.shape))

    @property
    def version(self) -> int:
        """The job step whose parameters the model holds (with a pull pending: once ``wait()`` returns);
        SSP: the step this worker computes next, on parameters of ``held_version``."""
        return self.client.step or 0

    @property
    def held_version(self) -> int:
        """The job version (steps applied) the parameters hold at least, once ``wait()`` returns: ``version``
        under BSP, at least ``version - staleness`` under SSP."""
        return self.client.held_step or 0

    def step(self, closure=None, *, weight: float | None = None):
        """Push gradients, commit (BSP, SSP) with every group's lr, wait for the applied step (SSP:
        the step ``staleness`` before it) and pull changed blocks. With ``overlap`` a backward since
        the last step already pushed and committed: this waits for that and checks it sent this
        step's lrs and weight.

        ``weight`` is this worker's weight in the mean over workers (default 1); pass the number of
        tokens of an imbalanced batch (with ``overlap``, declare it before backward with
        :meth:`set_step_weight`). Returns the closure's loss if one is given (torch.optim's
        contract), else the new version.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait()
        declared, self._step_weight = self._step_weight, None
        sent = self._pusher.finish() if self._pusher is not None else None
        if weight is not None:
            weight = self._check_weight(weight)
        if self._flat_hint_due:
            self._hint_flat()
        if sent is None:
            lrs = self._step_lrs()
            if self.flatten:
                grads = self._gathered_grads()
            else:
                # over shm into the shared gradient buffers: a local node takes them from there
                grads = self.client.stage_gradients(
                    {n: p.grad for n, p in self.params if p.requires_grad and p.grad is not None})
            self.client.lr = lrs
            push_step(self.client, self._host_group, grads, weight or declared or 1.0,
                      share_pull=pull_shared(self.client, self._host_group, self.prefetch_window))
        else:
            self._check_sent(*sent, declared if weight is None else weight)
            if not self._pusher.commits:   # flat groups: the commit goes from here, and brings the pull
                self._check_flat_frozen()
                self.client.lr = sent[1]
                self.client.commit(weight=sent[0])
        if self.prefetch_window == 0:
            started = time.perf_counter()
            self._pull()
            self._metrics.waited(time.perf_counter() - started)
        else:
            if self._host_group is not None and self._host_group.pull_owed:
                self._host_group.decline_pull("the leader prefetches its pull (prefetch_window 1)")
            # The pull of the new version runs while the caller prepares the next batch; whatever
            # reads the parameters next (a module's forward, zero_grad, step, wait) waits for it first.
            with self._pending_lock:
                if self._priority is not None:
                    chunks = self._priority.begin()
                    self._pending = self._executor.submit(self._priority.run, chunks, self._pull_chunk)
                else:
                    self._pending = self._executor.submit(self._pull)
            self._install_forward_hook()
        self._metrics.stepped()
        return loss if closure is not None else self.version

    def _hint_flat(self) -> None:
        """Say once which param groups ``flatten=True`` would have stepped as one tensor (the first
        step with gradients): the default stays per parameter, since only the script knows whether
        every step gives all of a group's parameters a gradient (docs/architecture.md, "Flat parameters")."""
        if not any(p.grad is not None for _, p in self.params):
            return
        self._flat_hint_due = False
        groups = groups_that_could_be_flat(self.param_groups)
        if groups:
            listed = ", ".join(f"group {i} ({n} parameters)" for i, n in groups)
            log.info("job %r: every trainable parameter of %s has a gradient this step; if each step gives all of "
                     "them one, flatten=True pushes and applies each such group as one tensor (fewer blocks per "
                     "step: faster for many small tensors; bench/step_overhead.py)", self.client.job, listed)

    def _check_sent(self, sent_weight: float, sent_lrs, weight: float | None) -> None:
        """What backward pushed and committed must be what this step() would have sent."""
        lrs = self._step_lrs()
        if lrs != sent_lrs:
            raise ShardlineConfigError(
                f"the learning rates changed from {sent_lrs!r} to {lrs!r} after backward pushed this step with "
                f"them (overlap): set the lr (step the scheduler) before backward, or pass overlap=False")
        if weight is not None and weight != sent_weight:
            raise ShardlineConfigError(
                f"this step's weight is {weight!r} but backward already pushed it with weight {sent_weight!r} "
                f"(overlap): declare the weight before backward with opt.set_step_weight({weight!r}), or pass "
                f"overlap=False")

    @staticmethod
    def _check_weight(weight) -> float:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not (math.isfinite(weight) and weight > 0):
            raise ShardlineConfigError(f"weight must be a finite number > 0, got {weight!r}")
        return float(weight)

    def set_step_weight(self, weight: float) -> None:
        """This worker's weight for the next step (what ``step(weight=...)`` passes), declared
        before its backward: with ``overlap`` every pushed block carries it."""
        self._step_weight = self._check_weight(weight)

    def no_sync(self):
        """``with opt.no_sync():`` backward inside only accumulates gradients (gradient
        accumulation, DDP's idiom); the next backward outside pushes the accumulated sum."""
        return self._pusher.no_sync() if self._pusher is not None else contextlib.nullcontext()

    def _round_info(self) -> tuple[float, object]:
        """The weight and lrs a step's pushes carry, when its first bucket goes out (training thread)."""
        return (1.0 if self._step_weight is None else self._step_weight), self._step_lrs()

    def _send(self, grads: dict, weight: float, lrs, commit: bool, blocks: dict | None = None) -> None:
        """A bucket of a step (communication thread); ``blocks``: only those blocks of each tensor."""
        self.client.lr = lrs
        self.client.push(grads, weight=weight, commit=commit, blocks=blocks)

    def _send_flat(self, payload: dict, weight: float, lrs, commit: bool) -> None:
        """Blocks of flat groups: ``{name: (gradient buffer, [block index])}``."""
        self._send({name: buf for name, (buf, _) in payload.items()}, weight, lrs, commit,
                   blocks={name: indices for name, (_, indices) in payload.items()})

    def _install_forward_hook(self) -> None:
        if self._hook is None:
            self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, _args) -> None:
        """The hook is global (every module of the process): a module that holds none of this
        optimizer's parameters does not wait for its pull, so another model's forward (another
        rank's, in one process) never waits for a step that needs that model's own commit."""
        started = time.perf_counter()
        try:
            if self._priority is None:
                if any(p is not None and id(p) in self._param_ids for p in module._parameters.values()):
                    self.wait()  # the whole pull (or its error)
            elif not self._priority.before_forward(module):
                self.wait()  # the pull failed: its error
        finally:
            self.forward_wait_seconds += time.perf_counter() - started

    def _pull(self) -> None:
        pull_step(self.client, self._host_group)   # from the host's leader, where it shares its pull
        self._sync_copies()
        self._metrics.transferred(self.client.stats, self.version)

    def _pull_chunk(self, indices: list[int]) -> None:
        """One chunk of a priority pull (communication thread)."""
        names = [self.params[i][0] for i in indices]
        self.client.pull_changed(names)
        self._sync_copies(set(names))
        self._metrics.transferred(self.client.stats, self.version)

    @property
    def pending(self) -> bool:
        """True while the pull of the last step is still running (prefetch_window 1)."""
        with self._pending_lock:
            return self._pending is not None and not self._pending.done()

    def wait(self) -> None:
        """Block until the parameters hold the last step's result (a no-op without prefetch).

        Callers in several threads at once (a module's forward in a loader thread, another
        optimizer's forward hook) all wait for the same pull: it is forgotten only once done."""
        with self._pending_lock:
            pending = self._pending
        if pending is None:
            return
        started = time.perf_counter()
        try:
            pending.result()  # re-raises the pull's error in the training thread
        finally:
            with self._pending_lock:
                mine = self._pending is pending
                if mine:
                    self._pending = None
            if mine:  # one observation per step: with the priority pull, what forwards waited counts too
                in_forward, self._forward_wait_observed = (self.forward_wait_seconds - self._forward_wait_observed,
                                                           self.forward_wait_seconds)
                self._metrics.waited(time.perf_counter() - started + in_forward)

    @property
    def lr(self) -> float:
        """The first group's learning rate."""
        return self.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        """Learning rate of every group for the following steps (all workers of a BSP job must set the same)."""
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0):
            raise ShardlineConfigError(f"lr must be a number >= 0, got {lr!r}")
        for group in self.param_groups:
            group["lr"] = float(lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._metrics.start()
        # Dropping the gradients needs no wait; zeroing them in place must wait until the step is
        # applied (until then the client may resend them to a restarted node).
        if self._priority is None or not set_to_none:
            self.wait()
        super().zero_grad(set_to_none=set_to_none)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._pusher is not None:
                self._pusher.remove()
            self._executor.shutdown(wait=True)
            if self._host_group is not None:
                self._host_group.close()
            self.client.close()
            if self._metrics_server is not None:
                self._metrics_server.shutdown()
                self._metrics_server.server_close()
                self._metrics_server = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
