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
