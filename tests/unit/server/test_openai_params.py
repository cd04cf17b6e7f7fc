"""Request bodies to engine parameters: defaults, the context limit, caps and refusals naming the field."""

from __future__ import annotations

import pytest

from core.errors import InvalidRequest
from server.openai_params import chat_messages, sampling_params
from server.openai_schemas import ChatCompletionRequest, CompletionRequest

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
        (completion(presence_penalty=0.5), "presence_penalty"),
        (completion(frequency_penalty=-1.0), "frequency_penalty"),
        (completion(logit_bias={"5": 1.0}), "logit_bias"),
        (completion(echo=True), "echo"),
        (completion(suffix="!"), "suffix"),
        (completion(best_of=3), "best_of"),
        (chat(tools=[{"type": "function"}]), "tools"),
        (chat(response_format={"type": "json_object"}), "response_format"),
        (completion(stop=[""]), "stop"),
    ],
)
def test_what_cannot_be_honoured_is_refused(body, param):
    assert refused(body).param == param


def test_zero_penalties_and_matching_best_of_are_accepted():
    body = completion(presence_penalty=0.0, frequency_penalty=0.0, best_of=2, n=2, logit_bias={})
    assert sampling_params(body, 10, CONTEXT, 4).n == 2


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
    ],
)
def test_malformed_messages_name_the_culprit(messages, param):
    with pytest.raises(InvalidRequest) as info:
        chat_messages(messages)
    assert info.value.param == param
