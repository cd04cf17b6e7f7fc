"""Vectorised torch versions of every kernel: the CPU fast path (same signatures as :mod:`loraplex_kernels.reference`).

Adapter rows are read in place: when a matrix's rows are evenly spaced by their width (the pool packs
each fused group's A rows, and each projection's B^T rows, adjacently), the matrix is a zero-copy view
of the arena; otherwise its rows are gathered. In fp32 and bf16 every segment of a layer and fused group goes
through one call of a small C loop (``cpu_sgmv.c``, built once per machine by ``cpu_library``)
when a C compiler exists: at decode a torch op costs far more to dispatch than to compute, and at
prefill the loop's blocked shrink and expand beat per-segment matmuls (about 0.5 s of the engine benchmark's
prefill LoRA became about 0.15 s). Otherwise, or with ``LORAPLEX_CPU_SGMV=0``, each segment takes one matmul
per fused group for the shrink and one per slice for the expand.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from loraplex_kernels.cpu_library import c_library, c_threads
from loraplex_kernels.layout import NO_ADAPTER, LayerLoraTables, Segments, SliceGroup

# The C loop's work items: a (chunk of at most this many tokens of one segment, slice). Chunks let a long
# prefill segment use every thread, and keep a chunk's rows of x and y in L1/L2 while the adapter rows pass.
C_CHUNK_TOKENS = 64
# What the C loops compute in (fp32 arithmetic either way; bf16 tensors are widened as they are read).
C_DTYPES = (torch.float32, torch.bfloat16)
# The C attention loop's limits (cpu_attention.c: MAX_BLOCK, and whole 8-float vectors per head).
C_ATTENTION_MAX_BLOCK = 64


@dataclass
class _SegmentPlan:
    rows: slice | torch.Tensor  # a slice of x/y rows, or row indices when the step is permuted
    a: torch.Tensor | None  # [sum of slice ranks, in_features]: the group's A rows (None: not needed)
    b_t: list[torch.Tensor | None]  # per slice: [rank, out_width] B^T rows, None when rank 0
    ranks: list[int]
    scales: list[float]


def _rows(arena: torch.Tensor, offsets: list[int], width: int) -> torch.Tensor:
    """``[len(offsets), width]`` rows starting at ``offsets``: a view when evenly spaced, else a gathered copy."""
    first, n = offsets[0], len(offsets)
    if offsets == list(range(first, first + n * width, width)):
        return arena[first : first + n * width].view(n, width)
    index = torch.tensor(offsets, device=arena.device)[:, None] + torch.arange(width, device=arena.device)
    return arena[index]


def _plan(
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
    in_features: int | None,
) -> list[_SegmentPlan]:
    """Per adapted segment: its rows and views of its A and B^T matrices."""
    slots, starts, lengths = segs.slots.tolist(), segs.starts.tolist(), segs.lengths.tolist()
    used = [g for g in range(len(slots)) if slots[g] != NO_ADAPTER and lengths[g]]
    if not used:
        return []
    index = torch.tensor([slots[g] for g in used], device=tables.ranks.device)
    projs = torch.tensor(group.projections, device=tables.ranks.device)
    width = max(segs.max_rank, 1)
    ranks = tables.ranks[index][:, projs].tolist()
    scales = tables.scales[index][:, projs].tolist()
    a_rows = tables.a_rows[index][:, projs, :width].tolist()
    b_rows = tables.b_rows[index][:, projs, :width].tolist()
    plans = []
    for j, g in enumerate(used):
        if not any(ranks[j]):
            continue
        if segs.token_index is None:
            rows: slice | torch.Tensor = slice(starts[g], starts[g] + lengths[g])
        else:
            rows = segs.token_index[starts[g] : starts[g] + lengths[g]]
        a_offsets = [off for s, r in enumerate(ranks[j]) for off in a_rows[j][s][:r]]
        b_t = [_rows(arena, b_rows[j][s][:r], group.out_widths[s]) if r else None for s, r in enumerate(ranks[j])]
        a = _rows(arena, a_offsets, in_features) if in_features is not None else None
        plans.append(_SegmentPlan(rows, a, b_t, ranks[j], scales[j]))
    return plans


def _expand_segment(y: torch.Tensor, v: torch.Tensor, plan: _SegmentPlan, group: SliceGroup) -> None:
    """``y[rows, slice] += scale * v[:, slice ranks] @ B^T`` for every slice of one segment."""
    col = 0
    in_place = isinstance(plan.rows, slice) and y.dtype == torch.float32
    for s, rank in enumerate(plan.ranks):
        if not rank:
            continue
        b_t, scale = plan.b_t[s], plan.scales[s]
        offset, width = group.out_offsets[s], group.out_widths[s]
        vs = v[:, col : col + rank]
        col += rank
        if in_place:
            y[plan.rows, offset : offset + width].addmm_(vs, b_t, alpha=scale)
        else:
            delta = torch.mm(vs, b_t.float()).mul_(scale)
            target = y[:, offset : offset + width]
            if isinstance(plan.rows, slice):
                target[plan.rows] = (target[plan.rows].float() + delta).to(y.dtype)
            else:
                target.index_put_((plan.rows,), (target[plan.rows].float() + delta).to(y.dtype))


def _shrink_segment(x: torch.Tensor, plan: _SegmentPlan) -> torch.Tensor:
    xs = x[plan.rows]
    if xs.dtype == torch.float32 and plan.a.dtype == torch.float32:
        return xs @ plan.a.t()
    return xs.float() @ plan.a.float().t()


def sgmv_shrink(
    x: torch.Tensor, arena: torch.Tensor, tables: LayerLoraTables, group: SliceGroup, segs: Segments
) -> torch.Tensor:
    """``v[t, s, :r] = x[t] @ A_s^T`` in fp32, ``[num_tokens, num_slices, segs.max_rank]``; zero elsewhere."""
    v = torch.zeros(x.shape[0], group.num_slices, segs.max_rank, dtype=torch.float32, device=x.device)
    for plan in _plan(arena, tables, group, segs, x.shape[1]):
        vs = _shrink_segment(x, plan)
        col = 0
        for s, rank in enumerate(plan.ranks):
            v[plan.rows, s, :rank] = vs[:, col : col + rank]
            col += rank
    return v


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """``y[t, slice s] += scale_s * v[t, s, :r] @ B_s^T`` in place; untouched where there is no adapter."""
    for plan in _plan(arena, tables, group, segs, None):
        vs = torch.cat([v[plan.rows, s, :rank] for s, rank in enumerate(plan.ranks) if rank], dim=1)
        _expand_segment(y, vs, plan, group)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """``y += scale * B(A x)`` for every slice of ``group``: one C call for the whole step where the loop
    applies (fp32 or bf16 on CPU), else one shrink matmul per segment, then the expands.

    A convenience that decides and plans on every call; the engine's ``TorchBackend`` does both once."""
    if segs.max_rank == 0:
        return
    loops = c_loops() if _c_eligible(y, x, arena, tables) else None
    add_lora_planned(c_step_plan(segs, loops), y, x, arena, tables, group, segs)


