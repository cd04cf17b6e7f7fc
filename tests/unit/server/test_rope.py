"""Every rope type gives transformers' inverse frequencies and cos/sin scaling, read from the same config.json."""

from __future__ import annotations

import copy

import pytest
import torch

from server.model.config import ModelConfig
from server.model.rope import RotaryEmbedding, rope_parameters

BASE = {
    "model_type": "llama",
    "vocab_size": 96,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
SHORT = [1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5]
LONG = [1.0, 1.3, 2.0, 3.5, 6.0, 9.0, 12.0, 16.0]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# config.json changes; the transformers class that reads them ("phi3" for partial rotary with the default type).
CASES = {
    "default": ("llama", {"rope_theta": 500000.0}),
    "default-partial": ("phi3", {"partial_rotary_factor": 0.75}),
    "linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "linear-partial": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}},
    ),
    "dynamic": ("llama", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    "yarn": ("llama", {"rope_parameters": {**YARN, "rope_theta": 1000000.0}}),
    "yarn-qwen3-head-dim": ("qwen3", {"head_dim": 32, "rope_scaling": YARN, "rope_theta": 1000000.0}),
    "yarn-mscale-betas-untruncated": (
        "llama",
        {
            "rope_scaling": {
                **YARN,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 16,
                "beta_slow": 2,
                "truncate": False,
            }
        },
    ),
    "yarn-attention-factor": ("llama", {"rope_scaling": {**YARN, "attention_factor": 1.5}}),
    "longrope": ("llama", {"rope_scaling": LONGROPE}),
    "longrope-factor-attention": ("llama", {"rope_scaling": {**LONGROPE, "factor": 2.0, "attention_factor": 1.1}}),
    "longrope-phi4-mini": (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32,
            "rope_scaling": {**LONGROPE, "short_factor": SHORT[:6], "long_factor": LONG[:6]},
        },
    ),
    "llama3": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "rope_theta": 500000.0,
        },
    ),
}
CONTEXTS = (16, 32, 33, 64, 65, 256, 1000)  # across every original length used above


def _hf(family: str, change: dict):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, Phi3Config, Qwen3Config

    cls = {"llama": LlamaConfig, "phi3": Phi3Config, "qwen3": Qwen3Config}[family]
    fields = {key: value for key, value in {**BASE, **change}.items() if key != "model_type"}
    return cls(**copy.deepcopy(fields))


def _hf_parameters(family: str, change: dict, context_len: int) -> tuple[torch.Tensor, float]:
    """What the family's rotary module in transformers holds after a forward over ``context_len`` tokens."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = _hf(family, change)
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        return Phi3RotaryEmbedding.compute_default_rope_parameters(config)  # partial-aware; Llama's is not
    # dynamic and longrope read seq_len (a forward's max position + 1); the others ignore it.
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=context_len)


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_scaling_match_transformers(name: str) -> None:
    family, change = CASES[name]
    config = ModelConfig.from_dict(
        {**BASE, **copy.deepcopy(change), "model_type": "qwen3" if family == "qwen3" else "llama"}
    )
    for context_len in CONTEXTS:
        inv_freq, scaling = rope_parameters(config.rope, config.head_dim, context_len)
        expected_freq, expected_scaling = _hf_parameters(family, change, context_len)
        assert inv_freq.shape == expected_freq.shape, context_len
        torch.testing.assert_close(inv_freq, expected_freq.float(), rtol=1e-6, atol=0)
        assert scaling == pytest.approx(expected_scaling, rel=1e-12)


def test_longrope_switches_factors_past_the_original_length() -> None:
    config = ModelConfig.from_dict({**BASE, "rope_scaling": LONGROPE})
    short, _ = rope_parameters(config.rope, config.head_dim, 64)
    long, _ = rope_parameters(config.rope, config.head_dim, 65)
    torch.testing.assert_close(short * torch.tensor(SHORT), long * torch.tensor(LONG))
    assert not torch.allclose(short, long)


def test_rotation_matches_phi3_partial_longrope() -> None:
    """The in-place rotation equals transformers' Phi-3 (partial rotary, long factors, cos/sin scaled)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    family, change = CASES["longrope-phi4-mini"]
    config = ModelConfig.from_dict({**BASE, **copy.deepcopy(change)})
    positions = torch.arange(45)
    x = torch.randn(45, 6, config.head_dim, generator=torch.Generator().manual_seed(0))  # 4 q heads + 2 kv heads
    cos, sin = Phi3RotaryEmbedding(_hf(family, change))(x, positions[None])
    q, k = apply_rotary_pos_emb(x[None, :, :4].transpose(1, 2), x[None, :, 4:].transpose(1, 2), cos, sin)
    expected = torch.cat([q, k], dim=1)[0].transpose(0, 1)

    rope = RotaryEmbedding(config.rope, config.head_dim, 45, torch.float32, torch.device("cpu"))
    got = x.clone()
    rope.apply_(got, *rope.tables(positions))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[..., 12:], x[..., 12:])  # the last quarter of each head is not rotated
