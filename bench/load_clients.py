"""Closed-loop clients of the soak: each sends a request, reads the whole answer, checks it, and sends the
next one; a 429 is waited out for its ``retry-after``, as the openai SDK does. Every request ends as one
``Outcome``: ``ok``, ``rate_limited`` (a 429 with ``retry-after``), or an error kind naming what went wrong.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

from bench.load_platform import SoakPlatform, Tenant
from bench.sse import sse_lines

OK = "ok"
RATE_LIMITED = "rate_limited"
BASE_SHARE = 0.2  # requests on the base model; the rest on the tenant's adapters
WORDS = ("amber", "cobalt", "delta", "ember", "flint", "garnet", "harbor", "indigo", "jasper", "kelp")
REQUEST_TIMEOUT_S = 120.0  # a request that hangs ends as a transport error, not a stuck soak


@dataclass(frozen=True)
class Request:
    tenant: Tenant
    model: str
    path: str
    body: dict
    stream: bool

    @property
    def on_adapter(self) -> bool:
        return self.model.startswith("ft:")


@dataclass(frozen=True)
class Outcome:
    kind: str
    latency_s: float
    on_adapter: bool
    model: str
    retry_after_s: float | None = None


def next_request(platform: SoakPlatform, rng: random.Random) -> Request:
    """A random request of a random tenant: base or one of its adapters, either endpoint, streamed or not."""
    tenant = rng.choice(platform.tenants)
    model = platform.base_model if rng.random() < BASE_SHARE else rng.choice(tenant.models)
    text = " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
    stream = rng.random() < 0.5
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(4, 24),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": stream,
    }
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", text
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    return Request(tenant, model, path, body, stream)


async def send(http: httpx.AsyncClient, request: Request) -> Outcome:
    """Send one request and judge its answer."""
    headers = {"Authorization": f"Bearer {request.tenant.key}"}
    started = time.monotonic()
    retry_after = None
    try:
        async with http.stream("POST", request.path, json=request.body, headers=headers) as response:
            if response.status_code != 200:
                kind, retry_after = _refusal(response, await response.aread())
            elif request.stream:
                kind = await _judge_stream(response)
            else:
                kind = _judge_body(await response.aread())
    except httpx.HTTPError as exc:
        kind = f"transport: {type(exc).__name__}"
    return Outcome(kind, time.monotonic() - started, request.on_adapter, request.model, retry_after)


def _refusal(response: httpx.Response, body: bytes) -> tuple[str, float | None]:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = "no error body"
    if response.status_code == 429:
        try:
            return RATE_LIMITED, float(response.headers["retry-after"])
        except (KeyError, ValueError):
            return f"429 without retry-after ({code})", None
    return f"http {response.status_code} ({code})", None


def _judge_body(body: bytes) -> str:
    try:
        answer = json.loads(body)
    except ValueError:
        return "answer is not JSON"
    if not answer.get("choices") or not answer.get("usage"):
        return "answer without choices or usage"
    return OK


async def _judge_stream(response: httpx.Response) -> str:
    done = finished = False
    async for line in sse_lines(response):
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            continue
        chunk = json.loads(data)
        if "error" in chunk:
            return f"stream error ({chunk['error'].get('code')})"
        finished = finished or any(c.get("finish_reason") for c in chunk.get("choices") or [])
    if not done:
        return "stream ended without [DONE]"
    return OK if finished else "stream without a finish_reason"


async def run_clients(platform: SoakPlatform, clients: int, duration_s: float, seed: int) -> list[Outcome]:
    """``clients`` closed loops for ``duration_s`` seconds; every request's outcome."""
    deadline = time.monotonic() + duration_s
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=platform.api_url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:

        async def loop(rng: random.Random) -> None:
            while time.monotonic() < deadline:
                outcome = await send(http, next_request(platform, rng))
                outcomes.append(outcome)
                if outcome.kind == RATE_LIMITED and outcome.retry_after_s is not None:
                    # The client's side of a 429: come back when told (not synchronisation of the soak).
                    await asyncio.sleep(max(0.0, min(outcome.retry_after_s, deadline - time.monotonic())))

        await asyncio.gather(*(loop(random.Random(seed * 1000 + c)) for c in range(clients)))
    return outcomes
