"""The short, fixed-seed fault schedule (tests/fault/chaos.py): 20+ faults of every kind while two
workers train; no step lost, parameters equal the no-fault run. ``make chaos`` runs longer ones."""

import pytest

from chaos import Chaos

pytestmark = pytest.mark.timeout(900)


def test_fixed_seed_schedule_loses_nothing(tmp_path, etcd):
    report = Chaos(tmp_path, etcd, seed=7, faults=24).run()
    summary = report.to_dict()
    print({k: v for k, v in summary.items() if k != "faults"})
    assert summary["faults_injected"] >= 20, summary
    assert report.steps_lost == 0, summary
    assert report.max_abs_diff <= 1e-6, summary
