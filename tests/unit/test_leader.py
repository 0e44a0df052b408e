"""The dispatchers' election state machine (dispatcher/leader.py) over a fake etcd and a fake clock."""

from __future__ import annotations

import math

import pytest

from shardline.dispatcher.leader import CANDIDATE, FOLLOWER, LEADER, Holder, LeaderElection, Observation, lease_ttl
from shardline.dispatcher.state_store import StateStoreError
from shardline.services.errors import ShardlineConfigError

TTL = 3


class FakeEtcd:
    """Leases that expire on the fake clock, and the leader key with etcd's create revisions."""

    def __init__(self, clock):
        self.clock = clock
        self.revision = 0
        self.leases: dict[int, float] = {}  # id -> expiry
        self.ttls: dict[int, int] = {}
        self.leader: Holder | None = None
        self.members: dict[str, int] = {}
        self._next_lease = 100

    def expire(self) -> None:
        now = self.clock()
        for lease, expiry in list(self.leases.items()):
            if now >= expiry:
                self.drop(lease)

    def drop(self, lease: int) -> None:
        self.leases.pop(lease, None)
        if self.leader is not None and self.leader.lease == lease:
            self.leader = None
        self.members = {a: l for a, l in self.members.items() if l != lease}


class FakeBackend:
    """One dispatcher's view of FakeEtcd; ``down`` makes every call fail (etcd unreachable)."""

    def __init__(self, etcd: FakeEtcd):
        self.etcd = etcd
        self.down = False
        self.lose_campaign_reply = False
        self.location = "etcd://fake"
        self.closed = False

    def _check(self):
        if self.down:
            raise StateStoreError("etcd etcd://fake: no endpoint answered")
        self.etcd.expire()

    def grant(self, ttl):
        self._check()
        self.etcd._next_lease += 1
        lease = self.etcd._next_lease
        self.etcd.leases[lease] = self.etcd.clock() + ttl
        self.etcd.ttls[lease] = ttl
        return lease

    def keepalive(self, lease):
        self._check()
        if lease not in self.etcd.leases:
            return False
        self.etcd.leases[lease] = self.etcd.clock() + self.etcd.ttls[lease]
        return True

    def revoke(self, lease):
        self._check()
        self.etcd.drop(lease)

    def campaign(self, lease, address):
        self._check()
        if self.etcd.leader is None and lease in self.etcd.leases:
            self.etcd.revision += 1
            self.etcd.leader = Holder(address, self.etcd.revision, lease)
            if self.lose_campaign_reply:
                self.lose_campaign_reply = False
                raise StateStoreError("etcd etcd://fake: no endpoint answered (reply lost)")
        return self.etcd.leader

    def observe(self):
        self._check()
        return Observation(self.etcd.leader, tuple(sorted(self.etcd.members)))

    def announce(self, lease, address):
        self._check()
        self.etcd.members[address] = lease

    def resign(self, holder):
        self._check()
        if self.etcd.leader is not None and self.etcd.leader.token == holder.token:
            self.etcd.leader = None

    def close(self):
        self.closed = True


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Dispatcher:
    """A LeaderElection with recorded callbacks."""

    def __init__(self, etcd: FakeEtcd, clock: Clock, address: str, fail_load: bool = False):
        self.backend = FakeBackend(etcd)
        self.elected: list[Holder] = []
        self.deposed: list[str] = []
        self.fail_load = fail_load

        def on_elected(term):
            if self.fail_load:
                raise StateStoreError("state store etcd://fake/shardline: key 'epoch' holds a bad epoch")
            self.elected.append(term)

        self.election = LeaderElection(self.backend, address, TTL, on_elected=on_elected,
                                       on_deposed=self.deposed.append, clock=clock)


@pytest.fixture
def world():
    clock = Clock()
    etcd = FakeEtcd(clock)
    a = Dispatcher(etcd, clock, "127.0.0.1:7001")
    b = Dispatcher(etcd, clock, "127.0.0.1:7002")
    return clock, etcd, a, b


def advance(clock: Clock, seconds: float, *dispatchers: Dispatcher, step: float = 0.5) -> None:
    """Let ``seconds`` pass, ticking every dispatcher every ``step``; never do two hold a term at once."""
    end = clock.now + seconds
    while clock.now < end:
        clock.now = min(end, clock.now + step)
        for d in dispatchers:
            d.election.tick()
            holding = [x for x in dispatchers if x.elected and x.election.holds(x.elected[-1])]
            assert len(holding) <= 1, f"two leaders at {clock.now}"


@pytest.mark.parametrize("value", [0, 0.5, 2.5, -1, math.nan, math.inf, True, "3", None])
def test_lease_timeout_must_be_whole_seconds_of_at_least_one(value):
    with pytest.raises(ShardlineConfigError, match="leader_lease_timeout"):
        lease_ttl(value)


def test_lease_ttl_accepts_whole_numbers():
    assert lease_ttl(1) == 1 and lease_ttl(3.0) == 3


def test_first_campaigner_leads_the_other_follows_and_knows_the_leader(world):
    clock, etcd, a, b = world
    assert a.election.role == FOLLOWER and a.election.leader == ""
    a.election.tick()
    b.election.tick()
    assert a.election.role == LEADER and b.election.role == FOLLOWER
    assert a.elected == [etcd.leader] and b.elected == []
    assert b.election.leader == "127.0.0.1:7001" and a.election.leader == "127.0.0.1:7001"
    assert a.election.holds(a.elected[0])
    assert a.election.keepalive_interval == pytest.approx(TTL / 3)
    advance(clock, 10, a, b)  # renewals keep it
    assert a.election.role == LEADER and a.deposed == [] and etcd.leader.address == "127.0.0.1:7001"
    assert set(a.election.dispatchers) == set(b.election.dispatchers) == {"127.0.0.1:7001", "127.0.0.1:7002"}


