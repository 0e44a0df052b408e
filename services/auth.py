"""Cluster-token authentication.

Data plane: a node configured with a cluster token answers a client's first frame, ``OP_HELLO``,
with a fresh random nonce; the client proves it holds the token by sending
``HMAC-SHA256(token, "shardline-dataplane-v1" || nonce)``; the token itself never crosses the wire.
Until then the node accepts no other frame. A node without a token answers the first HELLO with
an empty nonce: nothing to prove.

gRPC: callers send the token as ``authorization: Bearer <token>`` metadata (use TLS where the
network is not trusted); the standard health service stays open for probes.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from services.errors import ShardlineConfigError

NONCE_BYTES = 32
_CONTEXT = b"shardline-dataplane-v1"
MIN_TOKEN_BYTES = 16


def load_token(path: str | None) -> bytes | None:
    """Read a token file (surrounding whitespace stripped). None/empty path: no token."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            token = fh.read().strip()
    except OSError as exc:
        raise ShardlineConfigError(f"cannot read cluster token file {path!r}: {exc.strerror}") from None
    if len(token) < MIN_TOKEN_BYTES:
        raise ShardlineConfigError(f"cluster token in {path!r} must be at least {MIN_TOKEN_BYTES} bytes, got {len(token)}")
    return token


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def response(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, _CONTEXT + nonce, hashlib.sha256).digest()


def verify(token: bytes, nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(response(token, nonce), mac)


def bearer_matches(token: bytes, metadata_value: str | None) -> bool:
    if not metadata_value or not metadata_value.startswith("Bearer "):
        return False
    return hmac.compare_digest(metadata_value[len("Bearer "):].encode(), token)
