"""The base model's sizes are read from ``config.json`` once, with Hugging Face's defaults."""

from __future__ import annotations

import pytest

from core.adapter_format import BaseShapes
from core.model_sizes import ModelSizes

LLAMA = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 112, "num_attention_heads": 4}


def test_defaults_follow_transformers() -> None:
    sizes = ModelSizes.from_hf_config(LLAMA)
    assert (sizes.num_kv_heads, sizes.head_dim) == (4, 16)  # no GQA; hidden_size / heads
    assert sizes.base_shapes() == BaseShapes(num_layers=2, hidden_size=64, intermediate_size=112, q_size=64, kv_size=64)


def test_explicit_head_dim_and_kv_heads() -> None:
    sizes = ModelSizes.from_hf_config({**LLAMA, "num_key_value_heads": 2, "head_dim": 24})
    assert (sizes.q_size, sizes.kv_size) == (96, 48)
    assert sizes.base_shapes().in_out("o_proj") == (96, 64)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, KeyError),
        ({**LLAMA, "num_attention_heads": None}, TypeError),
        ({**LLAMA, "intermediate_size": "wide"}, ValueError),
        ([], TypeError),
    ],
)
def test_malformed_sizes_raise_what_callers_map(config, error) -> None:
    # The API turns these into a ConfigError naming LORAPLEX_BASE_MODEL; the server lets them surface.
    with pytest.raises(error):
        ModelSizes.from_hf_config(config)
