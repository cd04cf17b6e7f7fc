"""The host-RAM tier: LRU under a byte budget, idle expiry, pinned keys kept."""

from __future__ import annotations

import torch

from core.adapter_format import AdapterWeights, LoraTensors
from server.adapters.fetch import HostAdapter, weights_nbytes
from server.adapters.host_cache import HostCache


def adapter(rank: int = 2) -> HostAdapter:
    weights = AdapterWeights({(0, "q_proj"): LoraTensors(torch.zeros(rank, 8), torch.zeros(8, rank), 1.0)})
    return HostAdapter(weights, weights_nbytes(weights))


SIZE = adapter().nbytes  # 2 * 2 * 8 * 4 bytes


def test_least_recently_used_entries_leave_past_the_budget():
    cache = HostCache(budget_bytes=2 * SIZE, idle_ttl=100)
    assert cache.put("a", adapter(), now=0) == []
    assert cache.put("b", adapter(), now=1) == []
    cache.get("a", now=2)  # a is now more recent than b
    assert cache.put("c", adapter(), now=3) == ["b"]
    assert cache.keys() == ["a", "c"] and cache.nbytes == 2 * SIZE


def test_kept_keys_survive_the_budget_and_oversize_adapters_are_not_cached():
    cache = HostCache(budget_bytes=2 * SIZE, idle_ttl=100)
    cache.put("pinned", adapter(), now=0)
    cache.put("b", adapter(), now=1)
    assert cache.put("c", adapter(), now=2, keep={"pinned"}) == ["b"]
    assert cache.put("huge", adapter(rank=64), now=3) == ["huge"] and "huge" not in cache


def test_idle_entries_expire_unless_kept():
    cache = HostCache(budget_bytes=10 * SIZE, idle_ttl=5)
    cache.put("old", adapter(), now=0)
    cache.put("busy", adapter(), now=0)
    cache.put("new", adapter(), now=4)
    assert cache.next_expiry() == 5
    assert cache.next_expiry(keep={"old", "busy"}) == 9  # kept entries never wake anyone up
    assert cache.expire(now=5, keep={"busy"}) == ["old"]
    assert sorted(cache.keys()) == ["busy", "new"]
    assert cache.expire(now=9) == ["busy", "new"] and cache.keys() == []
