"""The adapter tiers: object store / local directory -> host RAM -> pool pages.

Owned by the engine thread: every method except ``drain_residency`` (and the fetches on the loader threads)
runs there, between engine steps, so placing and evicting never race a step. Downloads and
parsing run on a thread pool; their results come back through ``post`` (a queue the engine thread
drains). Loads of one adapter are shared by everyone who asks while it is in flight.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

from core.errors import LoraplexError
from server.adapters.errors import AdapterTooLarge, ModelNotFound
from server.adapters.eviction import Candidate, choose_victims
from server.adapters.fetch import AdapterFetcher, HostAdapter
from server.adapters.host_cache import HostCache
from server.adapters.sources import AdapterSource, LocalSource
from server.engine import LLMEngine
from server.engine.errors import AdapterInUse
from server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Waiter = Callable[[LoraplexError | None], None]


class AdapterState(Enum):
    COLD = "cold"  # in host RAM or nowhere
    FETCHING = "fetching"  # on a loader thread
    PLACING = "placing"  # in host RAM, waiting for pages or a slot
    RESIDENT = "resident"  # in pool pages


@dataclass(frozen=True)
class AdapterLimits:
    max_resident: int  # adapters in the pool at once (engine slots)
    pool_idle_ttl: float  # seconds unused before leaving the pool
    reserve_pages: int  # pages a placement leaves free for KV growth


@dataclass
class AdapterEntry:
    key: str
    source: AdapterSource
    refs: int = 0  # requests holding it (queued or running): never evicted while > 0
    pinned: bool = False
    forgotten: bool = False  # unloaded by name: leave every tier once unused
    state: AdapterState = AdapterState.COLD
    last_used: float = 0.0
    load_started: float = 0.0
    load_tier: str = ""
    pending: HostAdapter | None = None
    waiters: list[Waiter] = field(default_factory=list)
    pages: int = 0
    nbytes: int = 0
    residency_mark: float = 0.0


@dataclass(frozen=True)
class TierSnapshot:
    """What is where, for metrics and heartbeats; immutable, so any thread may read a published one."""

    resident: dict[str, int] = field(default_factory=dict)  # key -> pages
    host: tuple[str, ...] = ()


class AdapterManager:
    """Moves adapters between tiers so requests find them resident, within the pool's pages and slots."""

    def __init__(
        self,
        engine: LLMEngine,
        fetcher: AdapterFetcher,
        host: HostCache,
        limits: AdapterLimits,
        metrics: ServerMetrics,
        post: Callable[[Callable[[], None]], None],
        load_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.fetcher = fetcher
        self.host = host
        self.limits = limits
        self.metrics = metrics
        self.post = post
        self.clock = clock
        self._entries: dict[str, AdapterEntry] = {}
        self._placing: list[str] = []
        self._executor = ThreadPoolExecutor(max_workers=load_workers, thread_name_prefix="adapter-loader")
        self._page_seconds: dict[str, float] = {}
        self._lock = threading.Lock()  # guards _page_seconds
        self.placement_blocked = False  # a placement waits for pages or a slot held by busy adapters

    # ----- requests' view -----------------------------------------------------------------------------

    def acquire(self, key: str, source: AdapterSource, now: float) -> None:
        """A request will use ``key``: keep it (once resident) until ``release``."""
        entry = self._entry(key, source)
        entry.refs += 1
        entry.last_used = now

    def release(self, key: str, now: float) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.refs -= 1
        entry.last_used = now
        self.host.touch(key, now)
        if entry.refs == 0:
            self._settle(entry, now)

    def is_resident(self, key: str) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is AdapterState.RESIDENT

    def want(self, key: str, source: AdapterSource, waiter: Waiter, now: float) -> None:
        """Bring ``key`` into the pool; ``waiter`` hears how it went (at once if it is resident)."""
        entry = self._entry(key, source)
        entry.last_used = now
        if entry.state is AdapterState.RESIDENT:
            self.host.touch(key, now)
            waiter(None)
            return
        entry.waiters.append(waiter)
        if entry.state is not AdapterState.COLD:
            return  # already on its way: share that load
        entry.load_started = now
        cached = self.host.get(key, now)
        if cached is not None:
            entry.load_tier = "host"
            self._queue_placement(entry, cached)
            return
        entry.state = AdapterState.FETCHING
        entry.load_tier = "local" if isinstance(source, LocalSource) else "store"
        future = self._executor.submit(self.fetcher.fetch, source)
        future.add_done_callback(lambda f: self.post(lambda: self._fetched(key, f)))

    def pin(self, key: str, pinned: bool) -> None:
        """Pinned adapters are never evicted (neither idle TTL nor pressure)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.pinned = pinned

    def forget(self, key: str, now: float) -> None:
        """Drop ``key`` from every tier: at once where unused, otherwise when its last request ends."""
        if self.host.drop(key):
            self.metrics.adapter_evictions.labels("unload").inc()
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.forgotten, entry.pinned = True, False
        if entry.state is AdapterState.PLACING:
            self._placing.remove(key)
            entry.pending = None
            entry.state = AdapterState.COLD
            self._fail(entry, ModelNotFound(f"adapter {key} was unloaded while it loaded", param="model"))
        self._settle(entry, now)

    def evict(self, key: str, now: float) -> bool:
        """Move an unused resident adapter out of the pool (it stays in host RAM); False if busy or absent."""
        entry = self._entries.get(key)
        if entry is None or entry.state is not AdapterState.RESIDENT or entry.refs:
            return False
        self._unload(entry, "manual", now)
        return True

    # ----- the engine thread's periodic work ------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Place fetched adapters, apply idle TTLs, account residency."""
        self._account(now)
        self._place_pending(now)
        for entry in list(self._entries.values()):
            idle = now - entry.last_used
            if entry.state is AdapterState.RESIDENT and self._evictable(entry) and idle >= self.limits.pool_idle_ttl:
                self._unload(entry, "idle", now)
        for key in self.host.expire(now, keep=self._host_keep()):
            self.metrics.adapter_evictions.labels("host_idle").inc()
            entry = self._entries.get(key)
            if entry is not None:
                self._settle(entry, now)

    def relieve_pressure(self, now: float) -> bool:
        """KV needs pages: evict the least valuable unused adapter, if there is one."""
        victims = choose_victims(self._candidates(now), pages_needed=1)
        if not victims:
            return False
        self._unload(self._entries[victims[0]], "pressure", now)
        return True

    def next_deadline(self) -> float | None:
        """The earliest moment an idle TTL may expire."""
        deadlines = [
            e.last_used + self.limits.pool_idle_ttl
            for e in self._entries.values()
            if e.state is AdapterState.RESIDENT and self._evictable(e)
        ]
        host_expiry = self.host.next_expiry(keep=self._host_keep())
        if host_expiry is not None:
            deadlines.append(host_expiry)
        return min(deadlines, default=None)

    def drain_residency(self) -> dict[str, float]:
        """Page-seconds each adapter spent in the pool since the last drain (any thread)."""
        with self._lock:
            drained, self._page_seconds = self._page_seconds, {}
        return drained

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----- internals ----------------------------------------------------------------------------------------

    def _entry(self, key: str, source: AdapterSource) -> AdapterEntry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = AdapterEntry(key, source)
        return entry

    def _host_keep(self) -> set[str]:
        """Keys host RAM must hold on to whatever their age: in use, pinned, or about to be placed."""
        return {k for k, e in self._entries.items() if e.refs or e.pinned or e.state is AdapterState.PLACING}

    def _evictable(self, entry: AdapterEntry) -> bool:
        return entry.refs == 0 and not entry.pinned

    def _fetched(self, key: str, future: Future[HostAdapter]) -> None:
        now = self.clock()
        entry = self._entries.get(key)
        if entry is None:
            return
        try:
            adapter = future.result()
        except LoraplexError as exc:
            log.info("adapter %s refused: %s", key, exc.message)
            self._fetch_failed(entry, exc, now)
            return
        except Exception as exc:
            log.exception("loading adapter %s failed", key)
            self._fetch_failed(entry, LoraplexError(f"loading adapter {key} failed: {exc}"), now)
            return
        if entry.forgotten:
            self._fetch_failed(entry, ModelNotFound(f"adapter {key} was unloaded while it loaded", param="model"), now)
            return
        keep = {k for k, e in self._entries.items() if e.pinned or e.state is AdapterState.PLACING}
        for evicted in self.host.put(key, adapter, now, keep=keep):
            if evicted != key:
                self.metrics.adapter_evictions.labels("host_lru").inc()
        self._queue_placement(entry, adapter)  # even if every asker left: it was wanted, and TTLs clean up

    def _fetch_failed(self, entry: AdapterEntry, error: LoraplexError, now: float) -> None:
        entry.state = AdapterState.COLD
        self._fail(entry, error)
        self._settle(entry, now)

    def _queue_placement(self, entry: AdapterEntry, adapter: HostAdapter) -> None:
        entry.state = AdapterState.PLACING
        entry.pending = adapter
        self._placing.append(entry.key)

    def _place_pending(self, now: float) -> None:
        self.placement_blocked = False
        for key in list(self._placing):
            entry = self._entries[key]
            adapter = entry.pending
            assert adapter is not None
            needed = self.engine.adapter_pages_needed(adapter.weights)
            total = self.engine.pool_stats().total_pages
            if needed + self.limits.reserve_pages > total:
                self._placing.remove(key)
                entry.pending = None
                error = AdapterTooLarge(
                    f"adapter {entry.key} needs {needed} pool pages; the pool has {total}"
                    f" ({self.limits.reserve_pages} kept for KV): start the server with a larger --pool-bytes",
                    param="model",
                )
                self._fetch_failed(entry, error, now)
                continue
            if not self._make_room(needed, now):
                self.placement_blocked = True
                return  # first come, first placed: later ones wait behind it
            self._placing.remove(key)
            entry.pending = None
            try:
                self.engine.load_adapter(key, adapter.weights)
            except LoraplexError as exc:
                self._fetch_failed(entry, exc, now)
                continue
            entry.state = AdapterState.RESIDENT
            entry.pages = self.engine.resident_adapters()[key].num_pages
            entry.nbytes = adapter.nbytes
            entry.residency_mark = entry.last_used = now
            self.metrics.adapter_loads.labels(entry.load_tier).inc()
            self.metrics.adapter_load_seconds.observe(max(0.0, now - entry.load_started))
            waiters, entry.waiters = entry.waiters, []
            for waiter in waiters:
                waiter(None)

    def _make_room(self, needed: int, now: float) -> bool:
        """Evict what placing ``needed`` pages takes; False (evicting nothing) while busy adapters or KV hold it."""
        free = self.engine.pool_stats().free_pages
        resident = sum(1 for e in self._entries.values() if e.state is AdapterState.RESIDENT)
        slots_needed = max(0, resident + 1 - self.limits.max_resident)
        pages_needed = max(0, needed + self.limits.reserve_pages - free)
        if not slots_needed and not pages_needed:
            return True
        victims = choose_victims(self._candidates(now), pages_needed, slots_needed)
        if victims is None:
            return False
        for victim in victims:
            self._unload(self._entries[victim], "pressure", now)
        # An unload the engine refused (a request it has not reported finished yet) leaves the room short.
        resident = sum(1 for e in self._entries.values() if e.state is AdapterState.RESIDENT)
        free = self.engine.pool_stats().free_pages
        return resident < self.limits.max_resident and free >= needed + self.limits.reserve_pages

    def _candidates(self, now: float) -> list[Candidate]:
        return [
            Candidate(e.key, e.pages, e.nbytes, now - e.last_used, e.key in self.host)
            for e in self._entries.values()
            if e.state is AdapterState.RESIDENT and self._evictable(e)
        ]

    def _unload(self, entry: AdapterEntry, reason: str, now: float) -> None:
        try:
            self.engine.unload_adapter(entry.key)
        except AdapterInUse:  # the engine still runs a request of it (aborted, not yet reported)
            return
        self._account(now, entry)
        entry.state, entry.pages = AdapterState.COLD, 0
        self.metrics.adapter_evictions.labels(reason).inc()
        self._settle(entry, now)

    def _settle(self, entry: AdapterEntry, now: float) -> None:
        """Finish what an unused entry owes: a forgotten one leaves the pool; a cold one with nothing left goes."""
        if entry.refs or entry.waiters:
            return
        if entry.forgotten and entry.state is AdapterState.RESIDENT:
            self._unload(entry, "unload", now)
            return
        if entry.state is AdapterState.COLD and (entry.forgotten or entry.key not in self.host):
            self._entries.pop(entry.key, None)

    def _fail(self, entry: AdapterEntry, error: LoraplexError) -> None:
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter(error)

    def _account(self, now: float, only: AdapterEntry | None = None) -> None:
        entries = [only] if only is not None else list(self._entries.values())
        with self._lock:
            for e in entries:
                if e.state is AdapterState.RESIDENT:
                    self._page_seconds[e.key] = self._page_seconds.get(e.key, 0.0) + e.pages * (now - e.residency_mark)
                    e.residency_mark = now

    def snapshot(self) -> TierSnapshot:
        """What is where right now (engine thread; others read the copy the engine loop publishes)."""
        return TierSnapshot(
            resident={k: e.pages for k, e in self._entries.items() if e.state is AdapterState.RESIDENT},
            host=tuple(self.host.keys()),
        )
