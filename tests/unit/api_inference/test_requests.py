"""Cheap checks of inference requests and the body a replica receives."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from api.inference.requests import ChatCompletionBody, CompletionBody, UsageShown, check_request, upstream_body
from core.descriptor import AdapterDescriptor
from core.errors import InvalidRequest
from core.protocol import ADAPTER_FIELD, STATS_FIELD, TENANT_FIELD, TenantTag

DESCRIPTOR = AdapterDescriptor(
    id="adapter-1",
    name="ft:m:t:s:adapter-1",
    base_model="m",
    storage_prefix="p/",
    sha256="a",
    config_sha256="b",
    rank=4,
)
TAG = TenantTag(id="tenant-1", weight=2.0)


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "messages": []},
        {"model": "m"},
        {"model": "m", "messages": [{"content": "no role"}]},
        {"model": "m", "messages": "hello"},
        {"model": "", "messages": [{"role": "user", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0},
    ],
)
def test_malformed_chat_requests_are_refused(body: dict) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionBody.model_validate(body)


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompts_are_refused(prompt: object) -> None:
    with pytest.raises(ValidationError, match="prompt is empty"):
        CompletionBody.model_validate({"model": "m", "prompt": prompt})


@pytest.mark.parametrize("prompt", ["hi", ["a", "b"], [1, 2, 3], [[1], [2]]])
def test_text_and_token_prompts_are_accepted(prompt: object) -> None:
    assert CompletionBody.model_validate({"model": "m", "prompt": prompt}).prompt == prompt


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 9}, "n"),
        ({"max_tokens": 2049}, "max_tokens"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_caps_name_the_offending_field(fields: dict, param: str) -> None:
    body = ChatCompletionBody.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **fields})
    with pytest.raises(InvalidRequest) as exc:
        check_request(body, max_n=8, context_length=2048)
    assert exc.value.param == param


def test_a_request_within_caps_passes() -> None:
    body = CompletionBody.model_validate({"model": "m", "prompt": "x", "n": 8, "max_tokens": 2048, "stream": True})
    check_request(body, max_n=8, context_length=2048)


def test_client_supplied_descriptors_are_replaced_and_streams_always_ask_for_usage() -> None:
    raw = {
        "model": "ft:x",
        "prompt": "hi",
        "stream": True,
        "temperature": 0.5,
        ADAPTER_FIELD: {"id": "someone-elses"},
        STATS_FIELD: {"gpu_seconds": 0},
        TENANT_FIELD: {"id": "someone-else", "weight": 1000},
    }
    body, shown = upstream_body(raw, DESCRIPTOR, TAG)
    assert body[ADAPTER_FIELD] == DESCRIPTOR.model_dump(mode="json")
    assert body[TENANT_FIELD] == {"id": "tenant-1", "weight": 2.0}  # a client cannot pose as another tenant
    assert STATS_FIELD not in body
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["temperature"] == 0.5 and shown is UsageShown.NONE
    assert raw[ADAPTER_FIELD] == {"id": "someone-elses"}  # the caller's dict is left alone


def test_base_model_requests_carry_no_descriptor() -> None:
    body, shown = upstream_body(
        {"model": "m", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}, ADAPTER_FIELD: {}},
        None,
        TAG,
    )
    assert ADAPTER_FIELD not in body and shown is UsageShown.FINAL
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, shown = upstream_body({"model": "m", "prompt": "x", "stream": True, "stream_options": options}, None, TAG)
    assert shown is UsageShown.EVERY_CHUNK
    body, _ = upstream_body({"model": "m", "prompt": "x"}, None, TAG)
    assert "stream_options" not in body


def test_response_format_reaches_the_replica_unchanged() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x"]}}, "required": ["b"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for raw in (
        {"model": "ft:x", "messages": [{"role": "user", "content": "hi"}], "response_format": response_format},
        {"model": "ft:x", "prompt": "hi", "response_format": {"type": "json_object"}},
    ):
        model = ChatCompletionBody if "messages" in raw else CompletionBody
        assert model.model_validate(raw).model_dump()["response_format"] == raw["response_format"]  # allowed as is
        body, _ = upstream_body(raw, DESCRIPTOR, TAG)
        assert json.dumps(body["response_format"]) == json.dumps(raw["response_format"])  # key order too


def test_sampling_knobs_and_unknown_fields_reach_the_replica_unchanged() -> None:
    """The replica owns the decision (honour or refuse with a 400 naming the field); the API forwards as sent."""
    knobs = {
        "presence_penalty": 0.5, "frequency_penalty": -0.2, "repetition_penalty": 1.1, "min_p": 0.05,
        "logit_bias": {"17": -100}, "seed": 3, "user": "u", "min_tokens": 2,
    }  # fmt: skip
    for raw in ({"model": "m", "prompt": "hi", **knobs}, {"model": "m", "messages": [{"role": "user"}], **knobs}):
        model = ChatCompletionBody if "messages" in raw else CompletionBody
        model.model_validate(raw)
        body, _ = upstream_body(raw, None, TAG)
        assert {key: body[key] for key in knobs} == knobs