def add_lora_planned(
    plan: CStepPlan | None,
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """:func:`add_lora` through the step's C plan when there is one, else per-segment matmuls.

    With a plan the caller vouches for the C loop's layout: CPU tensors all fp32 or all bf16, ``x`` and ``y``
    rows of unit column stride, and tables laid out as :class:`LoraTables` makes them."""
    if segs.max_rank == 0:
        return
    if plan is not None and x.dtype == y.dtype == arena.dtype:  # the C loop reads all three in one dtype
        _add_lora_c(plan, y, x, arena, tables, group, segs)
        return
    for seg_plan in _plan(arena, tables, group, segs, x.shape[1]):
        _expand_segment(y, _shrink_segment(x, seg_plan), seg_plan, group)


@dataclass(frozen=True)
class CLoops:
    """The compiled C loops and how many threads they use, resolved once by whoever owns them."""

    lib: ctypes.CDLL
    threads: int


def c_loops() -> CLoops | None:
    """The C loops with the current thread setting, or None when they cannot be built (or are turned off)."""
    lib = c_library()
    return None if lib is None else CLoops(lib, c_threads())


@dataclass(frozen=True)
class CStepPlan:
    """What the C loop needs from a step's segments, derived once and reused by every layer and group."""

    lib: ctypes.CDLL
    # The adapted segments cut into chunks of at most C_CHUNK_TOKENS (int32, as Segments' fields).
    starts: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    workspace: torch.Tensor
    per_thread: int
    threads: int


def c_step_plan(segs: Segments, loops: CLoops | None, workspace: torch.Tensor | None = None) -> CStepPlan | None:
    """The step's C-loop plan, or None without the loops, without adapters, or when the segments do not suit
    it. ``workspace`` (fp32, reused when large enough) holds the per-thread scratch."""
    index = segs.token_index
    suitable = segs.slots.device.type == "cpu" and (
        index is None or (index.dtype == torch.int64 and index.is_contiguous() and index.device.type == "cpu")
    )
    if loops is None or not suitable or segs.max_rank == 0:
        return None
    chunks = [
        (start + offset, min(C_CHUNK_TOKENS, length - offset), slot)
        for start, length, slot in zip(segs.starts.tolist(), segs.lengths.tolist(), segs.slots.tolist(), strict=True)
        if slot != NO_ADAPTER
        for offset in range(0, length, C_CHUNK_TOKENS)
    ]
    starts, lengths, slots = torch.tensor(chunks, dtype=torch.int32).reshape(-1, 3).t().contiguous()
    per_thread = min(C_CHUNK_TOKENS, max(segs.max_len, 1)) * max(segs.max_rank, 1)
    needed = loops.threads * per_thread
    if workspace is None or workspace.numel() < needed:
        workspace = torch.empty(needed, dtype=torch.float32)
    return CStepPlan(
        lib=loops.lib,
        starts=starts,
        lengths=lengths,
        slots=slots,
        workspace=workspace,
        per_thread=per_thread,
        threads=loops.threads,
    )


def _c_eligible(y: torch.Tensor, x: torch.Tensor, arena: torch.Tensor, tables: LayerLoraTables) -> bool:
    """Whether the C loop's assumptions (CPU, fp32 or bf16, unit column strides, layout dtypes) hold for one call."""
    return (
        y.device.type == x.device.type == arena.device.type == tables.ranks.device.type == "cpu"
        and y.dtype == x.dtype == arena.dtype in C_DTYPES
        and tables.scales.dtype == torch.float32
        and tables.a_rows.dtype == tables.b_rows.dtype == torch.int64
        and tables.ranks.dtype == torch.int32
        and y.stride(1) == 1
        and x.stride(1) == 1
        and tables.a_rows.stride(-1) == 1
        and tables.a_rows.stride() == tables.b_rows.stride()
        and tables.ranks.stride() == tables.scales.stride()
    )


@functools.cache
def _group_arrays(group: SliceGroup) -> tuple[ctypes.Array, ctypes.Array, ctypes.Array]:
    """The group's projections, output offsets and widths as C arrays (groups are fixed per model)."""
    array = ctypes.c_int64 * group.num_slices
    return array(*group.projections), array(*group.out_offsets), array(*group.out_widths)


def _add_lora_c(
    step: CStepPlan,
    y: torch.Tensor,
    x: torch.Tensor,
    arena: torch.Tensor,
    tables: LayerLoraTables,
    group: SliceGroup,
    segs: Segments,
) -> None:
    """Every adapted segment of the step in one C call."""
    index = segs.token_index
    projections, out_offsets, out_widths = _group_arrays(group)
    step.lib.lora_segments(
        x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), arena.data_ptr(), x.shape[1],
        step.starts.numel(), step.starts.data_ptr(), step.lengths.data_ptr(), step.slots.data_ptr(),
        index.data_ptr() if index is not None else None, group.num_slices,
        projections, out_offsets, out_widths,
        tables.a_rows.data_ptr(), tables.b_rows.data_ptr(), tables.a_rows.stride(0), tables.a_rows.stride(1),
        tables.ranks.data_ptr(), tables.scales.data_ptr(), tables.ranks.stride(0), tables.ranks.stride(1),
        step.workspace.data_ptr(), step.per_thread, x.dtype == torch.bfloat16, step.threads,
    )  # fmt: skip


