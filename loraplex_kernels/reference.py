"""Obviously-correct torch loops for every kernel: the test oracle.

Each function has the exact signature and semantics of its Triton twin. They loop over segments
and rows in Python on purpose: speed is not their job, being easy to check by eye is.
"""

from __future__ import annotations

import torch

from loraplex_kernels.layout import NO_ADAPTER, LayerLoraTables, Segments, SliceGroup


def _segment_rows(segs: Segments, g: int) -> torch.Tensor:
    start = int(segs.starts[g])
    positions = torch.arange(start, start + int(segs.lengths[g]), device=segs.starts.device)
    if segs.token_index is None:
        return positions.long()
    return segs.token_index[positions]


def _gather_rows(arena: torch.Tensor, offsets: torch.Tensor, rank: int, width: int) -> torch.Tensor:
    """Rows ``offsets[:rank]`` of ``width`` elements each, as a ``[rank, width]`` fp32 matrix."""
    rows = [arena[int(off) : int(off) + width] for off in offsets[:rank].tolist()]
    return torch.stack(rows).float()


def sgmv_shrink(
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> torch.Tensor:
    """``v[t, s, :r] = x[t] @ A_s^T`` for every token of every adapted segment, in fp32.

    Returns ``[num_tokens, num_slices, segs.max_rank]`` fp32; entries past a slice's rank and rows of
    tokens without an adapter are zero.
    """
    v = torch.zeros(x.shape[0], group.num_slices, segs.max_rank, dtype=torch.float32, device=x.device)
    in_features = x.shape[1]
    for g in range(segs.num_segments):
        slot = int(segs.slots[g])
        if slot == NO_ADAPTER or int(segs.lengths[g]) == 0:
            continue
        rows = _segment_rows(segs, g)
        for s, proj in enumerate(group.projections):
            rank = int(tables.ranks[slot, proj])
            if rank == 0:
                continue
            a = _gather_rows(arena, tables.a_rows[slot, proj], rank, in_features)
            v[rows, s, :rank] = x[rows].float() @ a.T
    return v


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """``y[t, slice s] += scale_s * v[t, s, :r] @ B_s^T`` in place, accumulating in fp32.

    Tokens of segments without an adapter, and slices of rank 0, leave ``y`` untouched.
    """
    for g in range(segs.num_segments):
        slot = int(segs.slots[g])
        if slot == NO_ADAPTER or int(segs.lengths[g]) == 0:
            continue
        rows = _segment_rows(segs, g)
        for s, proj in enumerate(group.projections):
            rank = int(tables.ranks[slot, proj])
            if rank == 0:
                continue
            offset, width = group.out_offsets[s], group.out_widths[s]
            b_t = _gather_rows(arena, tables.b_rows[slot, proj], rank, width)
            delta = float(tables.scales[slot, proj]) * (v[rows, s, :rank] @ b_t)
            y[rows, offset : offset + width] = (y[rows, offset : offset + width].float() + delta).to(y.dtype)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """``y += scale * B(A x)`` for every slice of ``group``: shrink then expand."""
    if segs.max_rank == 0:
        return
    v = sgmv_shrink(x, arena, tables, group, segs)
    sgmv_expand(y, v, arena, tables, group, segs)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence attending over its first ``context_lens[b]`` cached tokens.

    ``q``: ``[B, num_heads, head_dim]``; caches: ``[num_pages, block_size, num_kv_heads, head_dim]``;
    ``block_tables``: ``[B, max_blocks]`` page ids. Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)`` (GQA). Returns ``[B, num_heads, head_dim]`` in ``q.dtype``.
    With a sliding ``window`` only the last ``window`` tokens are read: positions below
    ``context_lens[b] - window`` are skipped (the query is the token at ``context_lens[b] - 1``).
    With ``softcap`` each scaled score ``s`` becomes ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2).
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(batch):
        n = int(context_lens[b])
        if n == 0:
            continue
        first = max(0, n - window) if window is not None else 0
        pages = block_tables[b, : (n + block_size - 1) // block_size].long()
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[first:n].float()
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[first:n].float()
        keys = keys.repeat_interleave(group, dim=1)  # [n, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, values).to(q.dtype)
    return out


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
) -> torch.Tensor:
    """Causal attention of each sequence's rows over its pages, keys and values read only from the cache.

    Sequence ``s`` owns rows ``query_starts[s] .. + query_lens[s]`` of ``q`` ``[T, num_heads, head_dim]``; its
    row ``i`` is position ``p = context_lens[s] + i`` and sees keys ``j <= p`` (and ``j > p - window`` with a
    window). ``softcap`` caps scaled scores as ``softcap * tanh(s / softcap)`` before the mask. Rows no sequence
    owns are zero; ``max_query_len`` is unused (the Triton kernel sizes its grid with it)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for s in range(query_lens.shape[0]):
        start, n, context = int(query_starts[s]), int(query_lens[s]), int(context_lens[s])
        if n == 0:
            continue
        total = context + n
        pages = block_tables[s, : (total + block_size - 1) // block_size].long()
        keys = k_cache[pages].reshape(-1, num_kv_heads, head_dim)[:total].float().repeat_interleave(group, dim=1)
        values = v_cache[pages].reshape(-1, num_kv_heads, head_dim)[:total].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,nhd->hqn", q[start : start + n].float(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        rows = torch.arange(context, total, device=q.device)[:, None]
        cols = torch.arange(total, device=q.device)[None, :]
        seen = cols <= rows
        if window is not None:
            seen &= cols > rows - window
        probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
        out[start : start + n] = torch.einsum("hqn,nhd->qhd", probs, values).to(q.dtype)
    return out
