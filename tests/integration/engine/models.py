"""Tiny random Llama/Mistral/Qwen2/Qwen3 (and Phi-3) checkpoints and PEFT adapters for engine tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from core.projections import PROJECTIONS

ALL_PROJECTIONS = list(PROJECTIONS)


def hf_config(arch: str, *, gqa: bool = True, bias: bool = False, tie: bool = False, **overrides: Any) -> Any:
    """A transformers config of a tiny model of ``arch`` (llama, mistral, qwen2, qwen3, phi3); no sliding window unless
    ``overrides`` set one (``sliding_window``, and for qwen2 ``use_sliding_window``, ``max_window_layers``).

    qwen3 defaults to head_dim 32, twice hidden / heads, as Qwen3 checkpoints have it. gemma2 and gemma3_text
    (tied, as Gemma is) default to head_dim 24 with query_pre_attn_scalar 32 (Gemma 2 27B also scales by
    neither), full attention (a window of 256) and the soft-capping of their transformers configs."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

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
        return MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen2":
        return Qwen2Config(**{"use_sliding_window": False, **common})
    if arch == "qwen3":
        return Qwen3Config(**{"head_dim": 32, "attention_bias": bias, "use_sliding_window": False, **common})
    if arch == "phi3":
        return Phi3Config(**common)
    if arch in ("gemma2", "gemma3_text"):
        from transformers import Gemma2Config, Gemma3TextConfig

        gemma = {"head_dim": 24, "query_pre_attn_scalar": 32, "sliding_window": 256}
        tied = {"tie_word_embeddings": True}  # `tie` aside: pass tie_word_embeddings=False for an untied Gemma
        return (Gemma2Config if arch == "gemma2" else Gemma3TextConfig)(**{**gemma, **common, **tied, **overrides})
    raise ValueError(arch)


def phi3_as_llama(phi3_dir: Path, out_dir: Path) -> Path:
    """A Phi-3 checkpoint rewritten as the Llama it is (qkv_proj and gate_up_proj split), rope settings kept.

    transformers' Llama cannot rotate part of a head; its Phi-3 can, so it is the reference for partial rotary."""
    from safetensors.torch import load_file, save_file

    config = json.loads((phi3_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    state = {}
    for name, tensor in load_file(str(phi3_dir / "model.safetensors")).items():
        if name.endswith("self_attn.qkv_proj.weight"):
            prefix = name.removesuffix("qkv_proj.weight")
            for proj, part in zip(("q", "k", "v"), tensor.split([q, kv, kv]), strict=True):
                state[f"{prefix}{proj}_proj.weight"] = part.contiguous()
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            gate, up = tensor.chunk(2)
            state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = gate.contiguous(), up.contiguous()
        else:
            state[name] = tensor
    out_dir.mkdir(parents=True)
    save_file(state, str(out_dir / "model.safetensors"))
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def rewrite_config(model_dir: Path, drop: tuple[str, ...] = (), **keys: Any) -> None:
    """Edit ``config.json`` in place: remove the ``drop`` keys, set ``keys`` (a config as older files spell it)."""
    path = model_dir / "config.json"
    config = {k: v for k, v in json.loads(path.read_text()).items() if k not in drop}
    path.write_text(json.dumps({**config, **keys}, indent=2))


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
