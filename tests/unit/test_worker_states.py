"""The worker's small state machines: its lease of (job, rank) (worker/lease.py) against a scripted
dispatcher (its states, the lost-rank error a failed job reports, the release a finished worker
sends), and the shared caches' revocation gate (worker/shm_exchange.py)."""

import threading
import types

from shardline.worker.lease import LeaseState, WorkerLease


class Dispatcher:
    def __init__(self, failed: str = ""):
        self.calls, self.failed = [], failed
        self.renewed = threading.Event()

    def heartbeat(self, **kw):
        self.calls.append(kw)
        self.renewed.set()
        lost = [types.SimpleNamespace(rank=3), types.SimpleNamespace(rank=1)] if self.failed else []
        return types.SimpleNamespace(interval_seconds=0.2, failed=self.failed, lost=lost)


def test_a_lease_renews_once_started_and_a_release_says_leaving():
    dispatcher = Dispatcher()
    lease = WorkerLease("j", 2, "inc", dispatcher.heartbeat, lambda: 7)
    assert lease.state is LeaseState.IDLE
    lease.start()
    lease.start()   # idempotent
    assert lease.state is LeaseState.RENEWING and dispatcher.renewed.wait(5)
    lease.stop_renewing()
    lease.release()
    lease.join()
    assert lease.state is LeaseState.RELEASED and lease.lost is None
    assert dispatcher.calls[0] == dict(job="j", rank=2, incarnation="inc", step=7)
    assert dispatcher.calls[-1] == dict(job="j", rank=2, incarnation="inc", step=7, leaving=True)
    lease.start()   # released: never renews again
    assert lease.state is LeaseState.RELEASED


def test_a_lease_never_started_releases_nothing():
    dispatcher = Dispatcher()
    lease = WorkerLease("j", 0, "inc", dispatcher.heartbeat, lambda: 0)
    lease.release()
    assert lease.state is LeaseState.RELEASED and not dispatcher.calls


def test_a_failed_job_names_the_lost_ranks():
    dispatcher = Dispatcher(failed="rank 1 lost")
    lease = WorkerLease("j", 0, "inc", dispatcher.heartbeat, lambda: 0)
    lease.start()
    assert dispatcher.renewed.wait(5)
    lease.release()
    lease.join()
    assert lease.lost is not None and lease.lost.ranks == (1, 3) and "job 'j' failed: rank 1 lost" in str(lease.lost)


def test_the_shared_caches_gate_holds_new_pulls_until_the_last_one_out_moved_the_caches():
    from shardline.worker.shm_exchange import Gate, SharedMemory

    caches, moved = SharedMemory(), []
    caches._revoke_regions = lambda conns, job: moved.append(job)
    caches.begin_cache_write()           # a pull writes
    caches.given_up_mid_pull()           # another was given up mid-copy
    assert caches.gate is Gate.REVOKING
    entered = threading.Event()
    waiting = threading.Thread(target=lambda: (caches.begin_cache_write(), entered.set()), daemon=True)
    waiting.start()
    assert not entered.wait(0.2)         # a new pull waits while the caches move
    caches.end_cache_write([], "j")      # the last pull out moves them
    assert moved == ["j"] and entered.wait(5) and caches.gate is Gate.OPEN
