"""Cluster-token handshake on the data plane, driven over a socketpair (no daemon)."""

import socket
import threading

import pytest

from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
from shardline.ps_server.node import PSNode
from shardline.services import auth, frame
from shardline.services.errors import RemoteError, ShardlineConfigError
from shardline.services.pb import common_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.dataplane_client import DataPlaneConnection

TOKEN = b"s3cret-token-0123456789"


def test_mac_depends_on_token_and_nonce():
    nonce = auth.new_nonce()
    mac = auth.response(TOKEN, nonce)
    assert auth.verify(TOKEN, nonce, mac)
    assert not auth.verify(TOKEN + b"x", nonce, mac)
    assert not auth.verify(TOKEN, auth.new_nonce(), mac)
    assert auth.new_nonce() != nonce and len(nonce) == auth.NONCE_BYTES
    assert TOKEN not in mac


def test_bearer_metadata():
    assert auth.bearer_matches(TOKEN, "Bearer " + TOKEN.decode())
    assert not auth.bearer_matches(TOKEN, "Bearer nope")
    assert not auth.bearer_matches(TOKEN, TOKEN.decode())
    assert not auth.bearer_matches(TOKEN, None)


def test_load_token(tmp_path):
    p = tmp_path / "token"
    p.write_bytes(TOKEN + b"\n")
    assert auth.load_token(str(p)) == TOKEN
    p.write_bytes(b"short")
    with pytest.raises(ShardlineConfigError, match="at least"):
        auth.load_token(str(p))
    with pytest.raises(ShardlineConfigError, match="cannot read"):
        auth.load_token(str(tmp_path / "missing"))
    assert auth.load_token(None) is None


class _Transport:
    """Hands one end of a socketpair to DataPlaneConnection as if it had connected."""

    def __init__(self, sock):
        self.sock = sock

    def connect(self, address, timeout):
        return self.sock


def serve(server_token):
    node = PSNode("n1", lambda name: None, lambda: common_pb2.RoutingTable(epoch=1))
    a, b = socket.socketpair()
    t = threading.Thread(target=serve_connection, args=(a, "test", node, ConnectionPolicy(cluster_token=server_token)),
                         daemon=True)
    t.start()
    return b, t


def ping(sock):
    frame.send_frame(sock, frame.FrameHeader(op=dp.OP_PING, request_id=5))
    return frame.recv_header(sock)


@pytest.mark.parametrize("server_token, client_token", [(TOKEN, TOKEN), (None, None), (None, TOKEN)])
def test_handshake_succeeds(server_token, client_token):
    b, t = serve(server_token)
    conn = DataPlaneConnection("test", _Transport(b), 5.0, client_token)
    assert ping(conn.sock).op == dp.OP_REPLY
    conn.close()
    t.join(5)


def test_wrong_or_missing_token_is_refused_and_closed():
    b, t = serve(TOKEN)
    with pytest.raises(RemoteError, match="UNAUTHENTICATED"):
        DataPlaneConnection("test", _Transport(b), 5.0, b"another-token-0123456789")
    t.join(5)
    assert not t.is_alive()
    b, t = serve(TOKEN)
    with pytest.raises(ShardlineConfigError, match="requires the cluster token"):
        DataPlaneConnection("test", _Transport(b), 5.0, None)
    t.join(5)


def test_requests_before_authentication_are_refused():
    b, t = serve(TOKEN)
    reply = ping(b)
    assert reply.op == dp.OP_ERROR and reply.code == dp.UNAUTHENTICATED
    assert b.recv(1) == b""  # closed
    t.join(5)
    b, t = serve(TOKEN)
    big = frame.FrameHeader(op=dp.OP_HELLO, payload_bytes=1 << 20)  # no payload before auth
    b.sendall(frame.encode_prefix_and_header(big))
    assert frame.recv_header(b).code == dp.UNAUTHENTICATED
    t.join(5)
