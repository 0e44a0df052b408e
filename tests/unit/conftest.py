"""Fixtures shared by unit tests: the dispatcher's state stores and servicer context, a worker Client with no cluster,
a connected socket pair."""

from __future__ import annotations

import socket

import pytest

from shardline.dispatcher.state_memory import MemoryStateStore
from shardline.dispatcher.state_store import StateStoreError


class RecordingStore(MemoryStateStore):
    """A memory store that records each apply and fails them while ``failing`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.applies: list[tuple[dict, list]] = []
        self.failing = False

    def apply(self, puts, deletes=()):
        if self.failing:
            raise StateStoreError("cannot write dispatcher state to /state/dispatcher.db: disk I/O error")
        deletes = list(deletes)
        super().apply(puts, deletes)
        self.applies.append((dict(puts), deletes))


@pytest.fixture
def pair():
    """Two connected stream sockets (the frame tests' two ends), closed afterwards."""
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def recording_store() -> RecordingStore:
    return RecordingStore()


class ServicerContext:
    """The grpc.ServicerContext a servicer method is called with, outside a server: an abort fails the test."""

    def abort(self, code, message):
        raise AssertionError(f"aborted {code}: {message}")

    def set_trailing_metadata(self, _metadata):
        pass


@pytest.fixture
def grpc_context() -> ServicerContext:
    return ServicerContext()


@pytest.fixture
def offline_client():
    """A factory: ``offline_client(spec)`` is a worker Client of rank 0 with job ``spec`` loaded
    and no cluster (no dispatcher, connections or lease thread; caches in ordinary memory). A
    test sets ``routing``, ``_scatter`` or ``_exchange`` to what it drives."""
    import types
    import weakref

    from shardline.services.transport import get_transport
    from shardline.worker.client import Client
    from shardline.worker.lease import WorkerLease
    from shardline.worker.node_watch import NodeWatch
    from shardline.worker.recovery import Replay, StepsInFlight
    from shardline.worker.shm_exchange import SharedMemory

    def make(spec):
        client = Client.__new__(Client)
        this = weakref.ref(client)   # no cycle: a client the test drops is freed at once (its shared regions too)
        client._watch, client._lacking = NodeWatch(lambda known: known, lambda: this().routing), {}
        client.job, client.rank = spec.name, 0
        client._lease = WorkerLease(spec.name, 0, "offline", heartbeat=None, step=lambda: 0)
        client._lease.release()   # never renews: there is no dispatcher
        client._inflight = StepsInFlight()
        client._replay, client._compressor, client._values = Replay(client._inflight), None, {}
        client._shapes, client._slices, client.step, client.uid, client.max_retries = {}, {}, 0, "", 3
        client._transport, client._shm, client._versions = get_transport("tcp"), SharedMemory(), {}
        client._grad_buffers = {}
        client.routing = types.SimpleNamespace(epoch=2, ring=object(), owner=lambda job, tensor, index: "ps")
        client._load_spec(spec)
        return client
    return make

