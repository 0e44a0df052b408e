"""SQLite state store: ``<state_dir>/dispatcher.db``, one table ``kv(key, value JSON)``.

Why SQLite in WAL mode: ``apply`` must change several keys at once (a registration and the epoch
it bumps; a deleted job and its tombstone) and survive ``kill -9`` or a power cut at any instant.
A SQLite transaction gives exactly that: it commits all or nothing, and with ``synchronous=FULL``
the write-ahead log is fsynced before COMMIT returns, so a returned ``apply`` is on disk. After a
crash SQLite replays or discards the log itself, so there is no journal or recovery code of ours
to get wrong. WAL appends to one log per commit, cheaper than a rollback journal's extra writes,
and it is in the standard library: no service to deploy next to the dispatcher.

The connection holds the database in ``locking_mode=EXCLUSIVE``: a second dispatcher pointed at
the same ``state_dir`` fails at start (after ``lock_timeout``) instead of both writing to it. The
operating system releases the lock when the process dies, so a restart after ``kill -9`` opens it
at once. Contract: :mod:`shardline.dispatcher.state_store`.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from typing import Iterable, Mapping

from shardline.dispatcher.state_store import StateStoreError, decode_value, encode_value

DB_NAME = "dispatcher.db"
# A dispatcher restarting after a crash finds the lock free at once; waiting longer only delays
# the error when another dispatcher really holds it.
DEFAULT_LOCK_TIMEOUT_SECONDS = 2.0


def _reason(exc: sqlite3.Error) -> str:
    text = str(exc)
    if "locked" in text:
        return f"{text} (is another dispatcher using this state_dir?)"
    return text


class SqliteStateStore:
    """The state of one dispatcher in ``<state_dir>/dispatcher.db``; ``location`` is that path."""

    def __init__(self, state_dir: str, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT_SECONDS):
        self.state_dir = os.path.abspath(state_dir)
        self.location = self.path = os.path.join(self.state_dir, DB_NAME)
        self._lock = threading.Lock()
        try:
            os.makedirs(self.state_dir, exist_ok=True)
        except OSError as exc:
            raise StateStoreError(f"state_dir {self.state_dir}: cannot create it: {exc.strerror or exc}") from None
        if not os.access(self.state_dir, os.W_OK | os.X_OK):
            raise StateStoreError(f"state_dir {self.state_dir} is not writable by this process")
        conn = None
        try:
            conn = sqlite3.connect(self.path, timeout=lock_timeout, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StateStoreError(f"state store {self.path}: cannot use WAL mode (journal_mode is {mode!r})")
            conn.execute("PRAGMA synchronous=FULL")
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise StateStoreError(f"state store {self.path} is damaged: {check}")
            # The first write takes the exclusive lock and holds it until close.
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID")
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            raise StateStoreError(f"state store {self.path}: cannot open: {_reason(exc)}") from None
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        self._conn: sqlite3.Connection | None = conn
        self._sync_directory()

    def _sync_directory(self) -> None:
        # Make the database and log files' directory entries durable too (a new state_dir).
        try:
            fd = os.open(self.state_dir, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass  # some file systems refuse fsync on a directory; the data itself is synced
        finally:
            os.close(fd)

    def _require_open(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StateStoreError(f"state store {self.path} is closed")
        return self._conn

    def load(self) -> dict[str, dict]:
        with self._lock:
            conn = self._require_open()
            try:
                rows = conn.execute("SELECT key, value FROM kv").fetchall()
            except sqlite3.Error as exc:
                raise StateStoreError(f"cannot read dispatcher state from {self.path}: {_reason(exc)}") from None
        return {key: decode_value(self.path, key, text) for key, text in rows}

    def apply(self, puts: Mapping[str, dict], deletes: Iterable[str] = ()) -> None:
        with self._lock:
            conn = self._require_open()
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for key in deletes:
                        if not isinstance(key, str):
                            raise StateStoreError(f"state store {self.path}: keys must be strings, got {key!r}")
                        conn.execute("DELETE FROM kv WHERE key = ?", (key,))
                    for key, value in puts.items():
                        conn.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)",
                                     (key, encode_value(self.path, key, value)))
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StateStoreError(f"cannot write dispatcher state to {self.path}: {_reason(exc)}") from None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
