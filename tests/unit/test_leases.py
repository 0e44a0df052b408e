"""Worker leases with a fake clock: lost after the timeout, fail or wait, release, restart."""

from shardline.dispatcher.leases import WorkerLeases


def make(policies):
    return WorkerLeases(lambda job: policies.get(job), wall_clock=lambda: 1000.0)


def test_a_silent_rank_is_lost_after_the_timeout_and_fails_the_job():
    leases = make({"j": (5.0, "fail")})
    leases.heartbeat("j", 0, "a", 3, now=0.0)
    leases.heartbeat("j", 1, "b", 3, now=0.0)
    leases.heartbeat("j", 0, "a", 4, now=4.0)
    assert leases.expire(now=5.0) == []
    lost = leases.expire(now=5.5)
    assert [(lo.rank, lo.incarnation) for lo in lost] == [(1, "b")]
    assert leases.failed() == {"j": "rank 1 lost: no heartbeat for 5 s (worker_lease_timeout)"}
    assert leases.expire(now=6.0) == []  # lost once
    # the rank comes back (a restarted worker): the failure clears
    leases.heartbeat("j", 1, "c", 0, now=7.0)
    assert leases.failed() == {}
    (_, one) = leases.of_job("j")
    assert one.incarnation == "c" and one.restarts == 1 and one.lost_at is None


def test_wait_policy_never_fails_and_a_clean_leave_is_not_lost():
    leases = make({"j": (2.0, "wait")})
    leases.heartbeat("j", 0, "a", 0, now=0.0)
    leases.heartbeat("j", 1, "b", 0, now=0.0)
    leases.heartbeat("j", 0, "a", 9, now=1.0, leaving=True)
    lost = leases.expire(now=3.0)
    assert [lo.rank for lo in lost] == [1] and leases.failed() == {}
    assert [lo.rank for lo in leases.of_job("j")] == [1]  # rank 0 released its lease


def test_several_lost_ranks_are_named_and_unknown_jobs_dropped():
    policies = {"j": (1.0, "fail")}
    leases = make(policies)
    for rank in (0, 1, 2):
        leases.heartbeat("j", rank, f"i{rank}", 0, now=0.0)
    leases.heartbeat("j", 0, "i0", 0, now=1.5)
    leases.expire(now=2.0)
    assert leases.failed()["j"].startswith("ranks [1, 2] lost")
    del policies["j"]  # the job was deleted
    leases.expire(now=3.0)
    assert leases.all() == []


def test_ranks_that_never_check_in_are_lost_but_finished_ones_are_not():
    leases = make({"j": (2.0, "fail")})
    leases.heartbeat("j", 0, "a", 0, now=0.0, world_size=3)   # ranks 1 and 2 get a lease from now
    leases.heartbeat("j", 1, "b", 0, now=1.0, world_size=3)
    leases.heartbeat("j", 1, "b", 5, now=1.5, leaving=True)    # rank 1 finished
    leases.heartbeat("j", 0, "a", 5, now=2.5, world_size=3)
    lost = leases.expire(now=2.6)
    assert [(lo.rank, lo.incarnation) for lo in lost] == [(2, "")]   # never joined
    assert "rank 2 lost" in leases.failed()["j"]
    assert [lo.rank for lo in leases.of_job("j")] == [0, 2]          # no lease invented for rank 1 again
