"""A block's roles (ps_server/store/blocks.py): each transition returns the next role and leaves
nothing of the last one behind, and no store module resets a role's fields by hand."""

import ast
import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from shardline.ps_server.store import (AWAITING_HANDOVER, COPY, HOLDING, PRIMARY, REPLICA, Collection, Copy, Held,
                                       JobStore, Kept, Primary, Replay, StoreError, Takeover)
from test_store import init_store, make_job, push_refs, receive_all

STORE = Path(__file__).resolve().parents[2] / "ps_server" / "store"


def collecting(ranks=(0, 1), grad=None, **fields) -> Collection:
    return Collection(grad if grad is not None else torch.ones(3), True, set(ranks), set(ranks), **fields)


def test_a_copy_gained_collects_from_the_new_epoch_and_waits_for_a_live_previous_primary():
    role = COPY.gained(7, "ps-1", until=123.0)
    assert isinstance(role, Primary) and role.primary and role.since_epoch == 7
    assert role.takeover == Takeover("ps-1", 123.0) and role.awaits_handover and role.state == AWAITING_HANDOVER
    assert role.takeover.waiting(100.0) and not role.takeover.waiting(123.0)
    assert not role.collecting.pushed_by and role.kept is None and role.replay is None
    assert COPY.gained(7).state == PRIMARY   # its previous primary died: nothing to wait for
    assert role.stop_waiting().state == PRIMARY and role.stop_waiting().takeover.source == "ps-1"


def test_applied_collects_the_next_step_with_what_came_ahead_and_keeps_a_replayed_gradient_as_sent():
    grad, spare, ahead_buf = torch.ones(3), torch.zeros(3), torch.full((3,), 2.0)
    ahead = Collection(ahead_buf, True, {1}, {1})
    role = Primary(since_epoch=4, collecting=collecting(grad=grad, handed=frozenset({0})),
                   ahead={2: ahead, 3: Collection()},
                   takeover=Takeover("ps-1", 50.0, (0, 1)), spare=spare)
    replay = Replay(1, grad, 0.1)
    kept = Kept(1, 2, torch.zeros(3))
    after = role.applied(2, keep_epoch=False, kept=kept, replay=replay)
    assert after.collecting.grad_buf is ahead_buf and after.collecting.pushed_by == {1} and not after.collecting.handed
    assert list(after.ahead) == [3] and after.spare is grad      # the replayed gradient stays as sent
    assert after.since_epoch == 0 and after.takeover == Takeover("ps-1", 0.0, (0, 1))
    assert after.kept is kept and after.replay is replay
    assert role.collecting.pushed_by == {0, 1} and 2 in role.ahead   # the old role is left as it was
    ssp = role.applied(2, keep_epoch=True, kept=None, replay=None)
    assert ssp.since_epoch == 4 and ssp.collecting.grad_buf is ahead_buf


def test_applied_without_anything_ahead_reuses_the_buffer_and_keeps_a_receiving_rank_claim():
    grad = torch.ones(3)
    role = Primary(collecting=collecting(grad=grad, receiving=1))
    after = role.applied(1, keep_epoch=False, kept=None, replay=None)
    assert after.collecting.grad_buf is grad and not after.collecting.has_grad and not after.collecting.pushed_by
    assert after.collecting.receiving == 1   # its push, still arriving into the buffer, ends as a resend


def test_caught_up_drops_its_own_step_and_remembers_the_steps_it_adopted():
    role = Primary(since_epoch=3, collecting=collecting(receiving=0), ahead={5: Collection(), 6: Collection()},
                   takeover=Takeover("ps-1", 9.0))
    after = role.caught_up(2, 5)
    assert after.takeover.adopted == (2, 5) and after.takeover.until == 9.0 and after.since_epoch == 3
    assert not after.collecting.pushed_by and not after.collecting.has_grad and after.collecting.receiving == 0
    assert list(after.ahead) == [6]


