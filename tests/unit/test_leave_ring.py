"""A stopping PS node leaving the ring (ps_server/main.py ``leave_ring``): it waits for the ring to
switch while a dispatcher answers, rides out a leader failover, and stops waiting once no
dispatcher has answered for ``unreachable_timeout`` (the dispatchers stop too: nobody can switch
the ring, and a stop must not hang for the whole leave timeout)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from shardline.ps_server.main import leave_ring
from shardline.services.errors import ShardlineConnectionError


@dataclass
class View:
    nodes: set
    pending_epoch: int = 0
    epoch: int = 4


@dataclass
class FakeNode:
    answers: list                      # per refresh: a View, or None for an unreachable dispatcher
    node_id: str = "ps1"
    routing: View = field(default_factory=lambda: View({"ps1", "ps2"}, pending_epoch=5))
    roles_epoch: int = 0
    replicator: object = None

    def refresh_routing(self) -> View:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if answer is None:
            raise ShardlineConnectionError("dispatcher 127.0.0.1:1 GetRouting: connection refused")
        self.routing = answer
        self.roles_epoch = max(self.roles_epoch, answer.epoch)
        return answer


class FakeLinks:
    def __init__(self, node, sent: bool):
        self.node, self.sent, self.flushed_at = node, sent, None

    def flush(self, timeout):
        self.flushed_at = self.node.roles_epoch
        return self.sent


class FakeClient:
    def drain_node(self, node_id, *, leaving=False):
        assert leaving


def test_dispatchers_gone_after_accepting_the_drain_stop_the_wait_at_the_unreachable_timeout(caplog):
    node = FakeNode([None])  # the drain was accepted, then every dispatcher stopped
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shardline.ps"):
        assert leave_ring(node, FakeClient(), timeout=30.0, unreachable_timeout=0.5) is False
    assert time.monotonic() - started < 3.0
    assert "no dispatcher answered for 0.5 s" in caplog.text and "connection refused" in caplog.text


def test_a_leader_failover_mid_leave_is_ridden_out_and_the_switch_is_seen():
    pending = View({"ps1", "ps2"}, pending_epoch=5)
    node = FakeNode([pending, None, None, pending, View({"ps2"}, epoch=5)])
    assert leave_ring(node, FakeClient(), timeout=30.0, unreachable_timeout=2.0) is True


def test_a_ring_that_never_switches_is_given_up_at_the_leave_timeout():
    node = FakeNode([View({"ps1", "ps2"}, pending_epoch=5)])
    started = time.monotonic()
    assert leave_ring(node, FakeClient(), timeout=0.6, unreachable_timeout=0.2) is False
    assert 0.5 < time.monotonic() - started < 3.0


def test_a_node_that_left_sends_its_handovers_before_it_stops(caplog):
    """The handovers the switch queued (what the node collected of the step in flight, and the
    values a rank redoing it needs) go out before the node stops, once the thread that applied
    the switch assigned the roles; one that cannot be sent in time is named."""
    for sent in (True, False):
        node = FakeNode([View({"ps2"}, epoch=6)])
        node.replicator = type("R", (), {})()
        node.replicator.links = FakeLinks(node, sent)
        with caplog.at_level(logging.WARNING, logger="shardline.ps"):
            assert leave_ring(node, FakeClient(), timeout=10, unreachable_timeout=5)
        assert node.replicator.links.flushed_at == 6
        assert ("did not go out" in caplog.text) == (not sent)
        caplog.clear()
