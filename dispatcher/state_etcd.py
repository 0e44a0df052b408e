"""etcd state store and the etcd side of the dispatchers' leader election (etcd >= 3.4, v3 JSON gateway).

Why etcd: several dispatchers must share one durable state and agree on which of them writes it.
etcd is a replicated, linearizable key-value store with multi-key transactions (one ``apply`` is
one transaction: all or nothing, durable on a quorum when it returns) and leases (keys that
vanish when their owner stops renewing them), which is exactly an election with fencing. We talk
to it over its HTTP/JSON gateway (``/v3/``) with etcd3gw, which needs neither grpcio nor protobuf
(our pins of both stay free).

Keys under ``prefix`` (the ``state_prefix`` option, default ``/shardline``)::

    <prefix>/state/<key>          the StateStore keys (epoch, node/<id>, job/<name>, tombstone/<uid>)
    <prefix>/leader               the leading dispatcher's advertised address, on its lease
    <prefix>/dispatchers/<addr>   one per running dispatcher, on its lease (cluster status)

Fencing. A store opened with a :class:`~shardline.dispatcher.state_store.Fence` adds to every
transaction the compare ``create_revision(<prefix>/leader) == fence.token``. The leader key is
created anew at every election, so its create revision names one term of one leader: once the
lease behind it expired (the leader paused or was cut off) and another dispatcher created the key
again, the old leader's writes fail with FencedError and change nothing.

Endpoints: requests go to one endpoint at a time; a connection failure moves on to the next,
with a short pause, until the request's timeout. Every transaction puts and deletes absolute
values, so one resent after a lost reply does no harm.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Iterable, Mapping

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_exceptions

from shardline.dispatcher.leader import Holder, Observation
from shardline.dispatcher.state_store import Fence, FencedError, StateStoreError, decode_value, encode_value
from shardline.services.config import parse_address_list
from shardline.services.errors import ShardlineConfigError, ShardlineTimeoutError

SCHEME = "etcd://"
API_PATH = "/v3/"  # etcd 3.4 and later serve the v3 gateway here (3.3 used /v3beta/)
DEFAULT_REQUEST_TIMEOUT = 3.0
STATE_DIR = "/state/"
LEADER_KEY = "/leader"
DISPATCHERS_DIR = "/dispatchers/"
_RETRY_PAUSE_SECONDS = 0.05


def parse_etcd_url(url: object) -> list[str]:
    """``"etcd://a:2379,b:2379"`` -> ``["a:2379", "b:2379"]``; ShardlineConfigError quoting ``url`` otherwise."""
    if not isinstance(url, str) or not url.startswith(SCHEME) or not url[len(SCHEME):].strip():
        raise ShardlineConfigError(f"state_store must be etcd://HOST:PORT[,HOST:PORT...], got {url!r}")
    endpoints = parse_address_list(url[len(SCHEME):], what="state_store")
    for endpoint in endpoints:
        if endpoint.rpartition(":")[2] == "0":
            raise ShardlineConfigError(f"state_store endpoints need a port other than 0, got {url!r}")
    return endpoints


def validate_prefix(prefix: object) -> str:
    """A key prefix: ``/`` then printable ASCII without spaces, not ending in ``/`` (``/shardline``)."""
    if (not isinstance(prefix, str) or not 2 <= len(prefix) <= 256 or not prefix.startswith("/")
            or prefix.endswith("/") or any(not 33 <= ord(c) <= 126 for c in prefix)):
        raise ShardlineConfigError(
            f"state_prefix must start with '/', not end with '/' and hold 2..256 printable characters without "
            f"spaces, got {prefix!r}")
    return prefix


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def _unb64(data: str) -> str:
    return base64.b64decode(data).decode("utf-8")


def _range_end(prefix: str) -> str:
    """The end of the key range of ``prefix`` (its last byte + 1; prefixes here are ASCII)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdUnreachableError(StateStoreError):
    """No endpoint of the etcd cluster answered in time."""


