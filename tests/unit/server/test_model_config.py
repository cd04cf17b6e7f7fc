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
        ({"rope_scaling": {"rope_type": "yarn"}}, "rope type 'yarn' is not served"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor != 1 is not served"),
    ],
)
def test_unservable_configs_are_refused(change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**QWEN2, **change})
