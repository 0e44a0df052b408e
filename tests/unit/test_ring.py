"""Consistent-hash ring: checked against the properties consistent hashing promises.

Balance, weighting, minimal movement and determinism are measured over many random keys; ownership
and wrap-around are checked against the definition (first virtual node at a position >= the key),
computed here directly from CityHash64 rather than from the ring's own tables.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import Counter

import cityhash
import pytest

from shardline.services.errors import ShardlineConfigError, ShardlineStateError
from shardline.services.ring import HASH_SPACE, HashRing, load_adjusted_vnodes, vnode_counts

N_KEYS = 100_000


@pytest.fixture(scope="module")
def keys() -> list[int]:
    rng = random.Random(20240601)
    return [rng.getrandbits(64) for _ in range(N_KEYS)]


def equal_nodes(count: int, vnodes: int = 128) -> dict[str, int]:
    return {f"ps-{i}": vnodes for i in range(count)}


def key_fractions(ring: HashRing, keys: list[int]) -> dict[str, float]:
    counts = Counter(ring.owner(k) for k in keys)
    return {node: counts.get(node, 0) / len(keys) for node in ring.nodes}


def sorted_points(vnodes: dict[str, int]) -> list[tuple[int, str]]:
    """The ring's definition, independently of services.ring: (position, node) sorted."""
    return sorted((cityhash.CityHash64(f"{n}#{i}"), n) for n, c in vnodes.items() for i in range(c))


# --- vnode_counts -------------------------------------------------------------------------------


def test_vnode_counts_scale_with_capacity_and_never_drop_below_one():
    counts = vnode_counts({"a": 1, "b": 2.0, "c": 1.5, "d": 0.001}, vnodes_per_capacity=128)
    assert counts == {"a": 128, "b": 256, "c": 192, "d": 1}


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), True, "2"])
def test_vnode_counts_reject_bad_capacity_quoting_node_and_value(bad):
    with pytest.raises(ShardlineConfigError) as err:
        vnode_counts({"ps-7": bad})
    assert "ps-7" in str(err.value) and repr(bad) in str(err.value)


def test_vnode_counts_reject_bad_density():
    with pytest.raises(ShardlineConfigError, match="vnodes_per_capacity"):
        vnode_counts({"a": 1}, vnodes_per_capacity=0)


def test_vnode_counts_reject_capacity_that_would_explode_the_ring():
    with pytest.raises(ShardlineConfigError, match="1000000.0"):
        vnode_counts({"a": 1e6})


# --- balance and weights ------------------------------------------------------------------------


def test_equal_nodes_get_balanced_key_shares(keys):
    ring = HashRing(equal_nodes(8))
    fractions = key_fractions(ring, keys)
    mean = 1 / 8
    for node, fraction in fractions.items():
        assert abs(fraction - mean) <= 0.25 * mean, (node, fraction)


def test_share_matches_empirical_key_fractions(keys):
    ring = HashRing(equal_nodes(8))
    share = ring.share()
    assert math.isclose(sum(share.values()), 1.0, rel_tol=1e-12)
    fractions = key_fractions(ring, keys)
    # 100k keys: the sampling error of a ~1/8 fraction is ~0.001.
    for node in ring.nodes:
        assert abs(share[node] - fractions[node]) < 0.005, (node, share[node], fractions[node])


def test_capacity_two_node_gets_about_twice_the_keys(keys):
    ring = HashRing(vnode_counts({"big": 2, "a": 1, "b": 1, "c": 1, "d": 1}))
    fractions = key_fractions(ring, keys)
    small_mean = sum(fractions[n] for n in "abcd") / 4
    assert 1.6 <= fractions["big"] / small_mean <= 2.4


def test_single_node_owns_everything(keys):
    ring = HashRing({"only": 3})
    assert ring.share() == {"only": 1.0}
    assert {ring.owner(k) for k in keys[:1000]} == {"only"}
    assert ring.owner(0) == ring.owner(HASH_SPACE - 1) == "only"


# --- minimal movement ---------------------------------------------------------------------------


def test_adding_a_node_moves_only_keys_to_the_new_node(keys):
    before = HashRing(equal_nodes(8))
    after = HashRing(equal_nodes(9))  # adds ps-8
    moved = [k for k in keys if before.owner(k) != after.owner(k)]
    assert all(after.owner(k) == "ps-8" for k in moved)
    # Every key ps-8 owns now was moved to it, so the moved fraction is ps-8's share, about 1/9.
    fraction = len(moved) / len(keys)
    assert fraction == pytest.approx(key_fractions(after, keys)["ps-8"])
    assert abs(fraction - after.share()["ps-8"]) < 0.005
    assert 0.6 / 9 <= fraction <= 1.5 / 9


