"""A data-plane connection's payload buffer (services/dataplane_server.py): kept between frames,
given back once it has been far larger than a run of frames (a job's INIT or a replica's initial
sync is once: the connection then carries step-sized frames), never churned by frames that
alternate sizes or carry no payload; the node's budget counts what is held."""

from __future__ import annotations

from types import SimpleNamespace

from shardline.services.dataplane_server import (OVERSIZE_FRAMES, OVERSIZE_MIN_BYTES, _Connection, oversized)
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
