"""Tiny random Llama/Mistral/Qwen2 checkpoints and PEFT adapters for engine tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.projections import PROJECTIONS

ALL_PROJECTIONS = list(PROJECTIONS)


def hf_config(arch: str, *, gqa: bool = True, bias: bool = False, tie: bool = False, **overrides: Any) -> Any:
    """A transformers config of a tiny model of ``arch`` (llama, mistral, qwen2)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2 if gqa else 4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(attention_bias=bias, **common)
    if arch == "mistral":
        return MistralConfig(sliding_window=None, **common)
    if arch == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    raise ValueError(arch)


def save_model(directory: Path, config: Any, seed: int = 0, std: float = 0.15) -> Path:
    """Random weights (every parameter, biases and norms included) saved as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, std)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf(directory: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def save_adapter(directory: Path, base_dir: Path, seed: int, b_std: float = 0.5, **lora_kwargs: Any) -> Path:
    """A PEFT LoRA adapter with non-zero B (``init_lora_weights=False``), B scaled so deltas change tokens."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_hf(base_dir), LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.normal_(0.0, 0.3)
            elif "lora_B" in name:
                param.normal_(0.0, b_std)
    model.save_pretrained(directory)
    return directory
