"""The base model as the forward pass sees it, read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2).

Sizes come from :class:`core.model_sizes.ModelSizes`, the reading the API validates adapters with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.model_sizes import ModelSizes

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is ``default``, ``linear`` or ``llama3``."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig(ModelSizes):
    """Everything the forward pass and the pool need to know about the base model: its sizes, and more."""

    model_type: str
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``config.json`` (and ``generation_config.json`` for extra EOS ids) from a model directory."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path} not found: the model directory must hold a Hugging Face config.json")
        config = json.loads(path.read_text(encoding="utf-8"))
        gen_path = Path(model_dir) / "generation_config.json"
        generation = json.loads(gen_path.read_text(encoding="utf-8")) if gen_path.is_file() else {}
        return cls.from_dict(config, generation)

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Validate a ``config.json`` dict; refuses features the forward pass does not implement."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not served; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {config.get('hidden_act')!r} is not served; only 'silu'")
        if config.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not served")
        sizes = ModelSizes.from_hf_config(config)
        heads, kv_heads = sizes.num_heads, sizes.num_kv_heads
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        attention_bias = bool(config.get("attention_bias", False))
        eos = set(_as_ids(config.get("eos_token_id"))) | set(_as_ids((generation or {}).get("eos_token_id")))
        return cls(
            **asdict(sizes),
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=_rope_config(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            sliding_window=_sliding_window(config, model_type),
            eos_token_ids=tuple(sorted(eos)),
        )


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_config(config: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes ``rope_parameters`` (theta inside); older files use rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not served; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not served")
    defaults = RopeConfig()
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", defaults.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", defaults.high_freq_factor)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", defaults.original_max_position_embeddings)
        ),
    )


def _sliding_window(config: dict[str, Any], model_type: str) -> int | None:
    window = config.get("sliding_window")
    if window is None:
        return None
    if model_type == "qwen2":
        layer_types = config.get("layer_types") or []
        if not config.get("use_sliding_window") and "sliding_attention" not in layer_types:
            return None
    return int(window)
