"""Closed-loop clients of the soak: each sends a request, reads the whole answer, checks it, and sends the
next one; a 429 is waited out for its ``retry-after``, as the openai SDK does. Every request ends as one
``Outcome``: ``ok``, ``rate_limited`` (a 429 with ``retry-after``), or an error kind naming what went wrong.

Requests mix the base model and adapters, completions and chat, streamed or not; a share of chat requests
asks for a JSON schema (``response_format``), and every chat request opens with its tenant's long system
prompt, which the servers' prefix caches keep (``cached_tokens`` in the usage says how much).
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
STRUCTURED_SHARE = 0.3  # of chat requests
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
STRUCTURED_MAX_TOKENS = 96  # far more than the longest answer the schema allows
SYSTEM_WORDS = 120  # a tenant's system prompt: several KV pages, shared by all its chat requests


@dataclass(frozen=True)
class Request:
    tenant: Tenant
    model: str
    path: str
    body: dict
    stream: bool
    structured: bool = False

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
    ended_at: float = 0.0  # time.monotonic() when it ended
    structured: bool = False
    prompt_tokens: int = 0  # from the answer's usage (0 when it had none)
    cached_tokens: int = 0


def system_prompt(tenant: Tenant) -> str:
    """The tenant's long system prompt: the same words for all its chat requests, another tenant's differ."""
    rng = random.Random(tenant.key)
    return f"You answer for {tenant.name}. " + " ".join(rng.choices(WORDS, k=SYSTEM_WORDS))


def next_request(platform: SoakPlatform, rng: random.Random) -> Request:
    """A random request of a random tenant: base or one of its adapters, either endpoint, streamed or not,
    some chat requests constrained by a JSON schema."""
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
    if stream:
        body["stream_options"] = {"include_usage": True}
    structured = False
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", text
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "system", "content": system_prompt(tenant)}, {"role": "user", "content": text}]
        if rng.random() < STRUCTURED_SHARE:
            structured = True
            schema = {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}
            body |= {"response_format": {"type": "json_schema", "json_schema": schema}}
            body["max_tokens"] = STRUCTURED_MAX_TOKENS
    return Request(tenant, model, path, body, stream, structured)


async def send(http: httpx.AsyncClient, request: Request) -> Outcome:
    """Send one request and judge its answer."""
    headers = {"Authorization": f"Bearer {request.tenant.key}"}
    started = time.monotonic()
    retry_after = None
    answer = Answer()
    try:
        async with http.stream("POST", request.path, json=request.body, headers=headers) as response:
            if response.status_code != 200:
                kind, retry_after = _refusal(response, await response.aread())
            elif request.stream:
                kind = await _judge_stream(response, answer)
            else:
                kind = _judge_body(await response.aread(), answer)
        if kind == OK and request.structured:
            kind = _judge_structured(answer)
    except httpx.HTTPError as exc:
        kind = f"transport: {type(exc).__name__}"
    ended = time.monotonic()
    usage = answer.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Outcome(
        kind,
        ended - started,
        request.on_adapter,
        request.model,
        retry_after,
        ended,
        request.structured,
        usage.get("prompt_tokens") or 0,
        cached,
    )


@dataclass
class Answer:
    """What a judged answer said: its text (choice 0) and its usage."""

    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None


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


def _judge_body(body: bytes, answer: Answer) -> str:
    try:
        decoded = json.loads(body)
    except ValueError:
        return "answer is not JSON"
    if not decoded.get("choices") or not decoded.get("usage"):
        return "answer without choices or usage"
    choice = decoded["choices"][0]
    answer.text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
    answer.finish_reason, answer.usage = choice.get("finish_reason"), decoded["usage"]
    return OK


async def _judge_stream(response: httpx.Response, answer: Answer) -> str:
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
        answer.usage = chunk.get("usage") or answer.usage
        for choice in chunk.get("choices") or []:
            if choice.get("index") == 0:
                answer.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
            finished = finished or bool(choice.get("finish_reason"))
    if not done:
        return "stream ended without [DONE]"
    return OK if finished else "stream without a finish_reason"


def _judge_structured(answer: Answer) -> str:
    """A constrained answer is complete JSON that the schema allows."""
    if answer.finish_reason != "stop":
        return f"structured answer ended by {answer.finish_reason}"
    try:
        value = json.loads(answer.text)
    except ValueError:
        return "structured answer is not JSON"
    allowed = isinstance(value, dict) and set(value) == {"answer", "sure"}
    allowed = allowed and value["answer"] in ("yes", "no", "maybe") and isinstance(value["sure"], bool)
    return OK if allowed else "structured answer breaks its schema"


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
