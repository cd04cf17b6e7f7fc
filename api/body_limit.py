"""A cap on JSON request bodies, before anything reads them.

FastAPI reads a body whole (and parses it) before any dependency runs, authentication included, so without a cap
anyone could make the API hold a gigabyte in memory. Uploads (``multipart/form-data``, ``/v1/files`` and
``/v1/adapters``) stream through their own, larger limit (``LORAPLEX_MAX_UPLOAD_BYTES``, ``api/multipart.py``)
and are left alone here. A body over the cap gets a 413 in the OpenAI error shape: at once when its
``Content-Length`` says so, otherwise as soon as the bytes received pass it.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import PayloadTooLarge

UPLOAD_PATHS = frozenset({"/v1/files", "/v1/adapters"})  # multipart, streamed under their own limit


class BodyTooLarge(Exception):
    """Raised into the app's body read once the cap is passed; the middleware answers 413 instead."""


class BodyLimit:
    """ASGI middleware: JSON (and any other non-multipart) bodies at most ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope.get("path") in UPLOAD_PATHS and _is_multipart(scope)):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, f"the request body is {declared} bytes")
            return
        received = 0
        passed = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, passed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    passed = True
                    raise BodyTooLarge
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if passed:
                return  # whatever the app answers to the interrupted read, the client gets the 413
            started = started or message["type"] == "http.response.start"
            await send(message)

        with contextlib.suppress(BodyTooLarge):  # the app let the interrupted read's error through
            await self.app(scope, limited_receive, tracked_send)
        if passed and not started:
            await self._refuse(send, "the request body is larger than that")

    async def _refuse(self, send: Send, what: str) -> None:
        error = PayloadTooLarge(
            f"{what}; JSON request bodies may be at most {self.max_bytes} bytes (LORAPLEX_MAX_REQUEST_BYTES)",
            param="body",
        )
        body = json.dumps(error.to_dict()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


def _is_multipart(scope: Scope) -> bool:
    content_type: Any = _header(scope, b"content-type") or b""
    return bytes(content_type).lower().startswith(b"multipart/form-data")


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else None