def test_tick_asks_to_be_called_again_within_a_third_of_the_ttl(world):
    clock, etcd, a, b = world
    assert 0 < a.election.tick() <= TTL / 3
    assert 0 < b.election.tick() <= TTL / 3


def test_a_paused_leader_stops_holding_at_its_deadline_even_before_it_ticks(world):
    clock, etcd, a, b = world
    a.election.tick()
    b.election.tick()
    term = a.elected[0]
    clock.now += TTL  # a SIGSTOP: no renewal, no tick
    assert not a.election.holds(term)  # handlers refuse before the election thread runs
    b.election.tick()  # etcd expired a's lease: b wins
    assert b.election.role == LEADER and b.elected[0].token > term.token
    a.election.tick()  # a wakes up
    assert a.deposed and "not renewed" in a.deposed[0]
    assert a.election.role == FOLLOWER and a.election.leader == "127.0.0.1:7002"
    assert not a.election.holds(term)


def test_a_leader_cut_off_from_etcd_gives_up_after_the_ttl_and_the_other_takes_over(world):
    clock, etcd, a, b = world
    a.election.tick()
    b.election.tick()
    term = a.elected[0]
    a.backend.down = True
    advance(clock, TTL - 0.5, a, b, step=0.25)
    assert a.election.role == LEADER and a.election.holds(term)  # renewals fail, the lease still holds
    advance(clock, 0.75, a, b, step=0.25)
    assert a.election.role == FOLLOWER and not a.election.holds(term) and len(a.deposed) == 1
    assert b.election.role == LEADER
    # a gives up no later than etcd expires its lease: never two leaders at once
    a.backend.down = False
    advance(clock, 5, a, b)
    assert a.election.role == FOLLOWER and a.election.leader == "127.0.0.1:7002" and len(b.elected) == 1


def test_a_leader_whose_key_was_created_again_steps_down_at_the_next_tick(world):
    clock, etcd, a, b = world
    a.election.tick()
    term = a.elected[0]
    etcd.revision += 5
    etcd.leader = Holder("127.0.0.1:7009", etcd.revision, 999)  # another term, whatever happened
    a.election.tick()
    assert a.election.role == FOLLOWER and "127.0.0.1:7009" in a.deposed[0] and not a.election.holds(term)
    assert a.election.leader == "127.0.0.1:7009"


def test_step_down_then_leads_again_over_a_fresh_load_while_the_key_is_still_its_own(world):
    clock, etcd, a, b = world
    a.election.tick()
    term = a.elected[0]
    a.election.step_down("a write's outcome is unknown")
    assert not a.election.holds(term)  # at once, from the calling thread
    a.election.tick()
    assert a.deposed == ["a write's outcome is unknown"]
    assert a.elected == [term, term] and a.election.holds(term)  # same term, state loaded again


def test_step_down_after_a_fenced_write_follows_the_new_leader(world):
    clock, etcd, a, b = world
    a.election.tick()
    etcd.leader = None
    b.election.tick()  # b won meanwhile
    a.election.step_down("write refused: fenced")
    a.election.tick()
    assert a.election.role == FOLLOWER and a.election.leader == "127.0.0.1:7002" and a.elected[1:] == []


def test_a_lost_campaign_reply_is_recognised_by_the_lease(world):
    clock, etcd, a, b = world
    a.backend.lose_campaign_reply = True
    a.election.tick()  # the key was created but the reply lost
    assert a.election.role == FOLLOWER and a.elected == []
    a.election.tick()
    assert a.election.role == LEADER and a.elected[0].lease == etcd.leader.lease


def test_a_leader_that_cannot_load_the_state_resigns_so_another_can_try(world):
    clock, etcd, a, b = world
    a.fail_load = True
    a.election.tick()
    assert a.election.role == FOLLOWER and etcd.leader is None and "loading the state failed" in a.deposed[0]
    b.election.tick()
    assert b.election.role == LEADER


def test_close_hands_the_leadership_over_at_once(world):
    clock, etcd, a, b = world
    a.election.tick()
    b.election.tick()
    a.election.close()
    assert a.deposed == ["stopping"] and etcd.leader is None and a.backend.closed
    assert "127.0.0.1:7001" not in etcd.members  # its lease was revoked
    b.election.tick()
    assert b.election.role == LEADER


def test_a_candidate_is_a_follower_again_when_the_campaign_fails(world):
    clock, etcd, a, b = world
    seen = []
    original = a.backend.campaign

    def campaign(lease, address):
        seen.append(a.election.role)
        raise StateStoreError("etcd etcd://fake: no endpoint answered")

    a.backend.campaign = campaign
    a.election.tick()
    assert seen == [CANDIDATE] and a.election.role == FOLLOWER
    a.backend.campaign = original
    a.election.tick()
    assert a.election.role == LEADER


def test_etcd_down_at_first_tick_is_retried(world):
    clock, etcd, a, b = world
    a.backend.down = True
    delay = a.election.tick()
    assert a.election.role == FOLLOWER and 0 < delay <= 1
    a.backend.down = False
    clock.now += delay
    a.election.tick()
    assert a.election.role == LEADER
