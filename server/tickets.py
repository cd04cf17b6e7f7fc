"""A request between the HTTP handler (asyncio) and the engine thread, and what it cost.

The engine thread never touches asyncio objects directly: it hands results to the handler's event loop
with ``call_soon_threadsafe``.
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


@dataclass(eq=False)
class Ticket:
    """One completion request: created by the handler, queued, admitted and stepped by the engine thread."""

    request_id: str
    adapter: KnownAdapter | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # monotonic
    loop: asyncio.AbstractEventLoop
    admitted: asyncio.Future[None]
    outputs: asyncio.Queue[RequestOutput | LoraplexError]
    tenancy: Tenancy = DIRECT
    cache_salt: str | None = None
    cold_start: bool = False
    adapter_ready_at: float | None = None
    started_at: float | None = None  # start of the first engine step that produced output for it
    last_token_at: float | None = None
    gpu_seconds: float = 0.0
    stats: RequestStats | None = field(default=None)  # set before the final output is delivered

    @classmethod
    def create(
        cls,
        request_id: str,
        adapter: KnownAdapter | None,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        tenancy: Tenancy = DIRECT,
        cache_salt: str | None = None,
    ) -> Ticket:
        """A ticket bound to the running event loop (call from the handler)."""
        loop = asyncio.get_running_loop()
        return cls(
            request_id,
            adapter,
            prompt,
            params,
            arrival,
            loop,
            loop.create_future(),
            asyncio.Queue(),
            tenancy,
            cache_salt,
        )

    @property
    def adapter_key(self) -> str | None:
        return self.adapter.key if self.adapter is not None else None

    def admit(self, error: LoraplexError | None = None) -> None:
        """Tell the handler the engine took the request (or why it never will)."""
        settle_future(self.loop, self.admitted, error)

    def deliver(self, item: RequestOutput | LoraplexError) -> None:
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)

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
