"""Helpers the CPU benchmarks share: PEFT adapters with non-zero weights, and a PEFT model holding them all."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path
from typing import Any

import torch

from core.projections import PROJECTIONS
from core.tiny_model import TinyModelSpec

RANKS = (8, 16, 32)
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def bench_model(hidden: int, layers: int) -> TinyModelSpec:
    """The serving benchmarks' random-init Llama: 8 query / 4 KV heads from hidden 512 up, else 4 / 2."""
    large = hidden >= 512
    return TinyModelSpec(hidden=hidden, layers=layers, heads=8 if large else 4, kv_heads=4 if large else 2, seed=0)


def adapter_dir_name(index: int) -> str:
    """Directory (and, under an adapter root, model) name of the ``index``-th benchmark adapter."""
    return f"adapter-{index:02d}"


def make_adapters(base_dir: Path, out_dir: Path, num_adapters: int) -> list[Path]:
    """PEFT adapters with random non-zero weights, ranks cycling through 8/16/32."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = []
    for i in range(num_adapters):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        rank = RANKS[i % len(RANKS)]
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS), init_lora_weights=False)
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
        path = out_dir / adapter_dir_name(i)
        model.save_pretrained(path)
        dirs.append(path)
    return dirs


def make_many_adapters(base_dir: Path, out_dir: Path, num_adapters: int) -> list[Path]:
    """``num_adapters`` distinct adapters, fast: the first three (ranks 8/16/32) through PEFT as in
    :func:`make_adapters`, every later one a copy of the same rank's config with fresh random weights of the
    same shapes and scale (building a PEFT model per adapter takes seconds; thousands would take an hour)."""
    from safetensors.torch import load_file, save_file

    templates = make_adapters(base_dir, out_dir, min(num_adapters, len(RANKS)))
    weights = [load_file(t / ADAPTER_WEIGHTS) for t in templates]
    dirs = list(templates)
    for i in range(len(templates), num_adapters):
        template = i % len(RANKS)
        generator = torch.Generator().manual_seed(100 + i)
        fresh = {
            name: torch.randn(t.shape, generator=generator, dtype=t.dtype) * t.float().std().clamp_min(1e-3)
            for name, t in weights[template].items()
        }
        path = out_dir / adapter_dir_name(i)
        path.mkdir()
        shutil.copyfile(templates[template] / ADAPTER_CONFIG, path / ADAPTER_CONFIG)
        save_file(fresh, path / ADAPTER_WEIGHTS)
        dirs.append(path)
    return dirs


def load_peft(
    model_dir: Path, adapter_dirs: list[Path], names: list[str] | None = None, dtype: torch.dtype = torch.float32
) -> Any:
    """One ``PeftModel`` with every adapter loaded (named ``names``, default ``a0``, ``a1``, ...), in eval mode."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    names = names or [f"a{i}" for i in range(len(adapter_dirs))]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = PeftModel.from_pretrained(base, adapter_dirs[0], adapter_name=names[0])
    for name, path in zip(names[1:], adapter_dirs[1:], strict=True):
        model.load_adapter(path, adapter_name=name)
    return model.eval()


def pct(values: list[float], q: int) -> float:
    """The ``q``-th percentile (inclusive method; the one value when there is only one)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]
