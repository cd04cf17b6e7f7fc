"""Triton paged prefill attention: every row of a mixed step (prompt chunks and decodes) in one launch.

Semantics: sequence ``s`` owns query rows ``query_starts[s] .. query_starts[s] + query_lens[s]``; its row ``i``
is the token at position ``context_lens[s] + i`` and attends causally to positions ``j <= context_lens[s] + i``
(with a sliding ``window``, also ``j > position - window``), all read from the paged cache through
``block_tables[s]``: the step's own keys must already be written there. Decode rows are sequences of one row.

Grid: (query tile, KV head, sequence). A program loads ``BLOCK_Q`` query tokens times the query heads that share
its KV head (GQA) as one ``[BLOCK_Q * BLOCK_G, head_dim]`` tile, so each K/V tile is read once for the whole
group, and streams keys from the first one its window reaches to its last row's position, with an online
softmax in fp32. Programs past their sequence's rows return at once. Caches are strided views, never copied.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from loraplex_kernels.configs import MIN_DOT, PrefillConfig, cdiv, next_pow2, prefill_config
from loraplex_kernels.triton_attention import NO_WINDOW, _tanh
from loraplex_kernels.triton_common import check_launchable, check_paged_caches, dot


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    query_starts_ptr,
    query_lens_ptr,
    context_lens_ptr,
    block_tables_ptr,
    scale_log2,
    group,
    head_dim,
    window,
    softcap_log2,
    stride_qt,
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
    stride_ot,
    stride_oh,
    stride_od,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    s = tl.program_id(2).to(tl.int64)
    query_len = tl.load(query_lens_ptr + s)
    first_q = q_tile * BLOCK_Q
    if first_q >= query_len:
        return
    query_start = tl.load(query_starts_ptr + s).to(tl.int64)
    context = tl.load(context_lens_ptr + s)
    # Row r of the tile is query token r // BLOCK_G of the tile and head r % BLOCK_G of the group.
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = first_q + offs_m // BLOCK_G
    g = offs_m % BLOCK_G
    row_ok = (q_idx < query_len) & (g < group)
    heads = kv_head * group + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    position = context + q_idx  # rows past the sequence are computed (keys past `end` masked) but never stored
    end = context + tl.minimum(first_q + BLOCK_Q, query_len)  # past the tile's last position: no key beyond it
    # The first key the window of the tile's first row reaches, rounded down to a whole tile.
    start = (tl.maximum(context + first_q - window + 1, 0) // BLOCK_N) * BLOCK_N
    q = tl.load(
        q_ptr + (query_start + q_idx)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + offs_n
        t_ok = tokens < end
        page = tl.load(block_tables_ptr + s * stride_tb + (tokens // BLOCK_SIZE) * stride_tn, mask=t_ok, other=0)
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
        seen = (tokens[None, :] <= position[:, None]) & (tokens[None, :] > position[:, None] - window)
        scores = tl.where(seen & t_ok[None, :], scores, float("-inf"))
        # A row may see no key of a tile (its window starts later, or the diagonal is past it): keep its
        # running max finite so that exp2 never meets inf - inf.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
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
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on rows that are never stored
    out_ptrs = (
        out_ptr + (query_start + q_idx)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    *,
    config: PrefillConfig | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Causal attention of every row of ``q`` ``[T, num_heads, head_dim]`` over its sequence's paged cache.

    ``query_starts``/``query_lens``/``context_lens`` (int32 ``[S]``) place each sequence's rows and the tokens it
    had cached before them; ``block_tables`` (int32 ``[S, W]``) must cover ``context_lens[s] + query_lens[s]``
    tokens, all already written; ``max_query_len`` (host int) is the longest ``query_lens``. A sliding ``window``
    keeps keys ``position - window < j``; ``softcap`` caps each scaled score as ``softcap * tanh(s / softcap)``.
    Rows no sequence owns are left as they were allocated (uninitialised)."""
    num_rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_paged_caches(q, k_cache, v_cache)
    num_seqs = query_lens.shape[0]
    if query_starts.shape[0] != num_seqs or context_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError("query_starts, query_lens, context_lens and block_tables need one entry per sequence")
    interpret = check_launchable(
        q, k_cache, v_cache, query_starts, query_lens, context_lens, block_tables, interpret=interpret
    )
    out = torch.empty_like(q)
    if num_rows == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    cfg = config or prefill_config(
        max_query_len=max_query_len,
        group=group,
        head_dim=head_dim,
        max_context=block_tables.shape[1] * block_size,
        interpret=interpret,
    )
    log2e = math.log2(math.e)
    _prefill_kernel[(cdiv(max_query_len, cfg.block_q), num_kv_heads, num_seqs)](
        q,
        k_cache,
        v_cache,
        out,
        query_starts,
        query_lens,
        context_lens,
        block_tables,
        scale * log2e,
        group,
        head_dim,
        NO_WINDOW if window is None else window,
        (softcap or 1.0) * log2e,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        BLOCK_SIZE=block_size,
        BLOCK_Q=cfg.block_q,
        BLOCK_G=next_pow2(group),
        BLOCK_D=max(MIN_DOT, next_pow2(head_dim)),
        BLOCK_N=cfg.block_n,
        SOFTCAP=softcap is not None,
        INTERPRET=interpret,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
