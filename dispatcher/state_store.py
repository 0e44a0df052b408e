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
- etcd only: a write whose reply was lost is retried (it puts absolute values, so that is
  harmless); if no retry gets through, the outcome is unknown and the store's :class:`Fence` is
  told, so the leader steps down and whoever leads next reloads the state from etcd.

Callers write ahead: they apply a change to the store first and only then make it visible, so
nothing a caller was ever shown is missing after a restart. Backends: memory (no ``state_dir``),
SQLite (``state_dir``, one dispatcher) and etcd (``state_store: etcd://...``, several dispatchers
with one elected leader; :mod:`shardline.dispatcher.state_etcd`), chosen by :func:`open_state_store`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol, runtime_checkable

from shardline.services.errors import ShardlineConfigError, ShardlineStateError

EPOCH_KEY = "epoch"
NODE_PREFIX = "node/"
JOB_PREFIX = "job/"
TOMBSTONE_PREFIX = "tombstone/"
DEFAULT_STATE_PREFIX = "/shardline"   # the state_prefix option's default (services/config.py)
# How long a dispatcher waits at start for a replicated store (the connect_timeout option's default).
DEFAULT_CONNECT_TIMEOUT = 60.0


class StateStoreError(ShardlineStateError):
    """The dispatcher's state could not be read or written; the message names where it lives."""


class FencedError(StateStoreError):
    """A write of a dispatcher that is no longer the leader was refused; nothing of it took effect."""


@dataclass(frozen=True)
class Fence:
    """What makes a store refuse the writes of a deposed leader (the etcd backend; leader.py).

    ``token``: the create revision of the leader key this dispatcher won; every write is a
    transaction that also requires the key to still have it. ``lost(reason)`` is called when a
    write was refused for that (FencedError) or its outcome is unknown: the in-memory state can no
    longer be trusted, so the dispatcher must stop leading at once.
    """

    token: int
    lost: Callable[[str], None] = lambda reason: None


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


def state_backend(state_dir: str | None, state_store: str | None) -> str:
    """Which backend the options choose: ``"memory"``, ``"sqlite"`` or ``"etcd"``.

    Raises ShardlineConfigError naming both values if both are set, and naming ``state_store`` if it
    is not an ``etcd://HOST:PORT[,HOST:PORT...]`` URL.
    """
    if state_dir and state_store:
        raise ShardlineConfigError(
            f"state_dir ({state_dir!r}) and state_store ({state_store!r}) are mutually exclusive: state_dir keeps "
            "one dispatcher's state on its disk, state_store shares it between dispatchers; set one")
    if state_store:
        from shardline.dispatcher.state_etcd import parse_etcd_url

        parse_etcd_url(state_store)
        return "etcd"
    return "sqlite" if state_dir else "memory"


def open_state_store(state_dir: str | None, state_store: str | None = None, *, prefix: str = DEFAULT_STATE_PREFIX,
                     fence: Fence | None = None, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> StateStore:
    """The backend :func:`state_backend` chooses: SQLite in ``state_dir`` (created if missing), etcd at
    ``state_store`` (keys under ``prefix``), or memory when neither is set.

    ``fence`` (etcd only): every write then fails with FencedError, changing nothing, once the
    leader key is no longer the one this dispatcher won (:class:`Fence`). Raises
    ShardlineConfigError for bad options, StateStoreError naming the path if the directory cannot
    be used or the database is damaged, and ShardlineTimeoutError naming the endpoints if etcd does
    not answer within ``connect_timeout``.
    """
    backend = state_backend(state_dir, state_store)
    if backend == "etcd":
        from shardline.dispatcher.state_etcd import EtcdStateStore, parse_etcd_url

        return EtcdStateStore(parse_etcd_url(state_store), prefix, fence=fence, connect_timeout=connect_timeout)
    if backend == "memory":
        from shardline.dispatcher.state_memory import MemoryStateStore

        return MemoryStateStore()
    from shardline.dispatcher.state_sqlite import SqliteStateStore

    return SqliteStateStore(state_dir)
