"""Eviction order: cheap-to-reload, long-idle, little-wanted adapters go first, those of a tenant above its share
of the pool before a quiet tenant's; nothing is evicted when it cannot help."""

from __future__ import annotations

import pytest

from server.adapters.eviction import (
    DEMAND_HALF_LIFE_S,
    Candidate,
    choose_victims,
    decayed,
    eviction_order,
    reload_cost_s,
    share_excess,
)

MB = 1 << 20


def candidate(
    key: str,
    *,
    pages: int = 10,
    nbytes: int = 4 * MB,
    idle_s: float = 10.0,
    in_host: bool = True,
    demand: float = 0.0,
    owner_excess: float = 1.0,
) -> Candidate:
    return Candidate(key, pages, nbytes, idle_s, in_host, demand, owner_excess)


def test_an_adapter_still_in_host_ram_is_cheaper_to_reload_than_one_to_download():
    assert reload_cost_s(candidate("a", in_host=True)) < reload_cost_s(candidate("a", in_host=False))


def test_longer_idle_goes_first_at_equal_cost():
    order = eviction_order([candidate("recent", idle_s=1), candidate("old", idle_s=100), candidate("mid", idle_s=10)])
    assert [c.key for c in order] == ["old", "mid", "recent"]


def test_reload_cost_outweighs_a_little_idleness():
    in_ram = candidate("in-ram", idle_s=5, in_host=True)
    download = candidate("download", idle_s=20, in_host=False)
    assert [c.key for c in eviction_order([download, in_ram])] == ["in-ram", "download"]


def test_but_a_long_idle_download_loses_to_a_busy_one_in_ram():
    stale = candidate("stale", idle_s=100_000, in_host=False)
    hot = candidate("hot", idle_s=0.0, in_host=True)
    assert eviction_order([hot, stale])[0].key == "stale"


def test_victims_are_the_least_valuable_prefix_that_frees_enough():
    pool = [candidate("a", pages=4, idle_s=100), candidate("b", pages=4, idle_s=50), candidate("c", pages=4, idle_s=1)]
    assert choose_victims(pool, pages_needed=3) == ["a"]
    assert choose_victims(pool, pages_needed=5) == ["a", "b"]
    assert choose_victims(pool, pages_needed=0, slots_needed=1) == ["a"]
    assert choose_victims(pool, pages_needed=0) == []


def test_nothing_is_evicted_when_even_all_candidates_are_not_enough():
    pool = [candidate("a", pages=4), candidate("b", pages=4)]
    assert choose_victims(pool, pages_needed=9) is None
    assert choose_victims(pool, pages_needed=0, slots_needed=3) is None
    assert choose_victims([], pages_needed=1) is None


def test_an_adapter_wanted_often_outlasts_one_wanted_once_at_the_same_idleness():
    order = eviction_order([candidate("often", demand=20.0), candidate("once", demand=1.0)])
    assert [c.key for c in order] == ["once", "often"]


def test_demand_fades_by_half_every_half_life():
    assert decayed(8.0, 0.0) == 8.0
    assert decayed(8.0, DEMAND_HALF_LIFE_S) == pytest.approx(4.0)
    assert decayed(8.0, 3 * DEMAND_HALF_LIFE_S) == pytest.approx(1.0)
    assert decayed(8.0, -5.0) == 8.0  # a clock read out of order never inflates a count


def test_a_tenant_above_its_share_gives_pages_back_before_a_quiet_tenants_idler_adapter():
    quiet = candidate("quiet", idle_s=12.0)  # idler, so plain recency would pick it
    greedy = candidate("greedy", idle_s=10.0, owner_excess=share_excess({"a": 30, "b": 10}, {})["a"])
    assert [c.key for c in eviction_order([quiet, greedy])] == ["greedy", "quiet"]
    within = candidate("greedy", idle_s=10.0)
    assert [c.key for c in eviction_order([quiet, within])] == ["quiet", "greedy"]


def test_a_tenants_share_is_by_weight_among_the_tenants_holding_pages():
    assert share_excess({"a": 30, "b": 10}, {}) == {"a": 1.5, "b": 1.0}
    assert share_excess({"a": 30, "b": 10}, {"a": 3.0}) == {"a": 1.0, "b": 1.0}  # a's weight earns it 3/4
    assert share_excess({"a": 30, "b": 10, "idle": 0}, {"idle": 100.0}) == {"a": 1.5, "b": 1.0}


def test_a_tenant_alone_is_never_above_its_share():
    assert share_excess({"a": 40}, {"a": 0.1}) == {"a": 1.0}
    assert share_excess({}, {}) == {}
