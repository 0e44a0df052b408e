"""A real etcd (Debian's etcd-server, 3.4) on 127.0.0.1 for tests: free client and peer ports, a
temporary data directory (in /dev/shm when there is one: fsyncs there cost nothing), healthy
before it is handed out, always stopped and removed afterwards.

The ``etcd`` fixture (tests/conftest.py) fails -- never skips -- when the binary is missing: the
suite needs it, and scripts/install-system-deps.sh installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from ports import free_port

START_TIMEOUT = 20.0
START_ATTEMPTS = 3
INSTALL_HINT = "etcd is not installed: run scripts/install-system-deps.sh (as root) to install Debian's etcd-server"


def _get_here(url: str) -> str:
    with urllib.request.urlopen(url, timeout=1) as reply:
        return reply.read().decode("utf-8", "replace")


class EtcdServer:
    """One single-member etcd cluster; ``url`` is the dispatcher's ``state_store`` value.

    ``stop`` (also on ``__exit__``) kills it and removes its data. The process is started under
    ``setpriv --pdeathsig KILL`` where available, so even a test run killed outright leaves no etcd.
    """

    def __init__(self, binary: str = "etcd", *, host: str = "127.0.0.1", wrap=None, get=None):
        """``host``: the address it serves on; another than 127.0.0.1 is a private network
        namespace (tests/emulated_cluster.py), where etcd's own ports are free. ``wrap(argv)``: the
        command line that runs ``argv`` there; ``get(url)``: the body of ``GET url``, OSError if it
        fails (default: asked from here)."""
        self.host, self._wrap = host, wrap or (lambda argv: argv)
        self._get = get or _get_here
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(INSTALL_HINT)
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        # Not named "shardline-...": the shm tests, run alongside, check that no file of that name
        # appears in /dev/shm (Shardline's own segments are memfds).
        self.data_dir = Path(tempfile.mkdtemp(prefix="test-etcd-", dir=base))
        self.log_path = self.data_dir / "etcd.log"
        # etcd cannot take port 0: the free ports picked may be taken before it binds them, so a
        # start that fails with "address already in use" is tried again on other ports.
        for attempt in range(START_ATTEMPTS):
            self._start(path)
            try:
                self._wait_healthy()
                return
            except BaseException as exc:
                self.stop(remove=False)
                if attempt + 1 == START_ATTEMPTS or not isinstance(exc, RuntimeError) \
                        or "address already in use" not in str(exc):
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                    raise
                shutil.rmtree(self.data_dir / "data", ignore_errors=True)

    def _start(self, path: str) -> None:
        private = self.host != "127.0.0.1"
        self.client_port, self.peer_port = (2379, 2380) if private else (free_port(), free_port())
        self.endpoint = f"{self.host}:{self.client_port}"
        self.url = f"etcd://{self.endpoint}"
        peer = f"http://{self.host}:{self.peer_port}"
        argv = self._wrap([path, "--name", "test", "--data-dir", str(self.data_dir / "data"),
                           "--listen-client-urls", f"http://{self.endpoint}",
                           "--advertise-client-urls", f"http://{self.endpoint}",
                           "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                           "--initial-cluster", f"test={peer}", "--initial-cluster-state", "new",
                           "--logger", "zap", "--log-level", "warn"])
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            argv = [setpriv, "--pdeathsig", "KILL", *argv]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                if json.loads(self._get(f"http://{self.endpoint}/health")).get("health") == "true":
                    return
            except (OSError, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise RuntimeError(f"etcd not healthy within {START_TIMEOUT:g} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self, remove: bool = True) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=10)
        if remove:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "EtcdServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