class EtcdClient:
    """Requests to an etcd cluster at ``endpoints`` (``HOST:PORT``), one at a time (own HTTP session).

    ``request_timeout`` bounds each call, retries on other endpoints included. Failures raise
    StateStoreError naming ``location`` (EtcdUnreachableError when no endpoint answered).
    """

    def __init__(self, endpoints: list[str], *, request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.endpoints = list(endpoints)
        self.location = SCHEME + ",".join(self.endpoints)
        self.request_timeout = request_timeout
        self._clients = []
        for endpoint in self.endpoints:
            host, _, port = endpoint.rpartition(":")
            self._clients.append(etcd3gw.client(host=host.strip("[]"), port=int(port), api_path=API_PATH,
                                                timeout=request_timeout))
        self._current = 0
        self._lock = threading.Lock()
        self._closed = False

    def call(self, path: str, payload: dict, *, timeout: float | None = None) -> dict:
        """POST ``payload`` to ``/v3/<path>``; returns the decoded reply."""
        deadline = time.monotonic() + (self.request_timeout if timeout is None else timeout)
        with self._lock:
            while True:
                if self._closed:
                    raise StateStoreError(f"state store {self.location} is closed")
                client = self._clients[self._current]
                client.timeout = max(0.05, min(self.request_timeout, deadline - time.monotonic()))
                try:
                    return client.post(client.get_url(path), json=payload)
                except (etcd_exceptions.ConnectionFailedError, etcd_exceptions.ConnectionTimeoutError,
                        requests.RequestException) as exc:
                    reason = _reason(exc)
                    self._current = (self._current + 1) % len(self._clients)
                    if time.monotonic() + _RETRY_PAUSE_SECONDS >= deadline:
                        raise EtcdUnreachableError(f"etcd {self.location}: no endpoint answered: {reason}") from None
                    time.sleep(_RETRY_PAUSE_SECONDS)
                except etcd_exceptions.Etcd3Exception as exc:
                    raise StateStoreError(f"etcd {self.location}: {path} failed: {_reason(exc)}") from None
                except ValueError as exc:  # a reply that is not JSON: not an etcd gateway
                    raise StateStoreError(f"etcd {self.location}: {path}: unreadable reply: {exc}") from None

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] = (), *,
            timeout: float | None = None) -> dict:
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": list(failure)}, timeout=timeout)

    def wait_reachable(self, connect_timeout: float) -> None:
        """Return once an endpoint answers; ShardlineTimeoutError naming the endpoints after ``connect_timeout``."""
        try:
            self.call("maintenance/status", {}, timeout=connect_timeout)
        except EtcdUnreachableError as exc:
            raise ShardlineTimeoutError(
                f"etcd at {self.location} not reachable within {connect_timeout:g} s ({exc})") from None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                for client in self._clients:
                    client.session.close()


def _reason(exc: Exception) -> str:
    return (getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__).strip()[:300]


def _kvs(response: dict) -> list[dict]:
    return response.get("kvs", [])


def _range_op(key: str, end: str | None = None) -> dict:
    op = {"key": _b64(key)}
    if end is not None:
        op["range_end"] = _b64(end)
    return {"request_range": op}


class EtcdStateStore:
    """The StateStore contract (state_store.py) over etcd keys ``<prefix>/state/<key>``.

    With ``fence`` every read and write also requires the leader key to be the one the fence
    names; a refused one raises FencedError (and tells ``fence.lost``). ``location`` is
    ``etcd://<endpoints><prefix>``. Raises ShardlineTimeoutError if no endpoint answers within
    ``connect_timeout`` at construction.
    """

    def __init__(self, endpoints: list[str], prefix: str, *, fence: Fence | None = None,
                 connect_timeout: float = 10.0, request_timeout: float = DEFAULT_REQUEST_TIMEOUT):
        self.prefix = validate_prefix(prefix)
        self._client = EtcdClient(endpoints, request_timeout=request_timeout)
        self.location = self._client.location + self.prefix
        self._state = self.prefix + STATE_DIR
        self._fence = fence
        try:
            self._client.wait_reachable(connect_timeout)
        except BaseException:
            self._client.close()
            raise

    def _compare(self) -> list[dict]:
        if self._fence is None:
            return []
        return [{"key": _b64(self.prefix + LEADER_KEY), "target": "CREATE", "result": "EQUAL",
                 "create_revision": str(self._fence.token)}]

    def _fenced(self, what: str) -> FencedError:
        reason = (f"{what} refused: {self.prefix + LEADER_KEY} is no longer the leader key this dispatcher won "
                  f"(create revision {self._fence.token}); another dispatcher leads")
        self._fence.lost(reason)
        return FencedError(f"state store {self.location}: {reason}")

    def load(self) -> dict[str, dict]:
        reply = self._client.txn(self._compare(), [_range_op(self._state, _range_end(self._state))])
        if not reply.get("succeeded"):
            raise self._fenced("read")
        state = {}
        for kv in _kvs(reply["responses"][0].get("response_range", {})):
            key = _unb64(kv["key"])[len(self._state):]
            state[key] = decode_value(self.location, key, _unb64(kv.get("value", "")))
        return state

    def apply(self, puts: Mapping[str, dict], deletes: Iterable[str] = ()) -> None:
        # Encode everything before sending: a bad value fails the whole apply, changing nothing.
        encoded = {key: encode_value(self.location, key, value) for key, value in puts.items()}
        ops = []
        for key in deletes:
            if not isinstance(key, str) or not key:
                raise StateStoreError(f"state store {self.location}: keys must be non-empty strings, got {key!r}")
            if key not in encoded:  # etcd refuses two changes of one key in a transaction; the put wins
                ops.append({"request_delete_range": {"key": _b64(self._state + key)}})
        ops += [{"request_put": {"key": _b64(self._state + key), "value": _b64(text)}} for key, text in encoded.items()]
        if not ops:
            return
        try:
            reply = self._client.txn(self._compare(), ops)
        except EtcdUnreachableError as exc:
            if self._fence is not None:  # it may have been applied: the leader's memory may be behind etcd
                self._fence.lost(f"a write's outcome is unknown ({exc})")
            raise
        if not reply.get("succeeded"):
            raise self._fenced("write")

    def close(self) -> None:
        self._client.close()


