"""The worker's replay of a BSP step after the routing epoch changed, against real JobStores.

A commit at epoch E counts, on a node that took a block over at E, as "this rank pushed me the
block". So the replay that commits at E must have pushed every block at E, also when the routing
moves again while the replay runs (found by the seeded fault schedule: a paused leader, then a PS
killed; the commit counted where the push had not arrived). The nodes here are JobStores behind a
scripted exchange that refuses frames of an old epoch as a PS does (NOT_OWNER); the reference is
torch.optim on the mean gradient of both ranks."""

import types

import torch
from job_specs import one_tensor_spec

from shardline.ps_server.store import JobStore, PushItem
from shardline.services.errors import NotOwnerError
from shardline.services.pb import common_pb2
from shardline.services.pb import dataplane_pb2 as dp
from shardline.worker import client as client_module
from shardline.worker.client import Client, _Immediate

BLOCK = 4
KEYS = [("w", 0), ("w", 1)]


def spec() -> common_pb2.JobSpec:
    return one_tensor_spec(2, "adamw", BLOCK, lr=0.1)


class ScriptedCluster:
    """Nodes A and B, each a JobStore holding every block (the primary applies it). ``tables``
    maps epoch -> {key: owner}; ``on_push`` may move the cluster on when a push is taken."""

    def __init__(self, init: torch.Tensor, tables: dict):
        self.tables, self.epoch = tables, 1
        self.stores = {n: JobStore(spec()) for n in ("A", "B")}
        for store in self.stores.values():
            store.init_blocks([("w", i, init[i * BLOCK:(i + 1) * BLOCK].clone()) for i in range(2)])
        self.sent: list[tuple] = []   # (op, node, keys, epoch)
        self.on_push = lambda node, epoch: None
        self.move_to(1)

    def move_to(self, epoch: int) -> None:
        """Every node switches to ``epoch`` at once; a block a node gains there forgets what it
        collected (its previous owner handed nothing over: the harshest case)."""
        self.epoch = epoch
        for node, store in self.stores.items():
            store.set_primary({k for k, owner in self.tables[epoch].items() if owner == node}, epoch)

    def view(self):
        table = self.tables[self.epoch]
        return types.SimpleNamespace(epoch=self.epoch, pending_epoch=0, ring=object(), nodes={"A": 0, "B": 0},
                                     owner=lambda job, tensor, index: table[(tensor, index)])

    def exchange(self, rank: int, epoch: int, node: str, keys: list, op: int, step: int, weight: float, grads) -> int:
        self.sent.append((op, node, list(keys), epoch))
        if epoch < self.epoch:
            raise NotOwnerError("NOT_OWNER", f"client routes with epoch {epoch}, node is at epoch {self.epoch}",
                                epoch=self.epoch)
        store = self.stores[node]
        if op == dp.OP_PUSH:
            store.push(rank, step, weight, [PushItem(t, i, grads[(t, i)]) for t, i in keys])
            self.on_push(node, epoch)
        elif op == dp.OP_COMMIT:
            store.commit(rank, step, weight, epoch=epoch)
        return store.step

    def value(self) -> torch.Tensor:
        owners = self.tables[self.epoch]
        return torch.cat([self.stores[owners[k]].blocks[k].value for k in KEYS])


def cluster_client(cluster: ScriptedCluster, monkeypatch, offline_client) -> Client:
    """A Client of rank 0 with its job loaded, talking to ``cluster`` through the real _scatter."""
    monkeypatch.setattr(client_module, "RoutingView", types.SimpleNamespace(from_proto=lambda view: view))
    client = offline_client(spec())
    client.routing = cluster.view()
    client.dispatcher = types.SimpleNamespace(get_routing=cluster.view)
    client._pool = types.SimpleNamespace(submit=_Immediate)   # the frames of one op in order
    client._exchange = lambda node, keys, op, step, weight, grads, *_: cluster.exchange(
        0, client.routing.epoch, node, keys, op, step, weight, grads)
    return client


def test_a_replay_that_the_routing_interrupts_pushes_everything_again_before_it_commits(monkeypatch, offline_client):
    gen = torch.Generator().manual_seed(3)
    init, g0, g1 = (torch.randn(2 * BLOCK, generator=gen) for _ in range(3))
    # Epoch 1: w0 on A, w1 on B. Epoch 2 swaps them. Epoch 3 swaps them back: A regains w0 and B
    # w1, both having forgotten rank 0's pushes of epoch 1.
    cluster = ScriptedCluster(init, {1: {KEYS[0]: "A", KEYS[1]: "B"}, 2: {KEYS[0]: "B", KEYS[1]: "A"},
                                     3: {KEYS[0]: "A", KEYS[1]: "B"}})
    client = cluster_client(cluster, monkeypatch, offline_client)
    client._push({"w": g0}, 1.0)
    cluster.move_to(2)

    def second_move(node, epoch):   # the replay's first push at epoch 2 is taken, then the ring moves
        if epoch == 2:
            cluster.on_push = lambda *_: None
            cluster.move_to(3)
    cluster.on_push = second_move
    client._commit(1.0)   # refused at epoch 1 -> replay at 2 -> interrupted -> replay at 3

    last_commit = max(i for i, s in enumerate(cluster.sent) if s[0] == dp.OP_COMMIT)
    assert cluster.sent[last_commit][3] == 3
    pushed_at_3 = {(node, key) for op, node, keys, epoch in cluster.sent[:last_commit]
                   if op == dp.OP_PUSH and epoch == 3 for key in keys}
    assert pushed_at_3 == {("A", KEYS[0]), ("B", KEYS[1])}, cluster.sent

    for node in ("A", "B"):   # rank 1 at epoch 3: both blocks, then its commits
        key = KEYS[0] if node == "A" else KEYS[1]
        cluster.exchange(1, 3, node, [key], dp.OP_PUSH, 0, 1.0, {key: g1[key[1] * BLOCK:(key[1] + 1) * BLOCK]})
    for node in ("A", "B"):
        cluster.exchange(1, 3, node, [], dp.OP_COMMIT, 0, 1.0, None)

    p = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = (g0 + g1) / 2
    opt.step()
    assert all(store.step == 1 for store in cluster.stores.values())
    assert torch.allclose(cluster.value(), p.detach(), rtol=1e-6, atol=1e-7)