def test_removing_a_node_moves_only_that_nodes_keys(keys):
    before = HashRing(equal_nodes(8))
    remaining = equal_nodes(8)
    del remaining["ps-3"]
    after = HashRing(remaining)
    for k in keys:
        if before.owner(k) != "ps-3":
            assert after.owner(k) == before.owner(k)
        else:
            assert after.owner(k) != "ps-3"


def test_changing_one_nodes_capacity_moves_keys_only_to_or_from_it(keys):
    before = HashRing(equal_nodes(6))
    grown = equal_nodes(6)
    grown["ps-2"] = 256
    after = HashRing(grown)
    for k in keys:
        if before.owner(k) != after.owner(k):
            assert after.owner(k) == "ps-2"


# --- determinism and definition -----------------------------------------------------------------


def test_rings_from_the_same_table_agree_regardless_of_insertion_order(keys):
    table = {"ps-a": 100, "ps-b": 128, "ps-c": 7, "ps-d": 300}
    one = HashRing(table)
    two = HashRing(dict(reversed(list(table.items()))))
    assert one.share() == two.share()
    assert all(one.owner(k) == two.owner(k) for k in keys[:20_000])
    assert one.nodes == two.nodes == ("ps-a", "ps-b", "ps-c", "ps-d")
    assert len(one) == 4 and one.num_points == 535


def test_owner_is_first_point_at_or_after_the_key():
    table = equal_nodes(3, vnodes=16)
    ring = HashRing(table)
    points = sorted_points(table)
    for position, node in points:
        assert ring.owner(position) == node           # a key exactly on a point belongs to it
        assert ring.owner(position - 1) == node       # and so does the key just before it
    for (position, _), (_, next_node) in zip(points, points[1:]):
        assert ring.owner(position + 1) == next_node  # the key just after belongs to the next point


def test_keys_past_the_last_point_wrap_to_the_first():
    table = equal_nodes(3, vnodes=16)
    ring = HashRing(table)
    points = sorted_points(table)
    first_node = points[0][1]
    assert ring.owner(HASH_SPACE - 1) == first_node
    assert ring.owner(points[-1][0] + 1) == first_node
    assert ring.owner(0) == first_node


@pytest.mark.parametrize("bad", [-1, HASH_SPACE, 1.5, "7"])
def test_key_hash_out_of_range_is_rejected(bad):
    with pytest.raises(ShardlineConfigError):
        HashRing({"a": 1}).owner(bad)


@pytest.mark.parametrize("bad", [{"a": 0}, {"a": -3}, {"": 5}, {"a": 2.0}])
def test_bad_vnode_table_is_rejected(bad):
    with pytest.raises(ShardlineConfigError):
        HashRing(bad)


def test_empty_ring_raises_state_error_on_lookup():
    ring = HashRing({})
    assert len(ring) == 0 and ring.nodes == () and ring.share() == {}
    with pytest.raises(ShardlineStateError):
        ring.owner(123)
    with pytest.raises(ShardlineStateError):
        ring.owners(123, 2)


# --- replica placement --------------------------------------------------------------------------


def test_owners_are_distinct_nodes_in_clockwise_order(keys):
    table = equal_nodes(5, vnodes=32)
    ring = HashRing(table)
    points = sorted_points(table)
    positions = [p for p, _ in points]
    for k in keys[:500]:
        # Definition: distinct nodes in order of appearance walking clockwise from the key.
        start = bisect.bisect_left(positions, k)
        walk: list[str] = []
        for step in range(len(points)):
            node = points[(start + step) % len(points)][1]
            if node not in walk:
                walk.append(node)
        assert ring.owners(k, 3) == walk[:3]
        assert ring.owners(k, 3)[0] == ring.owner(k)
    assert len(ring.owners(keys[0], 10)) == 5
    assert ring.owners(keys[0], 0) == []


def test_owners_prefer_distinct_racks(keys):
    ring = HashRing(equal_nodes(6, vnodes=32))
    racks = {f"ps-{i}": f"rack-{i % 3}" for i in range(6)}
    for k in keys[:2000]:
        three = ring.owners(k, 3, racks)
        assert three[0] == ring.owner(k)
        assert len(set(three)) == 3
        assert len({racks[n] for n in three}) == 3
        # More replicas than racks: all racks used, then filled with further distinct nodes.
        five = ring.owners(k, 5, racks)
        assert len(set(five)) == 5 and {racks[n] for n in five} == {"rack-0", "rack-1", "rack-2"}
        assert five[:3] == three


