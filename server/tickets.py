"""A request between the HTTP handler (asyncio) and the engine loop, and what it cost.

The engine loop never touches asyncio objects directly: an in-process loop hands results to the handler's
event loop with ``call_soon_threadsafe``; the engine process sends them back over its pipe instead
(``server.engine_process``), through a ticket of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from core.errors import LoraplexError
from core.protocol import RequestStats
from server.adapters.registry import KnownAdapter
from server.engine import RequestOutput, SamplingParams
from server.engine.tenancy import DIRECT, Tenancy


def settle_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException | None = None,
                  result: Any = None) -> None:  # fmt: skip
    """Resolve ``future`` from any thread (no-op once it is done or its loop has closed)."""

    def settle() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody is waiting any more
        loop.call_soon_threadsafe(settle)


@dataclass(frozen=True)
class EngineRequest:
    """What the engine needs to run one completion request; crosses to the engine process as is."""

    request_id: str
    adapter: KnownAdapter | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic(): one clock for every process on the machine
    tenancy: Tenancy = DIRECT
    cache_salt: str | None = None
    cause: str | None = None  # request:<the API's request id>, for the audit trail of the loads it causes


@dataclass(eq=False)
class EngineTicket:
    """One request as the engine loop holds it: its accounting, and where admission and outputs go."""

    request: EngineRequest
    cold_start: bool = False
    adapter_ready_at: float | None = None
    started_at: float | None = None  # start of the first engine step that produced output for it
    last_token_at: float | None = None
    gpu_seconds: float = 0.0
    stats: RequestStats | None = field(default=None)  # set before the final output is delivered

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def adapter(self) -> KnownAdapter | None:
        return self.request.adapter

    @property
    def adapter_key(self) -> str | None:
        return self.adapter.key if self.adapter is not None else None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def arrival(self) -> float:
        return self.request.arrival

    @property
    def tenancy(self) -> Tenancy:
        return self.request.tenancy

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    def admit(self, error: LoraplexError | None = None) -> None:
        """Tell the handler the engine took the request (or why it never will)."""
        raise NotImplementedError

    def deliver(self, item: RequestOutput | LoraplexError) -> None:
        """Hand the handler one step's output (or the error that ends the request)."""
        raise NotImplementedError

    def finish_stats(self, replica: str) -> RequestStats:
        """What this request cost, for metering (called once, when it finishes)."""
        load_ms = None
        if self.cold_start and self.adapter_ready_at is not None:
            load_ms = (self.adapter_ready_at - self.arrival) * 1000.0
        started = self.started_at if self.started_at is not None else self.arrival
        self.stats = RequestStats(
            replica=replica,
            cold_start=self.cold_start,
            adapter_load_ms=load_ms,
            queue_ms=max(0.0, started - self.arrival) * 1000.0,
            gpu_seconds=self.gpu_seconds,
        )
        return self.stats


@dataclass(eq=False)
class Ticket(EngineTicket):
    """A request as its HTTP handler holds it: admission and outputs arrive on the handler's event loop."""

    loop: asyncio.AbstractEventLoop = field(kw_only=True)
    admitted: asyncio.Future[None] = field(kw_only=True)
    outputs: asyncio.Queue[RequestOutput | LoraplexError] = field(kw_only=True)

    @classmethod
    def create(cls, request: EngineRequest) -> Ticket:
        """A ticket bound to the running event loop (call from the handler)."""
        loop = asyncio.get_running_loop()
        return cls(request, loop=loop, admitted=loop.create_future(), outputs=asyncio.Queue())

    def admit(self, error: LoraplexError | None = None) -> None:
        settle_future(self.loop, self.admitted, error)

    def deliver(self, item: RequestOutput | LoraplexError) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
