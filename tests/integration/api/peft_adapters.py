"""LoRA adapters made with PEFT itself (the way a user would make one), and broken variants of them."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE


def make_peft_adapter(
    base_dir: Path, out_dir: Path, *, r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"), **lora: object
) -> Path:
    """``save_pretrained`` of a PEFT LoRA on ``base_dir`` (safetensors), with non-zero B so it does something."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False, **lora)
    get_peft_model(model, config).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def adapter_files(adapter_dir: Path) -> list[tuple[str, tuple[str, bytes, str]]]:
    """The multipart parts of an upload of ``adapter_dir``."""
    return [
        (
            ADAPTER_CONFIG_FILE,
            (ADAPTER_CONFIG_FILE, (adapter_dir / ADAPTER_CONFIG_FILE).read_bytes(), "application/json"),
        ),
        (
            ADAPTER_WEIGHTS_FILE,
            (ADAPTER_WEIGHTS_FILE, (adapter_dir / ADAPTER_WEIGHTS_FILE).read_bytes(), "application/octet-stream"),
        ),
    ]


def with_config(adapter_dir: Path, **changes: object) -> list[tuple[str, tuple[str, bytes, str]]]:
    """The upload of ``adapter_dir`` with fields of its adapter_config.json changed."""
    config = json.loads((adapter_dir / ADAPTER_CONFIG_FILE).read_text())
    config.update(changes)
    parts = adapter_files(adapter_dir)
    parts[0] = (ADAPTER_CONFIG_FILE, (ADAPTER_CONFIG_FILE, json.dumps(config).encode(), "application/json"))
    return parts


class _CreatesFile:
    """Unpickling this runs ``touch``: proof, if the file appears, that someone unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def pickle_payload(marker: Path) -> bytes:
    return pickle.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": _CreatesFile(marker)})
