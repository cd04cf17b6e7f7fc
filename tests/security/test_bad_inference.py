"""Inference requests no server should run: each is refused with a 4xx naming the field (by the API, or by
the replica for what only it knows, such as the prompt's length in tokens), no tokens are billed, and the
next request is served. Rate limits and the other tenants' adapters are swept in ``test_access.py``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.api_inference.deployment import Deployment
from tests.security.contract import Refusal, assert_refused, assert_still_serving, stores_nothing

pytestmark = pytest.mark.slow
BASE = "<base model>"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
NESTED = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}


WIDE_SCHEMA = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(20_000)]}
HUGE_PARAMETERS = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(50_000)}}  # 1.3 MB

# name -> (path, JSON body or raw bytes, refusal)
BAD_REQUESTS: dict[str, tuple[str, dict[str, Any] | bytes, Refusal]] = {
    "max-tokens-beyond-context": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 5000},
        Refusal(400, "beyond the model's context length", "max_tokens"),
    ),
    "max-tokens-past-prompt": (
        COMPLETIONS,
        {"prompt": "hi", "max_tokens": 2048},
        Refusal(400, "at most 2045 tokens can be generated", "max_tokens"),
    ),
    "chat-max-completion-tokens": (
        CHAT,
        {"messages": HI, "max_completion_tokens": 10**6},
        Refusal(400, "beyond the model's context length", "max_completion_tokens"),
    ),
    "n-beyond-cap": (COMPLETIONS, {"prompt": "hi", "n": 9}, Refusal(400, "at most 8 completions per request", "n")),
    "n-zero": (COMPLETIONS, {"prompt": "hi", "n": 0}, Refusal(400, "greater than or equal to 1", "n")),
    "empty-prompt": (COMPLETIONS, {"prompt": ""}, Refusal(400, "the prompt is empty", "prompt")),
    "empty-prompt-list": (COMPLETIONS, {"prompt": [""]}, Refusal(400, "the prompt is empty", "prompt")),
    "empty-token-ids": (COMPLETIONS, {"prompt": [[]]}, Refusal(400, "the prompt is empty", "prompt")),
    "token-id-out-of-vocabulary": (
        COMPLETIONS,
        {"prompt": [10**9]},
        Refusal(400, "prompt token ids must be in", "prompt"),
    ),
    "prompt-too-long": (
        COMPLETIONS,
        {"prompt": "x" * 3000, "max_tokens": 2},
        Refusal(400, "this model's context is 2048 tokens", "prompt", "context_length_exceeded"),
    ),
    "chat-too-long": (
        CHAT,
        {"messages": [{"role": "user", "content": "x" * 3000}]},
        Refusal(400, "context is 2048 tokens", "messages"),
    ),
    "messages-empty": (CHAT, {"messages": []}, Refusal(400, "at least 1 item", "messages")),
    "messages-not-a-list": (CHAT, {"messages": "hi"}, Refusal(400, "valid list", "messages")),
    "message-without-role": (
        CHAT,
        {"messages": [{"content": "hi"}]},
        Refusal(400, "this field is required", "messages.0.role"),
    ),
    "message-unknown-role": (
        CHAT,
        {"messages": [{"role": "wizard", "content": "hi"}]},
        Refusal(400, "role must be one of", "messages[0].role"),
    ),
    "message-content-number": (
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        Refusal(400, "valid string", "messages.0.content"),
    ),
    "message-image-part": (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        Refusal(400, "only text parts", "messages[0].content"),
    ),
    "invalid-utf-8": (
        COMPLETIONS,
        b'{"model": "m", "prompt": "\xff\xfe"}',
        Refusal(400, "not valid UTF-8", code="invalid_body"),
    ),
    "deeply-nested-body": (COMPLETIONS, NESTED, Refusal(400, "nested too deeply", code="invalid_body")),
    "not-json": (COMPLETIONS, b'{"model": ', Refusal(400, "not valid JSON")),
    "unknown-adapter": (
        COMPLETIONS,
        {"model": "ft:tiny:nobody::adapter-x", "prompt": "hi"},
        Refusal(404, "does not exist or you do not have access to it", "model", "model_not_found"),
    ),
    "model-missing": (COMPLETIONS, {"model": None, "prompt": "hi"}, Refusal(400, "valid string", "model")),
    # Schemas that would make the grammar compiler explode stop at llguidance's limits (0.2 s at most, measured).
    "schema-nested-too-deep": (
        CHAT,
        {"messages": HI, "response_format": json_schema(nested_schema(900))},
        Refusal(400, "recursion limit exceeded", "response_format"),
    ),
    "schema-too-large": (
        CHAT,
        {"messages": HI, "response_format": json_schema(WIDE_SCHEMA)},  # 1.4 MB
        Refusal(400, "schema too large", "response_format"),
    ),
    "body-too-large": (
        COMPLETIONS,
        {"prompt": "x" * (17 << 20)},
        Refusal(413, "JSON request bodies may be at most 16777216 bytes", "body", "payload_too_large"),
    ),
    # Tool definitions are bounded before their schemas are checked (about 7 us a byte, on the server).
    "tools-too-many": (
        CHAT,
        {"messages": HI, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
        Refusal(400, "at most 128 per request", "tools"),
    ),
    "tools-too-large": (
        CHAT,
        {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "parameters": HUGE_PARAMETERS}}]},
        Refusal(400, "bytes of JSON; at most 131072 per request", "tools"),
    ),
    "unsupported-option": (
        COMPLETIONS,
        {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        Refusal(400, "unknown field", "tools"),
    ),
}


def send(http: httpx.Client, path: str, body: dict[str, Any] | bytes, base: str) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json={"model": base, **body})


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_inference_request_is_refused_and_billed_nothing(serving: Deployment, case: str) -> None:
    path, body, expected = BAD_REQUESTS[case]
    tenant = serving.make_tenant()
    for stream in (False, True):
        if isinstance(body, dict):
            body = {**body, "stream": stream}
        with tenant.http() as http, stores_nothing(serving, tenant):
            assert_refused(send(http, path, body, serving.base_model), expected)
    assert_still_serving(serving, tenant)
