"""Request bodies to engine parameters: defaults, the context limit, caps and refusals naming the field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.errors import InvalidRequest
from server.openai_params import chat_messages, sampling_params
from server.openai_schemas import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest

CONTEXT = 100


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="m", prompt="p", **fields)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def refused(body, prompt_len: int = 10, max_n: int = 4) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        sampling_params(body, prompt_len, CONTEXT, max_n)
    return info.value


def test_defaults_follow_openai():
    params = sampling_params(completion(), 10, CONTEXT, 4)
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.logprobs) == (16, 1.0, 1.0, 1, None)
    assert sampling_params(chat(), 10, CONTEXT, 4).max_tokens == CONTEXT - 10  # chat: up to the context


def test_chat_token_limits_and_logprobs():
    assert sampling_params(chat(max_completion_tokens=5, max_tokens=9), 10, CONTEXT, 4).max_tokens == 5
    assert sampling_params(chat(logprobs=True, top_logprobs=3), 10, CONTEXT, 4).logprobs == 3
    assert sampling_params(chat(logprobs=True), 10, CONTEXT, 4).logprobs == 0
    assert refused(chat(top_logprobs=2)).param == "top_logprobs"


def test_the_context_limit_is_checked_against_prompt_and_max_tokens():
    assert sampling_params(completion(max_tokens=90), 10, CONTEXT, 4).max_tokens == 90
    error = refused(completion(max_tokens=91))
    assert error.param == "max_tokens" and "at most 90" in error.message
    assert refused(completion(), prompt_len=CONTEXT).param == "prompt"
    assert refused(chat(), prompt_len=CONTEXT + 5).param == "messages"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (completion(n=5), "n"),
        (completion(presence_penalty=2.5), "presence_penalty"),
        (chat(frequency_penalty=-3.0), "frequency_penalty"),
        (chat(repetition_penalty=0.0), "repetition_penalty"),
        (completion(min_p=1.5), "min_p"),
        (completion(logit_bias={"5": 101.0}), "logit_bias"),
        (chat(logit_bias={"five": 1.0}), "logit_bias"),
        (chat(logit_bias={"-1": 1.0}), "logit_bias"),
        (completion(echo=True), "echo"),
        (completion(suffix="!"), "suffix"),
        (completion(best_of=3), "best_of"),
        (chat(response_format={"type": "xml"}), "response_format"),
        (completion(response_format={"type": "json_schema", "json_schema": {"schema": {}}}), "response_format"),
        (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": []}}), "response_format"),
        (completion(stop=[""]), "stop"),
    ],
)
def test_what_cannot_be_honoured_is_refused(body, param):
    assert refused(body).param == param


def test_zero_penalties_and_matching_best_of_are_accepted():
    body = completion(presence_penalty=0.0, frequency_penalty=0.0, best_of=2, n=2, logit_bias={})
    params = sampling_params(body, 10, CONTEXT, 4)
    assert params.n == 2 and not params.penalised and params.logit_bias == {}


@pytest.mark.parametrize("make", [completion, chat])
def test_penalties_bias_and_min_p_reach_the_engine(make):
    knobs = dict(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, min_p=0.05)
    body = make(**knobs, logit_bias={"7": -100, "3": 2})
    params = sampling_params(body, 10, CONTEXT, 4)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.2)
    assert params.min_p == 0.05 and params.logit_bias == {7: -100.0, 3: 2.0} and params.penalised


@pytest.mark.parametrize("make", [completion, chat])
def test_unknown_fields_are_refused_and_the_ignorable_ones_accepted(make):
    with pytest.raises(ValidationError) as info:
        make(min_tokens=3)
    assert [(e["type"], e["loc"]) for e in info.value.errors()] == [("extra_forbidden", ("min_tokens",))]
    with pytest.raises(ValidationError):
        make(stream=True, stream_options={"include_usage": True, "include_everything": True})
    options = make(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert options.include_usage and options.continuous_usage  # vLLM's extension is known
    ignorable = {name: "x" for name in IGNORED_FIELDS}
    assert sampling_params(make(**ignorable), 10, CONTEXT, 4) == sampling_params(make(), 10, CONTEXT, 4)


def test_messages_are_normalised_to_text():
    messages = chat_messages(
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None},
        ]
    )
    assert messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]}],
            "messages[0].tool_calls[0].function.arguments",  # nested past the JSON parser's stack: still a 400
        ),
    ],
)
def test_malformed_messages_name_the_culprit(messages, param):
    with pytest.raises(InvalidRequest) as info:
        chat_messages(messages)
    assert info.value.param == param


def test_response_format_becomes_a_canonical_schema_for_both_routes():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spaced = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for body in (chat(response_format=spaced), completion(response_format=spaced)):
        text = sampling_params(body, 10, CONTEXT, 4).json_schema
        assert text == '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"string"}}}'  # order kept
    assert sampling_params(chat(response_format={"type": "json_object"}), 10, CONTEXT, 4).json_schema == (
        '{"type":"object"}'
    )
    assert sampling_params(chat(response_format={"type": "text"}), 10, CONTEXT, 4).json_schema is None
