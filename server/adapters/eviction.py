"""Which resident adapter to evict: the one whose pages are cheapest to give up.

Only adapters no request holds and nobody pinned are candidates. Keeping an adapter is worth what
reloading it would cost (a page copy from host RAM, or a download and parse from the object store),
times how much it is wanted (a count of its recent requests that halves every ``DEMAND_HALF_LIFE_S``),
spread over the pages it holds and discounted by how long it has sat idle: a long-idle adapter that is
still in host RAM goes first, a busy one that would have to be downloaded again goes last. Among tenants
the value is divided by how far the owner is above its fair share of the pool (pages of its adapters and
KV over its weighted share of the pages in use), so a tenant that fills the pool gives pages back before a
quiet one loses its only adapter. A tenant alone on the server is never above its share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Rough throughputs for the reload estimate; only their ratio matters for the ordering.
HOST_COPY_BYTES_PER_S = 5e9
STORE_BYTES_PER_S = 2e8
STORE_FIXED_S = 0.05  # request round trips, hashing, header parse
IDLE_FLOOR_S = 1.0
DEMAND_HALF_LIFE_S = 60.0  # how fast an adapter's request count fades


@dataclass(frozen=True)
class Candidate:
    """A resident adapter that could be evicted."""

    key: str
    pages: int
    nbytes: int
    idle_s: float
    in_host: bool  # a copy is still in host RAM, so a reload is a page copy
    demand: float = 0.0  # its requests lately, each fading with DEMAND_HALF_LIFE_S (see ``decayed``)
    owner_excess: float = 1.0  # its tenant's pool pages over the tenant's fair share; at most 1 is within it


def decayed(count: float, elapsed_s: float) -> float:
    """A request count ``elapsed_s`` seconds later, halved every ``DEMAND_HALF_LIFE_S``."""
    return count * 0.5 ** (max(elapsed_s, 0.0) / DEMAND_HALF_LIFE_S)


def share_excess(held: Mapping[str, int], weights: Mapping[str, float]) -> dict[str, float]:
    """Each tenant's pages over its fair share of all pages held (by weight among the tenants holding any);
    1.0 for a tenant at or below its share, so only those above it lose value."""
    total = sum(held.values())
    weight_sum = sum(weights.get(t, 1.0) for t, pages in held.items() if pages)
    excess = {}
    for tenant, pages in held.items():
        if pages:
            share = total * weights.get(tenant, 1.0) / weight_sum
            excess[tenant] = max(1.0, pages / share)
    return excess


def reload_cost_s(candidate: Candidate) -> float:
    """Estimated seconds to bring the adapter back into the pool after an eviction."""
    if candidate.in_host:
        return candidate.nbytes / HOST_COPY_BYTES_PER_S
    return STORE_FIXED_S + candidate.nbytes / STORE_BYTES_PER_S


def keep_value(candidate: Candidate) -> float:
    """Reload cost times demand per page freed, discounted by idleness and the owner's excess; lowest goes first."""
    worth = reload_cost_s(candidate) * (1.0 + candidate.demand)
    return worth / (max(candidate.pages, 1) * (candidate.idle_s + IDLE_FLOOR_S) * max(candidate.owner_excess, 1.0))


def eviction_order(candidates: Iterable[Candidate]) -> list[Candidate]:
    """Candidates from least to most valuable (ties: longest idle first, then key for determinism)."""
    return sorted(candidates, key=lambda c: (keep_value(c), -c.idle_s, c.key))


def choose_victims(candidates: Iterable[Candidate], pages_needed: int, slots_needed: int = 0) -> list[str] | None:
    """The fewest least-valuable adapters whose eviction frees ``pages_needed`` pages and ``slots_needed`` slots.

    None when evicting every candidate would still not be enough (then evict nothing and wait).
    """
    victims: list[str] = []
    pages = 0
    for candidate in eviction_order(candidates):
        if pages >= pages_needed and len(victims) >= slots_needed:
            break
        victims.append(candidate.key)
        pages += candidate.pages
    if pages < pages_needed or len(victims) < slots_needed:
        return None
    return victims
