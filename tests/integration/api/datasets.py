"""Training files for API tests."""

from __future__ import annotations

import json


def chat_jsonl(examples: int = 12) -> bytes:
    """A valid chat-format training file."""
    lines = [
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} plus {i}?"},
                    {"role": "assistant", "content": f"{2 * i}"},
                ]
            }
        )
        for i in range(examples)
    ]
    return ("\n".join(lines) + "\n").encode()


def tool_chat_jsonl(examples: int = 12) -> bytes:
    """A valid chat-format training file in OpenAI's function-calling format: a call, its result, the answer."""
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
    lines = []
    for i in range(examples):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "add", "arguments": json.dumps({"a": i, "b": i})},
        }
        messages = [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"{2 * i}"},
            {"role": "assistant", "content": f"{2 * i}"},
        ]
        lines.append(json.dumps({"tools": [tool], "parallel_tool_calls": False, "messages": messages}))
    return ("\n".join(lines) + "\n").encode()


def preference_jsonl(pairs: int = 12) -> bytes:
    """A valid preference file for DPO (OpenAI's format): the spelled-out answer preferred over the digits."""
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    lines = [
        json.dumps(
            {
                "input": {"messages": [{"role": "user", "content": f"What is {i % 5} plus {i % 5}?"}]},
                "preferred_output": [{"role": "assistant", "content": words[2 * (i % 5)]}],
                "non_preferred_output": [{"role": "assistant", "content": str(2 * (i % 5))}],
            }
        )
        for i in range(pairs)
    ]
    return ("\n".join(lines) + "\n").encode()
