"""The load generator: a closed loop of concurrent streaming clients over one seeded request sequence.

Each client sends a request, reads its SSE stream to the end, then takes the next request; so the
server always has about ``clients`` requests in flight. Requests ask for greedy decoding with
``ignore_eos`` (exact output lengths) and ``return_token_ids`` (exact token counts per chunk).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import httpx

from bench.serve_stats import RequestRecord
from bench.serve_workload import WorkItem
from bench.sse import DONE, SseParser, chunk_token_ids, chunk_tokens, parse_chunk, sse_lines
from core.protocol import STATS_FIELD


@dataclass(frozen=True)
class LoadPlan:
    """How much load: ``clients`` in flight, until ``requests`` were sent or ``duration_s`` passed."""

    clients: int
    requests: int | None = None
    duration_s: float | None = None
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError("need at least one client")
        if (self.requests is None) == (self.duration_s is None):
            raise ValueError("give either a request count or a duration")


def request_body(model: str, item: WorkItem) -> dict:
    """The ``/v1/completions`` body for one work item."""
    return {
        "model": model,
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(client: httpx.AsyncClient, url: str, model: str, item: WorkItem) -> RequestRecord:
    """One streaming request, timed chunk by chunk; failures end up in ``record.error``, never raised."""
    record = RequestRecord(item.index, item.adapter, item.max_tokens, time.perf_counter())
    try:
        async with client.stream("POST", url, json=request_body(model, item)) as response:
            if response.status_code != 200:
                record.error = _http_error(response.status_code, await response.aread())
                return record
            await _read_stream(response, record)
    except httpx.TimeoutException:
        record.error = "timeout"
    except httpx.HTTPError as exc:
        record.error = type(exc).__name__
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord) -> None:
    parser = SseParser()
    streamed, usage_tokens, done = 0, None, False
    async for line in sse_lines(response):
        data = parser.feed(line)
        if data is None:
            continue
        if data == DONE:
            done = True
            break
        try:
            chunk = parse_chunk(data)
        except ValueError:
            record.error = "malformed chunk"
            return
        if "error" in chunk:
            record.error = f"stream error {(chunk['error'] or {}).get('code') or ''}".strip()
            return
        if tokens := chunk_tokens(chunk):
            record.arrivals.append((time.perf_counter(), tokens))
            record.token_ids.extend(chunk_token_ids(chunk) or [])
            streamed += tokens
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        if isinstance(stats := chunk.get(STATS_FIELD), dict):
            record.cold_start = stats.get("cold_start")
    record.finished_at = time.perf_counter()
    record.output_tokens = streamed
    if not done:
        record.error = "stream ended without [DONE]"
    elif usage_tokens is not None and usage_tokens != streamed:
        record.error = "usage disagrees with streamed tokens"


def _http_error(status: int, body: bytes) -> str:
    """``http 429`` or, when the body is an OpenAI error with a code, ``http 503 loading``."""
    try:
        code = json.loads(body)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = None
    return f"http {status} {code}" if code else f"http {status}"


async def run_load(
    base_url: str,
    adapter_models: Sequence[str],
    items: Iterator[WorkItem],
    plan: LoadPlan,
    headers: Mapping[str, str] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Drive the server with ``plan``; every request's record and the wall seconds from first send to last answer.
    ``headers`` go with every request (the platform API's bearer key)."""
    url = f"{base_url}/v1/completions"
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=plan.clients, max_keepalive_connections=plan.clients)
    timeout = httpx.Timeout(plan.timeout_s, connect=30.0)
    start = time.perf_counter()
    deadline = start + plan.duration_s if plan.duration_s is not None else None
    budget = [plan.requests]  # shared by the clients; one event loop, so no lock

    def next_item() -> WorkItem | None:
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        if budget[0] is not None:
            if budget[0] <= 0:
                return None
            budget[0] -= 1
        return next(items)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while (item := next_item()) is not None:
            records.append(await send(client, url, adapter_models[item.adapter], item))

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(plan.clients)))
    return records, time.perf_counter() - start
