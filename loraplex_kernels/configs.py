"""Launch configurations for the Triton kernels, chosen by shape (no autotuning).

Pure Python so the choices can be tested without a GPU. The interpreter runs every program instance
as a sequence of numpy calls, so there the configs favour few, large tiles; on a GPU they favour
enough programs to keep every SM streaming weights (split-K for the decode shrink, KV partitions for
short-batch attention).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# tl.dot needs every dimension to be at least 16.
MIN_DOT = 16
# Slices fused into one launch; larger groups are launched in chunks of this many.
MAX_SLICES_PER_LAUNCH = 3
# Programs per SM we aim for so that enough loads are in flight to saturate HBM.
PROGRAMS_PER_SM = 4
# Widest K / N tile under the interpreter: wider tiles mean fewer numpy calls, but past this size
# numpy's OpenBLAS goes multi-threaded for tl.dot, which is slower on a busy CPU, not faster.
INTERPRET_MAX_TILE = 256


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def _block_m(max_len: int) -> int:
    # Decode segments hold a handful of tokens: the smallest tile tl.dot accepts wastes least.
    return _clamp(next_pow2(max_len), MIN_DOT, 64)


@dataclass(frozen=True)
class ShrinkConfig:
    """Tiles of the shrink kernel; ``split_k`` programs share one token tile's reduction over K."""

    block_m: int
    block_k: int
    block_r: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def k_per_split(self, in_features: int) -> int:
        """Input features handled by one split (a whole number of ``block_k`` tiles)."""
        return cdiv(cdiv(in_features, self.block_k), self.split_k) * self.block_k


@dataclass(frozen=True)
class ExpandConfig:
    """Tiles of the expand kernel; the rank is reduced in ``block_r`` chunks inside each program."""

    block_m: int
    block_n: int
    block_r: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles of paged decode attention; each program covers ``partition`` tokens of one sequence."""

    block_n: int
    partition: int
    num_warps: int = 4
    num_stages: int = 2

    def num_partitions(self, max_context: int) -> int:
        """Programs per (sequence, KV head); more than one needs the reduce pass."""
        return max(1, cdiv(max_context, self.partition))


def shrink_config(
    *, max_len: int, num_segments: int, num_slices: int, in_features: int, max_rank: int, num_sms: int, interpret: bool
) -> ShrinkConfig:
    """Tiles for ``v = x A^T``: one rank tile, K streamed, split when there are too few programs."""
    block_m = _block_m(max_len)
    block_r = max(MIN_DOT, next_pow2(max_rank))
    k_cap = next_pow2(max(in_features, MIN_DOT))
    if interpret:
        return ShrinkConfig(block_m=block_m, block_k=min(k_cap, INTERPRET_MAX_TILE), block_r=block_r)
    # Keep the A tile near 8K elements (16 KiB at 16 bits) per pipeline stage.
    block_k = min(k_cap, _clamp(8192 // block_r, 32, 256))
    programs = cdiv(max(max_len, 1), block_m) * max(num_segments, 1) * max(num_slices, 1)
    k_tiles = cdiv(in_features, block_k)
    split_k = _clamp(cdiv(PROGRAMS_PER_SM * num_sms, programs), 1, k_tiles)
    # Normalise so that no split is empty.
    split_k = cdiv(k_tiles, cdiv(k_tiles, split_k))
    return ShrinkConfig(block_m=block_m, block_k=block_k, block_r=block_r, split_k=split_k, num_stages=3)


def expand_config(*, max_len: int, max_width: int, max_rank: int, interpret: bool) -> ExpandConfig:
    """Tiles for ``y += s v B^T``: rank chunks of at most 64, output columns across programs."""
    block_m = _block_m(max_len)
    n_cap = next_pow2(max(max_width, MIN_DOT))
    if interpret:
        block_r = max(MIN_DOT, next_pow2(max_rank))
        return ExpandConfig(block_m=block_m, block_n=min(n_cap, INTERPRET_MAX_TILE), block_r=block_r)
    block_r = _clamp(next_pow2(max_rank), MIN_DOT, 64)
    block_n = _clamp(8192 // block_r, 64, 256) if block_m <= 32 else 64
    return ExpandConfig(block_m=block_m, block_n=min(n_cap, block_n), block_r=block_r)


def attention_config(
    *, batch: int, num_kv_heads: int, max_context: int, num_sms: int, interpret: bool
) -> AttentionConfig:
    """Token tiles and KV partitions (flash-decoding) so small batches still fill the GPU."""
    if interpret:
        block_n = _clamp(next_pow2(max_context), MIN_DOT, 256)
        return AttentionConfig(block_n=block_n, partition=max(cdiv(max_context, block_n), 1) * block_n)
    block_n = 64
    tiles = max(cdiv(max_context, block_n), 1)
    # Long partitions amortise the reduce pass; split only when (sequence, head) pairs are scarce.
    wanted = cdiv(PROGRAMS_PER_SM * num_sms, max(batch * num_kv_heads, 1))
    partitions = _clamp(wanted, 1, max(cdiv(max_context, 256), 1))
    return AttentionConfig(block_n=block_n, partition=cdiv(tiles, partitions) * block_n)


@dataclass(frozen=True)
class PrefillConfig:
    """Tiles of varlen paged prefill attention: ``block_q`` query tokens (times the GQA group) per program,
    keys streamed ``block_n`` at a time."""

    block_q: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def prefill_config(
    *, max_query_len: int, group: int, head_dim: int, max_context: int, interpret: bool
) -> PrefillConfig:
    """Query tiles of about 128 rows (query tokens times the heads sharing a KV head), at least ``MIN_DOT``."""
    block_g = next_pow2(group)
    low = max(1, MIN_DOT // block_g)
    if interpret:
        high = max(low, 128 // block_g)
        block_q = _clamp(next_pow2(max_query_len), low, high)
        return PrefillConfig(block_q=block_q, block_n=_clamp(next_pow2(max_context), MIN_DOT, INTERPRET_MAX_TILE))
    # Wide heads hold a [rows, head_dim] fp32 accumulator in registers: halve the tiles past 128.
    wide = head_dim > 128
    high = max(low, (64 if wide else 128) // block_g)
    block_q = _clamp(next_pow2(max_query_len), low, high)
    return PrefillConfig(
        block_q=block_q, block_n=32 if wide else 64, num_warps=8 if block_q * block_g >= 128 else 4, num_stages=2
    )


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter has no SMs to fill)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
