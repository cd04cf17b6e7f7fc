"""Rotary position embeddings, computed exactly as ``transformers`` does (default, linear, llama3)."""

from __future__ import annotations

import math

import torch

from server.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """fp32 ``[head_dim // 2]`` inverse frequencies after any scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
    low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position up to ``max_positions``."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device):
        inv_freq = inverse_frequencies(rope, head_dim).to(device)
        freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Only the first half is kept: transformers duplicates it, so the halves are identical.
        self.cos = freqs.cos().to(dtype)
        self.sin = freqs.sin().to(dtype)
        self.half = head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim // 2]`` for the step's positions (built once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate ``x`` ``[T, heads, head_dim]`` in place (rotate-half convention)."""
        x1, x2 = x[..., : self.half], x[..., self.half :]
        rotated1 = x1 * cos - x2 * sin
        x2.mul_(cos).addcmul_(x1, sin)
        x1.copy_(rotated1)
