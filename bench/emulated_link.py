"""One emulated host per process group, each behind a NIC of a chosen rate (``vs_ddp.py --link``).

On one machine every peer is local: the data plane picks shared memory and loopback TCP costs
only CPU, so communication takes no time a rank could hide behind backward. This module builds
what a small cluster has instead, out of network namespaces it creates and deletes (nothing
outside them is touched):

* ``<prefix>-net``: a namespace holding a bridge (the switch);
* one namespace per host (``<prefix>-<host>``), with ``eth0`` (10.231.0.N/24) on a veth pair to the
  bridge, and its loopback up;
* a token-bucket filter (``tc qdisc ... tbf rate R``) on both ends of every veth: each host sends
  and receives at most R, independently, as a full-duplex NIC does. No delay is added (the
  kernel has no netem here); the transfer time of a payload is what the link costs.

With ``rate=None`` the NICs are not shaped (the partition tests want a network, not a slow one).

Partitions (tests/integration/test_partitions.py, tests/fault/chaos.py): the switch drops frames
as a failed port or a partitioned network does, silently, with a bridge-family nftables table in
the switch namespace (``nft``, from nftables). :meth:`cut` loses everything a host sends and
receives, :meth:`drop` what one host sends to another (one way; call it twice for both),
:meth:`mend` ends every fault. Nothing inside the hosts changes: their links stay up, so their
sockets see a silent network (retransmits, timeouts), not an error.

Processes run in a host with :meth:`EmulatedLink.command` (``ip netns exec <ns> ...``, which
execs in place: the pid is the process's own). It needs root and iproute2 (``ip``, ``tc``; in
scripts/install-system-deps.sh). :meth:`close` deletes every namespace it made (their veths go
with them); call it after the processes inside have ended.
"""

from __future__ import annotations

import os
import re
import subprocess

SUBNET = "10.231.0"   # inside the namespaces created here only
RATE = re.compile(r"^\d+(\.\d+)?(kbit|mbit|gbit)$")


def check_rate(rate: str) -> str:
    """A tc rate such as ``10gbit`` or ``800mbit``; anything else is an error naming the value."""
    if not RATE.match(rate):
        raise ValueError(f"--link {rate!r}: give a rate such as 10gbit, 2.5gbit or 800mbit")
    return rate


def _run(*argv: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError(f"{argv[0]} not found: emulated hosts need iproute2 and nftables "
                           f"(scripts/install-system-deps.sh)") from None
    if done.returncode != 0:
        hint = " (network namespaces need root)" if os.geteuid() != 0 else ""
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}{hint}")


# The switch's table of partition faults (bridge family: it sees every frame between two ports).
FAULT_TABLE = ("bridge", "shardline_faults")


class EmulatedLink:
    """Hosts ``names`` (e.g. ``["ps0", "rank0", "rank1"]``) on a switch, each NIC at ``rate``
    (None: unshaped)."""

    def __init__(self, names: list[str], rate: str | None, *, prefix: str | None = None):
        self.rate = None if rate is None else check_rate(rate)
        self.prefix = prefix or f"sl{os.getpid()}"
        self.hosts: dict[str, tuple[str, str]] = {}   # name -> (namespace, address)
        self._ports: dict[str, str] = {}              # name -> its port on the switch
        self._namespaces: list[str] = []
        self._faults = False                          # the fault table exists
        try:
            self._build(names)
        except BaseException:
            self.close()
            raise

    def _netns(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        _run("ip", "netns", "add", ns)
        self._namespaces.append(ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        return ns

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate is None:
            return
        # burst: a few MTU-sized (64 KiB) packets; latency bounds the queue (packets beyond wait, not drop)
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", self.rate,
             "burst", "256kb", "latency", "50ms")

    def _build(self, names: list[str]) -> None:
        switch = self._netns("net")
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for n, name in enumerate(names, start=1):
            ns = self._netns(name)
            port = f"p{n}"
            # made in the switch namespace, one end moved into the host's as eth0
            _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "-n", switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", switch, "link", "set", port, "up")
            address = f"{SUBNET}.{n}"
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")        # what the host sends
            self._shape(switch, port)      # what it receives
            self.hosts[name] = (ns, address)
            self._ports[name] = port

    # -- partitions ---------------------------------------------------------------------------

    def _nft(self, *rule: str) -> None:
        _run("ip", "netns", "exec", f"{self.prefix}-net", "nft", *rule)

    def _fault(self, match: list[str]) -> None:
        family, table = FAULT_TABLE
        if not self._faults:
            self._nft("add", "table", family, table)
            self._nft("add", "chain", family, table, "forward", "{ type filter hook forward priority 0; }")
            self._faults = True
        self._nft("add", "rule", family, table, "forward", *match, "drop")

    def cut(self, name: str) -> None:
        """Host ``name`` loses its network: every frame it sends or is sent is dropped."""
        port = self._ports[name]
        self._fault(["iifname", port])
        self._fault(["oifname", port])

    def drop(self, src: str, dst: str) -> None:
        """Frames from host ``src`` to host ``dst`` are lost (one way: ``dst`` still reaches ``src``)."""
        self._fault(["iifname", self._ports[src], "oifname", self._ports[dst]])

    def mend(self) -> None:
        """End every cut and drop."""
        if self._faults:
            self._nft("flush", "chain", *FAULT_TABLE, "forward")

    def address(self, name: str) -> str:
        return self.hosts[name][1]

    def command(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` run inside host ``name``."""
        return ["ip", "netns", "exec", self.hosts[name][0], *argv]

    def close(self) -> None:
        for ns in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._namespaces = []

    def __enter__(self) -> "EmulatedLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def python_wrapper(path, python: str) -> str:
    """An executable at ``path`` that runs ``python`` inside the namespace named by the environment
    variable EMULATED_HOST_NETNS (directly if unset): LocalCluster starts every daemon with it,
    and each daemon's own env names its host."""
    with open(path, "w") as fh:
        fh.write("#!/bin/sh\n"
                 f'[ -n "$EMULATED_HOST_NETNS" ] && exec ip netns exec "$EMULATED_HOST_NETNS" {python} "$@"\n'
                 f'exec {python} "$@"\n')
    os.chmod(path, 0o755)
    return str(path)
