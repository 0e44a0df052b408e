"""A Shardline cluster on emulated hosts, for partition tests: every daemon and worker in a network
namespace of its own on one switch (bench/emulated_link.py, unshaped), whose frames the test can
drop (``cluster.link.cut(host)``, ``drop(src, dst)``, ``mend()``).

    with EmulatedCluster(tmp_path, ["disp", "ps0", "ps1", "w0", "w1"]) as cluster:
        cluster.start_dispatcher("disp", heartbeat_timeout=2)
        cluster.add_node("ps0", node_id="ps0")
        ...
        argv = cluster.on_host("w0", [sys.executable, "train_model.py", cluster.address, ...])

Daemons bind their host's address, so they need the cluster token the harness writes (workers get
it from ``SHARDLINE_CLUSTER_TOKEN_FILE``, which :attr:`worker_env` holds). The test process
stays in the machine's own namespace: its status queries (``cluster_status``, ``wait_until`` and
``leader``, through ``client`` and ``serving``) go through a probe process in a host of its own
(tests/status_probe.py) that no fault touches. Shutting down stops the daemons, the probe and
deletes every namespace.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from emulated_link import EmulatedLink, python_wrapper  # noqa: E402

from shardline.services.errors import ShardlineConnectionError  # noqa: E402
from shardline.local_cluster import LocalCluster  # noqa: E402
from shardline.services.pb import dispatcher_pb2  # noqa: E402
from shardline.services.security import write_new_token  # noqa: E402

PROBE_HOST = "probe"
PROBE = Path(__file__).with_name("status_probe.py")
# A dispatcher added with add_dispatcher listens on this port of its host (each host is a namespace of its own).
DISPATCHER_PORT = 7000
PROBE_TIMEOUT_SECONDS = 10.0
_CLUSTERS = itertools.count()   # namespace prefixes of this process's clusters


class _Probe:
    """The probe process: one request, one reply, at a time."""

    def __init__(self, argv: list[str], env: dict):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lock = threading.Lock()
        self.ask(None)

    def ask(self, request: dict | None, timeout: float = PROBE_TIMEOUT_SECONDS) -> dict:
        with self._lock:
            if request is not None:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:
                raise RuntimeError(f"the status probe did not answer {request} within {timeout:g} s "
                                   f"(exit code {self.proc.poll()})")
            return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()


class _ProbeClient:
    """What LocalCluster's status calls need of a DispatcherClient, through the probe."""

    def __init__(self, probe: _Probe, address: str, rpc_timeout: float):
        self.probe, self.address, self.rpc_timeout = probe, address, rpc_timeout

    def cluster_status(self):
        reply = self.probe.ask({"op": "status", "cluster": self.address, "timeout": self.rpc_timeout},
                               timeout=self.rpc_timeout * 4 + PROBE_TIMEOUT_SECONDS)
        if "error" in reply:
            raise ShardlineConnectionError(reply["error"])
        return dispatcher_pb2.ClusterStatus.FromString(base64.b64decode(reply["ok"]))

    def close(self) -> None:
        pass


class EmulatedCluster(LocalCluster):
    """A LocalCluster whose daemons run on the emulated hosts ``hosts`` (see the module docstring)."""

    def __init__(self, workdir, hosts: list[str], *, prefix: str | None = None, **kwargs):
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.link = EmulatedLink([*hosts, PROBE_HOST], None, prefix=prefix or f"slc{os.getpid()}x{next(_CLUSTERS)}")
        self.probe = None
        self._etcds: list = []
        try:
            token = workdir / "cluster.token"
            write_new_token(token)
            super().__init__(workdir, python=python_wrapper(workdir / "python", sys.executable),
                             cluster_token_file=str(token), **kwargs)
            self.worker_env = {"SHARDLINE_CLUSTER_TOKEN_FILE": str(token)}
            self.probe = _Probe(self.on_host(PROBE_HOST, [sys.executable, str(PROBE)]), {**os.environ, **self.worker_env})
        except BaseException:
            self._close_hosts()
            raise

    def address_of(self, host: str) -> str:
        return self.link.address(host)

    def on_host(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run in ``host``."""
        return self.link.command(host, argv)

    def _placed(self, host: str, port: int, env: dict | None) -> dict:
        return {"listen": f"{self.link.address(host)}:{port}",
                "env": {**(env or {}), "EMULATED_HOST_NETNS": self.link.hosts[host][0]}}

    def start_dispatcher(self, host: str, *, env: dict | None = None, **flags):
        return super().start_dispatcher(**self._placed(host, 0, env), **flags)

    def add_dispatcher(self, host: str, *, env: dict | None = None, **flags):
        return super().add_dispatcher(**self._placed(host, DISPATCHER_PORT, env), **flags)

    def add_node(self, host: str, node_id: str | None = None, *, env: dict | None = None, **flags):
        return super().add_node(node_id or host, **self._placed(host, 0, env), **flags)

    def client(self, rpc_timeout: float = 2.0):
        return _ProbeClient(self.probe, self.address, rpc_timeout)

    def serving(self, address: str) -> bool:
        """Whether the dispatcher at ``address`` says SERVING, asked from the probe's host."""
        return self.probe.ask({"op": "health", "address": address})["ok"] is True

    def start_etcd(self, host: str):
        """A real etcd (tests/etcd_server.py) in ``host``, stopped with the cluster; its ``url``
        is the dispatchers' ``state_store``."""
        from etcd_server import EtcdServer

        server = EtcdServer(host=self.address_of(host), wrap=lambda argv: self.on_host(host, argv), get=self.http_get)
        self._etcds.append(server)
        return server

    def http_get(self, url: str) -> str:
        """GET ``url`` from the probe's host; raises OSError with the error."""
        reply = self.probe.ask({"op": "http", "url": url})
        if "error" in reply:
            raise OSError(reply["error"])
        return reply["ok"]

    def _close_hosts(self) -> None:
        for server in self._etcds:
            server.stop()
        self._etcds = []
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        self.link.close()

    def shutdown(self, timeout: float = 10.0):
        try:
            return super().shutdown(timeout)
        finally:
            self._close_hosts()

    close = shutdown
