"""The device side of the RDMA transport: pyverbs objects for one reliable-connected QP.

Nothing here has run on hardware (the machines this was written on have no RDMA in the kernel);
tests/unit/test_rdma_transport.py drives everything above it through a fake, and its ``rdma``
test runs this module on a machine with a device or Soft-RoCE.

pyverbs is Debian's ``python3-pyverbs`` (rdma-core), a compiled package in the system's
dist-packages. ``import_pyverbs`` loads only that package, by path, into a virtualenv of the
same Python minor version; adding the whole dist-packages directory to ``sys.path`` would let
every Debian Python package shadow or mix with the virtualenv's own.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import mmap
import os
import random
import socket
import sys

from shardline.services.transport.rdma_exchange import ConnParams
from shardline.services.transport.rdma_pool import SlotRegion
from shardline.services.transport.rdma_stream import CREDIT, CREDIT_SENT, DATA, SEND_DONE, Completion

SYSTEM_DIST_PACKAGES = "/usr/lib/python3/dist-packages"
# wr_id of credit-return sends (data sends carry their send slot, receives their receive slot).
CREDIT_WR_ID = 1 << 32
CREDIT_BUFFER_BYTES = 64
RNR_RETRY_FOREVER = 7
# IB transport timeout 4.096 us * 2^14 = 67 ms per retry; 7 retries before the QP errors out.
ACK_TIMEOUT_EXP, RETRY_COUNT, MIN_RNR_TIMER = 14, 7, 12
HOP_LIMIT = 64  # routed RoCE v2 crosses IP routers


def import_pyverbs():
    """The ``pyverbs`` package: importable as is, or loaded from the system's dist-packages if its
    compiled modules were built for this interpreter. Raises ImportError saying why not."""
    if "pyverbs" in sys.modules:
        return sys.modules["pyverbs"]
    try:
        import pyverbs  # noqa: PLC0415 - lazy on purpose: most hosts have no RDMA stack
        return pyverbs
    except ImportError:
        pass
    pkg = os.path.join(SYSTEM_DIST_PACKAGES, "pyverbs")
    if not os.path.isfile(os.path.join(pkg, "__init__.py")):
        raise ImportError(f"pyverbs is not installed (no {pkg}; apt-get install python3-pyverbs)")
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so
    if not os.path.exists(os.path.join(pkg, "device" + suffix)):
        raise ImportError(f"the system's pyverbs in {pkg} is not built for this Python "
                          f"({sys.version_info.major}.{sys.version_info.minor}: no device{suffix})")
    spec = importlib.util.spec_from_file_location("pyverbs", os.path.join(pkg, "__init__.py"),
                                                  submodule_search_locations=[pkg])
    module = importlib.util.module_from_spec(spec)
    sys.modules["pyverbs"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["pyverbs"]
        raise
    return module


def list_devices() -> list[str]:
    """Names of the RDMA devices pyverbs sees (raises ImportError or pyverbs' error without one)."""
    import_pyverbs()
    import pyverbs.device as d  # noqa: PLC0415

    return [dev.name.decode() for dev in d.get_device_list()]


def gid_text(gid: bytes) -> str:
    """16 raw GID bytes in the form pyverbs' GID takes: eight groups of four hex digits."""
    h = gid.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


def gid_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


class _MR:
    """A registration (rdma_pool.Registration) of caller-owned memory."""

    def __init__(self, pd, address: int, length: int):
        import pyverbs.enums as e  # noqa: PLC0415
        from pyverbs.mr import MR  # noqa: PLC0415

        self.mr = MR(pd, length, e.IBV_ACCESS_LOCAL_WRITE, address=address)
        self.lkey, self.rkey = self.mr.lkey, 0  # local access only: the peer gets no rkey to use

    def close(self) -> None:
        self.mr.close()


class VerbsEndpoint:
    """Device context, protection domain, one CQ for both directions, an RC QP in INIT, and the
    two registered regions with every receive slot posted. ``local_params()`` is what the peer
    needs; ``connect(peer)`` brings the QP through RTR to RTS. Implements rdma_stream.Verbs."""

    def __init__(self, device: str, *, port: int, gid_index: int, slot_bytes: int, data_slots: int,
                 spare_slots: int, send_slots: int):
        import_pyverbs()
        import pyverbs.enums as e  # noqa: PLC0415
        from pyverbs.cq import CQ  # noqa: PLC0415
        from pyverbs.device import Context  # noqa: PLC0415
        from pyverbs.pd import PD  # noqa: PLC0415
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr  # noqa: PLC0415

        self._e = e
        self.port, self.gid_index = port, gid_index
        self._closers: list = []
        try:
            self.ctx = Context(name=device)
            self._closers.append(self.ctx)
            self.pd = PD(self.ctx)
            self._closers.append(self.pd)
            port_attr = self.ctx.query_port(port)
            self.lid, self.mtu = port_attr.lid, int(port_attr.active_mtu)
            self.gid = gid_bytes(self.ctx.query_gid(port, gid_index).gid)
            recv_wrs = data_slots + spare_slots
            # The send queue holds data sends and credit messages (RdmaConnection keeps those
            # in flight to at most this side's spare slots).
            send_wrs = send_slots + spare_slots
            self.cq = CQ(self.ctx, recv_wrs + send_wrs, None, None, 0)
            self._closers.append(self.cq)
            self.recv_region = SlotRegion(recv_wrs, slot_bytes, self._register)
            self._closers.append(self.recv_region)
            self.send_region = SlotRegion(send_slots, slot_bytes, self._register)
            self._closers.append(self.send_region)
            # The (read-only) source of credit messages, whose count is their immediate data.
            self.credit_region = SlotRegion(1, mmap.PAGESIZE, self._register)
            self._closers.append(self.credit_region)
            cap = QPCap(max_send_wr=send_wrs, max_recv_wr=recv_wrs, max_send_sge=1, max_recv_sge=1)
            self.qp = QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=1))
            self._closers.append(self.qp)
            init = QPAttr()
            init.port_num, init.pkey_index, init.qp_access_flags = port, 0, e.IBV_ACCESS_LOCAL_WRITE
            self.qp.to_init(init)
            for slot in range(recv_wrs):
                self.post_recv(slot)
        except BaseException:
            self.close()
            raise
        self.psn = random.randrange(1 << 24)
        self._data_slots, self._spare_slots, self._slot_bytes = data_slots, spare_slots, slot_bytes

    def _register(self, address: int, length: int) -> _MR:
        return _MR(self.pd, address, length)

    def local_params(self) -> ConnParams:
        r = self.recv_region
        return ConnParams(gid=self.gid, lid=self.lid, port=self.port, gid_index=self.gid_index, qp_num=self.qp.qp_num,
                          psn=self.psn, mtu=self.mtu, slot_bytes=self._slot_bytes, data_slots=self._data_slots,
                          spare_slots=self._spare_slots, ring_addr=r.address, ring_rkey=0, ring_bytes=r.nbytes)

    def connect(self, peer: ConnParams, mtu: int) -> None:
        """INIT -> RTR (toward ``peer``'s QP) -> RTS."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute  # noqa: PLC0415
        from pyverbs.qp import QPAttr  # noqa: PLC0415

        attr = QPAttr()
        attr.path_mtu, attr.dest_qp_num, attr.rq_psn = mtu, peer.qp_num, peer.psn
        attr.max_dest_rd_atomic, attr.min_rnr_timer = 1, MIN_RNR_TIMER
        # RoCE needs the GRH (a GID); InfiniBand without a router routes on the LID alone.
        is_global = 1 if any(peer.gid) else 0
        gr = GlobalRoute(dgid=GID(val=gid_text(peer.gid)), sgid_index=self.gid_index,
                         hop_limit=HOP_LIMIT) if is_global else None
        attr.ah_attr = AHAttr(port_num=self.port, is_global=is_global, dlid=peer.lid, gr=gr)
        attr.sq_psn, attr.timeout, attr.retry_cnt = self.psn, ACK_TIMEOUT_EXP, RETRY_COUNT
        attr.rnr_retry, attr.max_rd_atomic = RNR_RETRY_FOREVER, 1
        self.qp.to_rtr(attr)
        self.qp.to_rts(attr)

    # --- rdma_stream.Verbs ------------------------------------------------------------------------
    def post_recv(self, slot: int) -> None:
        from pyverbs.wr import SGE, RecvWR  # noqa: PLC0415

        r = self.recv_region
        self.qp.post_recv(RecvWR(wr_id=slot, num_sge=1, sg=[SGE(r.slot_address(slot), r.slot_bytes, r.lkey)]))

    def post_send(self, slot: int, nbytes: int) -> None:
        from pyverbs.wr import SGE, SendWR  # noqa: PLC0415

        s, e = self.send_region, self._e
        self.qp.post_send(SendWR(wr_id=slot, opcode=e.IBV_WR_SEND, num_sge=1,
                                 sg=[SGE(s.slot_address(slot), nbytes, s.lkey)], send_flags=e.IBV_SEND_SIGNALED))

    def post_credit(self, credits: int) -> None:
        from pyverbs.wr import SGE, SendWR  # noqa: PLC0415

        c, e = self.credit_region, self._e
        # A WR needs an SGE; the count travels as immediate data (big endian on the wire, as
        # ibv_send_wr.imm_data is), the few bytes are ignored.
        self.qp.post_send(SendWR(wr_id=CREDIT_WR_ID, opcode=e.IBV_WR_SEND_WITH_IMM, num_sge=1,
                                 imm_data=socket.htonl(credits), sg=[SGE(c.address, CREDIT_BUFFER_BYTES, c.lkey)],
                                 send_flags=e.IBV_SEND_SIGNALED))

    def poll(self, max_entries: int) -> list[Completion]:
        e = self._e
        n, wcs = self.cq.poll(max_entries)
        out = []
        for wc in wcs[:n]:
            if wc.status != e.IBV_WC_SUCCESS:
                out.append(Completion(DATA, error=f"work completion status {wc.status} (vendor error {wc.vendor_err})"))
            elif wc.opcode & e.IBV_WC_RECV:
                if wc.wc_flags & e.IBV_WC_WITH_IMM:
                    out.append(Completion(CREDIT, slot=wc.wr_id, credits=socket.ntohl(wc.imm_data)))
                else:
                    out.append(Completion(DATA, slot=wc.wr_id, nbytes=wc.byte_len))
            elif wc.wr_id == CREDIT_WR_ID:
                out.append(Completion(CREDIT_SENT))
            else:
                out.append(Completion(SEND_DONE, slot=wc.wr_id))
        return out

    def close(self) -> None:
        """QP first, then the regions (deregistered, then unmapped), CQ, PD, context."""
        closers, self._closers = self._closers, []
        for obj in reversed(closers):
            try:
                obj.close()
            except Exception:  # noqa: BLE001 - free what can be freed
                pass
