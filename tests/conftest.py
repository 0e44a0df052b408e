"""Fixtures shared by the unit and integration tests."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from etcd_server import INSTALL_HINT, EtcdServer  # noqa: E402 - needs the path above


@pytest.fixture(scope="module")
def etcd():
    """A real single-member etcd on 127.0.0.1, shared by a test module (tests use distinct
    ``state_prefix``es); missing binary: the test fails, naming the install script."""
    server = None
    try:
        server = EtcdServer()
    except FileNotFoundError:
        pass
    if server is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def closed_port():
    """Reserve ports where connections are refused for the whole test: ``closed_port()`` returns a
    :class:`ports.ClosedPort`."""
    from ports import ClosedPort

    held: list = []

    def reserve() -> ClosedPort:
        held.append(ClosedPort())
        return held[-1]

    yield reserve
    for port in held:
        port.release()
