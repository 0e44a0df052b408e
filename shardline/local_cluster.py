"""``LocalCluster``: start, kill and restart real Shardline daemons on 127.0.0.1 (tests, dev, ``shardline up``).

In the style of Ray's ``cluster_utils.Cluster``::

    with LocalCluster(tmp_path) as cluster:
        cluster.start_dispatcher(heartbeat_timeout=1)
        a = cluster.add_node()                    # a PS node, id "ps-0"
        cluster.add_node(rack="r2", capacity=2)   # "ps-1"
        cluster.wait_for_nodes(2, timeout=30)
        cluster.kill(a)                           # SIGKILL
        cluster.restart(a)                        # same name, node id and flags; new pid and ports

Several dispatchers share an etcd state store and elect a leader::

    cluster.add_dispatcher(state_store=etcd_url, leader_lease_timeout=2)   # "dispatcher"
    cluster.add_dispatcher(state_store=etcd_url, leader_lease_timeout=2)   # "dispatcher-1"
    cluster.address                               # "127.0.0.1:P0,127.0.0.1:P1": what PS nodes and workers get
    cluster.kill(cluster.leader())                # the other one takes over

Every daemon is a real subprocess (``python -m shardline.dispatcher_daemon`` / ``shardline.ps_server.main`` /
``shardline.jobs.worker_daemon`` of the installed package) started with ``--listen 127.0.0.1:0 --metrics-port 0 --ready-file
<workdir>/<name>.json``, in its own session and process group, with stdout and stderr appended to
``<workdir>/<name>.log``. Starting waits for the ready file; if the process dies first (or the
timeout passes) a :class:`DaemonStartError` carries the exit code and the tail of the log.

Extra keyword flags become command-line flags: ``heartbeat_timeout=1`` -> ``--heartbeat-timeout 1``;
``True`` -> a bare flag; ``None``/``False`` -> omitted.

Clean-up: :meth:`LocalCluster.shutdown` (also run by ``__exit__`` and, as a safety net, at interpreter
exit) sends SIGTERM to every daemon, SIGKILLs the process group of any that has not exited within
the grace period and reaps them all: no zombies, no orphans. On Linux each daemon also gets
SIGTERM from the kernel if the thread that started it dies (``PR_SET_PDEATHSIG``), so a test run
that is killed outright does not leave daemons behind either; start daemons from a thread that
outlives them (the main thread, normally).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from shardline.services.daemon import PARENT_PID_ENV

__all__ = ["DaemonHandle", "DaemonStartError", "LocalCluster", "dispatcher_serving", "flags_to_argv", "log_tail"]

STOP_TIMEOUT = 10.0

_MODULES = {"dispatcher": "shardline.dispatcher_daemon", "ps": "shardline.ps_server.main", "worker": "shardline.jobs.worker_daemon"}


class DaemonStartError(RuntimeError):
    """A daemon exited or timed out before writing its ready file."""


@dataclass
class DaemonHandle:
    """One daemon of a :class:`LocalCluster`. ``restart`` updates the handle in place."""

    name: str                      # "dispatcher", "ps-0", "worker-1"
    kind: str                      # "dispatcher", "ps" or "worker"
    argv: list[str]                # full command line
    ready_file: Path
    log_path: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)   # the ready file's JSON once ready
    starts: int = 0                # how many times it was started
    env: dict | None = None        # extra environment for this daemon (kept for restart)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def grpc(self) -> str | None:
        return self.info.get("grpc")

    @property
    def metrics(self) -> str | None:
        return self.info.get("metrics")

    @property
    def data(self) -> str | None:
        return self.info.get("data")

    @property
    def node_id(self) -> str | None:
        return self.info.get("node_id")

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def ready(self) -> bool:
        return bool(self.info)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited {self.returncode}" if self.proc else "not started"
        return f"DaemonHandle({self.name!r}, pid={self.pid}, grpc={self.grpc!r}, {state})"


def log_tail(path: str | os.PathLike, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read()
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def read_json_object(path: str | os.PathLike) -> dict | None:
    """The JSON object in ``path``, or None if it is missing, partial or not an object."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """``{"heartbeat_timeout": 1, "verbose": True, "x": None}`` -> ``["--heartbeat-timeout", "1", "--verbose"]``."""
    argv: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        opt = "--" + key.replace("_", "-")
        if value is True:
            argv.append(opt)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [opt, str(item)]
        else:
            argv += [opt, str(value)]
    return argv


# Clusters not yet shut down; shut down at interpreter exit. Strong references on purpose: a
# cluster object nobody holds any more still has processes to reap.
_LIVE: "set[LocalCluster]" = set()


def _shutdown_all() -> None:
    for cluster in list(_LIVE):
        try:
            cluster.shutdown(timeout=5.0)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


atexit.register(_shutdown_all)


class LocalCluster:
    """Dispatchers, PS nodes and workers as subprocesses of this process, on 127.0.0.1.

    ``workdir`` holds ready files and logs (created if missing). ``env`` is added to the
    environment of every daemon (each ``start_dispatcher``/``add_*`` takes an ``env`` of its own too).
    ``start_timeout`` bounds each wait for a ready file. ``cluster_token_file`` and the TLS files
    (``tls_cert_file``, ``tls_key_file``, ``tls_ca_file``) go to every daemon; this harness's own
    gRPC calls carry the token and verify servers with the CA.
    """

    def __init__(self, workdir: str | os.PathLike, *, python: str = sys.executable, env: dict[str, str] | None = None,
                 start_timeout: float = 60.0, host: str = "127.0.0.1", cluster_token_file: str | None = None,
                 tls_cert_file: str | None = None, tls_key_file: str | None = None, tls_ca_file: str | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.host = host
        # Every daemon gets the token file; this harness's own control-plane calls carry the token.
        self.cluster_token_file = cluster_token_file
        self.tls_files = {"tls_cert_file": tls_cert_file, "tls_key_file": tls_key_file, "tls_ca_file": tls_ca_file}
        self.dispatcher: DaemonHandle | None = None   # the first dispatcher
        self.dispatchers: list[DaemonHandle] = []
        self._fixed_addresses: dict[str, str] = {}    # dispatchers started on a chosen port
        self.handles: dict[str, DaemonHandle] = {}
        self._next_ps = 0
        self._lock = threading.RLock()
        self._closed = False
        _LIVE.add(self)

    # -- properties -----------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The cluster address: the dispatcher's gRPC host:port; with several dispatchers, all of
        theirs, comma-separated (PS nodes and workers started afterwards get it)."""
        addresses = [self._fixed_addresses.get(h.name) or h.grpc for h in self.dispatchers]
        if not addresses or not all(addresses):
            raise RuntimeError("the dispatcher is not started (call start_dispatcher first)")
        return ",".join(addresses)

    @property
    def nodes(self) -> list[DaemonHandle]:
        return [h for h in self.handles.values() if h.kind == "ps"]

    @property
    def workers(self) -> list[DaemonHandle]:
        return [h for h in self.handles.values() if h.kind == "worker"]

    def pids(self) -> list[int]:
        """Pids of the current process of every daemon (earlier incarnations were reaped)."""
        return [h.pid for h in self.handles.values() if h.pid is not None]

    # -- starting -------------------------------------------------------------------------------

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        env[PARENT_PID_ENV] = str(os.getpid())  # daemons die with us (services.daemon.arm_parent_death_signal)
        return env

    def _make_handle(self, name: str, kind: str, extra_argv: list[str], flags: dict[str, Any],
                     env: dict[str, str] | None = None) -> DaemonHandle:
        if self._closed:
            raise RuntimeError("this LocalCluster was shut down")
        if name in self.handles:
            raise ValueError(f"a daemon named {name!r} already exists")
        ready_file = self.workdir / f"{name}.json"
        log_path = self.workdir / f"{name}.log"
        base = {"listen": f"{self.host}:0", "metrics_port": 0, "cluster_token_file": self.cluster_token_file,
                **self.tls_files}
        base.update(flags)
        base["ready_file"] = str(ready_file)
        argv = [self.python, "-m", _MODULES[kind], *extra_argv, *flags_to_argv(base)]
        handle = DaemonHandle(name=name, kind=kind, argv=argv, ready_file=ready_file, log_path=log_path,
                              env=dict(env) if env else None)
        self.handles[name] = handle
        return handle

    def _spawn(self, handle: DaemonHandle) -> None:
        if self._closed:
            raise RuntimeError("this LocalCluster was shut down")
        try:
            handle.ready_file.unlink()
        except FileNotFoundError:
            pass
        handle.info = {}
        env = self._base_env()
        if handle.env:
            env.update(handle.env)
        with open(handle.log_path, "ab") as log:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            log.write(f"=== {stamp} LocalCluster start #{handle.starts + 1}: {' '.join(handle.argv)}\n".encode())
            log.flush()
            handle.proc = subprocess.Popen(
                handle.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, close_fds=True,
            )
        handle.starts += 1

    def wait_ready(self, handle: DaemonHandle, timeout: float | None = None) -> DaemonHandle:
        """Wait until ``handle`` wrote its ready file (with its own pid). Raises DaemonStartError."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        proc = handle.proc
        if proc is None:
            raise DaemonStartError(f"{handle.name} was never started")
        delay = 0.02
        while True:
            info = read_json_object(handle.ready_file)
            if info is not None and info.get("pid") == proc.pid:
                handle.info = info
                return handle
            code = proc.poll()
            if code is not None:
                # The file may have landed just before the exit.
                info = read_json_object(handle.ready_file)
                if info is not None and info.get("pid") == proc.pid:
                    handle.info = info
                    return handle
                raise DaemonStartError(
                    f"{handle.name} (pid {proc.pid}) exited with code {code} before it was ready; "
                    f"last lines of {handle.log_path}:\n{handle.log_tail()}")
            if time.monotonic() >= deadline:
                raise DaemonStartError(
                    f"{handle.name} (pid {proc.pid}) did not write {handle.ready_file} within {timeout:g} s; "
                    f"last lines of {handle.log_path}:\n{handle.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)  # reading a small file is cheap; each start waits on it

    def _start(self, handle: DaemonHandle, wait: bool) -> DaemonHandle:
        self._spawn(handle)
        if wait:
            try:
                self.wait_ready(handle)
            except DaemonStartError:
                self._terminate(handle)
                raise
        return handle

    def start_dispatcher(self, *, wait: bool = True, env: dict[str, str] | None = None, **flags) -> DaemonHandle:
        """Start the dispatcher (``heartbeat_timeout=1`` etc. become flags)."""
        with self._lock:
            if self.dispatcher is not None:
                raise RuntimeError("the dispatcher is already started (add_dispatcher starts another one)")
            handle = self._make_handle("dispatcher", "dispatcher", [], flags, env)
            self.dispatcher = handle
            self.dispatchers.append(handle)
        return self._start(handle, wait)

    def add_dispatcher(self, *, wait: bool = True, env: dict[str, str] | None = None, **flags) -> DaemonHandle:
        """Start one more dispatcher: ``dispatcher`` (the first), then ``dispatcher-1``, ... Several
        must share an etcd ``state_store=...``; they elect a leader (:meth:`leader`).

        Each listens on a port chosen now (unless ``listen`` is given), so a restart keeps its
        address and :attr:`address` stays valid for the PS nodes and workers that have it.
        """
        from shardline.services.daemon import format_host_port

        with self._lock:
            index = len(self.dispatchers)
            name = "dispatcher" if index == 0 else f"dispatcher-{index}"
            listen = flags.pop("listen", None) or format_host_port(self.host, _free_port(self.host))
            handle = self._make_handle(name, "dispatcher", [], {"listen": listen, **flags}, env)
            self._fixed_addresses[name] = listen
            self.dispatchers.append(handle)
            if self.dispatcher is None:
                self.dispatcher = handle
        return self._start(handle, wait)

    def serving(self, address: str) -> bool:
        """Whether the dispatcher at ``address`` says SERVING on its health service (it leads)."""
        return dispatcher_serving(address, self._credentials()[1])

    def leader(self, timeout: float = 30.0) -> DaemonHandle:
        """The dispatcher that leads now: the one whose health service says SERVING (a single
        dispatcher always does). Waits up to ``timeout`` s for one; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while True:
            for handle in self.dispatchers:
                address = self._fixed_addresses.get(handle.name) or handle.grpc
                if handle.alive() and address and self.serving(address):
                    return handle
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no dispatcher leads after {timeout:g} s: "
                                   + ", ".join(repr(h) for h in self.dispatchers))
            time.sleep(0.05)

    def add_node(self, node_id: str | None = None, rack: str = "default", capacity: float = 1.0, *,
                 wait: bool = True, env: dict[str, str] | None = None, cluster: str | None = None,
                 **flags) -> DaemonHandle:
        """Start a PS node (``ps-<i>``) registered with the dispatcher. ``node_id`` defaults to its name,
        so a restarted node comes back under the same id. ``cluster``: the dispatcher address to give
        it instead of :attr:`address` (a node started before its dispatcher)."""
        with self._lock:
            name = f"ps-{self._next_ps}"
            while name in self.handles:
                self._next_ps += 1
                name = f"ps-{self._next_ps}"
            self._next_ps += 1
            node_flags = {"node_id": node_id or name, "rack": rack, "capacity": capacity, **flags}
            handle = self._make_handle(name, "ps", ["--cluster", cluster or self.address], node_flags, env)
        return self._start(handle, wait)

    def add_cache(self, rack: str, cache_bytes: int, *, wait: bool = True, env: dict[str, str] | None = None,
                  **flags) -> DaemonHandle:
        """Start a rack cache (``cache-<rack>``): a dispatcher in the cache role registered with the
        dispatchers of :attr:`address`; not one of :attr:`dispatchers`."""
        with self._lock:
            handle = self._make_handle(f"cache-{rack}", "dispatcher",
                                       ["--cluster", self.address, "--rack", rack, "--cache-bytes", str(cache_bytes)],
                                       flags, env)
        return self._start(handle, wait)

    def add_worker(self, job_file: str | os.PathLike, rank: int, world_size: int, *, wait: bool = True,
                   name: str | None = None, env: dict[str, str] | None = None, **flags) -> DaemonHandle:
        """Start ``shardline-worker`` running ``job_file`` as ``rank`` of ``world_size`` (``worker-<rank>``).

        With ``wait`` (default) this returns once the worker joined the job: rank > 0 workers only
        become ready after rank 0 initialized it, so start several with ``wait=False`` and then
        :meth:`wait_ready` each. Flags such as ``result_file=...`` are passed through.
        """
        with self._lock:
            handle = self._make_handle(
                name or f"worker-{rank}", "worker",
                ["--cluster", self.address, "--job", str(job_file), "--rank", str(rank), "--world-size", str(world_size)],
                flags, env)
        return self._start(handle, wait)

    # -- stopping -------------------------------------------------------------------------------

    def kill(self, handle: DaemonHandle, sig: int = signal.SIGKILL) -> int | None:
        """Send ``sig`` to the daemon. For SIGKILL, also to its process group, and reap it.
        Returns the exit code if the process is gone (reaped), else None."""
        proc = handle.proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        if sig == signal.SIGKILL:
            self._killpg(proc.pid)
            try:
                return proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                return None
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        return proc.poll()

    @staticmethod
    def _killpg(pgid: int) -> None:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, handle: DaemonHandle, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM the daemon and wait up to ``timeout`` s. Returns its exit code, or None if it had
        to be SIGKILLed (it did not stop in time)."""
        proc = handle.proc
        if proc is None:
            return None
        if proc.poll() is not None:
            return proc.returncode
        try:
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGCONT)  # a stopped daemon handles the SIGTERM too
        except ProcessLookupError:
            pass
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._killpg(proc.pid)
            proc.wait()
            return None

    def _terminate(self, handle: DaemonHandle) -> None:
        self.stop(handle, timeout=STOP_TIMEOUT)

    def restart(self, handle: DaemonHandle, *, wait: bool = True) -> DaemonHandle:
        """Stop the daemon if it runs (SIGTERM) and start it again with the same command line.

        Restarting a dispatcher started by :meth:`start_dispatcher` (port 0) gives it a new port:
        running PS nodes and workers keep the old address, so restart it only before adding other
        daemons (or restart them too). Those of :meth:`add_dispatcher` keep their port.
        """
        if handle.alive():
            self.stop(handle)
        elif handle.proc is not None:
            handle.proc.wait()
        return self._start(handle, wait)

    def shutdown(self, timeout: float = STOP_TIMEOUT) -> dict[str, int | None]:
        """Stop every daemon with SIGTERM in stages — workers, then PS nodes, then the dispatcher —
        so PS nodes can report their final checkpoints to a dispatcher that is still up; SIGKILL
        what is left when ``timeout`` s have passed in all, and reap all. Returns exit codes by
        name (None: had to be killed). Safe to call twice."""
        with self._lock:
            handles = list(self.handles.values())
            self._closed = True
        running = [h for h in handles if h.alive()]
        deadline = time.monotonic() + timeout
        codes: dict[str, int | None] = {}
        for kind in ("worker", "ps", "dispatcher"):
            stage = [h for h in running if h.kind == kind]
            for h in stage:
                try:
                    h.proc.send_signal(signal.SIGTERM)
                    h.proc.send_signal(signal.SIGCONT)  # a stopped daemon handles the SIGTERM too
                except ProcessLookupError:
                    pass
            for h in stage:
                try:
                    codes[h.name] = h.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    codes[h.name] = None
        for h in handles:
            if h.proc is not None and h.name not in codes:
                codes[h.name] = h.proc.poll()
        # Anything left in the process group of a daemon that ran until now: stragglers, or
        # children of the daemon. (Groups of daemons reaped earlier are left alone: their ids may
        # have been reused.)
        for h in running:
            self._killpg(h.proc.pid)
            h.proc.wait()
        _LIVE.discard(self)
        return codes

    close = shutdown

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- cluster state --------------------------------------------------------------------------

    def _credentials(self) -> tuple[bytes | None, bytes | None]:
        """(token, CA) of this cluster, as its daemons get them."""
        from shardline.services.auth import load_token
        from shardline.services.security import load_ca

        return load_token(self.cluster_token_file), load_ca(self.tls_files["tls_ca_file"])

    def client(self, rpc_timeout: float = 5.0):
        """A DispatcherClient of this cluster with its token and CA (close it when done)."""
        from shardline.services.dispatcher_client import DispatcherClient

        token, tls_ca = self._credentials()
        return DispatcherClient(self.address, rpc_timeout=rpc_timeout, cluster_token=token, tls_ca=tls_ca)

    def cluster_status(self):
        """The dispatcher's ClusterStatus (protobuf)."""
        client = self.client()
        try:
            return client.cluster_status()
        finally:
            client.close()

    def wait_until(self, predicate: Callable[[Any], bool], timeout: float, what: str = "condition",
                   interval: float = 0.05):
        """Poll GetClusterStatus until ``predicate(status)`` is true; returns that status.
        Raises TimeoutError naming ``what`` and the last status seen."""
        from shardline.services.errors import ShardlineError

        deadline = time.monotonic() + timeout
        client = self.client()
        last: Any = None
        try:
            while True:
                try:
                    last = client.cluster_status()
                    if predicate(last):
                        return last
                except ShardlineError as exc:
                    last = exc
                if time.monotonic() >= deadline:
                    if self.dispatchers and not any(h.alive() for h in self.dispatchers):
                        h = self.dispatchers[0]
                        raise TimeoutError(f"{what}: the dispatcher exited with code {h.returncode}; "
                                           f"last lines of its log:\n{h.log_tail()}")
                    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}; last status: {_brief(last)}")
                time.sleep(interval)
        finally:
            client.close()

    def wait_for_nodes(self, n: int, timeout: float = 30.0):
        """Wait until the dispatcher counts at least ``n`` alive PS nodes serving the ring (a node
        joining a cluster with job data serves once it is in sync); returns the alive NodeInfos."""
        status = self.wait_until(lambda s: _serving(s) >= n and not s.routing.pending_epoch, timeout,
                                 f"{n} serving PS node(s)")
        return [node for node in status.all_nodes if node.state == "alive"]

    def wait_for_node_state(self, node_id: str, state: str, timeout: float = 30.0):
        """Wait until the dispatcher lists ``node_id`` in ``state`` ("alive" or "dead"); returns its NodeInfo."""
        def check(s) -> bool:
            return any(node.node_id == node_id and node.state == state for node in s.all_nodes)

        status = self.wait_until(check, timeout, f"node {node_id!r} to be {state}")
        return next(node for node in status.all_nodes if node.node_id == node_id)


def dispatcher_serving(address: str, tls_ca: bytes | None = None, timeout: float = 0.5) -> bool:
    """Whether the dispatcher at ``address`` answers SERVING on its health service within
    ``timeout`` (it leads; a follower says NOT_SERVING)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shardline.services.daemon import grpc_channel

    with grpc_channel(address, tls_ca=tls_ca) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _free_port(host: str) -> int:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def _serving(status) -> int:
    return sum(1 for node in status.all_nodes if node.state == "alive" and node.member in ("serving", ""))


def _brief(status) -> str:
    if status is None or isinstance(status, Exception):
        return repr(status)
    nodes = ", ".join(f"{n.node_id}={n.state}" for n in status.all_nodes) or "no nodes"
    return f"epoch {status.routing.epoch}, {nodes}"
