"""The engine loop in a process of its own, driven from the HTTP process like an in-process ``EngineLoop``.

Why: in one process the engine thread shares the GIL with the HTTP thread, which renders and streams every
token; each time the HTTP side holds the interpreter, a step waits, and inter-token latency grows a tail
that the schedule cannot remove. vLLM splits its engine core from its API server for the same reason. Here
the HTTP process keeps what is per request and cheap (tokenizing, rendering, the adapter names, metrics) and
the engine process owns the engine, the adapter tiers and the loader threads (``server.engine_child``).

The two talk over one ``multiprocessing`` pipe, in pickled tuples:

- HTTP → engine: ``("submit", EngineRequest)``, ``("cancel", request_id)``, ``("want", call, adapter,
  pinned, cause)``, ``("forget", key, cause)``, ``("residency", call)``, ``("stop",)``.
- engine → HTTP, as lists sent once per loop iteration: ``("metrics", updates)``, ``("view", PoolView)``,
  ``("admitted", request_id, error)``, ``("output", request_id, output, started_at, stats)``, ``("error",
  request_id, error)``, ``("adapter_error", adapter, error)``, ``("audit", AdapterAuditEvent)``, ``("answer",
  call, value)``; at start
  ``("ready", front, view)`` or ``("failed", error)``, at the end ``("closed", failure)``.

Counts of waiting and running requests are kept here, from the same events the in-process loop counts, so
``submit`` refuses a full queue at once, without a round trip.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from core.errors import LoraplexError, ServiceUnavailable
from core.protocol import AdapterAuditEvent
from core.storage import ObjectStore
from server.adapters.registry import KnownAdapter
from server.config import ServerConfig
from server.engine.front import EngineFront
from server.engine_child import Message, serve
from server.engine_loop import LoadCounts, PoolView, engine_unavailable, queue_full
from server.metrics import ServerMetrics
from server.tickets import Ticket, settle_future

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
RESIDENCY_TIMEOUT_S = 5.0


class _Phase(Enum):
    QUEUED = "queued"  # sent; not yet admitted into the engine
    ADMITTED = "admitted"  # in the engine, no output yet (still counted as waiting, as the loop counts it)
    RUNNING = "running"


@dataclass(eq=False)
class _Tracked:
    ticket: Ticket
    phase: _Phase = _Phase.QUEUED


class EngineProcess:
    """Starts the engine process and waits until it is ready (or raises why it could not start)."""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics, store: ObjectStore | None) -> None:
        self.metrics = metrics
        self.max_waiting = config.max_waiting
        self.on_adapter_error: Callable[[KnownAdapter, LoraplexError], None] | None = None
        self.on_audit: Callable[[AdapterAuditEvent], None] | None = None  # what the adapter tiers did
        self.failure: BaseException | None = None
        context = multiprocessing.get_context("spawn")  # a fork would copy this process's threads' locks
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=serve,
            args=(config, store, child_conn, logging.getLogger().getEffectiveLevel()),
            name=f"engine-{config.replica_id}",
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # ours closed, the child's end is its only one: its exit reads as EOF here
        # Registered after multiprocessing's own exit hook, so it runs first: that hook terminates daemonic children
        # and then joins them without a timeout, and the engine process ignores SIGTERM.
        atexit.register(self._kill_if_alive)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards what follows
        self._tracked: dict[str, _Tracked] = {}
        self._waiting = 0
        self._running = 0
        self._answers: dict[int, Callable[[Any], None]] = {}
        self._calls = itertools.count()
        self._closed = False
        self._residency: dict[str, float] = {}
        self._residency_ready = threading.Condition(self._lock)
        self.front, self.view = self._await_ready()
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)

    def _await_ready(self) -> tuple[EngineFront, PoolView]:
        try:
            (message,) = self._conn.recv()
        except (EOFError, OSError):
            self._reap()
            self._conn.close()
            raise ServiceUnavailable(
                f"the engine process exited with code {self._process.exitcode} before it was ready; see its log",
                code="engine_failed",
            ) from None
        if message[0] == "failed":
            self._reap()
            self._conn.close()
            raise message[1]
        _, front, view = message
        return front, view

    # ----- the loop's interface --------------------------------------------------------------------------

    def start(self) -> None:
        self._reader.start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Ask the engine process to stop, and make sure it has: it is killed when it does not in time."""
        with contextlib.suppress(ServiceUnavailable):
            self._send(("stop",))
        self._reap(timeout)
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self.failure is None and self._process.is_alive()

    def counts(self) -> LoadCounts:
        with self._lock:
            return LoadCounts(self._running, self._waiting)

    def submit(self, ticket: Ticket) -> None:
        """Queue a request; ``RateLimited`` when the waiting queue is full. Admission is reported on the ticket."""
        with self._lock:
            if self._closed:
                raise engine_unavailable(self.failure)
            if self._waiting >= self.max_waiting:
                raise queue_full(self._waiting, self.max_waiting)
            self._waiting += 1
            self._tracked[ticket.request_id] = _Tracked(ticket)
        self._send(("submit", ticket.request))

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request whose client went away (or that ended: then nothing happens)."""
        if ticket.request_id in self._tracked:
            with contextlib.suppress(ServiceUnavailable):
                self._send(("cancel", ticket.request_id))

    def wait_resident(
        self, adapter: KnownAdapter, *, pinned: bool | None = None, cause: str | None = None
    ) -> asyncio.Future[None]:
        """Load ``adapter`` into the pool; the future fails with the reason it cannot be loaded."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(error: LoraplexError | None) -> None:
            settle_future(loop, future, error)

        self._call(lambda call: ("want", call, adapter, pinned, cause), settle)
        return future

    def forget(self, key: str, cause: str | None = None) -> None:
        """Unload an adapter from every tier once no request uses it."""
        with contextlib.suppress(ServiceUnavailable):
            self._send(("forget", key, cause))

    def drain_residency(self) -> dict[str, float]:
        """Page-seconds per adapter key in the pool since the last call. An answer that comes too late is
        kept for the next call, so no residency is lost, only reported a heartbeat later."""
        with contextlib.suppress(ServiceUnavailable):
            self._call(lambda call: ("residency", call), self._add_residency)
        with self._residency_ready:
            if not self._residency and not self._closed:
                self._residency_ready.wait(RESIDENCY_TIMEOUT_S)
            drained, self._residency = self._residency, {}
        return drained

    # ----- internals ---------------------------------------------------------------------------------------

    def _kill_if_alive(self) -> None:
        if self._process.is_alive():
            self._process.kill()  # it ignores SIGTERM (see server.engine_child.serve)
            self._process.join(STOP_TIMEOUT_S)

    def _reap(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Make sure the engine process has ended: it is killed if it has not within ``timeout``."""
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not end within %.0f s; killing it", timeout)
            self._kill_if_alive()
        atexit.unregister(self._kill_if_alive)

    def _send(self, message: Message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise engine_unavailable(self.failure) from exc

    def _call(self, message: Callable[[int], Message], answer: Callable[[Any], None]) -> None:
        """Send a request that the engine process answers with ``("answer", call, value)``."""
        with self._lock:
            closed = self._closed
            call = next(self._calls)
            if not closed:
                self._answers[call] = answer
        if closed:
            answer(engine_unavailable(self.failure))
            return
        try:
            self._send(message(call))
        except ServiceUnavailable as exc:
            with self._lock:
                pending = self._answers.pop(call, None)
            if pending is not None:
                pending(exc)

    def _add_residency(self, seconds: dict[str, float] | LoraplexError) -> None:
        if isinstance(seconds, LoraplexError):
            return
        with self._residency_ready:
            for key, value in seconds.items():
                self._residency[key] = self._residency.get(key, 0.0) + value
            self._residency_ready.notify_all()

    def _read(self) -> None:
        try:
            while True:
                try:
                    batch = self._conn.recv()
                except (EOFError, OSError):
                    return
                for message in batch:
                    self._handle(message)
        except Exception:  # a bug here must not leave requests hanging: they are failed below
            log.exception("reading from the engine process failed")
        finally:
            self._lost()

    def _handle(self, message: Message) -> None:
        kind = message[0]
        if kind == "metrics":
            self.metrics.apply(message[1])  # before the view and outputs sent with them
        elif kind == "view":
            self.view = message[1]
        elif kind == "admitted":
            self._admitted(message[1], message[2])
        elif kind == "output":
            self._output(*message[1:])
        elif kind == "error":
            with self._lock:
                tracked = self._tracked.pop(message[1], None)
            if tracked is not None:
                tracked.ticket.deliver(message[2])
        elif kind == "audit":
            if self.on_audit is not None:
                self.on_audit(message[1])
        elif kind == "adapter_error":
            if self.on_adapter_error is not None:
                self.on_adapter_error(message[1], message[2])
        elif kind == "answer":
            with self._lock:
                answer = self._answers.pop(message[1], None)
            if answer is not None:
                answer(message[2])
        elif kind == "closed":
            self.failure = message[1]
            if self.failure is not None:
                log.error("the engine process's loop failed: %s", self.failure)

    def _admitted(self, request_id: str, error: LoraplexError | None) -> None:
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                return
            if error is None:
                tracked.phase = _Phase.ADMITTED
            elif tracked.phase is _Phase.QUEUED:
                self._waiting -= 1
                del self._tracked[request_id]
        tracked.ticket.admit(error)

    def _output(self, request_id: str, output: Any, started_at: float | None, stats: Any) -> None:
        with self._lock:
            tracked = self._tracked.get(request_id)
            if tracked is None:
                return
            ticket = tracked.ticket
            if started_at is not None and tracked.phase is not _Phase.RUNNING:
                tracked.phase = _Phase.RUNNING
                ticket.started_at = started_at
                self._waiting -= 1
                self._running += 1
            if output.finished:
                del self._tracked[request_id]
                self._running -= 1
        output.prompt_token_ids = ticket.prompt_token_ids
        if stats is not None:
            ticket.stats = stats
        ticket.deliver(output)

    def _lost(self) -> None:
        """The engine process is gone (stopped, failed or killed): answer everything still waiting on it."""
        with self._lock:
            self._closed = True
            tracked, self._tracked = list(self._tracked.values()), {}
            answers, self._answers = list(self._answers.values()), {}
            self._waiting = self._running = 0
        self._process.join(1.0)
        if self.failure is None and self._process.exitcode not in (0, None):
            self.failure = RuntimeError(f"the engine process exited with code {self._process.exitcode}")
        error = engine_unavailable(self.failure)
        for item in tracked:
            item.ticket.admit(error)  # no-op for admitted tickets
            item.ticket.deliver(error)
        for answer in answers:
            answer(error)
        with self._residency_ready:
            self._residency_ready.notify_all()
