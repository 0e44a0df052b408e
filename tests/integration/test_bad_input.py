"""Malformed and hostile data-plane input against a live PS: clear errors, no crash, nothing lost."""

import socket
import struct

import grpc
import pytest
import torch

from shardline.services import frame
from shardline.services.daemon import grpc_channel, parse_host_port
from shardline.services.pb import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from shardline.services.pb import dataplane_pb2 as dp
from shardline import connect

BLOCK = 16


@pytest.fixture(scope="module")
def job(cluster):
    addr = cluster.address
    client = connect(addr, job="bad")
    w0 = torch.arange(100, dtype=torch.float32)
    client.init({"w": w0}, optimizer="sgd", lr=1.0, block_elements=BLOCK)
    yield client, w0
    client.close()


def open_socket(address):
    host, port = parse_host_port(address)
    s = socket.create_connection((host, port), timeout=10)
    return s


def owner_and_other(client):
    owner = client.routing.owner("bad", "w", 0)
    other = next(n for n in client.routing.nodes if n != owner)
    return client.routing.data_address(owner), client.routing.data_address(other)


def request(sock, header, payloads=()):
    frame.send_frame(sock, header, list(payloads))
    return frame.recv_header(sock)


def ping_works(sock):
    reply = request(sock, frame.FrameHeader(op=dp.OP_PING, request_id=42))
    return reply.op == dp.OP_REPLY and reply.request_id == 42


def push_header(client, tensor="w", index=0, grad=None, job="bad", **kw):
    h = frame.FrameHeader(op=dp.OP_PUSH, request_id=1, job=job, epoch=client.routing.epoch, step=0, rank=0, weight=1.0, **kw)
    h.blocks.append(frame.block_ref(tensor, index, grad))
    return h


def assert_values_intact(client, w0):
    fresh = connect(client.dispatcher.address, job="bad")
    try:
        got = fresh.pull(["w"], min_step=0)["w"]
        assert torch.equal(got, w0), "a rejected frame changed stored values"
    finally:
        fresh.close()


def closed(sock):
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_garbage_bytes_close_connection_and_node_keeps_serving(job):
    client, w0 = job
    owner, _ = owner_and_other(client)
    s = open_socket(owner)
    s.sendall(b"\x00GARBAGE" * 100)
    reply = frame.recv_header(s)
    assert reply.op == dp.OP_ERROR and reply.code == dp.BAD_FRAME and "magic" in reply.message
    assert closed(s)
    s.close()
    other = open_socket(owner)
    assert ping_works(other)
    other.close()
    assert_values_intact(client, w0)


def test_truncated_frame_then_disconnect(job):
    client, w0 = job
    owner, _ = owner_and_other(client)
    g = torch.ones(BLOCK)
    data = frame.encode_prefix_and_header(push_header(client, grad=g, payload_bytes=BLOCK * 4)) + b"\x00" * 10
    for cut in (3, 8 + 2, len(data)):  # inside the prefix, inside the header, inside the payload
        s = open_socket(owner)
        s.sendall(data[:cut])
        s.close()
    s = open_socket(owner)
    assert ping_works(s)
    s.close()
    assert_values_intact(client, w0)


def test_header_claiming_100gb_is_refused_without_allocation(job, cluster):
    client, w0 = job
    owner, _ = owner_and_other(client)
    s = open_socket(owner)
    h = frame.FrameHeader(op=dp.OP_PUSH, job="bad", epoch=client.routing.epoch, payload_bytes=100 << 30)
    h.blocks.add(tensor="w", index=0, dtype=dp.FLOAT32, numel=25 << 30, nbytes=100 << 30)
    s.sendall(frame.encode_prefix_and_header(h))
    reply = frame.recv_header(s)
    assert reply.code == dp.TOO_LARGE and "exceeds" in reply.message
    assert closed(s)
    s.close()
    # A header length of 4 GiB is refused from the prefix alone.
    s = open_socket(owner)
    s.sendall(struct.pack(">2sBBI", b"SL", 1, 0, 0xFFFFFFFF))
    assert frame.recv_header(s).code == dp.TOO_LARGE
    s.close()
    s = open_socket(owner)
    assert ping_works(s)
    s.close()


