"""A PS node's memory accounting (ps_server/store/memory.py, ps_server/memory_report.py) against
its references: the arithmetic of what each option keeps per parameter, and the process's own
anonymous memory (what the kernel says the job's tensors took)."""

from __future__ import annotations

import ctypes
import gc
import json
import subprocess
import sys

import pytest
import torch

from shardline.ps_server.memory_report import JOB_MEMORY_KINDS, JobMemory, job_reports, process_memory
from shardline.ps_server.node import PSNode
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import JobStore, PushItem
from shardline.ps_server.store.memory import MEMORY_KINDS, held_parameters, job_memory
from shardline.services.blocks import block_slices
from shardline.services.pb import common_pb2

BLOCK = 1024
M_MMAP_THRESHOLD = -3   # glibc's malloc.h


def spec(numel: int, *, sync="bsp", world_size=2, kind="adamw", inexact_restarts=False, replicate_gradients=False,
         block=BLOCK, **hp):
    s = common_pb2.JobSpec(name="mem", sync=sync, world_size=world_size, block_elements=block,
                           inexact_restarts=inexact_restarts, replicate_gradients=replicate_gradients,
                           optimizer=OptimizerConfig.from_kwargs(kind, lr=0.01, **hp).to_proto())
    s.tensors.add(name="w", shape=[numel], dtype="float32", trainable=True)
    return s


def blocks_of(numel: int, block=BLOCK) -> int:
    return len(block_slices(numel, block))


def step_counters(kind: str, numel: int, block=BLOCK) -> int:
    """Adam/AdamW keep the step count of each block as a float32 scalar tensor (torch.optim's)."""
    return 4 * blocks_of(numel, block) if kind in ("adam", "adamw") else 0


def init(store: JobStore, numel: int, block=BLOCK) -> None:
    value = torch.randn(numel)
    store.init_blocks([("w", s.index, value[s.start:s.stop]) for s in block_slices(numel, block)])


def step(store: JobStore, step_no: int, numel: int, block=BLOCK) -> None:
    for rank in range(store.world_size):
        grad = torch.randn(numel)
        store.push(rank, step_no, 1.0, [PushItem("w", s.index, grad[s.start:s.stop].clone())
                                        for s in block_slices(numel, block)])
    for rank in range(store.world_size):
        store.commit(rank, step_no, 1.0)


@pytest.mark.parametrize("kind, state_floats", [("adamw", 2), ("sgd", 0)])
def test_a_fresh_job_holds_its_values_and_optimizer_state(kind, state_floats):
    numel = 10 * BLOCK + 17
    store = JobStore(spec(numel, kind=kind))
    init(store, numel)
    got = job_memory(store)
    assert set(got) == set(MEMORY_KINDS)
    assert got["values"] == 4 * numel
    assert got["optimizer_state"] == 4 * state_floats * numel + step_counters(kind, numel)
    assert sum(got.values()) == got["values"] + got["optimizer_state"]
    assert held_parameters(store) == numel


@pytest.mark.parametrize("inexact_restarts, kept", [(False, 4), (True, 0)])
def test_a_bsp_primary_after_a_step_holds_a_gradient_buffer_and_the_kept_value(inexact_restarts, kept):
    """AdamW BSP on one node (every block a primary): values 4 + moments 8 + the gradient sum 4 +
    (exact restarts) the value before the step 4 bytes per parameter."""
    numel = 8 * BLOCK
    store = JobStore(spec(numel, inexact_restarts=inexact_restarts))
    init(store, numel)
    for s in range(3):
        step(store, s, numel)
    got = job_memory(store)
    assert got["values"] == 4 * numel and got["optimizer_state"] == 8 * numel + step_counters("adamw", numel)
    assert got["gradients"] == 4 * numel
    assert got["kept_values"] == kept * numel
    assert got["replay_spares"] == got["staging"] == got["held_copies"] == got["parked_gradients"] == 0


def test_a_replayed_gradient_is_a_spare_buffer_counted_once():
    """replicate_gradients: the applied step's mean gradient stays as sent until the holders
    acknowledged it; it is the buffer the next step collects into after that (so two gradient
    buffers per primary, and the replay record and the spare the same storage, counted once)."""
    numel = 4 * BLOCK
    store = JobStore(spec(numel, replicate_gradients=True, inexact_restarts=True))
    init(store, numel)
    for s in range(3):
        step(store, s, numel)
    got = job_memory(store)
    assert got["gradients"] == 4 * numel
    assert got["replay_spares"] == 4 * numel


def test_a_storage_shared_by_two_records_counts_once_under_the_first_kind():
    numel = 2 * BLOCK
    store = JobStore(spec(numel, kind="sgd"))
    init(store, numel)
    with store.cond:
        block = store.blocks[("w", 0)]
        block.state["alias"] = block.value[:10]      # a view of the value's storage
    got = job_memory(store)
    assert got["values"] == 4 * numel and got["optimizer_state"] == 0


def test_the_node_report_adds_the_delta_history_per_job_incarnation():
    numel = 2 * BLOCK
    job_spec = spec(numel)
    node = PSNode("n0", lambda name: None, lambda: common_pb2.RoutingTable())
    job = node.store.add(job_spec, uid="u1")
    init(job, numel)
    node.delta_history.record(("u1", "mem", "w", 0), 1, torch.zeros(BLOCK, dtype=torch.bfloat16))
    node.delta_history.record(("other-uid", "mem", "w", 0), 1, torch.zeros(BLOCK, dtype=torch.bfloat16))
    (report,) = job_reports(node)
    assert isinstance(report, JobMemory) and set(report.bytes) == set(JOB_MEMORY_KINDS)
    assert report.bytes["delta_history"] == 2 * BLOCK
    assert report.parameters == numel
    assert report.total == 4 * numel + 8 * numel + step_counters("adamw", numel) + 2 * BLOCK
    assert report.per_parameter == pytest.approx(report.total / numel)


def measure_growth() -> tuple[int, int]:
    """In a process of its own: (growth of anonymous memory, bytes accounted) for an AdamW BSP job
    of 4 M parameters after two steps."""
    numel = 4 * 1024 * 1024
    block = 64 * 1024
    libc = ctypes.CDLL(None)
    assert libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024) == 1, "glibc's mallopt refused M_MMAP_THRESHOLD"
    gc.collect()
    before = process_memory()[1]
    assert before, "/proc/self/status gives no RssAnon: the reference this test checks against is missing"
    store = JobStore(spec(numel, block=block))
    init(store, numel, block)
    for s in range(2):
        step(store, s, numel, block)
    gc.collect()
    accounted = sum(job_memory(store).values())
    # values, moments, gradient sum, kept value (and the step counters)
    assert accounted == 20 * numel + step_counters("adamw", numel, block), accounted
    return process_memory()[1] - before, accounted


def test_what_is_accounted_is_what_the_process_took():
    """The kernel's count of a process's anonymous memory grows by what the accounting says the
    job holds (within 10 %: the job's Python records). The process tells glibc's malloc to map
    every allocation of 64 KiB or more on its own (M_MMAP_THRESHOLD): a freed one goes back to
    the kernel at once, so the transient gradients leave nothing behind (by default the threshold
    rises to the largest block freed, and the heap keeps such blocks: allocator slack, not the
    job's)."""
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    grew, accounted = json.loads(out.stdout)
    assert abs(grew - accounted) <= 0.1 * accounted, (grew, accounted)


if __name__ == "__main__":
    print(json.dumps(measure_growth()))
