"""RDMA/RoCE transport through pyverbs (imported lazily: most hosts have no RDMA stack).

``rdma_available()`` reports whether a usable device exists. This host class has no RDMA support
in the kernel, so ``auto`` falls back to TCP. The verbs data path (RC queue pairs with
registered memory regions for block payloads, connection set-up over TCP) is not implemented yet:
``listen``/``connect`` raise a clear error instead of pretending.
"""

from __future__ import annotations

import os

from shardline.services.errors import ShardlineConfigError

NAME = "rdma"
# Flipped once the verbs data path lands; until then `auto` uses TCP even where a device exists.
IMPLEMENTED = False


def rdma_available() -> tuple[bool, str]:
    """(True, device) if pyverbs imports and lists at least one device, else (False, reason)."""
    if not os.path.isdir("/sys/class/infiniband"):
        return False, "the kernel exposes no RDMA devices (/sys/class/infiniband is absent)"
    try:
        import pyverbs.device as d  # noqa: PLC0415 - lazy on purpose
    except ImportError as exc:
        return False, f"pyverbs is not installed ({exc})"
    try:
        devices = d.get_device_list()
    except Exception as exc:  # pyverbs raises PyverbsRDMAError without a driver
        return False, f"pyverbs found no RDMA device ({exc})"
    if not devices:
        return False, "pyverbs found no RDMA device"
    return True, devices[0].name.decode()


def _not_implemented(*_args, **_kwargs):
    raise ShardlineConfigError("the RDMA verbs data path is not implemented yet; use transport 'tcp' or 'auto'")


listen = _not_implemented
connect = _not_implemented
