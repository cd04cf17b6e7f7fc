"""The host-RAM tier: verified adapters, packed for the pool (``AdapterPlan``), kept in an LRU under a byte
budget and dropped when idle too long.

A pool eviction then costs one page copy to undo instead of a download; past ``idle_ttl`` an adapter leaves
host RAM too (scale to zero). Owned by the engine thread; ``keys`` and ``nbytes`` may be read from others.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

from server.memory.adapter_pages import AdapterPlan


@dataclass
class HostEntry:
    plan: AdapterPlan
    last_used: float


class HostCache:
    """LRU of adapter plans by key; ``put`` evicts the least recently used entries past ``budget_bytes``.

    The engine thread asks it something every step, and it may hold thousands of adapters: no call walks
    more entries than it drops (or keeps on purpose). That rests on the LRU order being ``last_used`` order,
    which holds because callers pass a monotonic clock.
    """

    def __init__(self, budget_bytes: int, idle_ttl: float) -> None:
        self.budget_bytes = budget_bytes
        self.idle_ttl = idle_ttl
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._nbytes = 0
        self._keys: tuple[str, ...] | None = ()  # membership as of the last change; None once stale
        self._lock = threading.Lock()  # for readers on other threads (metrics, heartbeat)

    def get(self, key: str, now: float) -> AdapterPlan | None:
        """The cached plan, marked as just used; None when absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.last_used = now
            self._entries.move_to_end(key)
            return entry.plan

    def touch(self, key: str, now: float) -> None:
        self.get(key, now)

    def put(self, key: str, plan: AdapterPlan, now: float, keep: Collection[str] = ()) -> list[str]:
        """Cache ``plan``; returns the keys evicted to stay under budget (never those in ``keep``).

        An adapter larger than the whole budget is not cached (it is returned as if evicted at once).
        """
        if plan.nbytes > self.budget_bytes:
            return [key]
        with self._lock:
            if (replaced := self._entries.pop(key, None)) is not None:
                self._nbytes -= replaced.plan.nbytes
            self._keys = None
            self._entries[key] = HostEntry(plan, now)
            self._nbytes += plan.nbytes
            evicted, excess = [], self._nbytes - self.budget_bytes
            for old, entry in self._entries.items():  # least recently used first, and only as far as needed
                if excess <= 0:
                    break
                if old != key and old not in keep:
                    evicted.append(old)
                    excess -= entry.plan.nbytes
            for old in evicted:
                self._nbytes -= self._entries.pop(old).plan.nbytes
            return evicted

    def expire(self, now: float, keep: Collection[str] = ()) -> list[str]:
        """Drop entries idle for ``idle_ttl`` or longer (except ``keep``); returns their keys."""
        with self._lock:
            gone = []
            for key, entry in self._entries.items():
                if now - entry.last_used < self.idle_ttl:
                    break  # the rest were used more recently still
                if key not in keep:
                    gone.append(key)
            for key in gone:
                self._nbytes -= self._entries.pop(key).plan.nbytes
            if gone:
                self._keys = None
            return gone

    def next_expiry(self, keep: Collection[str] = ()) -> float | None:
        """When the least recently used entry not in ``keep`` would expire, if any."""
        with self._lock:
            oldest = next((e for k, e in self._entries.items() if k not in keep), None)
            return oldest.last_used + self.idle_ttl if oldest else None

    def drop(self, key: str) -> bool:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return False
            self._nbytes -= entry.plan.nbytes
            self._keys = None
            return True

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> tuple[str, ...]:
        """The cached keys (least recently used first as of the last put or drop). The same tuple until one
        arrives or leaves: the engine loop publishes it every step."""
        with self._lock:
            if self._keys is None:
                self._keys = tuple(self._entries)
            return self._keys

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._nbytes