def _c_attention_eligible(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, lens: torch.Tensor
) -> bool:
    head_dim = q.shape[2]
    return (
        all(t.device.type == "cpu" for t in (q, k_cache, v_cache, block_tables, lens))
        and q.dtype == k_cache.dtype == v_cache.dtype in C_DTYPES
        and k_cache.stride() == v_cache.stride()
        and k_cache.stride(3) == 1
        and k_cache.stride(2) == head_dim
        and head_dim % 8 == 0
        and k_cache.shape[1] <= C_ATTENTION_MAX_BLOCK
        and block_tables.dtype == lens.dtype == torch.int32
        and block_tables.stride(1) == 1
        and lens.is_contiguous()
    )


def _head_parts(batch: int, num_kv_heads: int, threads: int) -> int:
    """How many parts to split each sequence's KV heads into for the C loop: whole sequences when the batch
    alone gives every thread a couple of items, else the fewest parts (a divisor of the KV heads) that do."""
    for parts in range(1, num_kv_heads + 1):
        if num_kv_heads % parts == 0 and batch * parts >= 2 * threads:
            return parts
    return num_kv_heads


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
    """One query token per sequence over its first ``context_lens[b]`` cached tokens (GQA aware), or only
    the last ``window`` of them; ``softcap`` caps scaled scores as ``softcap * tanh(s / softcap)``.

    A convenience that looks up the C loops on every call; the engine's ``TorchBackend`` resolves them once.
    """
    return paged_attention_decode_with(
        c_loops(), q, k_cache, v_cache, block_tables, context_lens, scale, window, softcap
    )


