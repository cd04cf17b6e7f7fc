"""Attention over the paged KV cache: one varlen kernel launch for a step holding prompt chunks where the backend
has one (Triton), else SDPA per prefill chunk; the paged decode kernel for single tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex_kernels import KernelBackend
from loraplex_kernels.torch_ops import softcapped_attention


@dataclass
class PrefillSpan:
    """A run of one sequence's new tokens (rows ``start .. start + length`` of the step)."""

    start: int
    length: int
    context_len: int  # tokens of this sequence already cached before the span
    block_table: torch.Tensor  # int32 pages covering context_len + length tokens


@dataclass
class VarlenSpans:
    """Every scheduled sequence's rows of a step, for one varlen prefill launch (chunks and decodes together)."""

    query_starts: torch.Tensor  # int32 [S] first row of each sequence
    query_lens: torch.Tensor  # int32 [S] rows (new tokens) of each sequence
    context_lens: torch.Tensor  # int32 [S] tokens cached before this step
    block_tables: torch.Tensor  # int32 [S, W] pages covering context_lens + query_lens tokens
    max_query_len: int  # host int: sizes the kernel's grid


@dataclass
class AttentionMetadata:
    """Where each of the step's tokens writes its K/V, and which attention path each token takes."""

    write_pages: torch.Tensor  # int64 [T]
    write_offsets: torch.Tensor  # int64 [T]
    prefills: list[PrefillSpan]
    decode_rows: torch.Tensor | None  # int64 [B] rows of single-token sequences; None when all rows decode
    decode_block_tables: torch.Tensor | None  # int32 [B, blocks of the longest decode sequence]
    decode_context_lens: torch.Tensor | None  # int32 [B], including the new token
    all_decode: bool  # every row is a decode row, in order: no gather/scatter needed
    # Set on steps holding prompt chunks when the backend attends to every row in one launch (varlen_prefill);
    # the spans and decode fields above are then left empty.
    varlen: VarlenSpans | None = None


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata):
    """Store the step's new keys and values into their pages."""
    k_cache[meta.write_pages, meta.write_offsets] = k
    v_cache[meta.write_pages, meta.write_offsets] = v


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kernels: KernelBackend,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the step's queries ``[T, heads, d]``; ``k``/``v`` must already be in the cache.

    With a sliding ``window`` the query at position ``i`` sees keys ``i - window < j <= i``, as transformers'
    ``sliding_window_overlay`` (``kv_idx > q_idx - sliding_window``). With ``softcap`` scaled scores ``s`` become
    ``softcap * tanh(s / softcap)`` before the mask and softmax (Gemma 2)."""
    if meta.all_decode:
        return kernels.paged_attention_decode(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, window, softcap
        )
    if meta.varlen is not None:
        spans = meta.varlen
        return kernels.paged_attention_prefill(
            q,
            k_cache,
            v_cache,
            spans.query_starts,
            spans.query_lens,
            spans.context_lens,
            spans.block_tables,
            spans.max_query_len,
            scale,
            window,
            softcap,
        )
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for span in meta.prefills:
        end = span.start + span.length
        query = q[span.start : end].transpose(0, 1).unsqueeze(0)
        total = span.context_len + span.length
        # Keys before ``first`` are outside every row's window (0 for a first chunk, or without a window).
        first = 0 if window is None else max(0, span.context_len + 1 - window)
        if span.context_len == 0:
            keys, values = k[span.start : end], v[span.start : end]
        else:
            # A later chunk: attend to the earlier chunks' keys, read back from their pages, from the page
            # holding ``first`` on.
            skip = first // k_cache.shape[1]
            tokens = slice(first - skip * k_cache.shape[1], total - skip * k_cache.shape[1])
            keys = k_cache[span.block_table[skip:]].flatten(0, 1)[tokens]
            values = v_cache[span.block_table[skip:]].flatten(0, 1)[tokens]
        mask = None  # plain causal: a first chunk that fits in its window
        if span.context_len or (window is not None and window < span.length) or softcap is not None:
            rows = torch.arange(span.context_len, total, device=q.device)[:, None]
            cols = torch.arange(first, total, device=q.device)[None, :]
            mask = cols <= rows if window is None else (cols <= rows) & (cols > rows - window)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                query,
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
        else:  # SDPA cannot cap scores
            o = softcapped_attention(query, keys.unsqueeze(0), values.unsqueeze(0), mask, scale, softcap)
        out[span.start : end] = o[0].transpose(0, 1)
    if meta.decode_rows is not None:
        out[meta.decode_rows] = kernels.paged_attention_decode(
            q[meta.decode_rows],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            window,
            softcap,
        )
    return out
