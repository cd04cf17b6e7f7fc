"""Which resident adapter to evict: the one whose pages are cheapest to give up.

Only adapters no request holds and nobody pinned are candidates. Keeping an adapter is worth what
reloading it would cost (a page copy from host RAM, or a download and parse from the object store),
spread over the pages it holds and discounted by how long it has sat idle: a long-idle adapter that is
still in host RAM goes first, a recently used one that would have to be downloaded again goes last.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Rough throughputs for the reload estimate; only their ratio matters for the ordering.
HOST_COPY_BYTES_PER_S = 5e9
STORE_BYTES_PER_S = 2e8
STORE_FIXED_S = 0.05  # request round trips, hashing, header parse
IDLE_FLOOR_S = 1.0


@dataclass(frozen=True)
class Candidate:
    """A resident adapter that could be evicted."""

    key: str
    pages: int
    nbytes: int
    idle_s: float
    in_host: bool  # a copy is still in host RAM, so a reload is a page copy


def reload_cost_s(candidate: Candidate) -> float:
    """Estimated seconds to bring the adapter back into the pool after an eviction."""
    if candidate.in_host:
        return candidate.nbytes / HOST_COPY_BYTES_PER_S
    return STORE_FIXED_S + candidate.nbytes / STORE_BYTES_PER_S


def keep_value(candidate: Candidate) -> float:
    """Reload cost per page freed, discounted by idleness; the lowest value is evicted first."""
    return reload_cost_s(candidate) / (max(candidate.pages, 1) * (candidate.idle_s + IDLE_FLOOR_S))


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
