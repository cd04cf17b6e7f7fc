"""Relaying a replica's SSE stream to the client as it arrives, rewriting only what the contract requires:
``STATS_FIELD`` is taken out (it is for metering), and the usage the API asked for on the client's behalf
(on every chunk) is cut back to what the client asked for (``UsageShown``).

A stream that breaks after output started ends with an OpenAI error event and ``data: [DONE]``, so
clients stop instead of hanging. A client that goes away stops the upstream request at once. Either
way the request is metered with what was delivered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from api.errors import error_body
from api.inference.metering import InferenceMeter, Outcome
from api.inference.requests import UsageShown
from api.inference.sse import Chunk, encode_event, parse_event
from api.inference.upstream import Opened
from core.protocol import STATS_FIELD

log = logging.getLogger(__name__)

Finish = Callable[[InferenceMeter], Awaitable[None]]


def broken_stream_events(message: str) -> bytes:
    """What a client sees when the replica broke off mid-answer: an error event, then the end."""
    return encode_event(error_body(message, "server_error", code="upstream_failed")) + encode_event(b"[DONE]")


class StreamRelay(Response):
    """The response streaming one opened replica answer to the client."""

    media_type = "text/event-stream"

    def __init__(self, opened: Opened, meter: InferenceMeter, usage_shown: UsageShown, finish: Finish) -> None:
        self.opened = opened
        self.meter = meter
        self.usage_shown = usage_shown
        self.finish = finish
        self.ended = False  # [DONE] was relayed
        self.status_code = 200
        self.background = None
        # x-accel-buffering: proxies such as nginx must not hold events back.
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no", "x-request-id": meter.request_id})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:

                async def relay() -> None:
                    await self._relay(send)
                    tasks.cancel_scope.cancel()

                async def watch() -> None:
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    if not self.ended:
                        self.meter.status = Outcome.CLIENT_DISCONNECTED
                    tasks.cancel_scope.cancel()

                tasks.start_soon(relay)
                tasks.start_soon(watch)
        finally:
            # Shielded: a cancelled request (client gone, server stopping) must still close the upstream
            # request, which aborts it on the replica, and be metered (finish does nothing the second time).
            with anyio.CancelScope(shield=True):
                await self.opened.close()
            await self._finish()

    async def _relay(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            for chunk in self.opened.head:
                await self._deliver(chunk, send)
            assert self.opened.raw is not None
            async for raw in self.opened.raw:
                for event in self.opened.splitter.feed(raw):
                    await self._deliver(parse_event(event), send)
        except httpx.TransportError as exc:
            log.warning("replica %s broke off request %s: %r", self.opened.replica.id, self.meter.request_id, exc)
            await self._break_off(send, "the inference server stopped in the middle of the answer; retry the request")
        except OSError:  # the client went away (ASGI servers that raise on send)
            self.meter.status = Outcome.CLIENT_DISCONNECTED
            return
        except Exception:  # a bug of ours must still end the client's stream rather than leave it hanging
            log.exception("relaying request %s failed", self.meter.request_id)
            await self._break_off(send, "the answer could not be relayed; retry the request")
        else:
            if not self.ended:
                await self._break_off(send, "the inference server ended the stream without finishing it")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _finish(self) -> None:
        with anyio.CancelScope(shield=True):  # a disconnect at this moment must not leave it half done
            await self.finish(self.meter)

    async def _break_off(self, send: Send, message: str) -> None:
        self.meter.status = Outcome.UPSTREAM_FAILED
        self.ended = True
        await self._finish()
        await send({"type": "http.response.body", "body": broken_stream_events(message), "more_body": True})

    async def _deliver(self, chunk: Chunk, send: Send) -> None:
        data = client_event(chunk, self.meter, self.usage_shown)
        if chunk.done:
            self.ended = True
            await self._finish()  # metered before the client sees the end (see finish_request)
        if data is not None:
            await send({"type": "http.response.body", "body": data, "more_body": True})


def client_event(chunk: Chunk, meter: InferenceMeter, usage_shown: UsageShown) -> bytes | None:
    """What the client gets for a replica's ``chunk`` (None: nothing), metering it on the way."""
    body = chunk.body
    if body is None:
        return chunk.raw
    meter.saw_output(chunk.pieces())
    if chunk.error is not None:
        meter.status = Outcome.UPSTREAM_ERROR
    changed = False
    if STATS_FIELD in body:
        stats = body.pop(STATS_FIELD)
        meter.stats = stats if isinstance(stats, dict) else None
        changed = True
    if chunk.usage is not None:
        meter.usage = chunk.usage  # the usage so far: what is billed if the stream ends after this chunk
    if "usage" in body and usage_shown is not UsageShown.EVERY_CHUNK:
        if not body.get("choices"):
            if chunk.usage is not None and usage_shown is UsageShown.NONE:
                return None  # the usage chunk itself, which this client did not ask for
        elif usage_shown is UsageShown.NONE:
            del body["usage"]
            changed = True
        elif body["usage"] is not None:
            body["usage"] = None  # OpenAI's shape: only the last chunk has the usage
            changed = True
    return encode_event(body) if changed else chunk.raw
