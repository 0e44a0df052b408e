"""Leaving a node that stopped answering, without a network partition to make: the worker's node
watch (worker/node_watch.py) aborting a request once its node leaves the ring, the client asking
again a node that lacks a block (UNKNOWN_TENSOR), a PS replication link giving up a peer that left
the routing, the abort of a connection, and the PS heartbeat's deadline."""

from __future__ import annotations

import logging
import socket
import threading
import time
import types

import pytest

from shardline.ps_server.main import heartbeat_deadline
from shardline.ps_server.replication_links import PeerLink, Send
from shardline.services import frame
from shardline.services.dataplane_client import DataPlaneConnection
from shardline.services.errors import RemoteError, ShardlineStateError
from shardline.services.pb import dataplane_pb2 as dp
from shardline.services.transport import tcp
from shardline.worker.node_watch import NodeWatch


def view(epoch: int, *nodes: str):
    return types.SimpleNamespace(epoch=epoch, pending_epoch=0, nodes={n: object() for n in nodes})


class Conn:
    def __init__(self):
        self.aborted = threading.Event()

    def abort(self) -> None:
        self.aborted.set()


def test_a_request_to_a_node_that_left_the_ring_is_aborted_and_one_to_a_node_in_it_is_not(caplog):
    routing = {"now": view(5, "a", "b")}
    asked = []

    def fetch(known):
        asked.append(known.epoch)
        return routing["now"] if routing["now"].epoch != known.epoch else known

    watch = NodeWatch(fetch, lambda: view(5, "a", "b"), interval=0.05)
    to_a, to_b = Conn(), Conn()
    caplog.set_level(logging.WARNING, logger="shardline.worker")
    with watch.waiting("a", "10.0.0.1:1", to_a, "OP_PUSH of step 3", 3) as wait_a, \
            watch.waiting("b", "10.0.0.2:1", to_b, "OP_PUSH of step 3", 3) as wait_b:
        time.sleep(0.2)
        assert asked and not to_a.aborted.is_set() and not to_b.aborted.is_set()   # both still in the ring
        routing["now"] = view(6, "b")                                                 # a declared dead
        assert to_a.aborted.wait(2.0)
        assert wait_a.abandoned == "it left the ring at epoch 6 (declared dead or drained)"
        assert not to_b.aborted.is_set() and not wait_b.abandoned
    assert "left the ring at epoch 6" in caplog.text
    watch.close()


def test_a_request_that_waits_long_is_logged_once_per_step_and_node_and_a_waiting_pull_not(caplog):
    watch = NodeWatch(lambda known: known, lambda: view(1, "a"), interval=0.05)
    caplog.set_level(logging.WARNING, logger="shardline.worker")
    with watch.waiting("a", "10.0.0.1:1", Conn(), "OP_PULL", 7, waits=True):
        time.sleep(1.2)
    assert "waits for PS node" not in caplog.text   # a pull waiting for a step on purpose
    with watch.waiting("a", "10.0.0.1:1", Conn(), "OP_PUSH of step 7", 7):
        time.sleep(1.3)
    with watch.waiting("a", "10.0.0.1:1", Conn(), "OP_COMMIT of step 7", 7):
        time.sleep(1.3)
    assert caplog.text.count("step 7 waits for PS node 'a' (10.0.0.1:1): no reply to its OP_PUSH of step 7") == 1
    assert "OP_COMMIT" not in caplog.text
    watch.close()


def test_the_watch_thread_ends_when_nothing_waits_and_holds_no_client():
    watch = NodeWatch(lambda known: known, lambda: view(1, "a"), interval=0.05)
    with watch.waiting("a", "x:1", Conn(), "OP_PUSH of step 1", 1):
        thread = watch._thread
        assert thread is not None and thread.is_alive()
    thread.join(1.0)
    assert not thread.is_alive() and watch._thread is None


def test_the_dispatcher_unreachable_keeps_the_request_waiting():
    from shardline.services.errors import ShardlineConnectionError

    def fetch(known):
        raise ShardlineConnectionError("dispatcher unreachable")

    watch = NodeWatch(fetch, lambda: view(1, "a"), interval=0.05)
    conn = Conn()
    with watch.waiting("a", "x:1", conn, "OP_PUSH of step 1", 1):
        time.sleep(0.3)
    assert not conn.aborted.is_set()
    watch.close()


