"""worker/host_step.py: when a worker aggregates with its host, and what a step sends in each role
(fakes for the client and the group: the calls, in order, are the contract)."""

from __future__ import annotations

import pytest
import torch

from shardline.services.errors import ErrorCode, RemoteError, ShardlineConnectionError
from shardline.worker.host_group import LeaderStep, MemberStep, SharedPull
from shardline.worker.host_step import aggregation_wanted, pull_step, push_step


def wanted(asked=None, sync="bsp", compression="none", overlap=False, remote=True):
    return aggregation_wanted(asked, sync=sync, compression=compression, overlap=overlap, nodes=["a", "b"],
                              is_local=lambda node: node == "a" or not remote)


def test_by_default_a_bsp_worker_aggregates_only_where_a_node_is_on_another_host():
    assert wanted() is True
    assert wanted(remote=False) is False                      # every node on this host: shm pushes
    assert wanted(asked=True, remote=False) is True           # asked for: also on one host
    assert wanted(asked=False) is False


@pytest.mark.parametrize("case", [dict(sync="ssp"), dict(sync="asp"), dict(compression="sign"), dict(overlap=True),
                                  dict(sync="ssp", asked=True), dict(overlap=True, asked=True)])
def test_never_for_ssp_asp_compressed_or_overlapped_pushes(case):
    assert wanted(**case) is False


class FakeClient:
    job, step = "j", 3

    @staticmethod
    def shape_of(name):
        return (2, 2)

    def __init__(self, refuse=None):
        self.calls, self.refuse = [], refuse

    def push(self, grads, *, weight, commit=True, aggregate=None, before_commit=None):
        assert aggregate is None or aggregate.sums["w"].shape == (2, 2)   # the flat sums in the tensor's shape
        self.calls.append(("push", weight, commit, None if aggregate is None else aggregate.ranks))
        if aggregate is not None and self.refuse is not None:
            raise self.refuse
        if before_commit is not None:
            before_commit()
        if commit:
            self.calls.append(("commit", weight))

    def check_finite(self, grads):
        self.calls.append(("check_finite",))

    def record_pushed(self, grads, *, weight):
        self.calls.append(("record_pushed", weight))

    def commit(self, *, weight, carry_pull=True):
        self.calls.append(("commit", weight) if carry_pull else ("commit", weight, "no carried pull"))

    def pull_changed(self):
        self.calls.append(("pull_changed",))

    def host_pull_state(self):
        return {"w": "values"}, {("w", 0): 1}

    def adopt_host_pull(self, held_step, durable_step):
        self.calls.append(("adopt_host_pull", held_step, durable_step))

    def durable_step(self):
        return 5


class FakeGroup:
    pull_owed = pull_awaited = False

    def __init__(self, role=None, *, owed=False, awaited=False, taken=None):
        self.role, self.pull_owed, self.pull_awaited, self.taken = role, owed, awaited, taken
        self.calls = []

    def begin_step(self, step, weight, grads, *, share_pull=False):
        assert step == FakeClient.step
        return self.role

    def take_pull(self, versions, values):
        self.calls.append(("take_pull", versions, values))
        return self.taken

    def share_pull(self, held_step, versions, values, durable_step):
        self.calls.append(("share_pull", held_step, durable_step))

    def decline_pull(self, why):
        self.calls.append(("decline_pull", why))


class Leader(LeaderStep):
    def finish(self, pushed):
        self.finished = pushed


class Member(MemberStep):
    def __init__(self, answer):
        super().__init__(step=3, leader=0)
        self.answer = answer

    def wait(self):
        return self.answer


GRADS = {"w": torch.ones(4)}


def leader() -> Leader:
    return Leader(step=3, ranks=(0, 1), weights=(1.0, 2.0), sums={"w": torch.full((4,), 3.0)})


def test_the_leader_pushes_the_aggregate_tells_its_members_then_commits():
    client, role = FakeClient(), leader()
    push_step(client, FakeGroup(role), GRADS, 1.0)
    assert client.calls == [("check_finite",), ("push", 1.0, True, (0, 1)), ("commit", 1.0)]
    assert role.finished is True


def test_an_aggregate_a_node_refuses_as_split_is_pushed_alone_by_every_rank():
    client, role = FakeClient(RemoteError(ErrorCode.AGGREGATE_CONFLICT, "rank 1 pushed alone")), leader()
    push_step(client, FakeGroup(role), GRADS, 1.0)
    assert role.finished is False   # the members push alone
    assert client.calls == [("check_finite",), ("push", 1.0, True, (0, 1)), ("push", 1.0, True, None),
                            ("commit", 1.0)]


def test_any_other_failure_of_the_aggregate_tells_the_members_and_is_raised():
    client, role = FakeClient(RemoteError(ErrorCode.INVALID_ARGUMENT, "bad")), leader()
    with pytest.raises(RemoteError):
        push_step(client, FakeGroup(role), GRADS, 1.0)
    assert role.finished is False


@pytest.mark.parametrize("answer, calls", [(True, [("record_pushed", 2.0), ("commit", 2.0)]),
                                           (False, [("push", 2.0, True, None), ("commit", 2.0)])])
def test_a_member_commits_what_its_leader_pushed_or_pushes_alone(answer, calls):
    client = FakeClient()
    push_step(client, FakeGroup(Member(answer)), GRADS, 2.0)
    assert client.calls == [("check_finite",), *calls]


def test_a_worker_without_a_group_or_alone_this_step_pushes_alone():
    for group, checked in ((None, []), (FakeGroup(None), [("check_finite",)])):
        client = FakeClient()
        push_step(client, group, GRADS, 1.0)
        assert client.calls == [*checked, ("push", 1.0, True, None), ("commit", 1.0)]


@pytest.mark.parametrize("taken, calls", [(SharedPull(7, 6), [("adopt_host_pull", 7, 6)]), (None, [("pull_changed",)])])
def test_a_member_owed_the_pull_takes_it_from_the_leader_or_pulls_itself(taken, calls):
    client, group = FakeClient(), FakeGroup(awaited=True, taken=taken)
    pull_step(client, group)
    assert group.calls == [("take_pull", {("w", 0): 1}, {"w": "values"})] and client.calls == calls


def test_a_leader_shares_its_pull_once_done_and_declines_if_it_raised():
    client, group = FakeClient(), FakeGroup(owed=True)
    client.held_step = 4
    pull_step(client, group)
    assert client.calls == [("pull_changed",)] and group.calls == [("share_pull", 4, 5)]

    class Failing(FakeClient):
        def pull_changed(self):
            raise ShardlineConnectionError("gone")

    group = FakeGroup(owed=True)
    with pytest.raises(ShardlineConnectionError):
        pull_step(Failing(), group)
    assert group.calls == [("decline_pull", "the leader's own pull failed")]


def test_a_member_that_shares_the_pull_commits_without_a_carried_one():
    client, group = FakeClient(), FakeGroup(Member(True), awaited=True)
    push_step(client, group, {"w": torch.ones(2, 2)}, 2.0, share_pull=True)
    assert client.calls[-1] == ("commit", 2.0, "no carried pull")
