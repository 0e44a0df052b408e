"""bf16 on the wire (issue 10, "bf16 without waste"): pulls name the dtype they want per block
(BlockRef.want_dtype), the PS converts its fp32 master with round to nearest even exactly as
torch's ``.to(torch.bfloat16)``; bf16 pushes are accumulated in fp32."""

import pytest
import torch

from shardline.ps_server.node import PSNode
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import JobStore, PushItem, StoreError
from shardline.services import frame
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp

BLOCK = 64


def spec(sync="bsp", world_size=1):
    s = common_pb2.JobSpec(name="j", sync=sync, world_size=world_size, block_elements=BLOCK,
                           optimizer=OptimizerConfig.from_kwargs("sgd", lr=0.5).to_proto())
    s.tensors.add(name="w", shape=[3 * BLOCK], dtype="float32", trainable=True)
    return s


def awkward_values(n: int) -> torch.Tensor:
    """Finite fp32 values (masters are finite) that exercise rounding: random bit patterns, exact
    ties (both parities), just above/below ties, subnormals, values rounding up into the next
    binade or to +-inf, signed zeros."""
    bits = torch.randint(0, 2 ** 32, (n,), generator=torch.Generator().manual_seed(5), dtype=torch.int64)
    special = [0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,   # ties to even (down / up), near ties
               0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,   # subnormals
               0x3FFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000,   # round up across a binade, to +-inf
               0x00000000, 0x80000000]                           # signed zeros
    bits[:len(special)] = torch.tensor(special, dtype=torch.int64)
    out = (bits - (bits >= 2 ** 31).long() * 2 ** 32).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(out), out, torch.zeros_like(out))


def rne_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even on the bits, independently of torch's cast (finite and inf inputs)."""
    b = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return rounded.to(torch.int32).to(torch.int16)  # low 16 bits


def make_node(sync="bsp", world_size=1):
    table = common_pb2.RoutingTable(epoch=1)
    table.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)
    node = PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=spec(sync, world_size), uid="u", ready=True),
                  lambda: table)
    node.refresh_routing()
    job = node.job("j")
    return node, job


def init(job, values):
    job.init_blocks([("w", i, values[i * BLOCK:(i + 1) * BLOCK]) for i in range(3)])


def pull(node, wants, has=None):
    header = frame.FrameHeader(op=dp.OP_PULL, request_id=1, job="j", epoch=1, wait_timeout_seconds=1.0)
    for i, want in enumerate(wants):
        ref = header.blocks.add(tensor="w", index=i, want_dtype=want)
        if has is not None:
            ref.has, ref.version = True, has
    frame.validate_header(header)
    node.precheck(header)
    return node.handle(header, bytearray(0))


def test_the_conversion_is_round_to_nearest_even_exactly_as_torch():
    x = awkward_values(1 << 16)
    assert torch.equal(x.to(torch.bfloat16).view(torch.int16), rne_bf16_bits(x))


@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_store_converts_masters_bitwise_like_torch(sync):
    job = JobStore(spec(sync))
    values = awkward_values(3 * BLOCK)
    init(job, values)
    wanted = [("w", i, None) for i in range(3)]
    step, blocks = job.changed_blocks(wanted, copy=sync != "bsp",
                                      dtypes=[torch.bfloat16, torch.float32, torch.bfloat16])
    assert step == 0 and [b[1] for b in blocks] == [0, 1, 2]
    for _tensor, index, _version, value in blocks:
        master = job.blocks[("w", index)].value
        if index == 1:
            assert value.dtype == torch.float32 and torch.equal(value, master)
        else:
            assert value.dtype == torch.bfloat16
            assert torch.equal(value.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))
            assert value.data_ptr() != master.data_ptr()
    # no dtypes: fp32 as before (BSP sends the masters themselves, ASP copies)
    _step, plain = job.changed_blocks(wanted, copy=sync != "bsp")
    assert all(v.dtype == torch.float32 for *_rest, v in plain)
    assert (plain[0][3].data_ptr() == job.blocks[("w", 0)].value.data_ptr()) == (sync == "bsp")


