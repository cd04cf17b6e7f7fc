"""The engine process's side of ``server.engine_process``: the engine loop, its adapter tiers, and the pipe.

The loop here is the same ``EngineLoop`` a server runs in-process; only its tickets and metrics differ. A
ticket's admission and outputs, counter increments, histogram observations and the published pool view are
queued as the engine thread produces them and sent in one message at the end of each loop iteration, so
the engine thread pays one pickle and one write per step, and the HTTP process sees a step's metrics and
pool before its outputs (as an in-process scrape would).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, cast

from core.errors import LoraplexError
from core.protocol import AdapterAuditEvent
from core.settings import LOG_FORMAT
from core.storage import ObjectStore
from server.config import ServerConfig
from server.engine import RequestOutput
from server.engine_loop import EngineLoop, PoolView
from server.local_engine import LocalEngine
from server.metrics import ServerMetrics
from server.tickets import EngineRequest, EngineTicket

log = logging.getLogger(__name__)

Message = tuple[Any, ...]


class Outbox:
    """What the engine process has to tell the HTTP process, sent in batches by ``flush``.

    ``put`` and the metric methods may be called from any thread (loader threads count evictions); ``flush``
    runs on the engine thread only.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._messages: list[Message] = []
        self._increments: dict[tuple[str, tuple[str, ...]], float] = {}
        self._observations: dict[str, list[float]] = {}
        self._view_sent: PoolView | None = None
        self.view: Callable[[], PoolView] | None = None  # the loop's published view, sent when it changed

    def put(self, message: Message) -> None:
        with self._lock:
            self._messages.append(message)

    def increment(self, name: str, labels: tuple[str, ...], amount: float) -> None:
        with self._lock:
            key = (name, labels)
            self._increments[key] = self._increments.get(key, 0.0) + amount

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self._observations.setdefault(name, []).append(value)

    def audit(self, event: AdapterAuditEvent) -> None:
        self.put(("audit", event))

    def flush(self) -> None:
        with self._lock:
            messages, self._messages = self._messages, []
            increments, self._increments = self._increments, {}
            observations, self._observations = self._observations, {}
        batch: list[Message] = []
        if increments or observations:
            batch.append(("metrics", (increments, observations)))
        view = self.view() if self.view is not None else None
        if view is not None and view != self._view_sent:
            batch.append(("view", view))
            self._view_sent = view
        batch += messages
        if batch:
            self.send(batch)

    def send(self, batch: list[Message]) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, EOFError):  # the HTTP process is gone:
            self._conn.send(batch)  # the reader sees EOF and stops the loop


class RelayedMetric:
    """A counter or histogram of ``ServerMetrics`` whose updates go to the HTTP process."""

    def __init__(self, outbox: Outbox, name: str, labels: tuple[str, ...] = ()) -> None:
        self._outbox, self._name, self._labels = outbox, name, labels

    def labels(self, *values: str) -> RelayedMetric:
        return RelayedMetric(self._outbox, self._name, values)

    def inc(self, amount: float = 1.0) -> None:
        self._outbox.increment(self._name, self._labels, amount)

    def observe(self, value: float) -> None:
        self._outbox.observe(self._name, value)


class RelayedMetrics:
    """Stands in for ``ServerMetrics`` in the engine process: the same attributes, relayed."""

    def __init__(self, outbox: Outbox) -> None:
        for name in ServerMetrics.ENGINE_UPDATED:
            setattr(self, name, RelayedMetric(outbox, name))


@dataclass(eq=False)
class RelayedTicket(EngineTicket):
    """A request in the engine process: admission and outputs go back over the pipe, keyed by request id."""

    outbox: Outbox = field(kw_only=True)
    on_end: Callable[[str], None] = field(kw_only=True)
    _start_sent: bool = field(default=False, kw_only=True)

    def admit(self, error: LoraplexError | None = None) -> None:
        self.outbox.put(("admitted", self.request_id, error))
        if error is not None:
            self.on_end(self.request_id)

    def deliver(self, item: RequestOutput | LoraplexError) -> None:
        if isinstance(item, LoraplexError):
            self.outbox.put(("error", self.request_id, item))
            self.on_end(self.request_id)
            return
        started = None
        if not self._start_sent and self.started_at is not None:
            started, self._start_sent = self.started_at, True
        # The HTTP side has the prompt: it is not sent again with every step.
        output = replace(item, prompt_token_ids=[])
        self.outbox.put(("output", self.request_id, output, started, self.stats if item.finished else None))
        if item.finished:
            self.on_end(self.request_id)


class EngineService:
    """Runs one engine loop for the HTTP process at the other end of ``conn``."""

    def __init__(self, local: LocalEngine, outbox: Outbox) -> None:
        self.local = local
        self.loop: EngineLoop = local.loop
        self.outbox = outbox
        self._tickets: dict[str, RelayedTicket] = {}
        self.loop.on_adapter_error = lambda known, error: outbox.put(("adapter_error", known, error))
        self.loop.on_iteration = outbox.flush
        outbox.view = lambda: self.loop.view

    def handle(self, message: Message) -> bool:
        """Act on one message from the HTTP process; False once told to stop."""
        kind = message[0]
        if kind == "submit":
            request: EngineRequest = message[1]
            ticket = RelayedTicket(request, outbox=self.outbox, on_end=self._end)
            self._tickets[request.request_id] = ticket
            try:
                self.loop.submit(ticket)
            except LoraplexError as exc:  # the loop has stopped: the HTTP side hears when this process ends
                ticket.admit(exc)
        elif kind == "cancel":
            cancelled = self._tickets.get(message[1])
            if cancelled is not None:
                self.loop.cancel(cancelled)
        elif kind == "want":
            _, call, known, pinned, cause = message
            self.loop.request_adapter(known, partial(self._answer, call), pinned=pinned, cause=cause)
        elif kind == "forget":
            self.loop.forget(message[1], message[2])
        elif kind == "residency":
            call = message[1]
            self.loop.post(lambda: self.outbox.put(("answer", call, self.loop.drain_residency())))
        elif kind == "stop":
            return False
        return True

    def _answer(self, call: int, value: Any) -> None:
        self.outbox.put(("answer", call, value))

    def _end(self, request_id: str) -> None:
        self._tickets.pop(request_id, None)


def serve(config: ServerConfig, store: ObjectStore | None, conn: Connection, log_level: int) -> None:
    """The engine process's main: build the engine, say it is ready (or why it cannot be), run the loop until
    the HTTP process says stop or goes away, then say how the loop ended."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    # Ctrl-C, or a supervisor's SIGTERM to the whole group, is the HTTP process's to handle: it drains its streams
    # (which needs this loop) and then stops us; if it dies instead, the pipe's end stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    outbox = Outbox(conn)
    try:
        local = LocalEngine(config, cast(ServerMetrics, RelayedMetrics(outbox)), store, outbox.audit)
    except Exception as exc:
        outbox.send([("failed", _picklable(exc))])
        return
    service = EngineService(local, outbox)
    outbox.send([("ready", local.front, local.loop.view)])
    local.loop.start()
    reader = threading.Thread(target=_read, args=(conn, service), name="engine-process-reader", daemon=True)
    reader.start()
    local.loop.join()
    failure = local.loop.failure
    outbox.send([("closed", _picklable(failure) if failure is not None else None)])
    local.close()


def _read(conn: Connection, service: EngineService) -> None:
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                log.info("the HTTP process went away; stopping the engine")
                return
            if not service.handle(message):
                return
    finally:
        service.loop.stop()


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` if it survives the pipe, else a RuntimeError that names it."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
