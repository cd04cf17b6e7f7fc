"""Triton SGMV shrink and expand over adapter rows read in place from the paged arena.

Grid: axis 0 = tiles inside a segment (token tiles x K splits for shrink, token tiles x column tiles
for expand), axis 1 = segment, axis 2 = slice (up to three projections per launch). Programs of
no-adapter segments, rank-0 slices and tiles past a segment's end return at once, so ``y`` rows they
would cover are never touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex_kernels.configs import (
    MAX_SLICES_PER_LAUNCH,
    ExpandConfig,
    ShrinkConfig,
    cdiv,
    expand_config,
    num_sms,
    shrink_config,
)
from loraplex_kernels.layout import LayerLoraTables, Segments, SliceGroup
from loraplex_kernels.triton_common import check_launchable, dot

# CUDA caps grid axes 1 and 2 at 65535; segments live on axis 1.
MAX_SEGMENTS = 65535


@triton.jit
def _pick(s, a, b, c):
    return tl.where(s == 0, a, tl.where(s == 1, b, c))


@triton.jit
def _segment_rows(starts_ptr, token_index_ptr, seg, m_start, length, HAS_INDEX: tl.constexpr, BLOCK_M: tl.constexpr):
    offs_m = m_start + tl.arange(0, BLOCK_M)
    row_ok = offs_m < length
    pos = tl.load(starts_ptr + seg) + offs_m
    rows = tl.load(token_index_ptr + pos, mask=row_ok, other=0) if HAS_INDEX else pos
    return rows.to(tl.int64), row_ok


@triton.jit
def _shrink_kernel(
    x_ptr,
    arena_ptr,
    v_ptr,
    a_rows_ptr,
    ranks_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    token_index_ptr,
    proj0,
    proj1,
    proj2,
    slice_base,
    in_features,
    v_width,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_vm,
    stride_vs,
    stride_vr,
    stride_as,
    stride_ap,
    stride_ar,
    stride_rs,
    stride_rp,
    HAS_INDEX: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    s = tl.program_id(2)
    m_start = (tile // SPLIT_K) * BLOCK_M
    split = tile % SPLIT_K
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    length = tl.load(lengths_ptr + seg)
    if (slot < 0) | (m_start >= length):
        return
    proj = _pick(s, proj0, proj1, proj2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rs + proj * stride_rp), v_width)
    if rank <= 0:
        return
    rows, row_ok = _segment_rows(starts_ptr, token_index_ptr, seg, m_start, length, HAS_INDEX, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    a_row = tl.load(a_rows_ptr + slot * stride_as + proj * stride_ap + offs_r * stride_ar, mask=r_ok, other=0)
    if ROW_ALIGN > 1:
        a_row = tl.multiple_of(a_row, ROW_ALIGN)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, in_features)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        ks = k + offs_k
        # k_per_split is a whole number of tiles, so only the last tile of K needs this mask.
        k_ok = ks < in_features
        x_tile = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        # A^T tile [BLOCK_K, BLOCK_R]: each column is one adapter row, contiguous along K.
        a_tile = tl.load(arena_ptr + a_row[None, :] + ks[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += dot(x_tile, a_tile, INTERPRET)
    v_ptrs = v_ptr + rows[:, None] * stride_vm + (slice_base + s) * stride_vs + offs_r[None, :] * stride_vr
    mask = row_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(v_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(v_ptrs, acc, mask=mask)


@triton.jit
def _expand_kernel(
    y_ptr,
    v_ptr,
    arena_ptr,
    b_rows_ptr,
    ranks_ptr,
    scales_ptr,
    starts_ptr,
    lengths_ptr,
    slots_ptr,
    token_index_ptr,
    proj0,
    proj1,
    proj2,
    out0,
    out1,
    out2,
    width0,
    width1,
    width2,
    slice_base,
    v_width,
    n_tiles,
    stride_ym,
    stride_yn,
    stride_vm,
    stride_vs,
    stride_vr,
    stride_bs,
    stride_bp,
    stride_br,
    stride_rs,
    stride_rp,
    stride_ss,
    stride_sp,
    HAS_INDEX: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile = tl.program_id(0)
    seg = tl.program_id(1)
    s = tl.program_id(2)
    m_start = (tile // n_tiles) * BLOCK_M
    n_start = (tile % n_tiles) * BLOCK_N
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    length = tl.load(lengths_ptr + seg)
    width = _pick(s, width0, width1, width2)
    if (slot < 0) | (m_start >= length) | (n_start >= width):
        return
    proj = _pick(s, proj0, proj1, proj2)
    rank = tl.minimum(tl.load(ranks_ptr + slot * stride_rs + proj * stride_rp), v_width)
    if rank <= 0:
        return
    scale = tl.load(scales_ptr + slot * stride_ss + proj * stride_sp)
    rows, row_ok = _segment_rows(starts_ptr, token_index_ptr, seg, m_start, length, HAS_INDEX, BLOCK_M)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < rank
        v_tile = tl.load(
            v_ptr + rows[:, None] * stride_vm + (slice_base + s) * stride_vs + offs_r[None, :] * stride_vr,
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b_row = tl.load(b_rows_ptr + slot * stride_bs + proj * stride_bp + offs_r * stride_br, mask=r_ok, other=0)
        if ROW_ALIGN > 1:
            b_row = tl.multiple_of(b_row, ROW_ALIGN)
        b_tile = tl.load(arena_ptr + b_row[:, None] + offs_n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        # v is rounded to the weight dtype (as PEFT and vLLM do) so 16-bit weights use tensor cores.
        acc += dot(v_tile.to(b_tile.dtype), b_tile, INTERPRET)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + (_pick(s, out0, out1, out2) + offs_n)[None, :] * stride_yn
    mask = row_ok[:, None] & n_ok[None, :]
    y_old = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y_old.to(tl.float32) + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


def _padded(values: tuple[int, ...]) -> tuple[int, int, int]:
    """Three per-slice scalars for one launch; unused entries are never read (grid axis 2 is shorter)."""
    return (*values, *([0] * (MAX_SLICES_PER_LAUNCH - len(values))))  # type: ignore[return-value]


def _chunks(group: SliceGroup) -> list[range]:
    return [
        range(base, min(base + MAX_SLICES_PER_LAUNCH, group.num_slices))
        for base in range(0, group.num_slices, MAX_SLICES_PER_LAUNCH)
    ]


def _check_segments(segs: Segments, num_rows: int) -> None:
    if segs.num_segments > MAX_SEGMENTS:
        raise ValueError(f"at most {MAX_SEGMENTS} segments per launch, got {segs.num_segments}")
    if segs.num_tokens > num_rows:
        raise ValueError(f"segments cover {segs.num_tokens} tokens but the activations hold {num_rows} rows")


def sgmv_shrink(
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
    *,
    config: ShrinkConfig | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """``v[t, s, :r] = x[t] @ A_s^T`` per adapted segment; fp32 ``[num_tokens, num_slices, segs.max_rank]``."""
    if x.dim() != 2 or arena.dim() != 1 or x.dtype != arena.dtype:
        raise ValueError("x must be [tokens, in_features] and the arena a flat tensor of the same dtype")
    interpret = check_launchable(x, arena, tables.a_rows, tables.ranks, segs.starts, interpret=interpret)
    _check_segments(segs, x.shape[0])
    v = torch.zeros(x.shape[0], group.num_slices, segs.max_rank, dtype=torch.float32, device=x.device)
    if segs.max_rank == 0 or segs.max_len == 0 or segs.num_segments == 0:
        return v
    in_features = x.shape[1]
    cfg = config or shrink_config(
        max_len=segs.max_len,
        num_segments=segs.num_segments,
        num_slices=min(group.num_slices, MAX_SLICES_PER_LAUNCH),
        in_features=in_features,
        max_rank=segs.max_rank,
        num_sms=num_sms(x.device),
        interpret=interpret,
    )
    if cfg.block_r < segs.max_rank:
        raise ValueError(f"shrink tile of {cfg.block_r} ranks cannot hold rank {segs.max_rank}")
    k_per_split = cfg.k_per_split(in_features)
    splits = cdiv(in_features, k_per_split)
    index = segs.token_index if segs.token_index is not None else segs.starts
    for chunk in _chunks(group):
        grid = (cdiv(segs.max_len, cfg.block_m) * splits, segs.num_segments, len(chunk))
        _shrink_kernel[grid](
            x,
            arena,
            v,
            tables.a_rows,
            tables.ranks,
            segs.starts,
            segs.lengths,
            segs.slots,
            index,
            *_padded(group.projections[chunk.start : chunk.stop]),
            chunk.start,
            in_features,
            segs.max_rank,
            k_per_split,
            x.stride(0),
            x.stride(1),
            *v.stride(),
            *tables.a_rows.stride(),
            *tables.ranks.stride(),
            HAS_INDEX=segs.token_index is not None,
            ROW_ALIGN=tables.row_align,
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k,
            BLOCK_R=cfg.block_r,
            SPLIT_K=splits,
            INTERPRET=interpret,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return v


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
    *,
    config: ExpandConfig | None = None,
    interpret: bool | None = None,
) -> None:
    """``y[t, slice s] += scale_s * v[t, s, :r] @ B_s^T`` in place, accumulating in fp32."""
    if y.dim() != 2 or v.dim() != 3 or arena.dim() != 1 or v.shape[1] != group.num_slices:
        raise ValueError("y must be [tokens, width], v [tokens, num_slices, rank] and the arena flat")
    if max((o + w for o, w in zip(group.out_offsets, group.out_widths, strict=True)), default=0) > y.shape[1]:
        raise ValueError(f"slice group reaches past y's {y.shape[1]} columns")
    interpret = check_launchable(y, v, arena, tables.b_rows, tables.ranks, segs.starts, interpret=interpret)
    _check_segments(segs, min(y.shape[0], v.shape[0]))
    if v.shape[2] == 0 or segs.max_len == 0 or segs.num_segments == 0 or group.num_slices == 0:
        return
    max_width = max(group.out_widths)
    cfg = config or expand_config(max_len=segs.max_len, max_width=max_width, max_rank=v.shape[2], interpret=interpret)
    n_tiles = cdiv(max_width, cfg.block_n)
    index = segs.token_index if segs.token_index is not None else segs.starts
    for chunk in _chunks(group):
        grid = (cdiv(segs.max_len, cfg.block_m) * n_tiles, segs.num_segments, len(chunk))
        _expand_kernel[grid](
            y,
            v,
            arena,
            tables.b_rows,
            tables.ranks,
            tables.scales,
            segs.starts,
            segs.lengths,
            segs.slots,
            index,
            *_padded(group.projections[chunk.start : chunk.stop]),
            *_padded(group.out_offsets[chunk.start : chunk.stop]),
            *_padded(group.out_widths[chunk.start : chunk.stop]),
            chunk.start,
            v.shape[2],
            n_tiles,
            y.stride(0),
            y.stride(1),
            *v.stride(),
            *tables.b_rows.stride(),
            *tables.ranks.stride(),
            *tables.scales.stride(),
            HAS_INDEX=segs.token_index is not None,
            ROW_ALIGN=tables.row_align,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_R=cfg.block_r,
            INTERPRET=interpret,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
    *,
    shrink: ShrinkConfig | None = None,
    expand: ExpandConfig | None = None,
    interpret: bool | None = None,
) -> None:
    """``y += scale * B(A x)`` for every slice of ``group``: shrink then expand (nothing without adapters)."""
    if segs.max_rank == 0:
        return
    v = sgmv_shrink(x, arena, tables, group, segs, config=shrink, interpret=interpret)
    sgmv_expand(y, v, arena, tables, group, segs, config=expand, interpret=interpret)
