"""Eviction order: cheap-to-reload, long-idle adapters go first; nothing is evicted when it cannot help."""

from __future__ import annotations

from server.adapters.eviction import Candidate, choose_victims, eviction_order, reload_cost_s

MB = 1 << 20


def candidate(key: str, *, pages: int = 10, nbytes: int = 4 * MB, idle_s: float = 10.0, in_host: bool = True):
    return Candidate(key, pages, nbytes, idle_s, in_host)


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
