"""State stores: both backends keep the contract; SQLite is durable across reopen and kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shardline.dispatcher.state_memory import MemoryStateStore
from shardline.dispatcher.state_sqlite import DB_NAME, SqliteStateStore
from shardline.dispatcher.state_store import StateStore, StateStoreError, open_state_store

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path):
    s = MemoryStateStore() if request.param == "memory" else SqliteStateStore(str(tmp_path / "state"))
    yield s
    s.close()


def test_round_trip_puts_and_deletes(store):
    assert isinstance(store, StateStore)
    assert store.load() == {}
    store.apply({"epoch": {"epoch": 3}, "node/a": {"rack": "r1", "capacity": 1.5}, "job/x": {"holders": {"a": None}}})
    store.apply({"node/b": {"rack": "r2"}}, deletes=["node/a", "never-there"])
    assert store.load() == {"epoch": {"epoch": 3}, "node/b": {"rack": "r2"}, "job/x": {"holders": {"a": None}}}


def test_a_key_put_and_deleted_in_one_apply_is_put(store):
    store.apply({"k": {"v": 1}})
    store.apply({"k": {"v": 2}}, deletes=["k"])
    assert store.load() == {"k": {"v": 2}}


def test_values_are_copies_both_ways(store):
    value = {"holders": {"a": 1}}
    store.apply({"k": value})
    value["holders"]["a"] = 99
    loaded = store.load()
    loaded["k"]["holders"]["a"] = 42
    assert store.load() == {"k": {"holders": {"a": 1}}}


@pytest.mark.parametrize("bad", [{"x": object()}, {"x": float("nan")}, ["not", "an", "object"]])
def test_a_failing_apply_changes_nothing(store, bad):
    store.apply({"a": {"v": 1}, "b": {"v": 1}})
    # "a" is written before the bad value is reached: the whole transaction must roll back.
    with pytest.raises(StateStoreError) as err:
        store.apply({"a": {"v": 2}, "c": {"v": 2}, "z": bad}, deletes=["b"])
    assert "'z'" in str(err.value) and store.location in str(err.value)
    assert store.load() == {"a": {"v": 1}, "b": {"v": 1}}
    store.apply({"a": {"v": 3}})  # the store still works
    assert store.load()["a"] == {"v": 3}


def test_closed_store_refuses_calls(store):
    store.close()
    store.close()  # idempotent
    with pytest.raises(StateStoreError, match="closed"):
        store.load()
    with pytest.raises(StateStoreError, match="closed"):
        store.apply({"k": {}})


def test_open_state_store_chooses_the_backend(tmp_path):
    memory = open_state_store(None)
    assert isinstance(memory, MemoryStateStore) and memory.location == "memory"
    sqlite = open_state_store(str(tmp_path / "new" / "dir"))
    try:
        assert isinstance(sqlite, SqliteStateStore)
        assert sqlite.location == str(tmp_path / "new" / "dir" / DB_NAME)
        assert Path(sqlite.location).is_file()
    finally:
        sqlite.close()


def test_sqlite_is_wal_with_full_sync_and_survives_reopen(tmp_path):
    first = SqliteStateStore(str(tmp_path))
    assert first._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert first._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    first.apply({"epoch": {"epoch": 7}, "job/a": {"uid": "u1"}})
    first.close()
    again = SqliteStateStore(str(tmp_path))
    try:
        assert again.load() == {"epoch": {"epoch": 7}, "job/a": {"uid": "u1"}}
    finally:
        again.close()


_WRITER = textwrap.dedent("""
    import sys
    from shardline.dispatcher.state_sqlite import SqliteStateStore

    store = SqliteStateStore(sys.argv[1])
    i = 0
    while True:
        store.apply({f"job/j{i}": {"i": i}, "epoch": {"epoch": i + 1}})
        print(i, flush=True)  # acknowledged: apply returned
        i += 1
""")


def test_sqlite_keeps_every_acknowledged_apply_across_kill_9(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        acked = -1
        while acked < 30:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            acked = int(line)
        proc.send_signal(signal.SIGKILL)  # while it is in the middle of further applies
        assert proc.wait(timeout=10) == -signal.SIGKILL
        acked = max([acked, *(int(line) for line in proc.stdout.read().split())])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    store = SqliteStateStore(str(tmp_path))  # the dead writer's lock is gone
    try:
        state = store.load()
    finally:
        store.close()
    assert all(state[f"job/j{i}"] == {"i": i} for i in range(acked + 1))
    assert state["epoch"]["epoch"] >= acked + 1
    # Nothing torn: every job key matches an epoch the same transaction wrote.
    assert len([k for k in state if k.startswith("job/")]) == state["epoch"]["epoch"]


def test_a_path_that_cannot_be_a_directory_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for path in (blocker, blocker / "sub"):
        with pytest.raises(StateStoreError) as err:
            open_state_store(str(path))
        assert str(path) in str(err.value)


def test_an_unwritable_directory_is_named(tmp_path, monkeypatch):
    """What a daemon running as its own user meets on a directory it may not write (simulated:
    these tests run as root, who writes through directory permissions)."""
    import shardline.dispatcher.state_sqlite as state_sqlite

    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access
    monkeypatch.setattr(state_sqlite.os, "access",
                        lambda path, mode: False if os.fspath(path) == str(locked) else real_access(path, mode))
    with pytest.raises(StateStoreError, match="not writable") as err:
        SqliteStateStore(str(locked))
    assert str(locked) in str(err.value)


def test_a_corrupt_database_is_named(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not a database, it is garbage " * 100)
    with pytest.raises(StateStoreError) as err:
        SqliteStateStore(str(tmp_path))
    assert str(tmp_path / DB_NAME) in str(err.value) and "not a database" in str(err.value)


def test_a_second_dispatcher_on_the_same_dir_is_refused(tmp_path):
    first = SqliteStateStore(str(tmp_path))
    try:
        with pytest.raises(StateStoreError, match="another dispatcher") as err:
            SqliteStateStore(str(tmp_path), lock_timeout=0.1)
        assert str(tmp_path / DB_NAME) in str(err.value)
    finally:
        first.close()
    SqliteStateStore(str(tmp_path)).close()  # free again once the first is closed
