"""Fixtures shared by the dispatcher's unit tests."""

from __future__ import annotations

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
