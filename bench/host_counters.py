"""What a benchmark reads from /proc about hosts and processes, and the all-reduce figure it
compares NIC bytes with (bench/vs_ddp.py).

* NIC counters: ``/proc/<pid>/net/dev`` lists the interfaces of the network namespace process
  ``pid`` runs in, so a process of any namespace reads any emulated host's ``eth0`` through a
  process that lives there (``self`` for its own host); a plain file read, cheap enough to take
  between two steps.
* CPU seconds and peak RSS of a process: ``/proc/<pid>/stat`` (utime + stime) and
  ``/proc/<pid>/status`` (``VmHWM``); ``reset_peak_rss`` starts the peak over (``clear_refs``).
* :func:`ring_allreduce_bytes`: what a ring all-reduce of ``payload_bytes`` over ``n`` hosts
  moves per host, each way.
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_net_dev(text: str, dev: str = "eth0") -> dict[str, int]:
    """``{"rx_bytes", "tx_bytes"}`` of interface ``dev`` in a ``/proc/net/dev`` listing."""
    for line in text.splitlines():
        name, sep, fields = line.partition(":")
        if sep and name.strip() == dev:
            values = fields.split()
            # receive: bytes packets errs drop fifo frame compressed multicast; then transmit: bytes ...
            return {"rx_bytes": int(values[0]), "tx_bytes": int(values[8])}
    raise LookupError(f"no interface {dev!r} in /proc/net/dev")


def read_nic(pid: int | str = "self", dev: str = "eth0") -> dict[str, int]:
    """Interface ``dev``'s byte counters in the network namespace of process ``pid``."""
    return parse_net_dev(Path(f"/proc/{pid}/net/dev").read_text(), dev)


def nic_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("rx_bytes", "tx_bytes")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def status_mib(pid: int, field: str) -> float:
    """A memory field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``...) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0   # kB
    raise LookupError(f"no {field} in /proc/{pid}/status")


def peak_rss_mib(pid: int) -> float:
    """Process ``pid``'s peak resident set (``VmHWM``) in MiB."""
    return status_mib(pid, "VmHWM")


def reset_peak_rss(pid: int) -> bool:
    """Start ``pid``'s ``VmHWM`` over from its current RSS (Linux >= 4.0; the process's owner or
    root). False where the kernel refuses: the peak then counts from the process's start."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def ring_allreduce_bytes(payload_bytes: int, n: int) -> float:
    """Bytes a host sends in a ring all-reduce of ``payload_bytes`` over ``n`` hosts, and as many
    it receives: (n - 1)/n of the payload in the reduce-scatter and as much in the all-gather,
    2(n - 1)/n x ``payload_bytes`` each way. Sent plus received per host: twice that."""
    if n < 1:
        raise ValueError(f"a ring needs at least one host, got {n}")
    return 2.0 * (n - 1) / n * payload_bytes
