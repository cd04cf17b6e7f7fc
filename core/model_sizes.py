"""The base model's sizes, read from its Hugging Face ``config.json`` in one place.

The API validates adapters against them and the server builds its forward pass and pool from them
(``server.model.config.ModelConfig`` extends :class:`ModelSizes`), so both read the same keys with
the same defaults. Pure Python: the API imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core.adapter_format import BaseShapes


@dataclass(frozen=True)
class ModelSizes:
    """Layer count and widths of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3) and its model_type."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str  # "" when config.json has none; it picks the module names adapters use

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelSizes:
        """From a ``config.json`` dict; a missing or malformed size raises KeyError, TypeError or ValueError."""
        heads = int(config["num_attention_heads"])
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            model_type=str(config.get("model_type") or ""),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def base_shapes(self) -> BaseShapes:
        """The shapes adapters are validated against."""
        return BaseShapes(
            self.num_layers, self.hidden_size, self.intermediate_size, self.q_size, self.kv_size, self.model_type
        )
