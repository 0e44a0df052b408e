"""bench/host_counters.py and the pure pieces of bench/vs_ddp.py that turn counters into the
figures other tools read (nic_bytes_per_step, cross_host_bytes_per_step, the ring all-reduce's
bytes, issue 40's goals), checked against values worked out by hand."""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from host_counters import cpu_seconds, nic_delta, parse_net_dev, peak_rss_mib, read_nic, ring_allreduce_bytes  # noqa: E402
from vs_ddp import issue40_goal_checks, nic_per_step, ps_options, ring_figures  # noqa: E402

# /proc/net/dev as Linux 6.x writes it: receive bytes is the first field, transmit bytes the ninth
NET_DEV = """\
Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo:    9120      80    0    0    0     0          0         0     9120      80    0    0    0     0       0          0
  eth0: 123456789  90210    0    3    0     0          0        12 987654321  80808    0    0    0     0       0          0
"""


def test_the_counters_of_the_named_interface_are_read_from_a_net_dev_listing():
    assert parse_net_dev(NET_DEV, "eth0") == {"rx_bytes": 123456789, "tx_bytes": 987654321}
    assert parse_net_dev(NET_DEV, "lo") == {"rx_bytes": 9120, "tx_bytes": 9120}
    with pytest.raises(LookupError, match="eth1"):
        parse_net_dev(NET_DEV, "eth1")


def test_a_process_reads_its_own_namespace_through_its_pid_and_its_own_cpu_and_peak_rss():
    own = read_nic("self", "lo")
    through_pid = read_nic(os.getpid(), "lo")
    assert through_pid["rx_bytes"] >= own["rx_bytes"] and through_pid["tx_bytes"] >= own["tx_bytes"]
    assert nic_delta(own, through_pid) == {k: through_pid[k] - own[k] for k in own}
    assert cpu_seconds(os.getpid()) > 0
    rss_now_kib = int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                           if line.startswith("VmRSS:")).split()[1])
    assert peak_rss_mib(os.getpid()) >= rss_now_kib / 1024.0


@pytest.mark.parametrize("hosts, each_way", [(1, 0.0), (2, 1000.0), (4, 1500.0), (8, 1750.0)])
def test_a_ring_all_reduce_moves_two_n_minus_one_over_n_of_the_payload_each_way(hosts, each_way):
    assert ring_allreduce_bytes(1000, hosts) == pytest.approx(each_way)


def test_ring_figures_of_the_tiny_model_over_two_hosts():
    ring = ring_figures(922_880, 2)   # 3,691,520 fp32 bytes; 2 x (2-1)/2 = 1 payload each way
    assert ring["payload_bytes"] == 3_691_520
    assert ring["bytes_each_way_per_host"] == pytest.approx(3_691_520)
    assert ring["nic_bytes_per_step"] == pytest.approx(7_383_040)        # sent plus received
    assert ring["cross_host_bytes_per_step"] == pytest.approx(7_383_040)  # both hosts' sends


def test_nic_bytes_per_step_is_the_mean_over_nics_of_sent_plus_received_and_cross_host_bytes_the_sum_sent():
    nic = {"host1": {"tx_bytes": 300, "rx_bytes": 100}, "host0": {"tx_bytes": 100, "rx_bytes": 300},
           "ps0": {"tx_bytes": 50, "rx_bytes": 50}}
    out = nic_per_step(nic, 10)
    assert out["nic_bytes_per_step_per_host"] == {"host0": 40.0, "host1": 40.0, "ps0": 10.0}
    assert out["nic_bytes_per_step"] == pytest.approx(30.0)
    assert out["cross_host_bytes_per_step"] == pytest.approx(45.0)


def args(**kw) -> Namespace:
    base = dict(workload="lognormal", link="2gbit", ps_on_ranks=True, ps=2, replication=None, workers_per_host=1,
                bucket_cap_mb=1.0, block_elements=None, replicate_gradients=True)
    return Namespace(**{**base, **kw})


def test_shardline_default_passes_no_option_and_the_others_theirs():
    assert ps_options("shardline_default", args()) == {}
    assert ps_options("shardline", args()) == dict(bucket_cap_mb=1.0, block_elements=None, replication=None,
                                                   overlap=True, prefetch_window=1, replicate_gradients=True)
    assert "replicate_gradients" not in ps_options("shardline_plain", args(replicate_gradients=False))


def test_issue_40_goals_on_a_link_run_with_ps_on_ranks_and_on_one_host():
    summary = {"shardline_default": {"ratio_to_ddp_paired_median": 1.35, "ratio_to_ddp_balanced_paired_median": 1.05,
                                     "nic_bytes_ratio_to_ring": 1.04, "last_rank_wait_ratio_to_ddp_paired_median": None}}
    link = issue40_goal_checks(summary, args())
    assert link["layout"] == "link" and link["as_in_issue"]
    assert {k: c["met"] for k, c in link["checks"].items()} == {
        "ratio_to_ddp_paired_median": True, "ratio_to_ddp_balanced_paired_median": False,
        "nic_bytes_ratio_to_ring": True, "last_rank_wait_ratio_to_ddp_paired_median": None}
    one = issue40_goal_checks(summary, args(link=None, ps_on_ranks=False, ps=1))
    assert one["layout"] == "one_host" and not one["as_in_issue"]
    assert {k: c["met"] for k, c in one["checks"].items()} == {
        "ratio_to_ddp_paired_median": True, "ratio_to_ddp_balanced_paired_median": True}
    assert issue40_goal_checks(summary, args(ps_on_ranks=False)) == {}     # not a layout of the issue
    assert issue40_goal_checks(summary, args(workload="balanced")) == {}
    assert issue40_goal_checks({}, args()) == {}
