"""A data-plane connection's payload buffer (services/dataplane_server.py): kept between frames,
given back once it has been far larger than a run of frames (a job's INIT or a replica's initial
sync is once: the connection then carries step-sized frames), never churned by frames that
alternate sizes or carry no payload; the node's budget counts what is held."""

from __future__ import annotations

from types import SimpleNamespace

from shardline.services.dataplane_server import (FAR_OVERSIZE_MIN_BYTES, OVERSIZE_FRAMES, OVERSIZE_MIN_BYTES,
                                                 _Connection, far_oversized, oversized)
from shardline.services.payload_budget import PayloadBudget

MIB = 1024 * 1024


def connection(budget: PayloadBudget) -> _Connection:
    conn = _Connection.__new__(_Connection)
    conn.policy = SimpleNamespace(budget=budget, payload_timeout=1.0)
    conn.buffer = bytearray(0)
    conn.smaller_frames = 0
    return conn


def test_the_rule():
    assert not oversized(OVERSIZE_MIN_BYTES, 1)              # small buffers are always kept
    assert oversized(OVERSIZE_MIN_BYTES + 1, 1)
    assert not oversized(64 * MIB, 32 * MIB) and oversized(64 * MIB, 32 * MIB - 1)


def test_a_buffer_left_from_one_large_frame_is_made_the_size_of_the_frames_that_follow():
    budget = PayloadBudget(1024 * MIB)
    conn = connection(budget)
    assert conn.ensure_buffer(160 * MIB)                      # the initial sync of a replica
    assert budget.in_use == 160 * MIB
    for _ in range(OVERSIZE_FRAMES - 1):                      # the steps' frames: kept a while
        assert conn.ensure_buffer(50 * MIB) and len(conn.buffer) == 160 * MIB
        assert conn.ensure_buffer(0) and len(conn.buffer) == 160 * MIB   # pulls change nothing
    assert conn.ensure_buffer(50 * MIB)
    assert len(conn.buffer) == 50 * MIB and budget.in_use == 50 * MIB
    for _ in range(3 * OVERSIZE_FRAMES):
        assert conn.ensure_buffer(50 * MIB) and len(conn.buffer) == 50 * MIB


def test_frames_that_alternate_sizes_keep_the_large_buffer():
    budget = PayloadBudget(1024 * MIB)
    conn = connection(budget)
    for _ in range(4 * OVERSIZE_FRAMES):
        assert conn.ensure_buffer(64 * MIB)
        assert conn.ensure_buffer(1 * MIB)
        assert len(conn.buffer) == 64 * MIB
    assert budget.in_use == 64 * MIB


def test_a_buffer_far_larger_than_the_next_frame_is_given_back_at_once():
    """A job's INIT (the whole model's values, 245 MiB in a LoRA run) then pushes of a few MiB:
    the buffer goes at the first push, not after OVERSIZE_FRAMES steps."""
    assert not far_oversized(FAR_OVERSIZE_MIN_BYTES, 1) and far_oversized(FAR_OVERSIZE_MIN_BYTES + 1, 1)
    assert not far_oversized(256 * MIB, 16 * MIB) and far_oversized(256 * MIB, 16 * MIB - 1)
    budget = PayloadBudget(1024 * MIB)
    conn = connection(budget)
    assert conn.ensure_buffer(245 * MIB)
    assert conn.ensure_buffer(2 * MIB) and len(conn.buffer) == 2 * MIB and budget.in_use == 2 * MIB
    assert conn.ensure_buffer(0) and len(conn.buffer) == 2 * MIB    # a pull changes nothing


def test_pushes_received_straight_into_gradient_buffers_count_as_frames_that_need_none():
    """Over shm a push's blocks come from the worker's regions straight into the gradient buffers:
    it needs no payload buffer (0 bytes), unlike a pull, which says nothing of the buffer's size."""
    budget = PayloadBudget(1024 * MIB)
    conn = connection(budget)
    assert conn.ensure_buffer(100 * MIB)                       # the INIT, one frame
    for _ in range(3 * OVERSIZE_FRAMES):
        assert conn.ensure_buffer(0) and len(conn.buffer) == 100 * MIB      # pulls: kept
    for _ in range(OVERSIZE_FRAMES - 1):
        assert conn.ensure_buffer(0, push=True) and len(conn.buffer) == 100 * MIB
    assert conn.ensure_buffer(0, push=True) and len(conn.buffer) == 0 and budget.in_use == 0
    conn = connection(budget)
    assert conn.ensure_buffer(245 * MIB)
    assert conn.ensure_buffer(0, push=True) and len(conn.buffer) == 0 and budget.in_use == 0   # far larger: at once
