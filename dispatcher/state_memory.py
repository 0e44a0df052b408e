"""In-memory state store: the dispatcher's state lives and dies with the process (no ``state_dir``).

Keeps the :class:`~shardline.dispatcher.state_store.StateStore` contract except durability, so the
dispatcher runs one code path with or without a state directory. Values are held as JSON text:
what ``load`` returns is a fresh copy, and a value the SQLite backend would refuse is refused here too.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

from shardline.dispatcher.state_store import StateStoreError, decode_value, encode_value


class MemoryStateStore:
    location = "memory"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, str] | None = {}

    def _require_open(self) -> dict[str, str]:
        if self._data is None:
            raise StateStoreError("state store memory is closed")
        return self._data

    def load(self) -> dict[str, dict]:
        with self._lock:
            return {key: decode_value(self.location, key, text) for key, text in self._require_open().items()}

    def apply(self, puts: Mapping[str, dict], deletes: Iterable[str] = ()) -> None:
        # Encode everything before touching the map: a bad value leaves it unchanged.
        encoded = {key: encode_value(self.location, key, value) for key, value in puts.items()}
        deletes = list(deletes)
        with self._lock:
            data = self._require_open()
            for key in deletes:
                data.pop(key, None)
            data.update(encoded)

    def close(self) -> None:
        with self._lock:
            self._data = None
