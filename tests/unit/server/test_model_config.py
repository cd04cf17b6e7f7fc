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


# As microsoft/Phi-3-mini-128k-instruct's first config.json ("su" for LongRoPE), in small.
PHI3_MINI_128K = {
    **QWEN2,
    "model_type": "phi3",
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
    "sliding_window": 262144,
}


def test_phi3_reads_its_configs_as_transformers_does() -> None:
    from transformers import Phi3Config

    def hf(config: dict) -> Phi3Config:
        return Phi3Config(**{k: v for k, v in config.items() if k != "model_type"})

    config = ModelConfig.from_dict(PHI3_MINI_128K)
    assert config.rope.rope_type == hf(PHI3_MINI_128K).rope_parameters["rope_type"] == "longrope"
    assert config.rope.original_max_position_embeddings == 4096 and config.default_max_model_len == 4096
    assert config.rms_norm_eps == hf(PHI3_MINI_128K).rms_norm_eps == 1e-5  # Phi3Config's default, not Llama's
    assert config.layer_windows == (262144, 262144) and not config.qkv_bias
    assert config.base_shapes().modules.names == ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    assert config.base_shapes().in_out("qkv_proj") == (64, 192)
    # Without the top-level original length Phi3Config supplies 4096, not max_position_embeddings.
    bare = {k: v for k, v in PHI3_MINI_128K.items() if k != "original_max_position_embeddings"}
    original = ModelConfig.from_dict(bare).rope.original_max_position_embeddings
    assert original == hf(bare).original_max_position_embeddings == 4096
    # "yarn" is another old Phi-3 name for LongRoPE; for other families it is YaRN.
    yarn = {**PHI3_MINI_128K, "rope_scaling": {**PHI3_MINI_128K["rope_scaling"], "type": "yarn"}}
    assert ModelConfig.from_dict(yarn).rope.rope_type == "longrope"


WINDOWED = {**QWEN2, "num_hidden_layers": 4}
FULL, SLIDE = "full_attention", "sliding_attention"


@pytest.mark.parametrize(
    ("change", "windows"),
    [
        # MistralModel windows every layer when sliding_window is set, and ignores layer_types.
        ({"model_type": "mistral", "sliding_window": 16}, (16, 16, 16, 16)),
        ({"model_type": "mistral", "sliding_window": None}, (None,) * 4),
        ({"model_type": "mistral", "sliding_window": 16, "layer_types": [FULL] * 4}, (16,) * 4),
        # Phi3Model windows every layer too (Phi-3-mini: 2047 tokens).
        ({"model_type": "phi3", "sliding_window": 2047}, (2047,) * 4),
        ({"model_type": "phi3", "sliding_window": None}, (None,) * 4),
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


# As google/gemma-2-2b's config.json, in small: both activation keys, transformers' defaults for the rest.
GEMMA2 = {
    **QWEN2,
    "model_type": "gemma2",
    "num_hidden_layers": 4,
    "head_dim": 24,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 24,
    "sliding_window": 16,
}
# As google/gemma-3-1b-it's config.json (transformers 4 keys), in small.
GEMMA3 = {
    **GEMMA2,
    "model_type": "gemma3_text",
    "num_hidden_layers": 7,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window_pattern": 3,
}
GEMMA_CASES = {
    "gemma2-2b": GEMMA2,
    "gemma2-uncapped-biased": {
        **GEMMA2,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "attention_bias": True,
    },
    "gemma2-layer-types": {**GEMMA2, "layer_types": [FULL, FULL, SLIDE, FULL], "final_logit_softcapping": 12.5},
    "gemma3-1b": GEMMA3,
    # 4B and up: linear scaling of the global layers' rope; without sliding_window_pattern every sixth is global.
    "gemma3-4b": {
        **{k: v for k, v in GEMMA3.items() if k != "sliding_window_pattern"},
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "attn_logit_softcapping": 20.0,  # in the config, but transformers' Gemma3Attention never applies it
    },
    # As transformers 5 writes it: rope_parameters per layer type, layer_types, no legacy keys.
    "gemma3-transformers5": {
        **{k: v for k, v in GEMMA3.items() if not k.startswith("rope") and k != "sliding_window_pattern"},
        "num_hidden_layers": 4,
        "layer_types": [SLIDE, FULL, SLIDE, SLIDE],
        "rope_parameters": {
            FULL: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 5e5},
            SLIDE: {"rope_type": "default", "rope_theta": 2e4},
        },
        "final_logit_softcapping": 30.0,
    },
}


@pytest.mark.parametrize("name", list(GEMMA_CASES))
def test_gemma_reads_its_configs_as_transformers_does(name) -> None:
    from transformers import AutoConfig

    raw = GEMMA_CASES[name]
    hf = AutoConfig.for_model(**raw)
    config = ModelConfig.from_dict(raw)
    # Gemma2Attention and Gemma3Attention: the window on sliding_attention layers, none on the others.
    assert config.layer_windows == tuple(hf.sliding_window if t == SLIDE else None for t in hf.layer_types)
    assert SLIDE in hf.layer_types and FULL in hf.layer_types
    assert config.hidden_act == hf.hidden_activation == "gelu_pytorch_tanh"
    assert config.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert config.tie_word_embeddings == hf.tie_word_embeddings is True
    assert config.max_position_embeddings == hf.max_position_embeddings
    assert config.norm_plus_one and config.sandwich_norms and config.embed_scale == 64**0.5
    assert config.final_softcap == hf.final_logit_softcapping
    assert config.qkv_bias == config.o_bias == hf.attention_bias  # q, k, v and o alike
    if raw["model_type"] == "gemma2":
        assert config.attn_softcap == hf.attn_logit_softcapping and config.local_rope is None
        assert config.rope.theta == hf.rope_parameters["rope_theta"] and not config.qk_norm
        return
    assert config.attn_softcap is None and config.qk_norm
    for rope, layer_type in ((config.rope, FULL), (config.local_rope, SLIDE)):
        params = hf.rope_parameters[layer_type]
        assert (rope.rope_type, rope.theta, rope.factor) == (
            params["rope_type"],
            params["rope_theta"],
            params.get("factor", 1.0),
        )
    assert [config.layer_rope(n) for n in range(config.num_layers)] == [
        config.local_rope if t == SLIDE else config.rope for t in hf.layer_types
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not served"),
        ({"head_dim": None}, "head_dim is missing: a gemma2 config.json must state it"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not served"),
        ({"attn_logit_softcapping": 0.0}, "attn_logit_softcapping must be a positive number or null, got 0.0"),
        ({"final_logit_softcapping": -1}, "final_logit_softcapping must be a positive number or null"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
        ({"sliding_window": None}, "no sliding_window applies"),
        ({"model_type": "gemma3_text", "sliding_window_pattern": 0}, "sliding_window_pattern must be a positive"),
        (
            {"model_type": "gemma3_text", "rope_parameters": {FULL: {"rope_type": "mrope"}}},
            "rope_parameters.full_attention.rope_type 'mrope' is not served",
        ),
        (
            {"model_type": "gemma3_text", "rope_parameters": {SLIDE: {"rope_type": "linear"}}},
            "rope_parameters.sliding_attention.factor is required for rope_type 'linear'",
        ),
    ],
)
def test_unservable_gemma_configs_are_refused(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**GEMMA2, **change})