def test_asp_snapshot_is_taken_in_the_wanted_dtype_under_the_lock():
    job = JobStore(spec("asp"))
    init(job, torch.ones(3 * BLOCK))
    _step, [(_t, _i, _v, value)] = job.changed_blocks([("w", 0, None)], copy=True, dtypes=[torch.bfloat16])
    job.push(0, 0, 1.0, [PushItem("w", 0, torch.ones(BLOCK))])  # steps the master meanwhile
    assert torch.equal(value, torch.ones(BLOCK, dtype=torch.bfloat16)), "the reply keeps the snapshot it took"


def test_node_pull_reply_carries_bf16_blocks_sized_and_valued_right():
    node, job = make_node()
    values = awkward_values(3 * BLOCK)
    init(job, values)
    reply, payloads = pull(node, [dp.BFLOAT16, dp.DTYPE_UNSPECIFIED, dp.FLOAT32])
    assert [r.dtype for r in reply.blocks] == [dp.BFLOAT16, dp.FLOAT32, dp.FLOAT32]
    assert [r.nbytes for r in reply.blocks] == [2 * BLOCK, 4 * BLOCK, 4 * BLOCK]
    reply.payload_bytes = sum(len(p) for p in payloads)
    frame.validate_header(reply)  # what a client checks before receiving
    got = frame.payload_views(bytearray(b"".join(bytes(p) for p in payloads)), reply.blocks)
    for ref, t in got:
        master = job.blocks[("w", ref.index)].value
        want = master.to(torch.bfloat16) if ref.dtype == dp.BFLOAT16 else master
        assert torch.equal(t.view(torch.int16) if t.dtype == torch.bfloat16 else t,
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want)
    # delta pull: nothing changed since version 0, nothing is sent in any dtype
    reply, payloads = pull(node, [dp.BFLOAT16] * 3, has=0)
    assert not reply.blocks and not payloads


def test_bf16_pushes_are_accumulated_in_fp32_on_the_ps():
    node, job = make_node(world_size=2)
    init(job, torch.zeros(3 * BLOCK))
    g0 = awkward_values(BLOCK).clamp(-1e30, 1e30).to(torch.bfloat16)
    g1 = torch.linspace(-3, 3, BLOCK).to(torch.bfloat16)
    job.push(0, 0, 1.0, [PushItem("w", 0, g0)])
    job.push(1, 0, 1.0, [PushItem("w", 0, g1)])
    block = job.blocks[("w", 0)]
    assert block.role.collecting.grad_buf.dtype == torch.float32
    assert torch.equal(block.role.collecting.grad_buf, g0.float() + g1.float())
    job.commit(0, 0, 1.0)
    job.commit(1, 0, 1.0)
    assert torch.equal(block.value, torch.zeros(BLOCK).add_((g0.float() + g1.float()) / 2, alpha=-0.5))


@pytest.mark.parametrize("op,want,message", [
    (dp.OP_PULL, dp.FLOAT16, "FLOAT16"),          # not converted to: fp16 overflows where bf16 does not
    (dp.OP_PULL, 99, "99"),                       # an enum value this node does not know
    (dp.OP_PUSH, dp.BFLOAT16, "only pulls"),
    (dp.OP_INIT, dp.FLOAT32, "only pulls"),
])
def test_want_dtype_is_validated(op, want, message):
    node, job = make_node()
    init(job, torch.zeros(3 * BLOCK))
    header = frame.FrameHeader(op=op, request_id=1, job="j", epoch=1)
    ref = header.blocks.add(tensor="w", index=0, want_dtype=want)
    if op == dp.OP_PUSH:
        ref.zero, ref.numel = True, BLOCK
    if op == dp.OP_INIT:
        ref.dtype, ref.numel, ref.nbytes = dp.FLOAT32, BLOCK, 4 * BLOCK
        header.payload_bytes = 4 * BLOCK
    frame.validate_header(header)  # well-formed: the node answers INVALID_ARGUMENT and keeps the connection
    with pytest.raises(StoreError) as err:
        node.precheck(header)
    assert err.value.code == "INVALID_ARGUMENT" and message in str(err.value)


def test_want_dtype_survives_the_header_codec():
    header = frame.FrameHeader(op=dp.OP_PULL, request_id=3, job="j")
    header.blocks.add(tensor="w", index=2, want_dtype=dp.BFLOAT16)
    body = frame.encode_prefix_and_header(header)[frame.PREFIX.size:]
    parsed = frame.parse_header(body)
    frame.validate_header(parsed)
    assert parsed.blocks[0].want_dtype == dp.BFLOAT16
