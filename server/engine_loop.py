"""The engine thread: admits queued requests, steps the engine, hands outputs back, runs the adapter tiers.

Everything that changes the pool -- steps, adapter placement and eviction -- happens on this one thread,
in order, so none of it races. Other threads talk to it by posting closures (``post``). A request whose
adapter is not resident waits here, outside the running batch, while the adapter loads on the loader
threads; the engine keeps stepping for everyone else meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from core.errors import ClientGone, LoraplexError, RateLimited, ServiceUnavailable
from server.adapters.manager import AdapterManager, TierSnapshot, Waiter
from server.adapters.registry import KnownAdapter
from server.engine import LLMEngine, RequestOutput
from server.engine.tenancy import TenantLoad
from server.memory.pool import PoolStats
from server.metrics import ServerMetrics
from server.tickets import EngineTicket, settle_future

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0  # idle wake-up, for residency accounting and TTLs when nothing else happens
RETRY_AFTER_S = 1.0
TENANT_LOADS_S = 0.25  # how fresh the per-tenant loads in metrics and heartbeats are


@dataclass(frozen=True)
class LoadCounts:
    running: int
    waiting: int


@dataclass(frozen=True)
class PoolView:
    """Pool pages and adapter tiers from the same moment, for metrics and heartbeats on other threads."""

    pool: PoolStats
    tiers: TierSnapshot
    tenants: Mapping[str, TenantLoad] = field(default_factory=dict)  # refreshed every TENANT_LOADS_S


class EngineLoop:
    """Owns the engine and the adapter manager on a background thread."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: ServerMetrics,
        replica_id: str,
        *,
        max_waiting: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.replica_id = replica_id
        self.max_waiting = max_waiting
        self.clock = clock
        self.manager: AdapterManager | None = None  # attached before start (it needs ``post``)
        # Told when an adapter cannot be loaded, e.g. to stop listing a broken one.
        self.on_adapter_error: Callable[[KnownAdapter, LoraplexError], None] | None = None
        # Called on the engine thread at the end of every iteration and once at exit: the engine process
        # sends what the iteration produced (admissions, outputs, metrics, the pool view) in one message.
        self.on_iteration: Callable[[], None] | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._closed = False  # set (under _counts_lock) when the thread exits: nothing posted after runs
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._pending: list[EngineTicket] = []  # not yet in the engine: waiting for their adapter to become resident
        self._admitted: dict[str, EngineTicket] = {}
        self._counts_lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.failure: BaseException | None = None
        self.view = PoolView(engine.pool_stats(), TierSnapshot())  # republished every iteration
        self._prefix_counted = engine.prefix_cache_stats()  # already added to the prefix cache counters
        self._tenants_at = -TENANT_LOADS_S

    # ----- any thread ----------------------------------------------------------------------------------

    def start(self) -> None:
        assert self.manager is not None, "attach the adapter manager first"
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (after ``stop``, or a failure)."""
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed and self.failure is None and not self._stop.is_set()

    def counts(self) -> LoadCounts:
        with self._counts_lock:
            return LoadCounts(self._running, self._waiting)

    def post(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the engine thread, between steps; ``ServiceUnavailable`` once the thread has ended."""
        with self._counts_lock:
            if self._closed:
                raise self._unavailable()
            self._inbox.put(job)
        self._wake.set()

    def submit(self, ticket: EngineTicket) -> None:
        """Queue a request; ``RateLimited`` when the waiting queue is full. Admission is reported on the ticket."""
        with self._counts_lock:
            if self._closed or not self._thread.is_alive():
                raise self._unavailable()
            if self._waiting >= self.max_waiting:
                raise queue_full(self._waiting, self.max_waiting)
            self._waiting += 1
            self._inbox.put(lambda: self._on_submit(ticket))
        self._wake.set()

    def cancel(self, ticket: EngineTicket) -> None:
        """Drop a request whose client went away: unqueue it, or abort it in the engine (freeing its pages)."""
        with contextlib.suppress(ServiceUnavailable):  # the thread ended and answered every ticket already
            self.post(lambda: self._on_cancel(ticket))

    def request_adapter(
        self, adapter: KnownAdapter, waiter: Waiter, *, pinned: bool | None = None, cause: str | None = None
    ) -> None:
        """Load ``adapter`` into the pool (a prefetch, in the audit trail, caused by ``cause``); ``waiter`` runs
        on the engine thread with the outcome."""
        manager = self.manager
        assert manager is not None

        def outcome(error: LoraplexError | None) -> None:
            if error is not None:
                self._adapter_failed(adapter, error)
            waiter(error)

        def job() -> None:
            manager.want(adapter.key, adapter.source, outcome, self.clock(), reason="prefetch", cause=cause)
            if pinned is not None:
                manager.pin(adapter.key, pinned)

        try:
            self.post(job)
        except ServiceUnavailable as exc:
            waiter(exc)

    def wait_resident(
        self, adapter: KnownAdapter, *, pinned: bool | None = None, cause: str | None = None
    ) -> asyncio.Future[None]:
        """:meth:`request_adapter` for the event loop: the future fails with the reason it cannot be loaded."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        self.request_adapter(adapter, lambda e: settle_future(loop, future, e), pinned=pinned, cause=cause)
        return future

    def drain_residency(self) -> dict[str, float]:
        """Page-seconds per adapter key in the pool since the last call."""
        assert self.manager is not None
        return self.manager.drain_residency()

    def forget(self, key: str, cause: str | None = None) -> None:
        """Unload an adapter from every tier once no request uses it (``cause``: who asked, for the audit)."""
        manager = self.manager
        assert manager is not None
        with contextlib.suppress(ServiceUnavailable):  # nothing is loaded any more anyway
            self.post(lambda: manager.forget(key, self.clock(), cause))

    # ----- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        manager = self.manager
        assert manager is not None
        try:
            while not self._stop.is_set():
                self._wake.clear()
                now = self.clock()
                self._drain_inbox()
                manager.tick(now)
                # A placement waiting for pages gets them as running requests finish: start nothing new meanwhile.
                self.engine.hold_admissions(manager.placement_blocked)
                self._publish()
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._end_iteration()
                else:
                    self._end_iteration()
                    deadline = manager.next_deadline()
                    timeout = IDLE_WAKE_S if deadline is None else min(IDLE_WAKE_S, max(deadline - now, 0.0) + 1e-3)
                    self._wake.wait(timeout)
        except Exception as exc:  # a bug or a device failure: stop serving rather than serve wrong answers
            log.exception("engine loop failed; the server is no longer ready")
            self.failure = exc
        finally:
            with self._counts_lock:
                self._closed = True
            self._close(manager)

    def _close(self, manager: AdapterManager) -> None:
        """Answer every request still here (and any that arrived meanwhile): the engine is gone."""
        error = self._unavailable()
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                break
            with contextlib.suppress(Exception):
                job()  # submissions join _pending; other jobs are harmless now
        self._fail_all(error)
        manager.close()
        self._end_iteration()

    def _end_iteration(self) -> None:
        if self.on_iteration is not None:
            self.on_iteration()

    def _drain_inbox(self) -> None:
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            job()

    def _on_submit(self, ticket: EngineTicket) -> None:
        manager = self.manager
        assert manager is not None
        self._pending.append(ticket)
        if ticket.adapter is None:
            self._admit(ticket)
            return
        key, source = ticket.adapter.key, ticket.adapter.source
        ticket.cold_start = not manager.is_resident(key)
        # ``want`` answers at once when the adapter is resident, else once it is placed (or cannot be).
        manager.want(
            key,
            source,
            lambda error: self._adapter_ready(ticket, error),
            self.clock(),
            ticket.tenancy,
            cause=ticket.request.cause,
        )

    def _adapter_ready(self, ticket: EngineTicket, error: LoraplexError | None) -> None:
        if error is not None and ticket.adapter is not None:
            self._adapter_failed(ticket.adapter, error)
        if ticket not in self._pending:
            return  # the client left while the adapter loaded
        if error is not None:
            self._drop_pending(ticket, error)
            return
        if ticket.cold_start and ticket.adapter_ready_at is None:
            ticket.adapter_ready_at = self.clock()
        self._admit(ticket)
        self._wake.set()

    def _adapter_failed(self, adapter: KnownAdapter, error: LoraplexError) -> None:
        if self.on_adapter_error is not None:
            self.on_adapter_error(adapter, error)

    def _on_cancel(self, ticket: EngineTicket) -> None:
        if ticket in self._pending:
            self._drop_pending(ticket, ClientGone("the client disconnected"))
        elif ticket.request_id in self._admitted:
            self.engine.abort_request(ticket.request_id)

    def _drop_pending(self, ticket: EngineTicket, error: LoraplexError) -> None:
        self._pending.remove(ticket)
        with self._counts_lock:
            self._waiting -= 1
        ticket.admit(error)

    def _admit(self, ticket: EngineTicket) -> None:
        """Hand a request whose adapter is resident (or that has none) to the engine; its scheduler decides
        when it runs. Done in the same turn the adapter is found resident: from then on the request holds
        the adapter in the engine, so no placement can evict it first."""
        try:
            self.engine.add_request(
                ticket.request_id,
                ticket.prompt_token_ids,
                ticket.params,
                ticket.adapter_key,
                arrival_time=ticket.arrival,
                cache_salt=ticket.cache_salt,
                tenancy=ticket.tenancy,
            )
        except LoraplexError as exc:
            self._drop_pending(ticket, exc)
            return
        self._pending.remove(ticket)
        self._admitted[ticket.request_id] = ticket
        self.metrics.prompt_tokens.inc(len(ticket.prompt_token_ids))
        ticket.admit()

    def _step(self) -> None:
        manager = self.manager
        assert manager is not None
        started = self.clock()
        outputs = self.engine.step()
        now = self.clock()
        if self.engine.kv_starved():
            manager.relieve_pressure(now)
        prefix, counted = self.engine.prefix_cache_stats(), self._prefix_counted
        self.metrics.prefix_cache_queries.inc(prefix.queried_tokens - counted.queried_tokens)
        self.metrics.prefix_cache_hits.inc(prefix.hit_tokens - counted.hit_tokens)
        self._prefix_counted = prefix
        self._publish()  # before answering, so a client that then scrapes sees this step's pool
        share = (now - started) / max(1, len(outputs))
        for out in outputs:
            self._on_output(out, started, now, share)

    def _on_output(self, out: RequestOutput, step_start: float, now: float, share: float) -> None:
        ticket = self._admitted.get(out.request_id)
        if ticket is None:
            return
        if ticket.started_at is None:
            ticket.started_at = step_start
            with self._counts_lock:
                self._waiting -= 1
                self._running += 1
        ticket.gpu_seconds += share
        new_tokens = sum(len(c.new_token_ids) for c in out.outputs)
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if ticket.last_token_at is None:
                self.metrics.time_to_first_token.observe(now - ticket.arrival)
            else:
                self.metrics.inter_token_latency.observe(now - ticket.last_token_at)
            ticket.last_token_at = now
        if out.finished:
            del self._admitted[out.request_id]
            with self._counts_lock:
                self._running -= 1
            self.metrics.e2e_request_latency.observe(now - ticket.arrival)
            if ticket.adapter is not None and self.manager is not None:
                self.manager.request_ended(ticket.adapter.key, now)
            ticket.finish_stats(self.replica_id)
        ticket.deliver(out)

    def _publish(self) -> None:
        assert self.manager is not None
        now = self.clock()
        tenants = self.view.tenants
        if now - self._tenants_at >= TENANT_LOADS_S:  # walks every sequence: not at every step
            tenants, self._tenants_at = self._tenant_loads(), now
        self.view = PoolView(self.engine.pool_stats(), self.manager.snapshot(), tenants)

    def _tenant_loads(self) -> dict[str, TenantLoad]:
        loads = self.engine.tenant_loads()
        for ticket in self._pending:  # waiting for their adapter, before the engine has them
            loads.setdefault(ticket.tenancy.tenant, TenantLoad()).waiting += ticket.params.n
        return loads

    def _fail_all(self, error: LoraplexError) -> None:
        for ticket in list(self._pending):
            ticket.admit(error)
        for ticket in self._admitted.values():
            ticket.admit(error)
            ticket.deliver(error)
        self._pending.clear()
        self._admitted.clear()

    def _unavailable(self) -> ServiceUnavailable:
        return engine_unavailable(self.failure)


def queue_full(waiting: int, limit: int) -> RateLimited:
    return RateLimited(
        f"{waiting} requests are already waiting (the limit is {limit}); retry shortly",
        retry_after=RETRY_AFTER_S,
        code="server_overloaded",
    )


def engine_unavailable(failure: BaseException | None) -> ServiceUnavailable:
    if failure is not None:
        return ServiceUnavailable(f"the inference engine failed: {failure}", code="engine_failed")
    return ServiceUnavailable("the inference engine is not running", code="engine_not_running")