def loopback_connection():
    """A DataPlaneConnection over loopback TCP (no handshake), the peer's socket and the
    listener; the caller closes all three."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    conn = DataPlaneConnection.__new__(DataPlaneConnection)
    conn.address, conn.sock, conn.lock = "x", tcp.connect(f"127.0.0.1:{server.getsockname()[1]}", 5.0), threading.Lock()
    peer, _ = server.accept()
    return conn, peer, server


def test_abort_ends_a_receive_blocked_in_another_thread():
    conn, peer, server = loopback_connection()   # the peer never answers
    got: list = []

    def receive():
        try:
            got.append(frame.recv_header(conn.sock, frame.FrameLimits()))
        except (OSError, ConnectionError) as exc:
            got.append(exc)
    reader = threading.Thread(target=receive)
    reader.start()
    time.sleep(0.1)
    started = time.monotonic()
    conn.abort()
    reader.join(2.0)
    assert not reader.is_alive() and isinstance(got[0], (OSError, ConnectionError)), got
    assert time.monotonic() - started < 1.0
    for s in (conn.sock, peer, server):
        s.close()


def test_a_replication_link_gives_up_the_frame_in_flight_once_its_peer_left_the_routing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    address = {"peer": f"127.0.0.1:{server.getsockname()[1]}"}
    accepted = []

    def answer_hello_only():   # a peer that authenticates, then never answers again (cut off)
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            accepted.append(sock)
            frame.recv_header(sock, frame.FrameLimits())
            frame.send_frame(sock, frame.FrameHeader(op=dp.OP_HELLO))
    threading.Thread(target=answer_hello_only, daemon=True).start()
    link = PeerLink("peer", lambda peer: address.get(peer), tcp, None, timeout=30.0)
    done = threading.Event()
    outcome = []
    link.send(Send(frame.FrameHeader(op=dp.OP_REPLICATE, job="j"), [],
                    lambda error, reply: (outcome.append(error), done.set())))
    time.sleep(0.3)
    link.abandon_if_gone()
    assert not done.is_set()                 # still in the routing: waited for
    del address["peer"]                      # declared dead: it left the routing
    started = time.monotonic()
    link.abandon_if_gone()
    assert done.wait(2.0) and time.monotonic() - started < 2.0   # not replication_timeout (30 s)
    assert outcome[0] is not None
    link.close()
    server.close()
    for sock in accepted:
        sock.close()


@pytest.mark.parametrize("interval, failure_timeout, rpc_timeout, expected", [
    (1.0, 5.0, 10.0, 2.5),     # the defaults: half the failure timeout
    (1.0, 2.0, 10.0, 1.0),     # never below the interval
    (1.0, 60.0, 10.0, 10.0),   # never above the rpc timeout
    (1.0, 0.0, 10.0, 10.0),    # a dispatcher that does not say: the rpc timeout
])
def test_a_heartbeat_waits_less_than_the_failure_timeout(interval, failure_timeout, rpc_timeout, expected):
    assert heartbeat_deadline(interval, failure_timeout, rpc_timeout) == expected


# --- a node that lacks a block it owns ----------------------------------------------------------

def lacking_client(offline_client, answers: list):
    from job_specs import one_tensor_spec

    client = offline_client(one_tensor_spec(2, "sgd", 4))
    client.recovery_timeout = 0.6
    calls = []

    def exchange_once(node_id, keys, op, *args, via=None):
        calls.append(node_id)
        answer = answers.pop(0) if answers else 7
        if isinstance(answer, Exception):
            raise answer
        return answer
    client._exchange_once = exchange_once
    return client, calls


def lacks(block="w[0]") -> RemoteError:
    return RemoteError("UNKNOWN_TENSOR", f"block {block} of job 'j' was never initialized on this node")


def test_a_node_lacking_a_block_of_the_job_is_asked_again_until_it_has_it(offline_client):
    client, calls = lacking_client(offline_client, [lacks(), lacks(), 7])
    assert client._exchange_retrying("ps1", [("w", 0)], dp.OP_PUSH, 3, 1.0, None, 0, 0.0) == 7
    assert calls == ["ps1"] * 3 and client._lacking == {}


def test_a_node_still_lacking_it_after_recovery_timeout_is_named(offline_client):
    client, _ = lacking_client(offline_client, [lacks()] * 100)
    with pytest.raises(ShardlineStateError, match=r"PS node 'ps1' still lacks a block of job .* after 0.6 s "
                                                  r"\(recovery_timeout\): block w\[0\]"):
        client._exchange_retrying("ps1", [("w", 0)], dp.OP_PUSH, 3, 1.0, None, 0, 0.0)
    assert client._lacking == {}


def test_an_unknown_tensor_the_job_does_not_have_is_not_asked_again(offline_client):
    client, calls = lacking_client(offline_client, [RemoteError("UNKNOWN_TENSOR", "unknown tensor 'ghost'")])
    with pytest.raises(RemoteError, match="ghost"):
        client._exchange_retrying("ps1", [("ghost", 0)], dp.OP_PULL, 0, 1.0, None, 0, 0.0)
    assert calls == ["ps1"]


def test_once_the_dispatcher_answers_again_a_connection_still_resending_what_a_cut_lost_is_aborted():
    """This worker's own network was cut: its checks fail (each dials afresh), and once one gets
    through, a request whose TCP connection still waits to retransmit is sent again on a new one;
    one whose connection is not retransmitting goes on waiting."""
    from shardline.services.errors import ShardlineConnectionError

    answers = {"up": False}
    redials = []

    def fetch(known):
        if not answers["up"]:
            raise ShardlineConnectionError("no route")
        return known

    class Resending(Conn):
        def __init__(self, resending: bool):
            super().__init__()
            self.resending = resending

        def retransmitting(self) -> bool:
            return self.resending

    watch = NodeWatch(fetch, lambda: view(3, "a", "b"), interval=0.05, on_unreachable=lambda: redials.append(1))
    stuck, idle = Resending(True), Resending(False)
    with watch.waiting("a", "x:1", stuck, "OP_PUSH of step 4", 4) as wait, \
            watch.waiting("b", "y:1", idle, "OP_PULL", 4, waits=True):
        time.sleep(0.3)
        assert redials and not stuck.aborted.is_set()
        answers["up"] = True
        assert stuck.aborted.wait(2.0) and "the network is back" in wait.abandoned
        time.sleep(0.2)
        assert not idle.aborted.is_set()
    watch.close()


def test_a_tcp_connection_tells_whether_it_is_retransmitting():
    conn, peer, server = loopback_connection()
    assert conn.retransmitting() is False   # nothing unacknowledged on loopback
    sock, conn.sock = conn.sock, types.SimpleNamespace()   # another transport: no TCP_INFO
    assert conn.retransmitting() is False
    for s in (sock, peer, server):
        s.close()
