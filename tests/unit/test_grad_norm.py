"""Global gradient clipping across PS nodes (ps_server/grad_norm.py), two nodes in one process,
against torch.nn.utils.clip_grad_norm_ + torch.optim.SGD on one process."""

import time

import pytest
import torch

from shardline.ps_server.grad_norm import GradNormExchange, clip_coefficient
from shardline.ps_server.node import PSNode
from shardline.ps_server.optimizer import OptimizerConfig
from shardline.ps_server.store import PushItem
from shardline.services.blocks import block_slices
from shardline.services.pb import common_pb2, dispatcher_pb2

BLOCK = 4
NUMEL = 40


def spec(max_grad_norm: float) -> common_pb2.JobSpec:
    s = common_pb2.JobSpec(name="clip", sync="bsp", world_size=1, block_elements=BLOCK, replication=1,
                           max_grad_norm=max_grad_norm,
                           optimizer=OptimizerConfig.from_kwargs("sgd", lr=0.5).to_proto())
    s.tensors.add(name="w", shape=[NUMEL], dtype="float32", trainable=True)
    return s


class Cluster:
    def __init__(self, max_grad_norm: float):
        self.epoch = 1
        self.spec = spec(max_grad_norm)
        info = dispatcher_pb2.JobInfo(spec=self.spec, uid="u", ready=True)
        self.nodes = {}
        for node_id in ("n1", "n2"):
            node = PSNode(node_id, lambda name: info, self.table)
            node.grad_norms = GradNormExchange(node, self.send)
            self.nodes[node_id] = node
        for node in self.nodes.values():
            node.refresh_routing()

    def table(self):
        t = common_pb2.RoutingTable(epoch=self.epoch, default_replication=1)
        for n in ("n1", "n2"):
            t.nodes.add(node_id=n, rack="r", grpc_address=n, data_address=f"{n}:1", vnodes=64)
        return t

    def send(self, address, share):
        self.nodes[address].grad_norms.receive(share)

    def owner(self, index):
        return next(iter(self.nodes.values())).routing.owner("clip", "w", index)

    def init(self, values):
        for s in block_slices(NUMEL, BLOCK):
            self.nodes[self.owner(s.index)].job("clip").init_blocks([("w", s.index, values[s.start:s.stop].clone())])
        for node in self.nodes.values():
            node.job("clip")

    def push(self, step, grad):
        for s in block_slices(NUMEL, BLOCK):
            part = grad[s.start:s.stop].clone()
            self.nodes[self.owner(s.index)].job("clip").push(0, step, 1.0, [PushItem("w", s.index, part)])

    def value(self):
        out = torch.empty(NUMEL)
        for s in block_slices(NUMEL, BLOCK):
            out[s.start:s.stop] = self.nodes[self.owner(s.index)].job("clip").blocks[("w", s.index)].value
        return out

    def wait_step(self, step, timeout=5.0):
        deadline = time.monotonic() + timeout
        while any(n.job("clip").step < step for n in self.nodes.values()):
            assert time.monotonic() < deadline, {k: n.job("clip").step for k, n in self.nodes.items()}
            time.sleep(0.005)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_two_nodes_clip_by_the_global_norm_like_clip_grad_norm(max_norm):
    c = Cluster(max_norm)
    assert {c.owner(i) for i in range(NUMEL // BLOCK)} == {"n1", "n2"}, "the blocks must span both nodes"
    torch.manual_seed(0)
    values = torch.randn(NUMEL)
    c.init(values)
    ref = values.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.5)
    for step in range(3):
        grad = torch.randn(NUMEL)
        c.push(step, grad)
        for node in c.nodes.values():
            node.job("clip").commit(0, step, 1.0, epoch=c.epoch)
        c.wait_step(step + 1)
        ref.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_([ref], max_norm)
        opt.step()
        assert (c.value() - ref.detach()).abs().max().item() <= 1e-6


def test_a_routing_change_while_a_step_waits_for_shares_shares_again_at_the_new_epoch():
    c = Cluster(0.5)
    torch.manual_seed(1)
    values = torch.randn(NUMEL)
    c.init(values)
    grad = torch.randn(NUMEL)
    c.push(0, grad)
    n1, n2 = c.nodes["n1"], c.nodes["n2"]
    n2.grad_norms._send = lambda address, share: None  # n2's share is lost on the way
    n1.job("clip").commit(0, 0, 1.0, epoch=1)
    n2.job("clip").commit(0, 0, 1.0, epoch=1)
    time.sleep(0.1)
    assert n1.job("clip").step == 0, "n1 must wait for n2's share"
    n2.grad_norms._send = c.send
    c.epoch = 2
    for node in c.nodes.values():
        node.refresh_routing()
    c.wait_step(1)
    expected = values - 0.5 * grad * clip_coefficient(0.5, float(grad.double().square().sum()))
    assert (c.value() - expected).abs().max().item() <= 1e-6
