"""A private network namespace for tests that must bind fixed or non-loopback addresses.

``NetNS()`` starts a holder process in a new network namespace (``unshare --net``; needs root or
user namespaces) with only ``lo`` up; :meth:`NetNS.popen` runs commands inside it (``nsenter``).
Nothing bound in it is reachable from the host's network, so tests may bind ``0.0.0.0`` or the
default ports there. :func:`listening` reads the listening TCP sockets of a process's namespace
(or only those the process itself holds) from ``/proc``. :meth:`NetNS.close` ends every process it
started (SIGTERM, then SIGKILL) and the holder.
"""

from __future__ import annotations

import ipaddress
import os
import select
import shutil
import signal
import subprocess

INSTALL_HINT = ("network namespaces need unshare/nsenter (util-linux) and ip (iproute2): run "
                "scripts/install-system-deps.sh as root")


class NetNSUnavailable(RuntimeError):
    pass


def _decode(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    return str(getattr(address, "ipv4_mapped", None) or address)  # gRPC binds 127.0.0.1 as ::ffff:127.0.0.1


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def listening(pid: int, *, own_only: bool = False) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket in ``pid``'s network namespace; with
    ``own_only`` just those ``pid`` holds."""
    own = _socket_inodes(pid) if own_only else None
    found = []
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}", encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            if own is not None and fields[9] not in own:
                continue
            host, port = fields[1].split(":")
            found.append((_decode(host), int(port, 16)))
    return sorted(found)


class NetNS:
    """A fresh network namespace with ``lo`` up, held by a sleeping process (see module docstring)."""

    def __init__(self, timeout: float = 10.0):
        for tool in ("unshare", "nsenter", "ip"):
            if shutil.which(tool) is None:
                raise NetNSUnavailable(f"{tool} is missing; {INSTALL_HINT}")
        self._procs: list[subprocess.Popen] = []
        self.holder = subprocess.Popen(["unshare", "--net", "sh", "-c", "ip link set lo up && echo up && exec sleep 3600"],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        ready, _, _ = select.select([self.holder.stdout], [], [], timeout)
        line = self.holder.stdout.readline() if ready else b""
        if line.strip() != b"up":
            self._kill(self.holder)
            err = self.holder.stderr.read() or b""
            raise NetNSUnavailable(f"cannot create a network namespace ({err.decode(errors='replace').strip()}); "
                                   f"{INSTALL_HINT}")

    @property
    def pid(self) -> int:
        return self.holder.pid

    def argv(self, argv: list[str]) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--", *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in the namespace (nsenter execs it: the Popen's pid is the command's)."""
        proc = subprocess.Popen(self.argv(argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
        proc = self.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            self._kill(proc)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def listening(self) -> list[tuple[str, int]]:
        return listening(self.holder.pid)

    @staticmethod
    def _kill(proc: subprocess.Popen, grace: float = 10.0) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in self._procs:
            self._kill(proc)
        self._kill(self.holder, grace=1.0)
        for stream in (self.holder.stdout, self.holder.stderr):
            stream.close()
