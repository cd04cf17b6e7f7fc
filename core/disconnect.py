"""Racing a request's work against its client going away, for the API and the inference servers alike.

Both answer over ASGI: once the request body has been read, the next message on the ``receive`` channel is
``http.disconnect``, sent when the client closes its connection. Waiting on it beside the work lets the
work stop (and free what it holds: engine pages, a replica's slot) the moment nobody wants the answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from core.errors import ClientGone

T = TypeVar("T")
Receive = Callable[[], Awaitable[Mapping[str, Any]]]


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``; if the client disconnects first, cancel it, let it clean up, and raise
    ``ClientGone``."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    gone = True
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        gone = task not in done
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Its cleanup (closing an upstream response, cancelling a ticket) runs before we go on; a
            # cancellation of our own while it runs still reaches it, as the task is already cancelled.
            await asyncio.wait({task})
    if gone:
        raise ClientGone("the client disconnected")
    return task.result()
