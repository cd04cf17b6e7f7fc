"""Noticing that a client went away, so its request stops using the engine and frees its pages.

Waiting (for an adapter, for admission) and non-streaming generation race a listener on the ASGI
``receive`` channel; streams use :class:`EventStream`, which listens while it sends, whatever ASGI spec
version the server speaks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from server.engine_loop import ClientGone

T = TypeVar("T")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; raise ``ClientGone`` (cancelling it) if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientGone("the client disconnected")
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events that stop (running ``on_close``) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(events, headers={"cache-control": "no-cache", **headers})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):  # the client went away mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _disconnected(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()