class EtcdElectionBackend:
    """The etcd operations of :class:`~shardline.dispatcher.leader.LeaderElection` (its ElectionBackend).

    ``request_timeout`` bounds each operation (keep it below a third of the lease TTL, so a
    slow request does not eat the renewal). Failures raise StateStoreError.
    """

    def __init__(self, endpoints: list[str], prefix: str, *, request_timeout: float = 1.0):
        self.prefix = validate_prefix(prefix)
        self._client = EtcdClient(endpoints, request_timeout=request_timeout)
        self.location = self._client.location + self.prefix
        self._leader_key = self.prefix + LEADER_KEY
        self._members = self.prefix + DISPATCHERS_DIR

    def wait_reachable(self, connect_timeout: float) -> None:
        self._client.wait_reachable(connect_timeout)

    def grant(self, ttl: int) -> int:
        return int(self._client.call("lease/grant", {"TTL": str(ttl), "ID": "0"})["ID"])

    def keepalive(self, lease: int) -> bool:
        # An expired or revoked lease comes back without a TTL.
        return int(self._client.call("lease/keepalive", {"ID": str(lease)}).get("result", {}).get("TTL", 0)) > 0

    def revoke(self, lease: int) -> None:
        try:
            self._client.call("kv/lease/revoke", {"ID": str(lease)})
        except StateStoreError as exc:
            if "lease not found" not in str(exc):
                raise

    def _holder(self, response: dict) -> Holder | None:
        kvs = _kvs(response.get("response_range", {}))
        if not kvs:
            return None
        kv = kvs[0]
        return Holder(address=_unb64(kv.get("value", "")), token=int(kv["create_revision"]), lease=int(kv.get("lease", 0)))

    def campaign(self, lease: int, address: str) -> Holder | None:
        key = _b64(self._leader_key)
        reply = self._client.txn(
            [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            [{"request_put": {"key": key, "value": _b64(address), "lease": str(lease)}}, _range_op(self._leader_key)],
            [_range_op(self._leader_key)],
        )
        return self._holder(reply["responses"][-1])

    def observe(self) -> Observation:
        reply = self._client.txn([], [_range_op(self._leader_key), _range_op(self._members, _range_end(self._members))])
        members = tuple(sorted(_unb64(kv.get("value", "")) for kv in _kvs(reply["responses"][1].get("response_range", {}))))
        return Observation(leader=self._holder(reply["responses"][0]), dispatchers=members)

    def announce(self, lease: int, address: str) -> None:
        self._client.call("kv/put", {"key": _b64(self._members + address), "value": _b64(address), "lease": str(lease)})

    def resign(self, holder: Holder) -> None:
        key = _b64(self._leader_key)
        self._client.txn([{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": str(holder.token)}],
                         [{"request_delete_range": {"key": key}}])

    def close(self) -> None:
        self._client.close()
