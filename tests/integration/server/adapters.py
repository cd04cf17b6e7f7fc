"""Adapters for server tests: one real PEFT adapter, fast variants of it, broken copies, and uploads to S3."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE
from core.base_fingerprint import BaseFingerprint
from core.descriptor import AdapterDescriptor
from core.storage import ObjectStore, sha256_file
from tests.integration.engine.models import ALL_PROJECTIONS, save_adapter
from trainer.manifest import stamp_origin

Tensors = dict[str, torch.Tensor]


def peft_adapter(base_dir: Path, out_dir: Path, seed: int = 1, r: int = 8) -> Path:
    """A LoRA saved by PEFT itself on every projection, with non-zero B so it changes the tokens."""
    return save_adapter(out_dir, base_dir, seed=seed, r=r, lora_alpha=2 * r, target_modules=ALL_PROJECTIONS)


def variant(source: Path, out_dir: Path, seed: int) -> Path:
    """Same PEFT config and tensor names as ``source``, new random values (a different adapter, made in ms)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        k: torch.randn(v.shape, generator=gen) * v.std() for k, v in load_file(source / ADAPTER_WEIGHTS_FILE).items()
    }
    return edited(source, out_dir, tensors=lambda _: tensors)


def edited(
    source: Path,
    out_dir: Path,
    config: dict | None = None,
    tensors: Callable[[Tensors], Tensors] | None = None,
) -> Path:
    """A copy of ``source`` with config fields replaced and/or tensors rewritten."""
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = json.loads((source / ADAPTER_CONFIG_FILE).read_text())
    settings.update(config or {})
    (out_dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(settings))
    weights = load_file(source / ADAPTER_WEIGHTS_FILE)
    save_file(tensors(weights) if tensors else weights, str(out_dir / ADAPTER_WEIGHTS_FILE))
    return out_dir


def copy_adapter(source: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        shutil.copy(source / name, out_dir / name)
    return out_dir


def made_on(source: Path, out_dir: Path, base: BaseFingerprint) -> Path:
    """A copy of ``source`` whose weights file records ``base`` as the one it was made on, as training does."""
    copy = copy_adapter(source, out_dir)
    stamp_origin(copy / ADAPTER_WEIGHTS_FILE, base)
    return copy


def upload(store: ObjectStore, adapter_dir: Path, base_model: str, name: str | None = None) -> AdapterDescriptor:
    """Put an adapter directory's two files in the store and describe it as the control plane would."""
    adapter_id = f"adapter-{uuid.uuid4().hex[:12]}"
    prefix = f"tenants/t-test/adapters/{adapter_id}/"
    config_path, weights_path = adapter_dir / ADAPTER_CONFIG_FILE, adapter_dir / ADAPTER_WEIGHTS_FILE
    store.put_file(prefix + ADAPTER_CONFIG_FILE, config_path)
    store.put_file(prefix + ADAPTER_WEIGHTS_FILE, weights_path)
    rank = int(json.loads(config_path.read_text()).get("r", 8))
    return AdapterDescriptor(
        id=adapter_id,
        name=name or f"ft:{base_model}:t-test:{adapter_id}",
        base_model=base_model,
        storage_prefix=prefix,
        sha256=sha256_file(weights_path),
        config_sha256=sha256_file(config_path),
        rank=max(rank, 1),
    )
