"""The host-RAM tier: LRU under a byte budget, idle expiry, pinned keys kept."""

from __future__ import annotations

import torch

from core.adapter_format import AdapterWeights, BaseShapes, LoraTensors
from core.projections import NUM_PROJECTIONS
from loraplex_kernels import KVGeometry, LoraTables
from server.adapters.host_cache import HostCache
from server.memory.adapter_pages import AdapterPages, AdapterPlan
from server.memory.pool import PagePool

SHAPES = BaseShapes(num_layers=1, hidden_size=64, intermediate_size=64, q_size=64, kv_size=64)
PAGES = AdapterPages(
    PagePool(KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4), 4, torch.float32, "cpu"),
    LoraTables.empty(2, 1, 64, num_projections=NUM_PROJECTIONS),
    SHAPES,
)


def adapter(rank: int = 2) -> AdapterPlan:
    weights = AdapterWeights({(0, "q_proj"): LoraTensors(torch.zeros(rank, 64), torch.zeros(64, rank), 1.0)})
    return PAGES.plan("a", weights)


SIZE = adapter().nbytes  # page images and row tables; a rank-64 adapter is more than twice that


def test_least_recently_used_entries_leave_past_the_budget():
    cache = HostCache(budget_bytes=2 * SIZE, idle_ttl=100)
    assert cache.put("a", adapter(), now=0) == []
    assert cache.put("b", adapter(), now=1) == []
    cache.get("a", now=2)  # a is now more recent than b
    assert cache.put("c", adapter(), now=3) == ["b"]
    assert cache.keys() == ("a", "c") and cache.nbytes == 2 * SIZE


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
    assert cache.expire(now=9) == ["busy", "new"] and cache.keys() == ()


def test_the_byte_count_follows_every_put_replace_drop_and_expiry():
    cache = HostCache(budget_bytes=3 * SIZE, idle_ttl=5)
    cache.put("a", adapter(), now=0)
    cache.put("a", adapter(), now=1)  # the same key again replaces, it does not add
    cache.put("b", adapter(), now=2)
    assert cache.nbytes == 2 * SIZE
    assert cache.drop("a") and not cache.drop("a")
    assert cache.nbytes == SIZE
    cache.put("c", adapter(), now=3)
    assert cache.expire(now=7) == ["b"] and cache.nbytes == SIZE  # c, used at 3, is not idle yet
    assert cache.put("d", adapter(), now=8) == [] and cache.put("e", adapter(), now=9) == []
    assert cache.put("f", adapter(), now=10) == ["c"] and cache.nbytes == 3 * SIZE
