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

from shardline.services.errors import ShardlineConfigError

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
    if not all(33 <= b < 127 for b in token):
        # It travels in gRPC metadata, so printable ASCII without spaces.
        raise ShardlineConfigError(f"cluster token in {path!r} must be printable ASCII without spaces")
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


# --- gRPC ---------------------------------------------------------------------------------------
import grpc  # noqa: E402 - kept below the data-plane helpers, which need no gRPC

AUTH_METADATA_KEY = "authorization"
# Open without a token, so load balancers and systemd-side probes can check liveness.
OPEN_METHOD_PREFIX = "/grpc.health.v1.Health/"


def _refuse(request, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token (authorization: Bearer ...)")


class BearerTokenServerInterceptor(grpc.ServerInterceptor):
    """Refuses every call but the health service unless it carries ``authorization: Bearer <token>``."""

    def __init__(self, token: bytes):
        self._token = token
        self._refusal = grpc.unary_unary_rpc_method_handler(_refuse)

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(OPEN_METHOD_PREFIX):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY and bearer_matches(self._token, value):
                return continuation(handler_call_details)
        return self._refusal


class BearerTokenClientInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every unary call of a channel."""

    def __init__(self, token: bytes):
        self._metadata = (AUTH_METADATA_KEY, "Bearer " + token.decode())

    def intercept_unary_unary(self, continuation, client_call_details, request):
        metadata = list(client_call_details.metadata or ()) + [self._metadata]
        return continuation(client_call_details._replace(metadata=metadata), request)
