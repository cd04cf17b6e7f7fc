"""Multi-LoRA and paged-attention kernels with one dispatch point.

``LORAPLEX_KERNELS`` picks the implementation: ``auto`` (default: Triton on CUDA, torch elsewhere),
``torch`` or ``triton``. Forcing Triton on a CPU tensor needs ``TRITON_INTERPRET=1`` set before
triton is first imported. This package imports nothing else of loraplex.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from loraplex_kernels.layout import (
    DOWN,
    GATE_UP,
    NO_ADAPTER,
    PROJ_INDEX,
    PROJECTIONS,
    QKV,
    ROW_ALIGN,
    KVGeometry,
    LayerLoraTables,
    LoraDelta,
    LoraTables,
    O,
    Segments,
    SliceGroup,
    kv_cache_views,
)

BACKENDS = ("auto", "torch", "triton")

__all__ = [
    "DOWN",
    "GATE_UP",
    "NO_ADAPTER",
    "PROJECTIONS",
    "PROJ_INDEX",
    "QKV",
    "ROW_ALIGN",
    "KVGeometry",
    "LayerLoraTables",
    "LoraDelta",
    "LoraTables",
    "O",
    "Segments",
    "SliceGroup",
    "add_lora",
    "backend_for",
    "kv_cache_views",
    "paged_attention_decode",
    "sgmv_expand",
    "sgmv_shrink",
]


def backend_for(device: torch.device) -> str:
    """The implementation used for tensors on ``device``: ``"torch"`` or ``"triton"``."""
    choice = os.environ.get("LORAPLEX_KERNELS", "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"LORAPLEX_KERNELS must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def _sgmv_impl(device: torch.device) -> ModuleType:
    if backend_for(device) == "triton":
        from loraplex_kernels import triton_sgmv

        return triton_sgmv
    from loraplex_kernels import torch_ops

    return torch_ops


def _attention_impl(device: torch.device) -> ModuleType:
    if backend_for(device) == "triton":
        from loraplex_kernels import triton_attention

        return triton_attention
    from loraplex_kernels import torch_ops

    return torch_ops


def sgmv_shrink(
    x: torch.Tensor, arena: torch.Tensor, tables: LayerLoraTables, group: SliceGroup, segs: Segments
) -> torch.Tensor:
    """``v = x @ A^T`` per segment and slice, fp32 ``[num_tokens, num_slices, segs.max_rank]``."""
    return _sgmv_impl(x.device).sgmv_shrink(x, arena, tables, group, segs)


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """``y[:, slice] += scale * v @ B^T`` per segment and slice, in place."""
    _sgmv_impl(y.device).sgmv_expand(y, v, arena, tables, group, segs)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """``y += scale * B(A x)`` for every slice of ``group`` (no-op when no segment has an adapter)."""
    _sgmv_impl(x.device).add_lora(y, x, arena, tables, group, segs)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged KV cache."""
    return _attention_impl(q.device).paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
