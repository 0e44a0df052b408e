"""Durable dispatcher state: the backend interface and how a backend is chosen.

The dispatcher keeps its state (ring epoch, node registrations, jobs, tombstones of deleted jobs)
as a string-keyed map of JSON objects. Keys in use (see ``Membership`` and ``JobRegistry``)::

    epoch               {"epoch": N}
    node/<node_id>      {"rack", "grpc_address", "data_address", "capacity", "state"}
    job/<name>          {"spec", "ready", "created_unix_ms", "uid", "holders"}
    tombstone/<uid>     {"job", "deleted_unix_ms"}

Contract every backend keeps:

- ``load()`` returns every key with a private copy of its value (mutating it changes nothing).
- ``apply(puts, deletes)`` is atomic and durable: when it returns, all of it survives a crash of
  the process or the machine; when it raises, none of it took effect. Deleting an absent key is
  not an error. A key both put and deleted is put (puts go last).
- Failures raise :class:`StateStoreError` naming the store's ``location``.
- Thread-safe; ``close()`` is idempotent and further calls raise StateStoreError.

Callers write ahead: they apply a change to the store first and only then make it visible, so
nothing a caller was ever shown is missing after a restart. Another backend (etcd) slots in by
implementing :class:`StateStore` and a branch in :func:`open_state_store`.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping, Protocol, runtime_checkable

from shardline.services.errors import ShardlineStateError

EPOCH_KEY = "epoch"
NODE_PREFIX = "node/"
JOB_PREFIX = "job/"
TOMBSTONE_PREFIX = "tombstone/"


class StateStoreError(ShardlineStateError):
    """The dispatcher's state could not be read or written; the message names where it lives."""


@runtime_checkable
class StateStore(Protocol):
    """A string-keyed store of JSON objects with atomic multi-key writes (contract: module docstring)."""

    location: str  # for messages: a path, or "memory"

    def load(self) -> dict[str, dict]: ...

    def apply(self, puts: Mapping[str, dict], deletes: Iterable[str] = ()) -> None: ...

    def close(self) -> None: ...


def encode_value(location: str, key: object, value: object) -> str:
    """``value`` as JSON text; raises StateStoreError naming ``key`` unless it is a JSON object
    (nan and infinities are refused: JSON has no spelling for them)."""
    if not isinstance(key, str) or not key:
        raise StateStoreError(f"state store {location}: keys must be non-empty strings, got {key!r}")
    if not isinstance(value, dict):
        raise StateStoreError(f"state store {location}: value of {key!r} must be a JSON object, got {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise StateStoreError(f"state store {location}: value of {key!r} is not JSON: {exc}") from None


def decode_value(location: str, key: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise StateStoreError(f"state store {location}: value of {key!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise StateStoreError(f"state store {location}: value of {key!r} is not a JSON object: {text[:80]!r}")
    return value


def with_prefix(state: Mapping[str, dict], prefix: str) -> dict[str, dict]:
    """The entries of ``state`` under ``prefix``, keyed by the rest of the key."""
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


def open_state_store(state_dir: str | None) -> StateStore:
    """SQLite in ``state_dir`` (created if missing), or memory when ``state_dir`` is None or empty.

    Raises StateStoreError naming the path if the directory cannot be used or the database is damaged.
    """
    if not state_dir:
        from shardline.dispatcher.state_memory import MemoryStateStore

        return MemoryStateStore()
    from shardline.dispatcher.state_sqlite import SqliteStateStore

    return SqliteStateStore(state_dir)
