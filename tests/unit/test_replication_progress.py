"""The per-holder states of replication (ps_server/replication_progress.py), driven without a
network or a clock: every transition of the diagram in ps_server/replication.py."""

from types import SimpleNamespace

import pytest

from shardline.ps_server.replication_progress import (Fetch, HolderProgress, HolderState, JobReplication, SyncAsk,
                                                      SyncWait, plan_step)

OUT, SYNCING, IN_SYNC = HolderState.OUT_OF_SYNC, HolderState.SYNCING, HolderState.IN_SYNC


def test_a_holder_starts_out_of_sync_and_joins_by_a_sync_or_the_initial_values():
    fresh = HolderProgress()
    assert fresh.state is OUT and not fresh.replicating
    syncing = fresh.sync_asked(1)
    assert (syncing.state, syncing.round) == (SYNCING, 1) and syncing.replicating
    assert fresh.initialized(2) == HolderProgress(IN_SYNC, 2)


def test_the_last_frame_of_the_sync_answer_of_its_round_makes_it_in_sync_and_no_other():
    syncing = HolderProgress().sync_asked(3)
    syncing.sent_ahead[("a", 0)] = "staged"
    assert syncing.sync_answered(2) is syncing           # an older round's answer
    in_sync = syncing.sync_answered(3)
    assert in_sync.state is IN_SYNC and in_sync.round == 3
    assert in_sync.sent_ahead == {("a", 0): "staged"}     # the same round: what was sent ahead stays
    assert in_sync.sync_answered(3) is in_sync


def test_a_new_sync_request_starts_a_new_round_forgetting_what_was_sent_ahead():
    in_sync = HolderProgress().initialized(1)
    in_sync.sent_ahead[("a", 0)] = "staged"
    again = in_sync.sync_asked(4)
    assert (again.state, again.round, again.sent_ahead) == (SYNCING, 4, {})


@pytest.mark.parametrize("state", ["syncing", "in_sync"])
def test_a_failed_frame_drops_a_holder_only_in_its_own_round(state):
    progress = HolderProgress().sync_asked(5) if state == "syncing" else HolderProgress().initialized(5)
    assert progress.failed(4) is progress                # a frame to its previous process
    assert progress.failed(5) == HolderProgress()
    assert progress.failed(None) == HolderProgress()     # any round
    out = HolderProgress()
    assert out.failed(5) is out


def test_the_job_record_keeps_only_replicating_holders():
    record = JobReplication()
    record.move("b", HolderProgress().sync_asked(1))
    record.move("c", HolderProgress().initialized(2))
    assert record.replicating() == {"b": 1, "c": 2}
    before = record.move("b", record.progress("b").failed(1))
    assert before.state is SYNCING and "b" not in record.holders
    assert record.progress("b") == HolderProgress()


def test_a_dropped_holder_is_invited_after_a_while_once_at_a_time_until_it_joins_or_leaves():
    record = JobReplication()
    record.move("n1", HolderProgress().initialized(1))
    record.move("n1", record.progress("n1").failed(1))
    record.dropped["n1"] = 10.0                        # Replicator.drop_holder notes when
    record.dropped["n2"] = 10.0
    assert record.invitations_due(11.0, 2.0, {"n1", "n2"}) == []          # time for its own ask
    assert record.invitations_due(12.0, 2.0, {"n1"}) == ["n1"]            # n2 holds nothing here now
    assert "n2" not in record.dropped
    assert record.invitations_due(20.0, 2.0, {"n1"}) == []                # one invitation in flight
    record.invited("n1", 20.0)
    assert record.invitations_due(21.0, 2.0, {"n1"}) == []                # it may be asking now
    assert record.invitations_due(22.0, 2.0, {"n1"}) == ["n1"]            # it did not: again
    record.invited("n1", 22.0)
    record.move("n1", HolderProgress().sync_asked(2))                      # it asked: no longer dropped
    assert record.dropped == {} and record.invitations_due(99.0, 2.0, {"n1"}) == []


def test_copies_sent_ahead_are_taken_out_of_every_round_once_their_step_is_applied():
    record = JobReplication()
    record.move("b", HolderProgress().initialized(1))
    record.move("c", HolderProgress().initialized(2))
    record.progress("b").sent_ahead.update({("a", 0): "s0", ("a", 1): "s1"})
    record.progress("c").sent_ahead.update({("a", 0): "s0"})
    assert record.take_sent_ahead([("a", 0)]) == {"b": {("a", 0): "s0"}, "c": {("a", 0): "s0"}}
    assert record.progress("b").sent_ahead == {("a", 1): "s1"} and record.progress("c").sent_ahead == {}


