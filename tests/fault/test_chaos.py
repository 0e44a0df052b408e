"""The short, fixed-seed fault schedule (tests/fault/chaos.py, ``cover``): every fault kind once and
every failpoint once while two workers train; no step lost, parameters equal the no-fault run.
``make chaos`` runs longer, weighted ones."""

import pytest

from chaos import FAULTS, POINTS, Chaos

pytestmark = pytest.mark.timeout(900)


def test_fixed_seed_schedule_loses_nothing(tmp_path, etcd):
    report = Chaos(tmp_path, etcd, seed=7, cover=True).run()
    summary = report.to_dict()
    print({k: v for k, v in summary.items() if k != "faults"})
    injected = [f for f in report.faults if f["injected"]]
    assert {f["kind"] for f in injected} == set(FAULTS), summary
    ps_fired = {f["detail"].split()[1].split("@")[0] for f in injected if f["kind"] == "ps_failpoint"}
    assert ps_fired == set(POINTS["ps_failpoint"]), summary
    assert sorted(report.worker_failpoints_fired) == sorted(POINTS["worker_failpoint"]), summary
    assert report.steps_lost == 0, summary
    assert report.max_abs_diff <= 1e-6, summary
