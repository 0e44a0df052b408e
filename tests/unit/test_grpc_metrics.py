"""The gRPC server interceptor: requests counted by service, method and status code, timed, in flight."""

import grpc
import pytest
from prometheus_client import REGISTRY

from shardline.services.daemon import create_grpc_server, grpc_channel
from shardline.services.grpc_metrics import split_method

pytestmark = pytest.mark.timeout(60)

SERVICE = "test.Metrics"


def test_split_method():
    assert split_method("/shardline.Dispatcher/GetJob") == ("shardline.Dispatcher", "GetJob")
    assert split_method("/grpc.health.v1.Health/Check") == ("grpc.health.v1.Health", "Check")
    assert split_method("GetJob") == ("unknown", "GetJob")
    assert split_method("") == ("unknown", "unknown")
    assert split_method("/a/b/c") == ("unknown", "/a/b/c")


def _ok(request, context):
    return b"ok:" + request


def _not_found(request, context):
    context.abort(grpc.StatusCode.NOT_FOUND, "nothing here")


def _boom(request, context):
    raise RuntimeError("bug")


def _set_code(request, context):
    context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
    context.set_details("busy")
    return b""


def _stream(request, context):
    for i in range(3):
        yield bytes([i])


def _register(server):
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
        "Ok": grpc.unary_unary_rpc_method_handler(_ok),
        "NotFound": grpc.unary_unary_rpc_method_handler(_not_found),
        "Boom": grpc.unary_unary_rpc_method_handler(_boom),
        "SetCode": grpc.unary_unary_rpc_method_handler(_set_code),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
    }),))


@pytest.fixture(scope="module")
def channel():
    server, port, _health = create_grpc_server("127.0.0.1:0", [_register], max_workers=4)
    ch = grpc_channel(f"127.0.0.1:{port}")
    yield ch
    ch.close()
    server.stop(0).wait(5)


def count(method: str, code: str) -> float:
    return REGISTRY.get_sample_value("shardline_grpc_server_requests_total",
                                     {"service": SERVICE, "method": method, "code": code}) or 0.0


def timed(method: str) -> float:
    return REGISTRY.get_sample_value("shardline_grpc_server_request_seconds_count", {"service": SERVICE, "method": method}) or 0.0


def in_flight(method: str) -> float:
    return REGISTRY.get_sample_value("shardline_grpc_server_in_flight_requests", {"service": SERVICE, "method": method}) or 0.0


@pytest.mark.parametrize("method, code", [("Ok", "OK"), ("NotFound", "NOT_FOUND"), ("Boom", "UNKNOWN"),
                                          ("SetCode", "RESOURCE_EXHAUSTED")])
def test_unary_calls_counted_by_status(channel, method, code):
    before, before_timed = count(method, code), timed(method)
    call = channel.unary_unary(f"/{SERVICE}/{method}")
    if code == "OK":
        assert call(b"x", timeout=10) == b"ok:x"
    else:
        with pytest.raises(grpc.RpcError) as err:
            call(b"x", timeout=10)
        assert err.value.code().name == code
    assert count(method, code) == before + 1
    assert timed(method) == before_timed + 1
    assert in_flight(method) == 0


def test_streaming_call_counted_when_the_stream_ends(channel):
    before = count("Stream", "OK")
    assert list(channel.unary_stream(f"/{SERVICE}/Stream")(b"", timeout=10)) == [b"\x00", b"\x01", b"\x02"]
    assert count("Stream", "OK") == before + 1
    assert in_flight("Stream") == 0


def test_health_service_is_counted_and_unknown_methods_are_not(channel):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    labels = {"service": "grpc.health.v1.Health", "method": "Check", "code": "OK"}
    before = REGISTRY.get_sample_value("shardline_grpc_server_requests_total", labels) or 0.0
    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert REGISTRY.get_sample_value("shardline_grpc_server_requests_total", labels) == before + 1
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary(f"/{SERVICE}/Missing")(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert count("Missing", "UNIMPLEMENTED") == 0  # no label value per unknown method name
