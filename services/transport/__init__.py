"""Data-plane transports, one module each, chosen by name: ``tcp``, ``shm``, ``rdma`` or ``auto``.

A transport (the ``Transport`` protocol of services/transport/base.py; :func:`get_transport` is the
one factory) provides ``listen(host, port, serve_connection, *, max_connections=0, refuse=None) ->
Listener`` and ``connect(address, connect_timeout) -> Connection``. A Connection has the socket
methods the frame codec needs (``recv_into``, ``sendall``, ``close``), so ``services.frame`` works
unchanged over any of them, and declares what else it offers (``CAPABILITIES``: shared memory,
checked copies, ...; ``capabilities_of(conn)``). ``auto`` picks RDMA when an RDMA device is present; otherwise it connects through
shared memory to a peer on this host (services/transport/shm.py) and through TCP to any other,
and a PS listens for both. RDMA itself falls back to TCP per connection when the peer declines
it (explicit ``rdma`` does not).
"""

from __future__ import annotations

import logging

from shardline.services.errors import ShardlineConfigError
from shardline.services.transport.base import Capabilities, Connection, Transport, capabilities_of

__all__ = ["TRANSPORT_NAMES", "Capabilities", "Connection", "Transport", "capabilities_of", "get_transport"]

log = logging.getLogger("shardline.transport")

TRANSPORT_NAMES = ("tcp", "rdma", "auto", "shm")


def get_transport(name: str, *, shm_ring_bytes: int | None = None) -> Transport:
    """Return the transport for ``name`` (``shm_ring_bytes``: the ring this side of a shm connection
    sends through; None: the default). Raises ShardlineConfigError for unusable choices."""
    if name not in TRANSPORT_NAMES:
        raise ShardlineConfigError(f"transport must be one of {', '.join(TRANSPORT_NAMES)}, got {name!r}")
    from shardline.services.transport import rdma, shm, tcp

    if name == "tcp":
        return tcp.TRANSPORT
    ring = {} if shm_ring_bytes is None else {"ring_bytes": shm_ring_bytes}
    if name == "shm":
        return shm.Transport(auto=False, **ring)
    available, reason = rdma.rdma_available()
    if name == "auto":
        if available:
            return rdma.transport(required=False, device=reason)
        log.info("no RDMA device (%s); data plane uses shared memory to local peers, TCP to others", reason)
        return shm.Transport(auto=True, **ring)
    if not available:
        raise ShardlineConfigError(f"transport 'rdma' requested but {reason}; use 'auto' to fall back to TCP")
    return rdma.transport(required=True, device=reason)
