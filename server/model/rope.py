"""Rotary position embeddings, computed exactly as ``transformers`` 5 does (``modeling_rope_utils``).

Types: default, linear, dynamic (NTK), yarn, longrope, llama3, each with an optional partial rotary
factor. transformers changes the frequencies of ``dynamic`` and ``longrope`` with the length of the
sequence in the forward call; an engine cannot, because keys already in the KV cache were rotated with
the frequencies of their own step. So here they are fixed once, for the engine's context length
(``max_positions``): the frequencies transformers uses for one full forward of that many tokens.
For ``dynamic`` that is the unscaled set while the context fits max_position_embeddings; for ``longrope``
the short factors while it fits original_max_position_embeddings, else the long ones (as vLLM does).
"""

from __future__ import annotations

import math

import torch

from server.model.rope_config import RopeConfig


def rope_parameters(rope: RopeConfig, head_dim: int, context_len: int) -> tuple[torch.Tensor, float]:
    """fp32 ``[rotary_dim // 2]`` inverse frequencies for sequences up to ``context_len``, and cos/sin's multiplier."""
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.rope_type == "dynamic":
        seq_len = max(context_len, rope.original_max_position_embeddings)
        growth = rope.factor * seq_len / rope.original_max_position_embeddings - (rope.factor - 1)
        return 1.0 / ((rope.theta * growth ** (dim / (dim - 2))) ** exponents), 1.0
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, exponents)
    if rope.rope_type == "longrope":
        return _longrope(rope, exponents, context_len)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, inv_freq), 1.0
    return inv_freq, 1.0


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, keep high ones, ramp between; cos/sin grow by the mscale."""
    factor, original = rope.factor, rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = float(_yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta**exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


def _longrope(rope: RopeConfig, exponents: torch.Tensor, context_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dim factors, short or long by the context length; cos/sin scaled as the paper says."""
    original = rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if rope.factor <= 1.0 else math.sqrt(1 + math.log(rope.factor) / math.log(original))
    factors = rope.long_factor if context_len > original else rope.short_factor
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents), attention


class RotaryEmbedding:
    """Precomputed cos/sin tables for every position up to ``max_positions`` (the engine's context length)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype, device: torch.device):
        inv_freq, scaling = rope_parameters(rope, head_dim, max_positions)
        freqs = torch.arange(max_positions, device=device, dtype=torch.float32)[:, None] * inv_freq.to(device)[None, :]
        # Only the first half is kept: transformers duplicates it, so the halves are identical.
        self.cos = (freqs.cos() * scaling).to(dtype)
        self.sin = (freqs.sin() * scaling).to(dtype)
        self.half = inv_freq.numel()  # rotary_dim // 2; dims past rotary_dim pass through unrotated

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, rotary_dim // 2]`` for the step's positions (built once per step)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the first ``rotary_dim`` dims of ``x`` ``[T, heads, head_dim]`` in place (rotate-half convention)."""
        x1, x2 = x[..., : self.half], x[..., self.half : 2 * self.half]
        rotated1 = x1 * cos - x2 * sin
        x2.mul_(cos).addcmul_(x1, sin)
        x1.copy_(rotated1)