def test_handed_over_collects_the_previous_primary_ranks_and_stops_waiting():
    role = COPY.gained(2, "ps-1", until=99.0)
    buf = torch.ones(3)
    after = role.handed_over((0, 1), buf, True)
    assert after.collecting.handed == {0, 1} and after.collecting.pushed_by == {0, 1} == after.collecting.received
    assert after.collecting.grad_buf is buf and after.collecting.has_grad and not after.awaits_handover
    assert after.takeover.source == "ps-1"   # a late handover from it is still recognized


def test_a_copy_holds_a_copy_sent_ahead_until_it_is_installed_and_a_lost_primary_is_a_bare_copy():
    held = Held(1, 1, torch.ones(3), {})
    role = COPY.holding(held)
    assert isinstance(role, Copy) and role.held is held and not role.primary and role.state == HOLDING
    assert role.installed() is COPY and COPY.state == REPLICA
    assert Primary(collecting=collecting(), kept=Kept(0, 1, torch.zeros(3))).lost() is COPY


def test_roles_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        COPY.held = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        Takeover().until = 1.0
    # Primary is not frozen (for speed): test_no_store_module_writes_a_role_field_by_hand keeps it so


def test_a_push_received_into_a_block_lost_and_gained_again_meanwhile_is_refused_whole():
    """The new role's collection is not the one the push was received into: NOT_OWNER (the
    worker resends), nothing of the push stays."""
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    refs, flat = push_refs("a", torch.ones(4, 5))
    ticket = store.begin_push(0, 0, 1.0, refs, bytearray(80))
    receive_all(store, ticket, flat)
    keys = set(store.blocks)
    store.set_primary(keys - {("a", 0)}, epoch=2)
    store.set_primary(keys, epoch=3)
    with pytest.raises(StoreError) as e:
        store.finish_push(ticket)
    assert e.value.code == "NOT_OWNER"
    assert all(not b.role.collecting.pushed_by and not b.role.collecting.has_grad for b in store.blocks.values())


# The fields of the role records; only their own methods (blocks.py: the mutable Collection and
# Staged, filled as pushes arrive) write them.
ROLE_FIELDS = {f.name for cls in (Primary, Copy, Collection, Takeover) for f in dataclasses.fields(cls)}


def test_no_store_module_writes_a_role_field_by_hand():
    offenders = []
    for path in sorted(STORE.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_records = {id(n) for c in ast.walk(tree)
                      if isinstance(c, ast.ClassDef) and c.name in ("Collection", "Staged")
                      for n in ast.walk(c)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr in ROLE_FIELDS
                    and id(node) not in in_records):
                offenders.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not offenders, "set role fields through a transition (blocks.py):\n" + "\n".join(offenders)


def test_a_push_waiting_for_another_rank_receiving_ends_when_the_block_is_lost_meanwhile():
    """A push of step 1 waits for a push of step 0 still receiving into the buffer (the step was
    applied without it); the block moves away: the waiting push ends (the block's collection went
    with its role, the worker resends at the new epoch) and the other, received into that
    collection, is refused NOT_OWNER."""
    store = JobStore(make_job(kind="sgd", lr=1.0))
    init_store(store, {"a": torch.zeros(4, 5), "b": torch.zeros(3), "frozen": torch.zeros(2)})
    refs, flat = push_refs("a", torch.ones(4, 5))
    t0 = store.begin_push(0, 0, 1.0, refs, bytearray(80))
    store.commit(0, 0, 1.0)
    store.commit(1, 0, 1.0)
    t1 = store.begin_push(0, 1, 1.0, refs, bytearray(80))
    receive_all(store, t1, flat)
    done = {}
    finisher = threading.Thread(target=lambda: done.setdefault("step", store.finish_push(t1)))
    finisher.start()
    finisher.join(0.2)
    assert finisher.is_alive()
    store.set_primary({key for key in store.blocks if key[0] != "a"}, epoch=2)
    finisher.join(10)
    assert done == {"step": 1} and all(b.role is COPY for k, b in store.blocks.items() if k[0] == "a")
    receive_all(store, t0, flat)
    with pytest.raises(StoreError) as e:
        store.finish_push(t0)
    assert e.value.code == "NOT_OWNER"
