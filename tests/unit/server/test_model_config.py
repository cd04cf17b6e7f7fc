"""The server's model config reads its sizes exactly as the API does, and refuses what it cannot run."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.model_sizes import ModelSizes
from server.model.config import ModelConfig

QWEN2 = {
    "model_type": "qwen2",
    "vocab_size": 96,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "eos_token_id": 2,
}


def test_sizes_are_the_api_reading() -> None:
    config = ModelConfig.from_dict(QWEN2, {"eos_token_id": [2, 5]})
    sizes = ModelSizes.from_hf_config(QWEN2)
    assert isinstance(config, ModelSizes)
    assert config.base_shapes() == sizes.base_shapes()
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.qkv_bias and config.eos_token_ids == (2, 5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma"}, "model_type 'gemma' is not served"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not served"),
        ({"mlp_bias": True}, "mlp_bias=true is not served"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
        ({"rope_scaling": {"rope_type": "proportional"}}, "rope_scaling.rope_type 'proportional' is not served"),
        ({"rope_parameters": {"rope_type": "mrope"}}, "rope_parameters.rope_type 'mrope' is not served"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor is required for rope_type 'linear'"),
        ({"partial_rotary_factor": 0.1}, "partial_rotary_factor 0.1 gives 1 rotated dims of head_dim 16"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8}},
            r"rope_scaling.short_factor must list 8 numbers \(rotated dims / 2\), got 1",
        ),
    ],
)
def test_unservable_configs_are_refused(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**QWEN2, **change})


def test_qwen3_normalises_q_and_k_and_may_widen_heads() -> None:
    qwen3 = {**QWEN2, "model_type": "qwen3", "head_dim": 32, "attention_bias": True}
    config = ModelConfig.from_dict(qwen3)
    assert config.qk_norm and config.qkv_bias and config.o_bias
    assert (config.head_dim, config.q_size, config.kv_size) == (32, 128, 64)
    assert not ModelConfig.from_dict({**qwen3, "attention_bias": False}).qkv_bias
    assert not ModelConfig.from_dict(QWEN2).qk_norm


def test_longrope_serves_the_original_context_unless_asked() -> None:
    """As vLLM: a LongRoPE model keeps its short factors by default; a longer max_model_len opts in to the long."""
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 4096}
    config = ModelConfig.from_dict(
        {**QWEN2, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "longrope", **factors}}
    )
    assert config.default_max_model_len == 4096
    assert config.rope.factor == 32.0  # max_position_embeddings / original, as transformers derives it
    assert ModelConfig.from_dict({**QWEN2, "max_position_embeddings": 4096}).default_max_model_len == 4096


WINDOWED = {**QWEN2, "num_hidden_layers": 4}
FULL, SLIDE = "full_attention", "sliding_attention"


@pytest.mark.parametrize(
    ("change", "windows"),
    [
        # MistralModel windows every layer when sliding_window is set, and ignores layer_types.
        ({"model_type": "mistral", "sliding_window": 16}, (16, 16, 16, 16)),
        ({"model_type": "mistral", "sliding_window": None}, (None,) * 4),
        ({"model_type": "mistral", "sliding_window": 16, "layer_types": [FULL] * 4}, (16,) * 4),
        # Llama has no sliding window: a stray key changes nothing.
        ({"model_type": "llama", "sliding_window": 16}, (None,) * 4),
        # Qwen2 files without layer_types: windows only with use_sliding_window, from max_window_layers on.
        ({"sliding_window": 32768, "use_sliding_window": False, "max_window_layers": 2}, (None,) * 4),
        ({"sliding_window": 24, "use_sliding_window": True, "max_window_layers": 2}, (None, None, 24, 24)),
        ({"sliding_window": 24, "use_sliding_window": True}, (None,) * 4),  # max_window_layers defaults to 28
        # layer_types (transformers 5 writes them) name each layer.
        (
            {"sliding_window": 24, "use_sliding_window": True, "layer_types": [SLIDE, FULL, SLIDE, FULL]},
            (24, None, 24, None),
        ),
        ({"sliding_window": None, "use_sliding_window": False, "layer_types": [FULL] * 4}, (None,) * 4),
    ],
)
def test_layer_windows_are_read_per_family(change, windows) -> None:
    assert ModelConfig.from_dict({**WINDOWED, **change}).layer_windows == windows


def test_layer_windows_match_transformers_qwen2_attention() -> None:
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    hf = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=24, max_window_layers=3,
    )  # fmt: skip
    expected = tuple(Qwen2Attention(hf, i).sliding_window for i in range(5))
    assert expected == (None, None, None, 24, 24)
    assert ModelConfig.from_dict(hf.to_dict()).layer_windows == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": [SLIDE, FULL]}, "layer_types lists 2 layers; num_hidden_layers is 4"),
        ({"layer_types": ["chunked_attention"] * 4}, r"layer_types \['chunked_attention'\] are not served"),
        ({"use_sliding_window": False, "sliding_window": 16, "layer_types": [SLIDE] * 4}, "no sliding_window"),
        ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive number"),
    ],
)
def test_unservable_windows_are_refused(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**WINDOWED, **change})