@pytest.mark.parametrize("case, code, words", [
    ("unknown_job", dp.UNKNOWN_JOB, "nope"),
    ("unknown_tensor", dp.UNKNOWN_TENSOR, "ghost"),
    ("wrong_shape", dp.INVALID_ARGUMENT, "elements"),
    ("bad_index", dp.INVALID_ARGUMENT, "out of range"),
    ("nan", dp.NONFINITE, "'w'"),
    ("inf_fp16", dp.NONFINITE, "'w'"),
    ("stale_step", dp.STALE_STEP, "step"),
])
def test_request_errors_keep_connection_usable(job, case, code, words):
    client, w0 = job
    owner, _ = owner_and_other(client)
    g = torch.ones(BLOCK)
    if case == "unknown_job":
        h = push_header(client, grad=g, job="nope")
    elif case == "unknown_tensor":
        h = push_header(client, tensor="ghost", grad=g)
    elif case == "wrong_shape":
        g = torch.ones(BLOCK + 3)
        h = push_header(client, grad=g)
    elif case == "bad_index":
        h = push_header(client, index=99, grad=g)
    elif case == "nan":
        g[3] = float("nan")
        h = push_header(client, grad=g)
    elif case == "inf_fp16":
        g = torch.ones(BLOCK, dtype=torch.float16)
        g[0] = float("inf")
        h = push_header(client, grad=g)
    else:
        h = push_header(client, grad=g)
        h.step = 5
    s = open_socket(owner)
    reply = request(s, h, [frame.tensor_bytes(g)])
    assert reply.op == dp.OP_ERROR and reply.code == code, reply
    assert words in reply.message, reply.message
    assert ping_works(s), "connection should stay usable after a request error"
    s.close()
    assert_values_intact(client, w0)


def test_wrong_dtype_is_a_bad_frame(job):
    client, _ = job
    owner, _ = owner_and_other(client)
    s = open_socket(owner)
    h = push_header(client, grad=torch.ones(BLOCK))
    h.blocks[0].dtype = 42
    reply = request(s, h, [frame.tensor_bytes(torch.ones(BLOCK))])
    assert reply.code == dp.BAD_FRAME and "dtype" in reply.message


def test_block_not_owned_answers_not_owner_with_epoch(job):
    client, w0 = job
    _, other = owner_and_other(client)
    s = open_socket(other)
    reply = request(s, push_header(client, grad=torch.ones(BLOCK)), [frame.tensor_bytes(torch.ones(BLOCK))])
    assert reply.code == dp.NOT_OWNER and reply.epoch == client.routing.epoch
    # a stale epoch is refused too, even at the owner
    owner, _ = owner_and_other(client)
    s2 = open_socket(owner)
    h = push_header(client, grad=torch.ones(BLOCK))
    h.epoch = client.routing.epoch - 1
    reply = request(s2, h, [frame.tensor_bytes(torch.ones(BLOCK))])
    assert reply.code == dp.NOT_OWNER and reply.epoch == client.routing.epoch
    s.close(), s2.close()
    assert_values_intact(client, w0)


def test_client_rejects_nonfinite_gradient_naming_the_tensor(job):
    client, w0 = job
    g = torch.zeros(100)
    g[50] = float("inf")
    with pytest.raises(Exception, match="'w'"):
        client.push({"w": g})
    assert_values_intact(client, w0)


def test_grpc_invalid_arguments(cluster):
    channel = grpc_channel(cluster.address)
    stub = dispatcher_pb2_grpc.DispatcherStub(channel)
    spec = common_pb2.JobSpec(name="bad job!", sync="bsp", world_size=1)
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=spec), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bad job!" in e.value.details()
    spec = common_pb2.JobSpec(name="ok", sync="eventually", world_size=1)
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateJob(dispatcher_pb2.CreateJobRequest(spec=spec), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "eventually" in e.value.details()
    channel.close()
