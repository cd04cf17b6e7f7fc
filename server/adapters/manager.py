"""The adapter tiers: object store / local directory -> host RAM -> pool pages.

Owned by the engine thread: every method except ``drain_residency`` (and the fetches on the loader threads)
runs there, between engine steps, so placing and evicting never race a step. Downloads and
parsing run on a thread pool; their results come back through ``post`` (a queue the engine thread
drains). Loads of one adapter are shared by everyone who asks while it is in flight.

Whether an adapter is resident, its pages, and whether a request uses it are the engine's
:class:`~server.engine.resident_adapters.ResidentAdapters`'s facts: this module asks it and keeps only
what the tiers add (loads in flight, host RAM, pins, idle times).
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
from core.protocol import AdapterAuditEvent
from server.adapters.errors import AdapterTooLarge, ModelNotFound
from server.adapters.eviction import Candidate, choose_victims, decayed, share_excess
from server.adapters.fetch import AdapterFetcher
from server.adapters.host_cache import HostCache
from server.adapters.sources import AdapterSource, LocalSource
from server.audit import audit_event
from server.engine import LLMEngine
from server.engine.tenancy import DIRECT, Tenancy
from server.memory.adapter_pages import AdapterPlan
from server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Waiter = Callable[[LoraplexError | None], None]


class LoadState(Enum):
    IDLE = "idle"  # no load in flight (resident or not: ask the registry)
    FETCHING = "fetching"  # on a loader thread
    PLACING = "placing"  # in host RAM, planned, waiting for pages or a slot


@dataclass(frozen=True)
class AdapterLimits:
    max_resident: int  # adapters in the pool at once (engine slots)
    pool_idle_ttl: float  # seconds unused before leaving the pool
    reserve_pages: int  # pages a placement leaves free for KV growth


@dataclass
class AdapterEntry:
    key: str
    source: AdapterSource
    pinned: bool = False
    forgotten: bool = False  # unloaded by name: leave every tier once unused
    state: LoadState = LoadState.IDLE
    last_used: float = 0.0
    load_started: float = 0.0
    load_tier: str = ""
    load_reason: str = "request"  # why the load in flight started: a request, or an explicit load (prefetch)
    load_cause: str | None = None  # the request or job behind it, for the audit trail
    unload_cause: str | None = None  # who asked it to be forgotten
    plan: AdapterPlan | None = None  # while PLACING: the pages it will take, worked out once
    waiters: list[Waiter] = field(default_factory=list)  # requests waiting for it to become resident
    nbytes: int = 0
    residency_mark: float = 0.0
    owner: Tenancy = DIRECT  # the tenant whose requests want it (the latest one's), for fair eviction
    demand: float = 0.0  # requests lately, fading (eviction.decayed) from demand_at
    demand_at: float = 0.0

    def wanted(self, now: float) -> None:
        """One more request wants it: its demand, faded to ``now``, grows by one."""
        self.demand = decayed(self.demand, now - self.demand_at) + 1.0
        self.demand_at = now


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
        audit: Callable[[AdapterAuditEvent], None] | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = engine.adapters  # residency, pages and references: asked, never copied
        self.fetcher = fetcher
        self.host = host
        self.limits = limits
        self.metrics = metrics
        self.post = post
        self.clock = clock
        self.audit = audit
        self._entries: dict[str, AdapterEntry] = {}
        self._placing: list[str] = []
        self._pinned: set[str] = set()  # keys of pinned entries
        self._executor = ThreadPoolExecutor(max_workers=load_workers, thread_name_prefix="adapter-loader")
        self._page_seconds: dict[str, float] = {}
        self._lock = threading.Lock()  # guards _page_seconds
        self.placement_blocked = False  # a placement waits for pages or a slot held by busy adapters

    # ----- requests' view -----------------------------------------------------------------------------

    def request_ended(self, key: str, now: float) -> None:
        """A request of ``key`` finished in the engine (which released its reference): idle time starts now."""
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.last_used = now
        self.host.touch(key, now)
        self._settle(entry, now)

    def is_resident(self, key: str) -> bool:
        return self.adapters.is_resident(key)

    def want(
        self,
        key: str,
        source: AdapterSource,
        waiter: Waiter,
        now: float,
        tenancy: Tenancy | None = None,
        *,
        reason: str = "request",
        cause: str | None = None,
    ) -> None:
        """Bring ``key`` into the pool; ``waiter`` hears how it went (at once if it is resident). A request's
        ``tenancy`` makes its tenant the adapter's owner and counts towards the adapter's demand. ``reason``
        (request or prefetch) and ``cause`` (the request or job) go into the audit trail if a load starts."""
        entry = self._entry(key, source)
        entry.last_used = now
        if tenancy is not None:
            entry.owner = tenancy
            entry.wanted(now)
        if self.adapters.is_resident(key):
            self.host.touch(key, now)
            waiter(None)
            return
        entry.waiters.append(waiter)
        if entry.state is not LoadState.IDLE:
            return  # already on its way: share that load
        entry.load_started = now
        entry.load_reason, entry.load_cause = reason, cause
        cached = self.host.get(key, now)
        if cached is not None:
            entry.load_tier = "host"
            self._queue_placement(entry, cached)
            return
        entry.state = LoadState.FETCHING
        entry.load_tier = "local" if isinstance(source, LocalSource) else "store"
        future = self._executor.submit(self._load, key, source)
        future.add_done_callback(lambda f: self.post(lambda: self._fetched(key, f)))

    def _load(self, key: str, source: AdapterSource) -> AdapterPlan:
        """On a loader thread: fetch, verify and parse the weights, then pack them for the pool, so the engine
        thread only copies pages."""
        return self.adapters.plan(key, self.fetcher.fetch(source))

    def pin(self, key: str, pinned: bool) -> None:
        """Pinned adapters are never evicted (neither idle TTL nor pressure)."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.pinned = pinned
            if pinned:
                self._pinned.add(key)
            else:
                self._pinned.discard(key)

    def forget(self, key: str, now: float, cause: str | None = None) -> None:
        """Drop ``key`` from every tier: at once where unused, otherwise when its last request ends."""
        entry = self._entries.get(key)
        if self.host.drop(key):
            self.metrics.adapter_evictions.labels("unload").inc()
            self._audit("evict", key, entry, tier="host", reason="unload", cause=cause)
        if entry is None:
            return
        entry.forgotten, entry.pinned, entry.unload_cause = True, False, cause
        self._pinned.discard(key)
        if entry.state is LoadState.PLACING:
            self._placing.remove(key)
            entry.plan = None
            entry.state = LoadState.IDLE
            self._fail(entry, ModelNotFound(f"adapter {key} was unloaded while it loaded", param="model"))
        self._settle(entry, now)

    def evict(self, key: str, now: float) -> bool:
        """Move an unused resident adapter out of the pool (it stays in host RAM); False if busy or absent."""
        entry = self._entries.get(key)
        if entry is None or not self.adapters.is_resident(key) or self.adapters.in_use(key):
            return False
        self._unload(entry, "manual", now)
        return True

    # ----- the engine thread's periodic work ------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Place fetched adapters, apply idle TTLs, account residency. Runs before every engine step, so it
        walks the pool's adapters (a few dozen) and never every adapter host RAM or the registry knows."""
        self._account(now)
        self._place_pending(now)
        for entry in self._resident_entries():
            idle = now - entry.last_used
            if self._evictable(entry) and idle >= self.limits.pool_idle_ttl:
                self._unload(entry, "idle", now)
        for key in self.host.expire(now, keep=self._host_keep()):
            self.metrics.adapter_evictions.labels("host_idle").inc()
            entry = self._entries.get(key)
            self._audit("evict", key, entry, tier="host", reason="host_idle")
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
        deadlines = [e.last_used + self.limits.pool_idle_ttl for e in self._resident_entries() if self._evictable(e)]
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

    def _resident_entries(self) -> list[AdapterEntry]:
        return [e for k in self.adapters.resident if (e := self._entries.get(k)) is not None]

    def _host_keep(self) -> set[str]:
        """Keys host RAM must hold on to whatever their age: in use, pinned, or about to be placed (an entry
        still fetching is not in host RAM yet; every other one with waiters is placing)."""
        in_use = {k for k in self.adapters.resident if self.adapters.in_use(k)}
        return in_use | self._pinned | set(self._placing)

    def _evictable(self, entry: AdapterEntry) -> bool:
        """Resident, and neither used by a request nor pinned."""
        key = entry.key
        return self.adapters.is_resident(key) and not self.adapters.in_use(key) and not entry.pinned

    def _fetched(self, key: str, future: Future[AdapterPlan]) -> None:
        now = self.clock()
        entry = self._entries.get(key)
        if entry is None:
            return
        try:
            plan = future.result()
        except LoraplexError as exc:
            log.info("adapter %s refused: %s", key, exc.message)
            self._fetch_failed(entry, exc, now)
            return
        except Exception as exc:
            log.exception("loading adapter %s failed", key)
            self._fetch_failed(entry, LoraplexError(f"loading adapter {key} failed: {exc}"), now)
            return
        self._audit("verify", key, entry, tier=entry.load_tier, reason="ok", cause=entry.load_cause)
        if entry.forgotten:
            self._fetch_failed(entry, ModelNotFound(f"adapter {key} was unloaded while it loaded", param="model"), now)
            return
        keep = self._pinned | set(self._placing)
        for evicted in self.host.put(key, plan, now, keep=keep):
            if evicted != key:
                self.metrics.adapter_evictions.labels("host_lru").inc()
                self._audit("evict", evicted, self._entries.get(evicted), tier="host", reason="host_lru")
        self._queue_placement(entry, plan)  # even if every asker left: it was wanted, and TTLs clean up

    def _fetch_failed(self, entry: AdapterEntry, error: LoraplexError, now: float) -> None:
        tier = entry.load_tier
        self._audit(
            "refuse", entry.key, entry, tier=tier, reason=error.code, cause=entry.load_cause, detail=error.message
        )
        entry.state = LoadState.IDLE
        self._fail(entry, error)
        self._settle(entry, now)

    def _queue_placement(self, entry: AdapterEntry, plan: AdapterPlan) -> None:
        """Queue a packed adapter to be placed as soon as its pages and a slot can be had."""
        entry.state = LoadState.PLACING
        entry.plan = plan
        entry.nbytes = plan.nbytes
        self._placing.append(entry.key)

    def _place_pending(self, now: float) -> None:
        self.placement_blocked = False
        for key in list(self._placing):
            entry = self._entries[key]
            plan = entry.plan
            assert plan is not None
            total = self.engine.pool.num_pages
            if plan.num_pages + self.limits.reserve_pages > total:
                self._placing.remove(key)
                entry.plan = None
                error = AdapterTooLarge(
                    f"adapter {entry.key} needs {plan.num_pages} pool pages; the pool has {total}"
                    f" ({self.limits.reserve_pages} kept for KV): start the server with a larger --pool-bytes",
                    param="model",
                )
                self._fetch_failed(entry, error, now)
                continue
            if not self._make_room(plan.num_pages, now):
                self.placement_blocked = True
                return  # first come, first placed: later ones wait behind it
            self._placing.remove(key)
            entry.plan = None
            try:
                self.adapters.place(key, plan)
            except LoraplexError as exc:
                self._fetch_failed(entry, exc, now)
                continue
            entry.state = LoadState.IDLE
            entry.residency_mark = entry.last_used = now
            self.metrics.adapter_loads.labels(entry.load_tier).inc()
            self._audit("load", key, entry, tier=entry.load_tier, reason=entry.load_reason, cause=entry.load_cause)
            self.metrics.adapter_load_seconds.observe(max(0.0, now - entry.load_started))
            waiters, entry.waiters = entry.waiters, []
            for waiter in waiters:
                waiter(None)

    def _make_room(self, needed: int, now: float) -> bool:
        """Evict what placing ``needed`` pages takes; False (evicting nothing) while busy adapters or KV hold it.
        Cached KV pages count as free: the pool reclaims them before any adapter (docs/prefix-caching.md)."""
        free = self.engine.pool.num_available
        slots_needed = max(0, len(self.adapters.resident) + 1 - self.limits.max_resident)
        pages_needed = max(0, needed + self.limits.reserve_pages - free)
        if not slots_needed and not pages_needed:
            return True
        victims = choose_victims(self._candidates(now), pages_needed, slots_needed)
        if victims is None:
            return False
        for victim in victims:  # unused by definition, so every unload succeeds and frees what was counted
            self._unload(self._entries[victim], "pressure", now)
        return True

    def _candidates(self, now: float) -> list[Candidate]:
        entries = [e for e in self._resident_entries() if self._evictable(e)]
        excess = self._owner_excess() if entries else {}
        return [
            Candidate(
                e.key,
                self._pages(e.key),
                e.nbytes,
                now - e.last_used,
                e.key in self.host,
                demand=decayed(e.demand, now - e.demand_at),
                owner_excess=excess.get(e.owner.tenant, 1.0),
            )
            for e in entries
        ]

    def _owner_excess(self) -> dict[str, float]:
        """How far each tenant is above its fair share of the pool: its KV pages and its adapters' pages."""
        loads = self.engine.tenant_loads()
        held = {tenant: load.kv_pages for tenant, load in loads.items()}
        weights = {tenant: load.weight for tenant, load in loads.items()}
        for key, adapter in self.adapters.resident.items():
            entry = self._entries.get(key)
            owner = DIRECT if entry is None else entry.owner
            held[owner.tenant] = held.get(owner.tenant, 0) + adapter.num_pages
            weights.setdefault(owner.tenant, owner.weight)
        return share_excess(held, weights)

    def _pages(self, key: str) -> int:
        adapter = self.adapters.get(key)
        return 0 if adapter is None else adapter.num_pages

    def _unload(self, entry: AdapterEntry, reason: str, now: float) -> None:
        self._account(now, entry)
        self.adapters.remove(entry.key)
        self.metrics.adapter_evictions.labels(reason).inc()
        cause = entry.unload_cause if reason == "unload" else None
        self._audit("evict", entry.key, entry, tier="pool", reason=reason, cause=cause)
        self._settle(entry, now)

    def _settle(self, entry: AdapterEntry, now: float) -> None:
        """Finish what an unused entry owes: a forgotten one leaves the pool; a cold one with nothing left goes."""
        if self.adapters.in_use(entry.key) or entry.waiters:
            return
        resident = self.adapters.is_resident(entry.key)
        if entry.forgotten and resident:
            self._unload(entry, "unload", now)
            return
        if not resident and entry.state is LoadState.IDLE and (entry.forgotten or entry.key not in self.host):
            self._entries.pop(entry.key, None)
            self._pinned.discard(entry.key)

    def _audit(self, action: str, key: str, entry: AdapterEntry | None, **facts: str | None) -> None:
        if self.audit is not None:
            self.audit(audit_event(action, key, entry.source if entry is not None else None, **facts))  # type: ignore[arg-type]

    def _fail(self, entry: AdapterEntry, error: LoraplexError) -> None:
        waiters, entry.waiters = entry.waiters, []
        for waiter in waiters:
            waiter(error)

    def _account(self, now: float, only: AdapterEntry | None = None) -> None:
        entries = [only] if only is not None else self._resident_entries()
        with self._lock:
            for e in entries:
                pages = self._pages(e.key)
                if pages:
                    self._page_seconds[e.key] = self._page_seconds.get(e.key, 0.0) + pages * (now - e.residency_mark)
                    e.residency_mark = now

    def snapshot(self) -> TierSnapshot:
        """What is where right now (engine thread; others read the copy the engine loop publishes)."""
        return TierSnapshot(
            resident={name: adapter.num_pages for name, adapter in self.adapters.resident.items()},
            host=self.host.keys(),
        )
