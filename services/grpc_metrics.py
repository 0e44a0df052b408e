"""Prometheus metrics of every daemon's gRPC server: a server interceptor.

:func:`services.daemon.create_grpc_server` installs :class:`MetricsInterceptor`, so the dispatcher,
PS nodes and workers all export, per gRPC service and method (both bounded by the registered
servicers; calls to unknown methods are not counted):

* ``shardline_grpc_server_requests_total{service, method, code}`` — finished RPCs by status code
  name (``OK``, ``NOT_FOUND``, ...). Errors are the series with ``code != "OK"``.
* ``shardline_grpc_server_request_seconds{service, method}`` — handling time (for a streaming
  response: until the stream ends).
* ``shardline_grpc_server_in_flight_requests{service, method}`` — RPCs being handled now.

The status code is what the handler left on the context (``context.abort``/``set_code``); a handler
that raises without setting one ends as ``UNKNOWN``, as gRPC reports it to the caller.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import grpc
from prometheus_client import Counter, Gauge, Histogram

__all__ = ["MetricsInterceptor", "split_method", "status_name", "REQUESTS", "REQUEST_SECONDS", "IN_FLIGHT"]

# Control-plane calls are sub-millisecond to seconds; WaitJobReady may wait up to its timeout.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter("shardline_grpc_server_requests_total", "gRPC requests handled, by service, method and status code",
                   ["service", "method", "code"])
REQUEST_SECONDS = Histogram("shardline_grpc_server_request_seconds", "gRPC request handling time in seconds",
                            ["service", "method"], buckets=LATENCY_BUCKETS)
IN_FLIGHT = Gauge("shardline_grpc_server_in_flight_requests", "gRPC requests being handled now", ["service", "method"])


def split_method(full_method: str) -> tuple[str, str]:
    """``"/pkg.Service/Method"`` -> ``("pkg.Service", "Method")``; anything else -> ``("unknown", text)``."""
    parts = (full_method or "").split("/")
    if len(parts) == 3 and not parts[0] and parts[1] and parts[2]:
        return parts[1], parts[2]
    return "unknown", full_method or "unknown"


def status_name(context, raised: bool) -> str:
    """The status code name an RPC ends with, from its servicer context."""
    code = None
    getter = getattr(context, "code", None)
    if callable(getter):
        try:
            code = getter()
        except Exception:  # noqa: BLE001 - an exotic context must not break the call
            code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    return "UNKNOWN" if raised else "OK"


class _Call:
    """Bookkeeping of one RPC: in-flight gauge, then the counter and the histogram when it ends."""

    __slots__ = ("service", "method", "started", "_done")

    def __init__(self, service: str, method: str):
        self.service, self.method = service, method
        self.started = time.perf_counter()
        self._done = False
        IN_FLIGHT.labels(service, method).inc()

    def finish(self, context, raised: bool) -> None:
        if self._done:
            return
        self._done = True
        IN_FLIGHT.labels(self.service, self.method).dec()
        REQUEST_SECONDS.labels(self.service, self.method).observe(time.perf_counter() - self.started)
        REQUESTS.labels(self.service, self.method, status_name(context, raised)).inc()


def _unary_response(behavior: Callable, service: str, method: str) -> Callable:
    def wrapper(request_or_iterator, context):
        call = _Call(service, method)
        try:
            response = behavior(request_or_iterator, context)
        except BaseException:
            call.finish(context, raised=True)
            raise
        call.finish(context, raised=False)
        return response

    return wrapper


def _stream_response(behavior: Callable, service: str, method: str) -> Callable:
    def wrapper(request_or_iterator, context) -> Iterator:
        call = _Call(service, method)
        raised = False
        try:
            yield from behavior(request_or_iterator, context)
        except BaseException:  # includes GeneratorExit when the caller cancels
            raised = True
            raise
        finally:
            call.finish(context, raised=raised)

    return wrapper


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every RPC of the server it is installed on (see the module docstring)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, method = split_method(handler_call_details.method)
        common = dict(request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_unary_response(handler.unary_unary, service, method), **common)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_unary_response(handler.stream_unary, service, method), **common)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_stream_response(handler.unary_stream, service, method), **common)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_stream_response(handler.stream_stream, service, method), **common)
        return handler
