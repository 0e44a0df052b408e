"""Checks of a request's frame header that every data-plane server applies (a PS node and a rack
cache alike) before it reads the payload; each raises RequestError INVALID_ARGUMENT.
"""

from __future__ import annotations

from shardline.services import frame
from shardline.services.errors import ErrorCode, RequestError
from shardline.services.pb import dataplane_pb2 as dp


def refuse_duplicates(header: frame.FrameHeader) -> None:
    """A frame names each block once: a repeated reference could only make the node reserve (and
    read) the same block's bytes again. (A handover's copy of a block and its value from before
    its last step are its second and third parts, flagged.)"""
    seen, handover = set(), header.replicate_kind == dp.REPLICATE_HANDOVER
    for ref in header.blocks:
        key = (ref.tensor, ref.index, handover and ref.copy, handover and ref.previous)
        if key in seen:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"{dp.Op.Name(header.op)} names block {ref.tensor[:200]}[{ref.index}] more than once")
        seen.add(key)


def check_want_dtypes(header: frame.FrameHeader) -> None:
    """Only a pull names the dtype it wants a block in, and only one of frame.PULL_DTYPES."""
    for ref in header.blocks:
        if not ref.want_dtype:
            continue
        if not frame.asks_blocks(header):
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"{dp.Op.Name(header.op)} names want_dtype for block {ref.tensor[:200]}[{ref.index}]: "
                               f"only pulls do")
        if ref.want_dtype not in frame.PULL_DTYPES:
            name = dp.DType.Name(ref.want_dtype) if ref.want_dtype in dp.DType.values() else str(ref.want_dtype)
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"pull asks block {ref.tensor[:200]}[{ref.index}] in dtype {name}; "
                               f"nodes send FLOAT32 or BFLOAT16")