def test_owners_fill_with_same_rack_nodes_when_racks_run_out(keys):
    ring = HashRing(equal_nodes(4, vnodes=32))
    racks = {"ps-0": "r1", "ps-1": "r1", "ps-2": "r1", "ps-3": "r2"}
    for k in keys[:1000]:
        two = ring.owners(k, 2, racks)
        assert {racks[n] for n in two} == {"r1", "r2"}
        four = ring.owners(k, 4, racks)
        assert sorted(four) == ["ps-0", "ps-1", "ps-2", "ps-3"]


def test_owners_with_one_rack_equal_plain_walk(keys):
    ring = HashRing(equal_nodes(5, vnodes=16))
    racks = dict.fromkeys(ring.nodes, "same")
    for k in keys[:500]:
        assert ring.owners(k, 3, racks) == ring.owners(k, 3)


def test_owners_reject_negative_count():
    with pytest.raises(ShardlineConfigError):
        HashRing({"a": 1}).owners(0, -1)


# --- load-aware adjustment ----------------------------------------------------------------------

BASE = {"a": 128, "b": 128, "c": 128, "d": 128}


def test_load_in_proportion_to_capacity_changes_nothing():
    base = {"a": 256, "b": 128, "c": 128}
    load = {"a": 20.0, "b": 10.0, "c": 10.0}  # a has twice the capacity and twice the load
    assert load_adjusted_vnodes(base, load, dict(base)) == base


def test_vnodes_scale_inversely_to_relative_load():
    # a carries 2/5 of the load on 1/4 of the base: relative load 1.6; the others 0.8.
    result = load_adjusted_vnodes(BASE, {"a": 2.0, "b": 1.0, "c": 1.0, "d": 1.0}, dict(BASE))
    assert result == {"a": round(128 / 1.6), "b": round(128 / 0.8), "c": 160, "d": 160}


def test_changes_within_hysteresis_are_ignored():
    load = {"a": 1.05, "b": 1.0, "c": 1.0, "d": 1.0}  # a about 4% over: inside a 10% band
    assert load_adjusted_vnodes(BASE, load, dict(BASE), hysteresis=0.1) == BASE
    moved = load_adjusted_vnodes(BASE, load, dict(BASE), hysteresis=0.0)
    assert moved["a"] < 128 and moved["b"] > 128


def test_adjustment_is_stable_under_repeated_application():
    load = {"a": 3.0, "b": 1.0, "c": 1.0, "d": 0.5}
    once = load_adjusted_vnodes(BASE, load, dict(BASE))
    assert once != BASE
    assert load_adjusted_vnodes(BASE, load, once) == once
    # Small jitter around the same load does not flap the ring.
    for jitter in (0.97, 1.03, 0.99, 1.02):
        jittered = {n: v * (jitter if n == "a" else 1.0) for n, v in load.items()}
        assert load_adjusted_vnodes(BASE, jittered, once) == once


def test_adjustment_is_clamped():
    result = load_adjusted_vnodes(BASE, {"a": 1000.0, "b": 0.0, "c": 1.0, "d": 1.0}, dict(BASE))
    assert result["a"] == 128 // 4  # min_factor 0.25
    assert result["b"] == 128 * 4   # max_factor 4 (an idle node)


def test_missing_measurements_keep_counts_and_new_nodes_start_from_base():
    current = {"a": 100, "b": 128, "c": 128}  # d is new
    result = load_adjusted_vnodes(BASE, {"b": 1.0, "c": 1.0}, current)
    assert result == {"a": 100, "b": 128, "c": 128, "d": 128}
    assert load_adjusted_vnodes(BASE, dict.fromkeys(BASE, 0.0), current) == {**current, "d": 128}


@pytest.mark.parametrize(
    "load, hysteresis",
    [({"a": -1.0}, 0.1), ({"a": float("nan")}, 0.1), ({"a": 1.0}, -0.1), ({"a": 1.0}, 1.0)],
)
def test_adjustment_rejects_bad_input(load, hysteresis):
    with pytest.raises(ShardlineConfigError):
        load_adjusted_vnodes(BASE, load, dict(BASE), hysteresis)
