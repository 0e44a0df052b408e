"""Every transport implements the Transport protocol (services/transport/base.py) and its
connections declare their capabilities; callers ask for those instead of probing for methods."""

import inspect
import socket

import pytest

from shardline.services.transport import Capabilities, capabilities_of, get_transport, rdma, shm, tcp
from shardline.services.transport.base import PLAIN, Transport
from shardline.services.transport.rdma_stream import RdmaConnection

PROTOCOL_METHODS = {"connect", "listen"}


@pytest.mark.parametrize("transport", [tcp.TRANSPORT, shm.Transport(auto=False), shm.Transport(auto=True),
                                       rdma.RdmaTransport("rxe0")], ids=["tcp", "shm", "auto", "rdma"])
def test_each_transport_has_the_protocol_surface(transport):
    assert isinstance(transport.NAME, str) and isinstance(transport.capabilities, Capabilities)
    for name in PROTOCOL_METHODS:
        ours = inspect.signature(getattr(transport, name))
        protocol = inspect.signature(getattr(Transport, name))
        assert list(ours.parameters)[:2] == [p for p in protocol.parameters if p != "self"][:2], name


def test_the_factory_returns_tcp_without_capabilities():
    assert get_transport("tcp") is tcp.TRANSPORT
    assert get_transport("tcp").capabilities == PLAIN


def test_connections_declare_what_they_offer():
    a, b = socket.socketpair()
    try:
        assert capabilities_of(a) == PLAIN   # a TCP (plain) socket offers nothing beyond a socket
    finally:
        a.close()
        b.close()
    caps = shm.ShmConnection.CAPABILITIES
    assert caps.shares_memory and caps.checks_on_copy and caps.signals_between_frames and caps.gathers_sends
    for method in ("share_region", "unshare_region", "region_size", "place_many", "take_many",
                   "recv_checked_into", "wait_readable", "sendall_many"):
        assert callable(getattr(shm.ShmConnection, method)), method
    assert RdmaConnection.CAPABILITIES == Capabilities(registers_memory=True)
    assert rdma.RdmaTransport("rxe0").capabilities.registers_memory
