"""What the HTTP side reads of an engine: its tokenizer, the model's config and the context length.

The front is all a request handler needs to turn a body into token ids and sampling parameters, so it can
live in the HTTP process while the engine itself runs in another (``server.engine_process``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.errors import InvalidRequest
from server.model.config import ModelConfig


@dataclass(frozen=True)
class EngineFront:
    tokenizer: Any  # a transformers tokenizer, or None for a model directory without one
    model_config: ModelConfig
    max_model_len: int

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS)."""
        return encode_prompt(self.tokenizer, prompt)


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    if tokenizer is None:
        raise InvalidRequest("this model directory has no tokenizer; send token ids", param="prompt")
    return list(tokenizer(prompt).input_ids)
