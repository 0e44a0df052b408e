"""``shardline-worker``: run a job file as one training worker of a Shardline cluster.

    shardline-worker --cluster 127.0.0.1:7000 --job examples/demo_job.yaml --rank 0 --world-size 2

``--rank``/``--world-size`` default to the ``RANK``/``WORLD_SIZE`` environment variables (as torchrun
sets them), else 0/1. The worker builds the job's model, joins the job with a ``PSOptimizer`` (rank 0
creates it if the cluster lacks it), writes the ready file ``{"pid", "grpc", "metrics", "job", "rank",
"world_size"}``, trains with :func:`shardline.jobs.runner.run_training` while showing progress (loss, tokens/s,
version) on stderr, prints the before/after sample answers and a final ``done:`` line on stdout, and
with ``--result-file PATH`` writes a JSON result (``status``, losses, throughput, accuracy, samples,
transfer counters) that ``shardline up`` reads for its summary.

Like every daemon it serves gRPC health on ``--listen`` and Prometheus metrics on ``--metrics-port``.
SIGTERM/SIGINT stop training at the next step boundary and exit 0 (``status: "stopped"``); a worker
blocked in a step that cannot finish (its peers are gone) exits 0 after a grace period. Exit codes:
0 done or stopped, 1 training failed, 2 bad configuration or job file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from typing import Any

from shardline.services.config import log_configuration, parse_daemon_args
from shardline.services.daemon import (add_common_args, format_host_port, exit_after_stop, install_stop_handlers, parse_host_port,
                             setup_logging, start_metrics_server, announce_ready, create_grpc_server)
from shardline.services.errors import ShardlineConfigError, ShardlineError
from shardline.services.security import daemon_security
from shardline.worker.metrics import TaskMetrics

log = logging.getLogger("shardline.worker")

PROG = "shardline-worker"
# After SIGTERM, how long a step may take to reach its boundary before the worker exits anyway
# (the whole shutdown must stay within the 10 s the daemons promise).
STOP_GRACE_SECONDS = 6.0

class StopTraining(Exception):
    """Raised at a step boundary once SIGTERM/SIGINT was received."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ShardlineConfigError(f"environment variable {name} must be an integer, got {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Shardline training worker: runs a job file against a cluster")
    add_common_args(p, "worker")  # every option is declared in services/config.py
    return p


def _validate(args: argparse.Namespace) -> None:
    """Cross-option checks; types and bounds were checked by parse_daemon_args."""
    if args.rank is None:
        args.rank = _env_int("RANK", 0)
    if args.world_size is None:
        args.world_size = _env_int("WORLD_SIZE", 1)
    if args.world_size < 1:
        raise ShardlineConfigError(f"world_size must be >= 1, got {args.world_size!r}")
    if not 0 <= args.rank < args.world_size:
        raise ShardlineConfigError(f"rank must be in [0, {args.world_size}), got {args.rank!r}")


def _check_cache_bound(named_parameters, cache_bytes: int) -> None:
    """The client's L1 cache holds every tensor of the job in fp32: refuse a job that exceeds the bound."""
    if not cache_bytes:
        return
    need = 4 * sum(p.numel() for _, p in named_parameters)
    if need > cache_bytes:
        raise ShardlineConfigError(
            f"the job's tensors need {need:,} bytes of L1 cache (fp32), more than cache_bytes={cache_bytes:,}; "
            f"raise cache_bytes (0 = no bound) or train a smaller model")


def _make_ps_optimizer(PSOptimizer, args, named_parameters, **kwargs):
    """PSOptimizer with the worker's data-plane and control-plane knobs."""
    _check_cache_bound(named_parameters, args.cache_bytes)
    return PSOptimizer(named_parameters, transport=args.transport, pull_timeout=args.pull_timeout,
                       connect_timeout=args.connect_timeout, rpc_timeout=args.rpc_timeout,
                       recovery_timeout=args.recovery_timeout, block_elements=args.block_elements,
                       prefetch_window=args.prefetch_window,
                       straggler_warning_seconds=args.straggler_warning_seconds, rack=args.rack, **kwargs)


class _Tracker:
    """Sits between run_training and the real optimizer/progress display: updates the task's metrics
    (loss, tokens; the PSOptimizer records the step metrics), records what a stopped run still
    reports, and raises StopTraining at step boundaries after a stop."""

    def __init__(self, stop: threading.Event, spec, rank: int, world_size: int, display):
        self.stop = stop
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.display = display
        self.opt = None
        self.steps_done = 0
        self.losses: list[float] = []
        self.tokens = 0
        self.tokens_per_s = 0.0
        self.version = 0
        self._step_started: float | None = None
        self.metrics = TaskMetrics(spec.name, rank)

    # -- the progress protocol of run_training --
    def update(self, step: int, loss: float | None = None, tokens_per_s: float | None = None,
               version: int | None = None, tokens: int | None = None) -> None:
        self.steps_done = step
        if loss is not None:
            self.losses.append(loss)
            self.metrics.loss.set(loss)
        if tokens_per_s is not None:
            self.tokens_per_s = tokens_per_s
        if version is not None:
            self.version = version
        tr = self.spec.train
        if tokens:
            self.tokens += tokens
            self.metrics.tokens.inc(tokens)
        if self.display is not None:
            self.display.update(step, loss=loss, tokens_per_s=tokens_per_s, version=version)
        if self.stop.is_set() and step < tr.steps:
            raise StopTraining()

    def close(self) -> None:
        if self.display is not None:
            self.display.close()


class _StoppableOptimizer:
    """PSOptimizer with a stop check before each step starts."""

    def __init__(self, opt, tracker: _Tracker):
        self.opt = opt
        self.tracker = tracker

    @property
    def version(self) -> int:
        return self.opt.version

    def set_lr(self, lr: float) -> None:
        self.opt.set_lr(lr)

    def zero_grad(self) -> None:
        if self.tracker.stop.is_set():
            raise StopTraining()
        self.opt.zero_grad()

    def step(self, weight: float | None = None) -> int:
        return self.opt.step(weight=weight)

    def set_step_weight(self, weight: float) -> None:
        self.opt.set_step_weight(weight)

    def no_sync(self):
        return self.opt.no_sync()


def _write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def _transfer(opt) -> dict:
    stats = getattr(getattr(opt, "client", None), "stats", None)
    return dataclasses.asdict(stats) if stats is not None and dataclasses.is_dataclass(stats) else {}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_daemon_args(parser, argv)  # validates types and bounds; cluster and job are required
        setup_logging(args.log_level, "worker", args.log_format)
        log_configuration(log, args)
        _validate(args)
        host, _ = parse_host_port(args.listen, what="listen")
        # gRPC health and metrics bind the listen host (the metrics port does not matter to the policy)
        security = daemon_security(args, {"listen": args.listen, "metrics": format_host_port(host, args.metrics_port)})
        cluster_token = security.token
        from shardline.jobs.spec import load_job

        spec = load_job(args.job)
        if spec.model.is_hf:  # fail before joining the cluster when the extra is missing
            from shardline.jobs.models.hf import require_hf

            require_hf()
        if args.steps is not None:
            spec = dataclasses.replace(spec, train=dataclasses.replace(spec.train, steps=args.steps))
    except ShardlineConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2

    import torch

    from shardline.jobs.runner import run_training
    from shardline.worker.optim import PSOptimizer
    from shardline.worker.progress import Progress

    torch.set_num_threads(args.torch_threads)
    stop = install_stop_handlers()
    done = threading.Event()
    started = time.monotonic()
    tr = spec.train
    rank, world_size = args.rank, args.world_size
    base_result: dict[str, Any] = {
        "job": spec.name, "job_file": os.path.abspath(args.job), "cluster": args.cluster, "rank": rank,
        "world_size": world_size, "steps_planned": tr.steps, "sync": tr.sync, "staleness": tr.staleness,
        "optimizer": tr.optimizer,
        "pid": os.getpid(),
    }

    try:
        server, grpc_port, _health = create_grpc_server(args.listen, [], cluster_token=cluster_token,
                                                        tls=security.server_tls)
        metrics_server, metrics_port = start_metrics_server(host, args.metrics_port)
    except (ShardlineConfigError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    grpc_address = format_host_port(host, grpc_port)
    metrics_address = format_host_port(host, metrics_port)
    base_result.update(grpc=grpc_address, metrics=metrics_address)

    display = None
    if args.progress != "off":
        display = Progress(tr.steps, stream=sys.stderr, every=tr.log_every,
                           tty=None if args.progress == "auto" else args.progress == "tty",
                           prefix=f"[rank {rank}] " if world_size > 1 else "")
    tracker = _Tracker(stop, spec, rank, world_size, display)
    holder: dict[str, Any] = {}

    def make_optimizer(named_parameters):
        opt = _make_ps_optimizer(PSOptimizer, args, named_parameters, cluster=args.cluster, job=spec.name,
                                 sync=tr.sync, staleness=tr.staleness if tr.sync == "ssp" else None,
                                 world_size=world_size, rank=rank, cluster_token=cluster_token,
                                 tls_ca=security.tls_ca,
                                 replication=tr.replication or None, on_worker_failure=tr.on_worker_failure,
                                 worker_lease_timeout=tr.worker_lease_timeout, compression=tr.compression,
                                 exact_restarts=tr.exact_restarts, replicate_gradients=tr.replicate_gradients,
                                 flatten=tr.flatten,
                                 **tr.optimizer_kwargs())
        holder["opt"] = opt
        tracker.version = opt.version
        n_params = sum(p.numel() for _, p in named_parameters)
        n_train = sum(p.numel() for _, p in named_parameters if p.requires_grad)
        log.info("rank %d/%d joined job %s on %s at version %d: %s parameters (%s trainable), %s, %s, %d steps",
                 rank, world_size, spec.name, args.cluster, opt.version, f"{n_params:,}", f"{n_train:,}",
                 tr.optimizer, tr.sync, tr.steps)
        announce_ready(args.ready_file, {"grpc": grpc_address, "metrics": metrics_address, "job": spec.name,
                                         "rank": rank, "world_size": world_size})
        return _StoppableOptimizer(opt, tracker)

    def watchdog() -> None:
        stop.wait()
        if done.wait(STOP_GRACE_SECONDS):
            return
        log.warning("training did not reach a step boundary within %.0f s of the stop signal; exiting", STOP_GRACE_SECONDS)
        try:
            _write_json(args.result_file, {**base_result, "status": "stopped", "steps_done": tracker.steps_done,
                                           "final_loss": tracker.losses[-1] if tracker.losses else None,
                                           "tokens_per_s": tracker.tokens_per_s, "version": tracker.version,
                                           "wall_seconds": time.monotonic() - started, "forced": True})
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()

    status, code, result, error = "completed", 0, None, None
    try:
        result = run_training(spec, make_optimizer, rank, world_size, progress=tracker)
    except StopTraining:
        status = "stopped"
    except ShardlineConfigError as exc:
        status, code, error = "failed", 2, str(exc)
    except Exception as exc:  # noqa: BLE001 - reported in the result file and the exit code
        if stop.is_set():  # the cluster went away while we were stopping: that is a stop, not a failure
            status = "stopped"
            log.info("stopping: %s: %s", type(exc).__name__, exc)
        else:
            status, code, error = "failed", 1, f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ShardlineError):
                log.exception("training failed")
    finally:
        done.set()
    wall = time.monotonic() - started

    opt = holder.get("opt")
    out: dict[str, Any] = {**base_result, "status": status, "wall_seconds": wall, "transfer": _transfer(opt)}
    if result is not None:
        out.update(result.to_dict())
        out.update(steps_done=result.steps, version=opt.version if opt is not None else result.steps,
                   summary=result.summary())
    else:
        out.update(steps_done=tracker.steps_done, version=tracker.version, losses=tracker.losses,
                   final_loss=tracker.losses[-1] if tracker.losses else None, tokens=tracker.tokens,
                   tokens_per_s=tracker.tokens_per_s)
    if error:
        out["error"] = error

    if status == "completed" and args.summary == "full":
        print(result.summary(), flush=True)
    elif status == "failed":
        print(f"{PROG}: error: rank {rank}: {error}", file=sys.stderr, flush=True)
    transfer = out["transfer"]
    moved = ""
    if transfer:
        moved = (f", pushed {transfer.get('pushed_bytes', 0) / 2**20:.1f} MiB, "
                 f"pulled {transfer.get('pulled_bytes', 0) / 2**20:.1f} MiB")
    final_loss = out.get("final_loss")
    loss_text = f"{final_loss:.4f}" if isinstance(final_loss, float) and math.isfinite(final_loss) else "n/a"
    print(f"done: rank {rank}/{world_size} job {spec.name} {status}: {out['steps_done']}/{tr.steps} steps, "
          f"final loss {loss_text}, {out.get('tokens_per_s') or 0:,.0f} tok/s, version {out.get('version')}"
          f"{moved}, {wall:.1f} s", flush=True)
    try:
        _write_json(args.result_file, out)
    except OSError as exc:
        print(f"{PROG}: error: cannot write --result-file {args.result_file!r}: {exc.strerror}", file=sys.stderr)
        code = code or 1

    if opt is not None:
        try:
            opt.close()
        except Exception as exc:  # noqa: BLE001 - closing must not turn success into failure
            log.debug("closing the client: %s", exc)
    server.stop(1).wait(2)
    metrics_server.shutdown()
    metrics_server.server_close()
    exit_after_stop(code)


if __name__ == "__main__":
    sys.exit(main())
