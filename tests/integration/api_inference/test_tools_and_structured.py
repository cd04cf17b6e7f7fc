"""Tool calls and structured outputs through the platform API with the stock openai SDK: the API passes
``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and ``response_format`` to the replica as sent, and relays
its tool calls (streamed as OpenAI's fragments, or whole) and its constrained JSON back."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from tests.integration.api_inference.deployment import Deployment

pytestmark = pytest.mark.slow


class Point(BaseModel):
    """Bounded, so the random model's constrained output always finishes."""

    label: str = Field(max_length=6)
    x: int = Field(ge=0, le=99)


# A short tool description: the tiny model's template wraps tools in a ~400 token preamble already.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


def test_parse_returns_the_pydantic_object_through_the_api(serving: Deployment) -> None:
    client = serving.make_tenant().openai()
    completion = client.chat.completions.parse(
        model=serving.base_model, messages=QUESTION, response_format=Point, seed=1, max_completion_tokens=100
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Point), choice.message.content
    assert Point.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_round_trip_through_the_api(serving: Deployment, stream: bool) -> None:
    client = serving.make_tenant().openai()
    forced = {"type": "function", "function": {"name": "get_weather"}}
    args = {"model": serving.base_model, "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 200}
    first = {**args, "messages": QUESTION, "tool_choice": forced, "parallel_tool_calls": False}
    if stream:  # the SDK's stream helper puts the call back together from its fragments
        with client.chat.completions.stream(**first) as events:
            chunks = [event.chunk for event in events if event.type == "chunk"]
            completion = events.get_final_completion()
        deltas = [d for chunk in chunks for c in chunk.choices for d in c.delta.tool_calls or []]
        assert deltas[0].function.name == "get_weather" and len(deltas) > 1  # a head, then argument fragments
        assert all(d.function.name is None and d.id is None for d in deltas[1:])
    else:
        completion = client.chat.completions.create(**first)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    city = json.loads(call.function.arguments)["city"]
    assert isinstance(city, str)

    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer = client.chat.completions.create(**{**args, "max_tokens": 8}, messages=history, tool_choice="none")
    assert not answer.choices[0].message.tool_calls and isinstance(answer.choices[0].message.content, str)
