"""Gradient compression (job option ``compression``): the sign codec against a reference written
here, frame validation of compressed blocks, the error-feedback residual, the PS decoding into its
accumulators, bf16, and the worker resending the same encoded bytes when it replays a step."""

import math
import socket
import threading

import pytest
import torch

from shardline.dispatcher.jobs import normalize_spec, spec_difference
from shardline.jobs.spec import parse_job
from shardline.services.payload_budget import PayloadBudget
from shardline.services.dataplane_server import ConnectionPolicy, serve_connection
from shardline.ps_server.node import PSNode
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import JobStore, PushItem, PushRef, StoreError
from shardline.services import compression, frame
from shardline.services.errors import FrameError, FrameTooLargeError, ShardlineConfigError
from shardline.services.pb import common_pb2, dispatcher_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.worker.client import Client
from shardline.worker.compressor import GradientCompressor

BLOCK = 37  # not a multiple of 8: every block has padding bits


def ref_bits(v: torch.Tensor) -> list[int]:
    """The packed bytes, bit by bit: element i is bit i % 8 of byte i // 8, set when v[i] >= 0."""
    out = [0] * ((v.numel() + 7) // 8)
    for i, x in enumerate(v.tolist()):
        if x >= 0:
            out[i // 8] |= 1 << (i % 8)
    return out


def ref_decode(v: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(scale, decoded) of a block: scale = mean |v| in fp32, decoded = +-scale by sign (>= 0: +)."""
    scale = torch.tensor(float(v.double().abs().mean()), dtype=torch.float32)
    return float(scale), torch.where(v >= 0, scale, -scale)


# --- codec -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 8, 9, 37, 1000])
def test_sign_round_trip_matches_the_reference(n):
    v = torch.randn(n, generator=torch.Generator().manual_seed(n))
    v[-1] = 0.0 if n > 1 else v[-1]  # zero encodes as +scale
    block = compression.encode_signs(v)
    assert block.packed.dtype == torch.uint8 and block.packed.numel() == compression.sign_nbytes(n) == math.ceil(n / 8)
    assert block.packed.tolist() == ref_bits(v)
    assert compression.padding_problem(block.packed, n) is None
    scale, want = ref_decode(v)
    assert block.scale == pytest.approx(scale, rel=1e-6)
    got = compression.decode_signs(block.packed, n, block.scale)
    assert got.dtype == torch.float32
    assert torch.equal(got.abs(), torch.full((n,), block.scale))   # every element is exactly +-scale
    assert torch.equal(got > 0, v >= 0)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    # bound: ||v - s sign(v)||^2 = ||v||^2 - n s^2 <= ||v||^2 (s = mean |v|)
    err = float((v.double() - got.double()).square().sum())
    assert err == pytest.approx(float(v.double().square().sum()) - n * block.scale ** 2, rel=1e-5, abs=1e-9)
    out = torch.full((n,), 7.0)
    compression.decode_signs(block.packed, n, block.scale, out=out)
    assert torch.equal(out, got)


def test_padding_bits_must_be_zero():
    packed = compression.encode_signs(torch.ones(BLOCK)).packed.clone()
    assert compression.padding_problem(packed, BLOCK) is None
    packed[-1] |= 1 << 7
    assert "unused bits" in compression.padding_problem(packed, BLOCK)
    assert compression.padding_problem(torch.full((2,), 255, dtype=torch.uint8), 16) is None


def test_compression_names_are_checked():
    assert compression.check_compression("sign") == "sign"
    with pytest.raises(ShardlineConfigError, match="'zip'"):
        compression.check_compression("zip")
    assert compression.compression_of(common_pb2.JobSpec()) == "none"


# --- frames ------------------------------------------------------------------------------------
def sign_push(numel=BLOCK, **fields) -> frame.FrameHeader:
    ref = dict(tensor="w", index=0, dtype=dp.SIGN1, numel=numel, nbytes=compression.sign_nbytes(numel), scale=0.5)
    ref.update(fields)
    h = frame.FrameHeader(op=dp.OP_PUSH, request_id=3, job="j", epoch=1, step=0, rank=0, weight=1.0)
    h.blocks.append(dp.BlockRef(**ref))
    h.payload_bytes = ref["nbytes"]
    return h


def test_a_well_formed_compressed_push_passes_validation():
    frame.validate_header(sign_push())
    frame.validate_header(sign_push(numel=8, nbytes=1, scale=0.0))


@pytest.mark.parametrize("fields, match", [
    ({"nbytes": 4 * BLOCK}, "37 packed signs take 5 bytes != nbytes 148"),
    ({"nbytes": 4}, "37 packed signs take 5 bytes != nbytes 4"),
    ({"scale": float("nan")}, "finite number >= 0"),
    ({"scale": float("inf")}, "finite number >= 0"),
    ({"scale": -1.0}, "finite number >= 0"),
    ({"dtype": dp.FLOAT32, "nbytes": 4 * BLOCK}, "has a sign scale"),
])
def test_malformed_compressed_blocks_are_refused(fields, match):
    h = sign_push(**fields)
    h.payload_bytes = h.blocks[0].nbytes
    with pytest.raises(FrameError, match=match):
        frame.validate_header(h)


@pytest.mark.parametrize("op", [dp.OP_INIT, dp.OP_REPLY, dp.OP_REPLICATE])
def test_only_pushes_carry_compressed_blocks(op):
    h = sign_push()
    h.op = op
    with pytest.raises(FrameError, match="cannot carry compressed"):
        frame.validate_header(h)


def test_a_huge_compressed_claim_is_refused_from_the_header():
    h = sign_push(numel=1 << 40, nbytes=compression.sign_nbytes(1 << 40))
    with pytest.raises(FrameTooLargeError):
        frame.validate_header(h)


def job_spec(kind="sgd", comp="sign", sync="bsp", world_size=2, numel=2 * BLOCK, **hp):
    s = common_pb2.JobSpec(name="j", sync=sync, world_size=world_size, block_elements=BLOCK, compression=comp,
                           optimizer=OptimizerConfig.from_kwargs(kind, **(hp or {"lr": 1.0})).to_proto())
    s.tensors.add(name="w", shape=[numel], dtype="float32", trainable=True)
    return s


class Served:
    """A node (routing: itself alone) with a payload budget, served over a socketpair."""

    def __init__(self, comp="sign"):
        table = common_pb2.RoutingTable(epoch=1)
        table.nodes.add(node_id="n1", rack="r", grpc_address="x:1", data_address="x:2", vnodes=16)
        self.node = PSNode("n1", lambda name: dispatcher_pb2.JobInfo(spec=job_spec(comp=comp, world_size=1), uid="u",
                                                                      ready=True), lambda: table)
        self.node.refresh_routing()
        self.budget = PayloadBudget(1 << 20)
        self.sock, server = socket.socketpair()
        self.sock.settimeout(5)
        self.thread = threading.Thread(target=serve_connection, daemon=True, args=(
            server, "peer:1", self.node, ConnectionPolicy(payload_timeout=1.0, budget=self.budget)))
        self.thread.start()

    def ask(self, header, payloads=()):
        frame.send_frame(self.sock, header, list(payloads))
        return frame.recv_header(self.sock)

    def close(self):
        self.sock.close()
        self.thread.join(5)


def test_a_malformed_compressed_frame_gets_bad_frame_and_nothing_is_reserved():
    s = Served()
    try:
        h = sign_push(nbytes=4 * BLOCK)
        body = h.SerializeToString()
        s.sock.sendall(frame.PREFIX.pack(frame.MAGIC, frame.FORMAT_VERSION, 0, len(body)) + body)
        reply = frame.recv_header(s.sock)
        assert reply.op == dp.OP_ERROR and reply.code == dp.BAD_FRAME and "packed signs" in reply.message
        assert s.budget.in_use == 0
    finally:
        s.close()


def test_served_compressed_push_is_decoded_and_bad_padding_refused():
    s = Served()
    try:
        init = frame.FrameHeader(op=dp.OP_INIT, request_id=1, job="j", epoch=1)
        zeros = torch.zeros(BLOCK)
        init.blocks.extend([frame.block_ref("w", 0, zeros), frame.block_ref("w", 1, zeros)])
        assert s.ask(init, [frame.tensor_bytes(zeros)] * 2).op == dp.OP_REPLY
        g = torch.randn(BLOCK, generator=torch.Generator().manual_seed(1))
        block = compression.encode_signs(g)
        bad = block.packed.clone()
        bad[-1] |= 0x80
        push = frame.FrameHeader(op=dp.OP_PUSH, request_id=2, job="j", epoch=1, step=0, rank=0, weight=1.0)
        push.blocks.append(block.block_ref("w", 0))
        reply = s.ask(push, [memoryview(bad.numpy())])
        assert reply.op == dp.OP_ERROR and reply.code == dp.INVALID_ARGUMENT and "unused bits" in reply.message
        reply = s.ask(push, [block.payload()])  # the connection stays usable; the good push is taken
        assert reply.op == dp.OP_REPLY
        commit = frame.FrameHeader(op=dp.OP_COMMIT, request_id=3, job="j", epoch=1, step=0, rank=0, weight=1.0)
        assert s.ask(commit).op == dp.OP_REPLY
        job = s.node.store.get("j")
        _, want = ref_decode(g)
        assert torch.allclose(job.blocks[("w", 0)].value, -want, rtol=1e-6, atol=0)  # sgd lr 1 from zero
        assert torch.equal(job.blocks[("w", 1)].value, zeros)
    finally:
        s.close()


# --- the PS store --------------------------------------------------------------------------------
def sign_refs(blocks):
    return [PushRef("w", i, False, b.numel, torch.uint8, b.scale) for i, b in blocks]


def push_signs(store, rank, weight, blocks, step=0):
    """A data-plane push of SignBlocks [(index, block)]: scratch holds their bytes at payload offsets."""
    scratch = bytearray(b"".join(bytes(b.payload()) for _, b in blocks))
    ticket = store.begin_push(rank, step, weight, sign_refs(blocks), scratch)
    for n, (_, b) in enumerate(blocks):
        if ticket.dests[n] is not None:
            ticket.dests[n].copy_(b.packed)
        store.check_received(ticket, n)
    return store.finish_push(ticket)


def test_store_steps_the_weighted_mean_of_decoded_gradients_like_torch():
    init = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(0))
    store = JobStore(job_spec("adamw", lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1))
    store.init_blocks([("w", i, init[i * BLOCK:(i + 1) * BLOCK]) for i in range(2)])
    p = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        g0, g1 = torch.randn(2 * BLOCK, generator=gen), torch.randn(2 * BLOCK, generator=gen)
        b0 = [(i, compression.encode_signs(g0[i * BLOCK:(i + 1) * BLOCK])) for i in range(2)]
        b1 = [(0, compression.encode_signs(g1[:BLOCK]))]   # rank 1 pushes only block 0
        push_signs(store, 0, 3.0, b0, step)
        push_signs(store, 1, 1.0, b1, step)
        store.commit(0, step, 3.0)
        store.commit(1, step, 1.0)
        d0 = torch.cat([ref_decode(g0[:BLOCK])[1], ref_decode(g0[BLOCK:])[1]])
        d1 = torch.cat([ref_decode(g1[:BLOCK])[1], torch.zeros(BLOCK)])
        p.grad = (3.0 * d0 + d1) / 4.0
        ref.step()
        got = torch.cat([store.blocks[("w", i)].value for i in range(2)])
        assert torch.allclose(got, p.detach(), rtol=1e-5, atol=1e-6), f"step {step}"


def test_asp_decodes_a_compressed_push_on_arrival():
    store = JobStore(job_spec(sync="asp", world_size=1))
    store.init_blocks([("w", i, torch.zeros(BLOCK)) for i in range(2)])
    g = torch.randn(BLOCK, generator=torch.Generator().manual_seed(2))
    push_signs(store, 0, 1.0, [(1, compression.encode_signs(g))])
    assert torch.allclose(store.blocks[("w", 1)].value, -ref_decode(g)[1], rtol=1e-6, atol=0)
    assert store.step == 1


def test_a_job_without_sign_compression_refuses_sign_blocks_and_keeps_nothing():
    for comp in ("none", "bf16"):
        store = JobStore(job_spec(comp=comp))
        store.init_blocks([("w", i, torch.zeros(BLOCK)) for i in range(2)])
        with pytest.raises(StoreError, match="no sign-compressed") as err:
            push_signs(store, 0, 1.0, [(0, compression.encode_signs(torch.ones(BLOCK)))])
        assert err.value.code == "INVALID_ARGUMENT"
        assert not store.blocks[("w", 0)].role.collecting.pushed_by and not store.blocks[("w", 0)].role.collecting.has_grad


# --- the worker's compressor (error feedback) -----------------------------------------------------
def test_error_feedback_residual_identity_over_steps():
    comp = GradientCompressor("sign")
    gen = torch.Generator().manual_seed(3)
    e_ref = {k: torch.zeros(BLOCK, dtype=torch.float64) for k in (("w", 0), ("w", 1))}
    total_g = {k: torch.zeros(BLOCK, dtype=torch.float64) for k in e_ref}
    total_sent = {k: torch.zeros(BLOCK, dtype=torch.float64) for k in e_ref}
    for step in range(20):
        grads = {k: torch.randn(BLOCK, generator=gen) * (1 + step) for k in e_ref}
        if step % 4 == 3:
            grads[("w", 1)] = None   # a zero block: nothing sent, residual kept
        out = comp.encode(grads, step)
        for k, g in grads.items():
            if g is None:
                assert out[k] is None
                continue
            # the reference: v = g + e, e <- v - scale * sign(v), scale = mean |v|
            v = g.double() + e_ref[k]
            dec = compression.decode_signs(out[k].packed, BLOCK, out[k].scale).double()
            assert out[k].scale == pytest.approx(float(v.abs().mean()), rel=1e-5)
            assert torch.equal(dec > 0, v >= 0)
            e_ref[k] = v - dec
            total_g[k] += g.double()
            total_sent[k] += dec
            assert torch.allclose(comp.residuals[k].double(), e_ref[k], rtol=0, atol=1e-4 * (1 + step))
    for k in e_ref:
        # what was sent over the steps = what was computed - the residual still held
        assert torch.allclose(total_sent[k] + comp.residuals[k].double(), total_g[k], rtol=0, atol=1e-3)
        # the residual stays bounded (it does not accumulate the gradients)
        assert float(comp.residuals[k].abs().max()) < float(total_g[k].abs().max())


def test_the_same_step_gets_the_same_encoding_and_asp_encodes_anew():
    comp = GradientCompressor("sign")
    g = torch.randn(BLOCK, generator=torch.Generator().manual_seed(4))
    first = comp.encode({("w", 0): g}, 5)[("w", 0)]
    residual = comp.residuals[("w", 0)].clone()
    again = comp.encode({("w", 0): g * 3}, 5)[("w", 0)]
    assert again is first and torch.equal(comp.residuals[("w", 0)], residual)
    nxt = comp.encode({("w", 0): g}, 6)[("w", 0)]
    assert nxt is not first and not torch.equal(comp.residuals[("w", 0)], residual)
    asp = GradientCompressor("sign")
    a = asp.encode({("w", 0): g}, None)[("w", 0)]
    b = asp.encode({("w", 0): g}, None)[("w", 0)]
    assert a is not b


def test_bf16_compression_of_bf16_gradients_is_no_compression():
    comp = GradientCompressor("bf16")
    g32 = torch.randn(BLOCK, generator=torch.Generator().manual_seed(5))
    g16 = g32.to(torch.bfloat16)
    half = g32.to(torch.float16)
    out = comp.encode({("w", 0): g16, ("w", 1): g32, ("w", 2): None, ("w", 3): half}, 0)
    assert out[("w", 0)] is g16       # the same bytes as without compression
    assert out[("w", 1)].dtype == torch.bfloat16 and torch.equal(out[("w", 1)], g32.to(torch.bfloat16))
    assert out[("w", 2)] is None and out[("w", 3)] is half
    # and the store steps a bf16 gradient the same with the bf16 job option as without it
    got = []
    for c in ("none", "bf16"):
        store = JobStore(job_spec(comp=c, world_size=1))
        store.init_blocks([("w", i, torch.zeros(BLOCK)) for i in range(2)])
        store.push(0, 0, 1.0, [PushItem("w", 0, out[("w", 0)] if c == "bf16" else g16)])
        store.commit(0, 0, 1.0)
        got.append(store.blocks[("w", 0)].value.clone())
    assert torch.equal(got[0], got[1])


def test_none_is_the_identity():
    g = torch.randn(BLOCK)
    assert GradientCompressor("none").encode({("w", 0): g}, 0)[("w", 0)] is g


# --- the worker resends the same encoded bytes ------------------------------------------------------
@pytest.fixture
def recording_client(offline_client):
    """``recording_client(comp)``: (a Client with no cluster whose _scatter records what would be sent, the record)."""
    def make(comp: str) -> tuple[Client, list]:
        client, sent = offline_client(job_spec(comp=comp)), []
        client._scatter = lambda op, keys, **kw: sent.append((op, list(keys), dict(kw.get("grads") or {}))) or {}
        return client, sent
    return make


def test_a_replayed_step_resends_the_encoded_blocks_not_a_new_encoding(recording_client):
    client, sent = recording_client("sign")
    g = torch.randn(2 * BLOCK, generator=torch.Generator().manual_seed(6))
    client._push({"w": g}, 1.0)
    (op, keys, grads), = sent
    assert op == dp.OP_PUSH and all(isinstance(b, compression.SignBlock) for b in grads.values())
    residuals = {k: r.clone() for k, r in client._compressor.residuals.items()}
    client._inflight[0].committed = True
    client._replay.epoch_moved()   # the routing epoch changed mid-step
    assert client._replay_after_epoch_change()
    (op2, keys2, grads2), (op3, _, _) = sent[1:]
    assert op2 == dp.OP_PUSH and op3 == dp.OP_COMMIT and keys2 == keys
    assert all(grads2[k] is grads[k] for k in keys)   # the same encoded blocks, bytes and scale
    assert all(torch.equal(client._compressor.residuals[k], residuals[k]) for k in residuals)


def test_uncompressed_jobs_push_the_gradient_as_is(recording_client):
    client, sent = recording_client("none")
    g = torch.randn(2 * BLOCK)
    client._push({"w": g}, 1.0)
    assert client._compressor is None
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in sent[0][2].values())


# --- the job option ------------------------------------------------------------------------------------
def test_job_spec_option_is_validated_and_compared():
    spec = job_spec(comp="")
    assert normalize_spec(spec).compression == "none"
    spec.compression = "topk"
    with pytest.raises(ShardlineConfigError, match="'topk'"):
        normalize_spec(spec)
    a, b = normalize_spec(job_spec(comp="sign")), normalize_spec(job_spec(comp="none"))
    assert "compression is 'sign' but the request has 'none'" in spec_difference(a, b)
    nonfinite = job_spec(comp="sign")
    nonfinite.allow_nonfinite = True
    with pytest.raises(ShardlineConfigError, match="allow_nonfinite"):
        normalize_spec(nonfinite)
    old = normalize_spec(job_spec(comp="none"))
    old.ClearField("compression")   # a job made before the option
    assert spec_difference(old, normalize_spec(job_spec(comp="none"))) is None


def test_job_file_compression():
    assert parse_job({"job": {"name": "x"}, "train": {"compression": "sign"}}).train.compression == "sign"
    assert parse_job({"job": {"name": "x"}}).train.compression == "none"
    with pytest.raises(ShardlineConfigError, match="'gzip'"):
        parse_job({"job": {"name": "x"}, "train": {"compression": "gzip"}})


def test_a_request_without_compression_takes_the_jobs():
    from shardline.dispatcher.jobs import JobRegistry
    from shardline.services.errors import ShardlineStateError

    jobs = JobRegistry()
    record, created = jobs.create(job_spec(comp="sign"))
    assert created and record.spec.compression == "sign"
    again, created = jobs.create(job_spec(comp=""))   # e.g. a restarted rank 0 that does not say
    assert not created and again.spec.compression == "sign"
    with pytest.raises(ShardlineStateError, match="compression is 'sign' but the request has 'none'"):
        jobs.create(job_spec(comp="none"))


def test_status_lists_each_jobs_compression():
    from shardline.cli import render_status

    job = {"name": "sft", "sync": "bsp", "optimizer": "adamw", "compression": "sign", "world_size": 2, "step": 3,
           "checkpoint_step": None, "tensors": 4, "parameters": 1000, "ready": True, "workers": [],
           "on_worker_failure": "wait"}
    text = render_status({"cluster": "127.0.0.1:1", "epoch": 1, "alive_nodes": 0, "nodes": [], "jobs": [job],
                          "security": {}})
    header, row = [line for line in text.splitlines() if "COMPRESSION" in line or line.startswith("sft")]
    assert header.split()[-1] == "COMPRESSION" and row.split()[-1] == "sign"