def paged_attention_decode_with(
    loops: CLoops | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`paged_attention_decode` through ``loops`` where the tensors suit them, else in torch.

    Pages of the whole batch are gathered once (from the first page any sequence's window reaches, up to
    the longest context), then one masked batched softmax-attention runs for all sequences.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if batch == 0:
        return torch.empty_like(q)
    max_len = int(context_lens.max())
    if loops is not None and _c_attention_eligible(q, k_cache, v_cache, block_tables, context_lens):
        # The C loop trusts its indices: check them here, where a bad table raises instead of crashing.
        if max_len > block_tables.shape[1] * block_size or int(block_tables.max()) >= k_cache.shape[0]:
            raise ValueError("context_lens or block_tables point outside the KV cache")
        q = q.contiguous()
        out = torch.empty_like(q)
        threads = loops.threads
        parts = _head_parts(batch, num_kv_heads, threads)
        per_thread = min(max_len, window or max_len) * num_heads // parts
        bf16 = q.dtype == torch.bfloat16
        if bf16:  # the item's q and output, widened to fp32
            per_thread += 2 * head_dim * num_heads // parts
        scratch = torch.empty(threads * per_thread, dtype=torch.float32)
        loops.lib.paged_attention_decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(), batch, num_heads,
            num_kv_heads, head_dim, block_size, window or 0, scale, softcap or 0.0, out.data_ptr(), scratch.data_ptr(),
            per_thread, parts, bf16, threads,
        )  # fmt: skip
        return out
    num_blocks = -(-max_len // block_size)
    lens = context_lens[:, None].long()
    first_block = 0 if window is None else int((lens - window).clamp(min=0).min()) // block_size
    pages = block_tables[:, first_block:num_blocks].long()
    span = (num_blocks - first_block) * block_size
    keys = k_cache[pages].view(batch, span, num_kv_heads, head_dim)
    values = v_cache[pages].view(batch, span, num_kv_heads, head_dim)
    positions = torch.arange(first_block * block_size, num_blocks * block_size, device=q.device)[None, :]
    mask = positions < lens
    if window is not None:
        mask &= positions >= lens - window
    mask = mask[:, None, None, :]
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float().unsqueeze(2),
            keys.float().transpose(1, 2),
            values.float().transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
    else:  # SDPA cannot cap scores: the same attention, spelled out
        out = softcapped_attention(q.float().unsqueeze(2), keys.float(), values.float(), mask, scale, softcap)
    out = out.squeeze(2)
    empty = context_lens == 0
    if bool(empty.any()):  # nothing to attend to: zeros, as the reference (softmax of nothing is NaN)
        out[empty.to(out.device)] = 0
    return out.to(q.dtype)


def softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with scores capped as ``softcap * tanh(s / softcap)`` before the mask and softmax (Gemma 2).

    ``q``: ``[B, heads, M, d]``; ``keys``/``values``: ``[B, N, kv_heads, d]``; ``mask``: bool, broadcast to
    ``[B, heads, M, N]``. Rows whose mask is all False come back as NaN, as SDPA's do."""
    group = q.shape[1] // keys.shape[2]
    keys = keys.transpose(1, 2).repeat_interleave(group, dim=1)
    values = values.transpose(1, 2).repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype), values)
