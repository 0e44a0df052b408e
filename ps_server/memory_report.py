"""A PS node's memory as operators see it: each job's tensors by kind (ps_server/store/memory.py)
and its images in the subscribers' delta history, against the parameters the node holds; the data
plane's receive buffers; the process's resident and anonymous memory. The metrics
(``shardline_ps_memory_bytes``), ``GetNodeStatus`` and ``shardline status`` report it.
docs/operations.md, "Memory", says what each kind costs per parameter under each option.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardline.ps_server.store.memory import MEMORY_KINDS, held_parameters, job_memory

JOB_MEMORY_KINDS = (*MEMORY_KINDS, "delta_history")


@dataclass(frozen=True)
class JobMemory:
    """One job's bytes on a node by kind (JOB_MEMORY_KINDS) and the parameters it holds there."""

    name: str
    parameters: int
    bytes: dict

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @property
    def per_parameter(self) -> float:
        return self.total / self.parameters if self.parameters else 0.0


def job_report(job, images: dict) -> JobMemory:
    """``job`` accounted (a walk of its blocks under its lock); ``images``: the node's
    ``delta_history.job_bytes()``."""
    kinds = job_memory(job)
    kinds["delta_history"] = images.get((job.uid, job.name), 0)
    return JobMemory(job.name, held_parameters(job), kinds)


def job_reports(node) -> list[JobMemory]:
    """Every job ``node`` holds, accounted."""
    images = node.delta_history.job_bytes()
    return [job_report(job, images) for job in node.store.jobs()]


def receive_buffer_bytes(node) -> int:
    """Payload buffers the node's data-plane connections hold (0: no budget attached)."""
    budget = getattr(node, "payload_budget", None)
    return budget.in_use if budget is not None else 0


def process_memory(path: str = "/proc/self/status") -> tuple[int, int]:
    """This process's (resident, anonymous resident) bytes; (0, 0) where the kernel does not say."""
    fields = {}
    try:
        with open(path) as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in ("VmRSS", "RssAnon"):
                    fields[name] = int(rest.split()[0]) * 1024   # "kB"
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("VmRSS", 0), fields.get("RssAnon", 0)
