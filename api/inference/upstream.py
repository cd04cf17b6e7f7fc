"""Sending a request to replicas until one starts answering.

A replica that refuses the connection, drops it, answers 5xx or goes silent before any output is
skipped and the next one tried: nothing reached the client yet, so the request can be replayed. One
that answers 429 is marked busy and the request spills over. Once output has started, the answer is
committed to that replica.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

from api.inference.sse import Chunk, EventSplitter, parse_event
from api.routing.router import ReplicaRouter
from core.errors import RateLimited, ServiceUnavailable, StorageError
from core.protocol import REQUEST_ID_HEADER, ReplicaStatus

log = logging.getLogger(__name__)

ERROR_BODY_LIMIT = 64 * 1024
DEFAULT_BUSY_S = 1.0
ALL_FAILED_RETRY_AFTER_S = 2.0
STORAGE_UNAVAILABLE = StorageError.default_code


@dataclass
class Opened:
    """A replica's answer that has started: its status and what was read so far."""

    replica: ReplicaStatus
    response: httpx.Response
    status_code: int
    body: bytes | None = None  # a non-streaming (or refused) answer, read in full
    head: list[Chunk] = field(default_factory=list)  # a stream's events up to the first that carries output
    splitter: EventSplitter = field(default_factory=EventSplitter)
    raw: AsyncIterator[bytes] | None = None  # the stream's bytes, read once: the head, then the relay goes on
    _released: bool = False
    _router: ReplicaRouter | None = None

    @property
    def refused(self) -> bool:
        return self.status_code >= 400

    async def close(self) -> None:
        """Close the upstream response and stop counting it in flight (idempotent)."""
        await self.response.aclose()
        if not self._released and self._router is not None:
            self._released = True
            self._router.finish(self.replica.id)


class ReplicaUnusable(Exception):
    """This replica cannot take the request now; another may. ``code`` and ``retry_after``: what its error
    answer said, if anything."""

    def __init__(
        self, reason: str, *, busy_for: float | None = None, code: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(reason)
        self.busy_for = busy_for
        self.code = code
        self.retry_after = retry_after


class Upstream:
    """The API's HTTP client to the inference servers."""

    def __init__(self, client: httpx.AsyncClient, internal_token: str | None, attempts: int) -> None:
        self.client = client
        self.internal_token = internal_token
        self.attempts = attempts

    def headers(self, request_id: str | None = None) -> dict[str, str]:
        """What every call to a replica carries: the internal token (and the request id to trace it)."""
        if self.internal_token is None:
            raise ServiceUnavailable(
                "inference is not configured: set LORAPLEX_INTERNAL_TOKEN to the inference servers' token",
                code="inference_not_configured",
            )
        headers = {"Authorization": f"Bearer {self.internal_token}"}
        if request_id:
            headers[REQUEST_ID_HEADER] = request_id
        return headers

    async def open(
        self,
        router: ReplicaRouter,
        path: str,
        body: dict[str, Any],
        adapter_id: str | None,
        *,
        stream: bool,
        request_id: str,
    ) -> Opened:
        """The first answer that started from ``router``'s replicas (those of the request's base model);
        ``RateLimited`` when all were busy, else ``ServiceUnavailable``."""
        candidates = await router.candidates(adapter_id)
        payload = json.dumps(body).encode()
        reasons: list[str] = []
        busy_for: list[float] = []
        codes: set[str | None] = set()
        waits: list[float] = []
        for replica in candidates[: self.attempts]:
            try:
                return await self._attempt(router, replica, path, payload, stream=stream, request_id=request_id)
            except ReplicaUnusable as exc:
                reasons.append(f"{replica.id}: {exc}")
                codes.add(exc.code)
                if exc.retry_after is not None:
                    waits.append(exc.retry_after)
                if exc.busy_for is not None:
                    busy_for.append(exc.busy_for)
        log.warning("request %s found no replica able to serve it: %s", request_id, "; ".join(reasons))
        if busy_for and len(busy_for) == len(reasons):
            raise RateLimited(
                "every inference server is at capacity; retry shortly", retry_after=min(busy_for), code="overloaded"
            )
        if codes == {STORAGE_UNAVAILABLE}:  # the replicas are fine; the adapter's files cannot be fetched
            raise ServiceUnavailable(
                "the adapter could not be loaded because the object store is unavailable; retry shortly",
                retry_after=max(waits, default=ALL_FAILED_RETRY_AFTER_S),
                code=STORAGE_UNAVAILABLE,
            )
        raise ServiceUnavailable(
            "no inference server could take the request; retry shortly",
            retry_after=ALL_FAILED_RETRY_AFTER_S,
            code="upstream_unavailable",
        )

    async def _attempt(
        self, router: ReplicaRouter, replica: ReplicaStatus, path: str, payload: bytes, *, stream: bool, request_id: str
    ) -> Opened:
        headers = {**self.headers(request_id), "Content-Type": "application/json"}
        request = self.client.build_request("POST", replica.url.rstrip("/") + path, content=payload, headers=headers)
        router.start(replica.id)
        opened: Opened | None = None
        try:
            response = await self.client.send(request, stream=True)
            opened = Opened(replica, response, response.status_code, _router=router)
            await self._read_head(router, opened, stream=stream)
        except httpx.TransportError as exc:
            if opened is not None:
                await opened.close()
            else:
                router.finish(replica.id)
            router.unreachable(replica.id)
            raise ReplicaUnusable(f"{type(exc).__name__}: {exc}") from exc
        except ReplicaUnusable:
            assert opened is not None
            await opened.close()
            raise
        except BaseException:  # cancelled (its client went away): free the replica's slot, abort its work
            with anyio.CancelScope(shield=True):
                if opened is not None:
                    await opened.close()
                else:
                    router.finish(replica.id)
            raise
        router.answered(replica.id)
        return opened

    async def _read_head(self, router: ReplicaRouter, opened: Opened, *, stream: bool) -> None:
        """Read until the answer is committed: a whole non-streaming body, or a stream's first output."""
        response = opened.response
        if response.status_code == 429:
            seconds = _retry_after(response) or DEFAULT_BUSY_S
            router.busy(opened.replica.id, seconds)
            raise ReplicaUnusable("busy (429)", busy_for=seconds)
        if response.status_code >= 500:
            text = (await _read_limited(response)).decode(errors="replace")
            code = _error_code(text)
            seconds = _retry_after(response)
            if seconds is not None and code != STORAGE_UNAVAILABLE:
                # e.g. 503 while its model loads: says when to come back. An object-store outage is not
                # the replica's: other requests may still go there.
                router.busy(opened.replica.id, seconds)
            raise ReplicaUnusable(f"HTTP {response.status_code}: {text[:200]}", code=code, retry_after=seconds)
        if response.status_code >= 400 or not stream:
            opened.body = await response.aread()
            return
        opened.raw = response.aiter_bytes()
        async for raw in opened.raw:
            for event in opened.splitter.feed(raw):
                chunk = parse_event(event)
                opened.head.append(chunk)
                if chunk.carries_output():
                    return
        raise ReplicaUnusable("the stream ended before any output")


def _error_code(text: str) -> str | None:
    """The ``error.code`` of a replica's error body, if it is one."""
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        value = float(response.headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if value > 0 else None


async def _read_limited(response: httpx.Response) -> bytes:
    data = b""
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= ERROR_BODY_LIMIT:
            break
    return data
