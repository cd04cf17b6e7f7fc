"""The base model as the forward pass sees it, read from ``config.json`` (Llama, Mistral, Qwen, Phi-3, Gemma).

Sizes come from :class:`core.model_sizes.ModelSizes`, the reading the API validates adapters with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.model_sizes import ModelSizes
from server.model.rope_config import RopeConfig, gemma3_rope_configs, rope_config

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention kinds of ``layer_types`` we serve
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the MLP gate's activation: SwiGLU, or GeGLU (Gemma)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# Gemma2Config's and Gemma3TextConfig's defaults where they differ from Llama's.
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
    },
}
# Phi3Config's defaults where they differ from Llama's (LongRoPE reads the top-level original length).
PHI3_DEFAULTS = {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class ModelConfig(ModelSizes):
    """Everything the forward pass and the pool need to know about the base model: its sizes, and more."""

    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each q and k head (weights of head_dim) before RoPE
    layer_windows: tuple[int | None, ...]  # each layer's sliding window in tokens; None: full attention
    eos_token_ids: tuple[int, ...]
    # Gemma 2 and Gemma 3 switches; the defaults are Llama's.
    hidden_act: str = "silu"  # one of HIDDEN_ACTS
    norm_plus_one: bool = False  # every RMSNorm (q/k norms too) scales by 1 + w, computed in fp32
    sandwich_norms: bool = False  # the attention and MLP outputs are normalised before their residual adds
    embed_scale: float | None = None  # embeddings are multiplied by this (sqrt(hidden_size)) in the model's dtype
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim's
    attn_softcap: float | None = None  # attention scores s become c * tanh(s / c) before the mask and softmax
    final_softcap: float | None = None  # logits likewise
    local_rope: RopeConfig | None = None  # sliding-window layers' own rope (Gemma 3); None: ``rope`` everywhere

    def layer_rope(self, n: int) -> RopeConfig:
        """The rope layer ``n`` rotates with."""
        return self.local_rope if self.local_rope is not None and self.layer_windows[n] is not None else self.rope

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

    @property
    def default_max_model_len(self) -> int:
        """The context served when none is asked for: LongRoPE keeps its short factors, as vLLM does by default."""
        if self.rope.rope_type == "longrope":
            return min(self.max_position_embeddings, self.rope.original_max_position_embeddings)
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, config: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        """Validate a ``config.json`` dict; refuses features the forward pass does not implement."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not served; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type in GEMMA_TYPES:
            config = {**GEMMA_DEFAULTS[model_type], **config}
        act_key = "hidden_activation" if model_type in GEMMA_TYPES else "hidden_act"  # Gemma ignores hidden_act
        hidden_act = config.get(act_key, "silu")
        if hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"{act_key} {hidden_act!r} is not served; supported: {', '.join(HIDDEN_ACTS)}")
        if config.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not served")
        if model_type == "phi3":
            config = {**PHI3_DEFAULTS, **config}
        sizes = ModelSizes.from_hf_config(config)
        heads, kv_heads = sizes.num_heads, sizes.num_kv_heads
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        attention_bias = bool(config.get("attention_bias", False)) and model_type != "phi3"  # Phi-3 has no biases
        local_rope = gemma3_rope_configs(config, sizes.head_dim) if model_type == "gemma3_text" else None
        gemma = _gemma_switches(config, model_type, sizes.hidden_size) if model_type in GEMMA_TYPES else {}
        eos = set(_as_ids(config.get("eos_token_id"))) | set(_as_ids((generation or {}).get("eos_token_id")))
        return cls(
            **asdict(sizes),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope=local_rope[0] if local_rope else rope_config(config, sizes.head_dim),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "qwen3", *GEMMA_TYPES) and attention_bias,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            layer_windows=_layer_windows(config, model_type, sizes.num_layers),
            eos_token_ids=tuple(sorted(eos)),
            hidden_act=hidden_act,
            local_rope=local_rope[1] if local_rope else None,
            **gemma,
        )


def _gemma_switches(config: dict[str, Any], model_type: str, hidden_size: int) -> dict[str, Any]:
    """What Gemma2Model and Gemma3TextModel do beyond Llama, read from their config keys."""
    if config.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=true is not served: the engine attends causally")
    if not config.get("head_dim"):
        # ModelSizes would take hidden_size / num_attention_heads; transformers' Gemma configs default to 256.
        raise ConfigError(f"head_dim is missing: a {model_type} config.json must state it")
    return {
        "norm_plus_one": True,
        "sandwich_norms": True,
        "embed_scale": hidden_size**0.5,
        "query_pre_attn_scalar": _positive(config, "query_pre_attn_scalar"),
        # Gemma3TextConfig has the key too, but Gemma3Attention never passes it on: transformers ignores it there.
        "attn_softcap": _positive(config, "attn_logit_softcapping") if model_type == "gemma2" else None,
        "final_softcap": _positive(config, "final_logit_softcapping"),
    }


def _positive(config: dict[str, Any], key: str) -> float | None:
    value = config.get(key)
    if value is not None and not float(value) > 0:
        raise ConfigError(f"{key} must be a positive number or null, got {value!r}")
    return None if value is None else float(value)


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _layer_windows(config: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as the family's transformers config and model read it.

    A window of W lets the query at position i see keys i - W < j <= i (transformers' ``sliding_window_overlay``).
    """
    window = config.get("sliding_window")
    if model_type == "llama":
        return (None,) * num_layers  # LlamaModel has no sliding window: the key is ignored
    if model_type in ("mistral", "phi3"):
        # MistralModel and Phi3Model window every layer when sliding_window is set and ignore layer_types.
        return (None if window is None else _window(window),) * num_layers
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None  # their configs drop sliding_window unless use_sliding_window is true
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = _default_layer_types(config, model_type, num_layers, window is not None)
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types lists {len(layer_types)} layers; num_hidden_layers is {num_layers}")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"layer_types {unknown} are not served; supported: {', '.join(LAYER_TYPES)}")
    if "sliding_attention" not in layer_types:
        return (None,) * num_layers
    if window is None:
        raise ConfigError(
            "layer_types lists sliding_attention layers but no sliding_window applies "
            "(set sliding_window, and use_sliding_window=true for Qwen2/Qwen3)"
        )
    return tuple(_window(window) if kind == "sliding_attention" else None for kind in layer_types)


def _default_layer_types(config: dict[str, Any], model_type: str, num_layers: int, windowed: bool) -> list[str]:
    """``layer_types`` as the family's transformers config fills them in when config.json has none."""
    if model_type == "gemma2":  # even layers slide, odd layers attend fully
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if model_type == "gemma3_text":  # every sliding_window_pattern-th layer attends fully
        pattern = int(config.get("sliding_window_pattern", 6))
        if pattern < 1:
            raise ConfigError(f"sliding_window_pattern must be a positive number of layers, got {pattern}")
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    first = num_layers
    if windowed and model_type in ("qwen2", "qwen3"):
        first = int(config.get("max_window_layers", 28))  # layers from max_window_layers on slide
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


def _window(value: Any) -> int:
    if int(value) < 1:
        raise ConfigError(f"sliding_window must be a positive number of tokens, got {value!r}")
    return int(value)
