"""Triton paged-attention decode: one query token per sequence over its block table.

Grid: (KV head, sequence, partition). A program loads the query heads that share its KV head (GQA),
so each KV tile is read once, and streams its partition of the context with an online softmax.
With more than one partition (flash-decoding, for batches too small to fill the GPU) a second
kernel merges the partial results. Caches are strided views into the arena and are never copied.
With a sliding window a program starts at the window's first token (lo = context - window), so pages
before it are never read, and partitions wholly before it write nothing and are left out of the merge.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex_kernels.configs import MIN_DOT, AttentionConfig, attention_config, next_pow2, num_sms
from loraplex_kernels.triton_common import check_launchable, check_paged_caches, dot

NO_WINDOW = 2**31 - 1  # the window passed for full attention: longer than any context (int32)


@triton.jit
def _tanh(x):
    # No tanh in tl (libdevice's is missing under the interpreter); exp overflowing to inf still gives 1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_o_ptr,
    scale_log2,
    group,
    head_dim,
    partition,
    window,
    softcap_log2,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tn,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_pd,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    kv_head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)
    context = tl.load(context_lens_ptr + b)
    lo = tl.maximum(context - window, 0)  # the window's first token
    start = tl.maximum(part * partition, lo)
    end = tl.minimum(part * partition + partition, context)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + offs_g
    g_ok = offs_g < group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    if start >= end:
        if not SPLIT:
            # An empty sequence attends to nothing: zeros, as in the reference.
            out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
            zeros = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
            tl.store(out_ptrs, zeros.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        return
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + offs_n
        t_ok = tokens < end
        page = tl.load(block_tables_ptr + b * stride_tb + (tokens // BLOCK_SIZE) * stride_tn, mask=t_ok, other=0)
        page = page.to(tl.int64)
        slot = tokens % BLOCK_SIZE
        k_tile = tl.load(
            k_ptr
            + page[None, :] * stride_kp
            + slot[None, :] * stride_ks
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd,
            mask=d_ok[:, None] & t_ok[None, :],
            other=0.0,
        )
        scores = dot(q, k_tile, INTERPRET) * scale_log2
        if SOFTCAP:  # softcap * tanh(s / softcap), in the log2 units of the online softmax
            scores = softcap_log2 * _tanh(scores / softcap_log2)
        scores = tl.where(t_ok[None, :], scores, float("-inf"))
        # Every tile holds at least one live token, so m_new is finite and no NaN appears.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_tile = tl.load(
            v_ptr
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=t_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + dot(p.to(v_tile.dtype), v_tile, INTERPRET)
        m_i = m_new
    out = acc / l_i[:, None]
    mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        stats = b * stride_pb + heads * stride_ph + part * stride_pp
        tl.store(part_m_ptr + stats, m_i, mask=g_ok)
        tl.store(part_l_ptr + stats, l_i, mask=g_ok)
        tl.store(part_o_ptr + stats[:, None] * stride_pd + offs_d[None, :], out, mask=mask)
    else:
        out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_o_ptr,
    context_lens_ptr,
    partition,
    window,
    head_dim,
    stride_ob,
    stride_oh,
    stride_od,
    stride_pb,
    stride_ph,
    stride_pp,
    stride_pd,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    context = tl.load(context_lens_ptr + b)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    out_ptrs = out_ptr + b * stride_ob + head * stride_oh + offs_d * stride_od
    if context <= 0:
        tl.store(out_ptrs, tl.zeros((BLOCK_D,), dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=d_ok)
        return
    # Only partitions that overlap the window (or the whole context) wrote their statistics.
    lo = tl.maximum(context - window, 0)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = (offs_p < tl.cdiv(context, partition)) & (offs_p >= lo // partition)
    stats = b * stride_pb + head * stride_ph + offs_p * stride_pp
    m = tl.load(part_m_ptr + stats, mask=p_ok, other=float("-inf"))
    total = tl.load(part_l_ptr + stats, mask=p_ok, other=0.0)
    weight = tl.exp2(m - tl.max(m, axis=0)) * total
    o = tl.load(
        part_o_ptr + stats[:, None] * stride_pd + offs_d[None, :], mask=p_ok[:, None] & d_ok[None, :], other=0.0
    )
    out = tl.sum(o * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    config: AttentionConfig | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, num_heads, head_dim]`` over the first ``context_lens[b]`` cached tokens, or
    with a sliding ``window`` over the last ``window`` of them; ``softcap`` caps each scaled score ``s`` as
    ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_caches(q, k_cache, v_cache)
    interpret = check_launchable(q, k_cache, v_cache, block_tables, context_lens, interpret=interpret)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    cfg = config or attention_config(
        batch=batch,
        num_kv_heads=num_kv_heads,
        max_context=max_context,
        num_sms=num_sms(q.device),
        interpret=interpret,
    )
    partitions = cfg.num_partitions(max_context)
    block_d = max(MIN_DOT, next_pow2(head_dim))
    if partitions > 1:
        part_o = torch.empty(batch, num_heads, partitions, head_dim, dtype=torch.float32, device=q.device)
        part_m = torch.empty(batch, num_heads, partitions, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_o = part_m = part_l = out  # never touched when SPLIT is off
    # Flat (sequence, head, partition) index of m/l; times head_dim it addresses the partial outputs.
    part_strides = (*part_m.stride(), head_dim) if partitions > 1 else (0, 0, 0, 0)
    group = num_heads // num_kv_heads
    _decode_kernel[(num_kv_heads, batch, partitions)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_m,
        part_l,
        part_o,
        scale * math.log2(math.e),
        group,
        head_dim,
        cfg.partition,
        NO_WINDOW if window is None else window,
        (softcap or 1.0) * math.log2(math.e),
        *q.stride(),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        *block_tables.stride(),
        *out.stride(),
        *part_strides,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(MIN_DOT, next_pow2(group)),
        BLOCK_D=block_d,
        BLOCK_N=cfg.block_n,
        SPLIT=partitions > 1,
        SOFTCAP=softcap is not None,
        INTERPRET=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if partitions > 1:
        _merge_kernel[(num_heads, batch)](
            out,
            part_m,
            part_l,
            part_o,
            context_lens,
            cfg.partition,
            NO_WINDOW if window is None else window,
            head_dim,
            *out.stride(),
            *part_strides,
            BLOCK_P=max(2, next_pow2(partitions)),
            BLOCK_D=block_d,
        )
    return out