def test_a_step_goes_to_replicating_holders_and_waits_for_a_sync_where_it_has_none():
    blocks = {key: SimpleNamespace(key=key) for key in [("a", 0), ("a", 1), ("a", 2)]}
    copies = {("a", 0): ["me", "b", "c"], ("a", 1): ["me", "c"], ("a", 2): ["me"]}
    plan = plan_step(list(blocks.items()), copies.__getitem__, "me", {"b"})
    assert plan.by_peer == {"b": [(("a", 0), blocks[("a", 0)])]}
    assert plan.protected == [blocks[("a", 0)], blocks[("a", 2)]]   # a block with no copy holder is not held back
    assert plan.unprotected == [blocks[("a", 1)]] and plan.unsynced == {"c"}


def test_sync_waits_are_released_by_a_holder_that_synced_or_left():
    record = JobReplication()
    record.sync_waits.extend([SyncWait(1, ["x"], frozenset({"b"})), SyncWait(2, ["y"], frozenset({"c", "d"}))])
    assert record.release_sync_waits(lambda peers: "c" in peers) == [SyncWait(2, ["y"], frozenset({"c", "d"}))]
    assert [w.step for w in record.sync_waits] == [1]
    assert record.release_sync_waits(lambda peers: False) == []


def test_a_fetch_moves_to_the_next_previous_holder_when_one_lacks_the_block():
    fetch = Fetch(("b", "c"))
    assert fetch.asked == "b"
    assert fetch.lacked_by("c") is fetch              # not the one asked
    assert fetch.lacked_by("b") == Fetch(("c",))
    assert Fetch(("c",)).lacked_by("c") is None       # nobody holds it


def test_a_resync_asks_for_copies_and_fetches_and_notes_what_no_role_needs():
    record = JobReplication()
    record.asks = {"old": SyncAsk(1)}
    fetch = record.plan_resync(held={("a", 0), ("a", 9)}, primary={("a", 1)}, copies={("a", 0)},
                               missing={("a", 1): ["b", "c"]}, routed={"b", "c", "me"}, me="me", now=10.0,
                               epoch=2, asked=["p"])
    assert fetch == {"b": [("a", 1)]}
    assert record.fetches == {("a", 1): Fetch(("b", "c"))}
    assert record.asks == {"p": SyncAsk(2), "b": SyncAsk(2)}     # the earlier routing's asks no longer count
    assert record.unowned == {("a", 9): 10.0}
    assert record.expired_unowned(15.0, grace=10.0) == [] and record.expired_unowned(21.0, grace=10.0) == [("a", 9)]


def test_a_resync_asks_again_for_what_an_earlier_change_left_missing_of_holders_still_routed():
    record = JobReplication(fetches={("a", 1): Fetch(("gone", "c")), ("a", 2): Fetch(("c",))})
    fetch = record.plan_resync(held={("a", 2)}, primary={("a", 1), ("a", 2)}, copies=set(), missing={},
                               routed={"c", "me"}, me="me", now=0.0, epoch=3, asked=[])
    assert fetch == {"c": [("a", 1)]} and record.fetches == {("a", 1): Fetch(("c",))}   # ("a", 2) arrived


def test_the_last_frame_of_a_sync_answer_ends_its_ask_and_hands_lacked_fetches_on():
    record = JobReplication(asks={"b": SyncAsk(2)},
                            fetches={("a", 1): Fetch(("b", "c")), ("a", 2): Fetch(("b",)), ("a", 3): Fetch(("b",))})
    ask_next, abandoned = record.sync_answered("b", 1, held={("a", 3)}, epoch=2)   # asked at an older epoch
    assert record.asks == {"b": SyncAsk(2), "c": SyncAsk(2)}
    assert ask_next == {"c": [("a", 1)]} and abandoned == [("a", 2)]
    assert record.fetches == {("a", 1): Fetch(("c",))}
    ask_next, abandoned = record.sync_answered("c", 2, held={("a", 1)}, epoch=2)
    assert (ask_next, abandoned, record.asks, record.fetches) == ({}, [], {"b": SyncAsk(2)}, {})


def test_a_block_that_arrived_otherwise_ends_its_fetch():
    record = JobReplication(fetches={("a", 1): Fetch(("b",)), ("a", 2): Fetch(("b",))})
    assert record.fetching(held={("a", 1)})
    assert not record.fetching(held={("a", 2)})
