"""Noticing that a client went away, so its request stops using the engine and frees its pages.

Waiting (for an adapter, for admission) and non-streaming generation race a listener on the ASGI
``receive`` channel (``core.disconnect.unless_disconnected``); streams use :class:`EventStream`, which
listens while it sends, whatever ASGI spec version the server speaks.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from core.disconnect import wait_for_disconnect


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
                await wait_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()
