"""A random-init Llama checkpoint of any size and fixed-rank PEFT adapters on all seven projections, written fast.

``core.tiny_model`` has a byte-level vocabulary and untied embeddings, and ``bench.common.make_adapters`` builds a
PEFT model per adapter (seconds each at 1B parameters); the GPU benchmark needs Llama-3.2-1B's shapes and 64
adapters within a short lease, so tensors are drawn directly, on the GPU when there is one, and saved as PEFT
would save them (``adapter_config.json`` from PEFT's own ``LoraConfig``, keys as ``save_pretrained`` writes them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from core.projections import PROJECTIONS


@dataclass(frozen=True)
class LlamaDims:
    """The shapes and rope settings of a Llama checkpoint."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tie_embeddings: bool = True
    rope_theta: float = 500000.0
    max_position: int = 131072

    def params(self) -> int:
        """Parameter count (the tied embedding counted once)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate + 2 * self.hidden
        heads = 1 if self.tie_embeddings else 2
        return heads * self.vocab * self.hidden + self.layers * layer + self.hidden

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` width of each adaptable projection."""
        q, kv, h, i = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.hidden, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


# Llama-3.2-1B's shapes (its llama3 rope scaling left out: the engine and transformers agree either way).
LLAMA_3_2_1B = LlamaDims(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192, vocab=128256)
TINY = LlamaDims(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512, max_position=2048)

STD = 0.02  # Llama's initializer_range
EOS_ID = 2  # never produced on purpose: the benchmarks ignore EOS


def _parent(projection: str) -> str:
    return "self_attn" if projection in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def llama_config(dims: LlamaDims, dtype: torch.dtype) -> dict:
    """The ``config.json`` transformers' ``LlamaForCausalLM`` and our engine both load."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": EOS_ID,
        "pad_token_id": 0,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "hidden_size": dims.hidden,
        "initializer_range": STD,
        "intermediate_size": dims.intermediate,
        "max_position_embeddings": dims.max_position,
        "mlp_bias": False,
        "num_attention_heads": dims.heads,
        "num_hidden_layers": dims.layers,
        "num_key_value_heads": dims.kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": dims.rope_theta,
        "tie_word_embeddings": dims.tie_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
        "vocab_size": dims.vocab,
    }


def write_model(out_dir: Path, dims: LlamaDims, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """A random Llama of ``dims`` saved in ``dtype`` (config and safetensors only: prompts are token ids)."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * STD).to(dtype).cpu()

    tensors = {"model.embed_tokens.weight": normal(dims.vocab, dims.hidden)}
    for layer in range(dims.layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(dims.hidden, dtype=dtype)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(dims.hidden, dtype=dtype)
        for name, (width_in, width_out) in dims.projection_shapes().items():
            tensors[f"{p}{_parent(name)}.{name}.weight"] = normal(width_out, width_in)
    tensors["model.norm.weight"] = torch.ones(dims.hidden, dtype=dtype)
    if not dims.tie_embeddings:
        tensors["lm_head.weight"] = normal(dims.vocab, dims.hidden)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(llama_config(dims, dtype), indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def write_adapters(
    out_dir: Path, dims: LlamaDims, count: int, rank: int, dtype: torch.dtype, device: str, seed: int = 100
) -> list[Path]:
    """``count`` PEFT LoRA adapters of ``rank`` on all seven projections, each with its own random A and B.

    A is scaled like PEFT's Kaiming init and B so that the update is a few percent of the base projection's
    output: enough to change greedy tokens, small enough to keep activations in range."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), task_type="CAUSAL_LM")
    gen = torch.Generator(device=device).manual_seed(seed)
    dirs = []
    for index in range(count):
        tensors = {}
        for layer in range(dims.layers):
            for name, (width_in, width_out) in dims.projection_shapes().items():
                key = f"base_model.model.model.layers.{layer}.{_parent(name)}.{name}"
                a = torch.randn(rank, width_in, generator=gen, device=device) / width_in**0.5
                b = torch.randn(width_out, rank, generator=gen, device=device) * (STD / rank**0.5)
                tensors[key + ".lora_A.weight"] = a.to(dtype).cpu()
                tensors[key + ".lora_B.weight"] = b.to(dtype).cpu()
        path = out_dir / f"adapter-{index:02d}"
        config.save_pretrained(str(path))
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        dirs.append(path)
    return dirs


def describe(dims: LlamaDims) -> dict:
    """The dims as plain values, with the parameter count (for the benchmark's JSON)."""
    return {**asdict(dims), "params": dims.params()}
