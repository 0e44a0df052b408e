"""The worker's step protocol without a cluster (worker/recovery.py): the replay's states and
transitions, the steps it keeps, what a node that came back is sent, and the wait for a node."""

import pytest
import torch

from shardline.services.errors import ErrorCode, RemoteError, ShardlineConnectionError, ShardlineStateError
from shardline.services.pb import dataplane_pb2 as dp
from shardline.worker.recovery import (InflightStep, Replay, ReplayEvent, ReplayState, StepsInFlight, recover_node,
                                       resend_to_node)

S, E = ReplayState, ReplayEvent


@pytest.mark.parametrize("state, event, after", [
    (S.CURRENT, E.EPOCH_MOVED, S.MOVED),
    (S.MOVED, E.EPOCH_MOVED, S.MOVED),
    (S.MOVED, E.BEGIN, S.REPLAYING),
    (S.MOVED, E.NOTHING, S.CURRENT),
    (S.REPLAYING, E.EPOCH_MOVED, S.MOVED_WHILE_REPLAYING),
    (S.MOVED_WHILE_REPLAYING, E.RESTART, S.REPLAYING),
    (S.REPLAYING, E.DONE, S.CURRENT),
    (S.REPLAYING, E.FAILED, S.CURRENT),
    (S.MOVED_WHILE_REPLAYING, E.FAILED, S.MOVED),   # the move seen mid-replay is still due
])
def test_replay_transitions(state, event, after):
    assert state.after(event) is after


def test_an_event_with_no_transition_is_named():
    with pytest.raises(ShardlineStateError, match="no transition from current on DONE"):
        S.CURRENT.after(E.DONE)


def steps_sent(*steps, committed=True) -> StepsInFlight:
    held = StepsInFlight()
    for step in steps:
        record = held.record(step, 1.0, staleness=2)
        record.grads[("w", 0)] = torch.ones(2)
        record.committed = committed
    return held


def test_a_move_without_steps_in_flight_is_no_replay():
    replay = Replay(StepsInFlight())
    replay.epoch_moved()
    assert replay.state is S.CURRENT


def test_a_replay_resends_oldest_first_and_starts_over_when_the_epoch_moves_again():
    replay, sent = Replay(steps_sent(4, 5)), []

    def push(record: InflightStep):
        sent.append(("push", record.step))
        if len(sent) == 1:
            replay.epoch_moved()   # the first push met a newer epoch

    replay.epoch_moved()
    assert replay.state is S.MOVED and replay.state.due
    assert replay.run(True, push, lambda r: sent.append(("commit", r.step)), lambda: 3)
    # interrupted before any commit: everything is pushed again at the newer epoch, then committed
    assert sent == [("push", 4), ("push", 4), ("commit", 4), ("push", 5), ("commit", 5)]
    assert replay.state is S.CURRENT


def test_a_replay_running_is_not_started_again_by_its_own_requests():
    replay, nested = Replay(steps_sent(1)), []
    replay.epoch_moved()
    replay.run(True, lambda r: nested.append(replay.run(True, None, None, None)), lambda r: None, lambda: 1)
    assert nested == [False]


def test_a_failed_replay_keeps_a_move_it_saw_due():
    replay = Replay(steps_sent(1))
    replay.epoch_moved()

    def push(record):
        replay.epoch_moved()
        raise ShardlineConnectionError("gone")
    with pytest.raises(ShardlineConnectionError):
        replay.run(True, push, None, lambda: 1)
    assert replay.state is S.MOVED


def test_nothing_to_collect_ends_a_due_replay():
    replay = Replay(steps_sent(1))
    replay.epoch_moved()
    assert not replay.run(False, None, None, None) and replay.state is S.CURRENT


def test_the_steps_kept_are_the_last_staleness_plus_one():
    held = steps_sent(*range(6))
    assert sorted(held) == [3, 4, 5]
    held.forget_before(5)
    assert [r.step for r in held.oldest_first()] == [5]


def test_a_node_back_gets_the_steps_it_lacks_of_its_own_blocks():
    held, sent = steps_sent(3, 4), []
    held[4].grads[("w", 1)] = torch.ones(2)

    def send(node, keys, op, step, weight, grads):
        sent.append((dp.Op.Name(op), step, keys))
        return step + (op == dp.OP_COMMIT)
    owner = {("w", 0): "a", ("w", 1): "b"}.get
    assert resend_to_node(held, "b", 4, owner, send) == 5
    assert sent == [("OP_PUSH", 4, [("w", 1)]), ("OP_COMMIT", 4, [])]
    with pytest.raises(ShardlineStateError, match="updates of steps 1..2 are lost"):
        resend_to_node(held, "b", 1, owner, send)


def test_recover_node_waits_while_busy_and_names_the_last_error_after_the_timeout():
    now = [0.0]
    answers = [RemoteError(ErrorCode.UNAVAILABLE, "restoring"), 7]

    def probe():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    got = recover_node("n", OSError("reset"), recovery_timeout=5, in_ring=lambda: True, probe=probe,
                       resend=lambda step: step + 1, sleep=lambda d: now.__setitem__(0, now[0] + d),
                       clock=lambda: now[0])
    assert got == 8
    assert recover_node("n", OSError("reset"), recovery_timeout=5, in_ring=lambda: False, probe=probe,
                        resend=None) is None   # LEFT: it left the ring

    def refused():
        raise ConnectionRefusedError("refused")
    with pytest.raises(ShardlineConnectionError, match="within 1 s .*refused"):
        recover_node("n", OSError("reset"), recovery_timeout=1, in_ring=lambda: True, probe=refused, resend=None,
                     sleep=lambda d: now.__setitem__(0, now[0] + d), clock=lambda: now[0])
    with pytest.raises(RemoteError):   # an answer that is no busy one is the request's own error
        recover_node("n", OSError("reset"), recovery_timeout=1, in_ring=lambda: True,
                     probe=lambda: (_ for _ in ()).throw(RemoteError(ErrorCode.INVALID_ARGUMENT, "no")), resend=None)
