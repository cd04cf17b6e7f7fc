"""The vectorised CPU path (``loraplex_kernels.torch_ops``) against the obviously-correct reference loops."""

from __future__ import annotations

import pytest
import torch

from core.projections import NUM_PROJECTIONS, QKV
from loraplex_kernels import reference, torch_ops
from loraplex_kernels.layout import NO_ADAPTER, LoraTables, Segments, SliceGroup

IN, OUT = 44, (40, 24, 20)  # widths off the 8-float vector too: the C loop's scalar tails run
TOL = dict(rtol=1e-5, atol=2e-4)
# bf16 results against the fp32 reference on the same (bf16) inputs: one rounding of the output (2^-9 relative)
# plus fp32 accumulation.
BF16_TOL = dict(rtol=1e-2, atol=1e-2)
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def build(ranks: dict[int, tuple[int, ...]], contiguous: bool, seed: int = 0, dtype=torch.float32, in_features=IN):
    """An arena with adapter rows laid out contiguously (views) or scattered with gaps (gathers)."""
    gen = torch.Generator().manual_seed(seed)
    arena = torch.randn(300_000, generator=gen).to(dtype)
    tables = LoraTables.empty(4, 1, 16, num_projections=NUM_PROJECTIONS)
    at = 7
    for slot, slot_ranks in ranks.items():
        for k, proj in enumerate(QKV.indices):
            r = slot_ranks[k]
            tables.ranks[slot, 0, proj] = r
            tables.scales[slot, 0, proj] = 0.25 + slot + k
            for i in range(r):
                tables.a_rows[slot, 0, proj, i] = at
                at += in_features + (0 if contiguous else 5)
        for k, proj in enumerate(QKV.indices):
            for i in range(slot_ranks[k]):
                tables.b_rows[slot, 0, proj, i] = at
                at += OUT[k] + (0 if contiguous else 3)
    return arena, tables.layer(0)


RANKS = {0: (4, 0, 16), 1: (8, 8, 8), 2: (1, 3, 0)}


@DTYPES
@pytest.mark.parametrize("use_c", [True, False], ids=["c-loop", "torch-ops"])
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("permuted", [False, True])
@pytest.mark.parametrize("lengths", ["decode", "chunked", "prefill"])
def test_add_lora_matches_reference(use_c, contiguous, permuted, lengths, dtype, monkeypatch):
    if not use_c:
        monkeypatch.setattr(torch_ops, "c_library", lambda: None)
    else:
        assert torch_ops.c_library() is not None, "the C loop should build here (a C compiler is installed)"
    arena, tables = build(RANKS, contiguous, dtype=dtype)
    # Segments of 1-3 tokens, of 5-15 (blocks of 4 with ragged tails) and of 23-69 (69 > C_CHUNK_TOKENS:
    # the C loop cuts it into two work items).
    repeat = {"decode": 1, "chunked": 5, "prefill": 23}[lengths]
    assert torch_ops.C_CHUNK_TOKENS < 3 * 23
    token_slots = [s for s in [0, 0, NO_ADAPTER, 1, 2, 2, 2, 1] for _ in range(repeat)]
    n = len(token_slots)
    index = torch.randperm(n, generator=torch.Generator().manual_seed(3)).tolist() if permuted else None
    segs = Segments.from_token_slots(token_slots, {0: 16, 1: 8, 2: 3}, token_index=index)
    group = SliceGroup.contiguous(QKV.indices, OUT)
    x, y = torch.randn(n, IN).to(dtype), torch.randn(n, sum(OUT)).to(dtype)
    expected, got = y.float(), y.clone()
    reference.add_lora(expected, x.float(), arena.float(), tables, group, segs)
    torch_ops.add_lora(got, x, arena, tables, group, segs)
    torch.testing.assert_close(got.float(), expected, **(TOL if dtype == torch.float32 else BF16_TOL))
    no_adapter_rows = [index[i] if index else i for i, s in enumerate(token_slots) if s == NO_ADAPTER]
    assert torch.equal(got[no_adapter_rows], y[no_adapter_rows])


@pytest.mark.parametrize("in_features", [200, 512])
def test_bf16_c_loop_over_wide_rows_matches_fp32_reference(in_features):
    # Rows of 64+ inputs take the C loop's pairwise (AVX-512 BF16) shrink where the build has it; 200 leaves tails.
    arena, tables = build(RANKS, contiguous=False, dtype=torch.bfloat16, in_features=in_features)
    segs = Segments.from_token_slots([0, 1, 1, 2, 2, 2, 0, 1, 1, 1, 1, 1], {0: 16, 1: 8, 2: 3})
    group = SliceGroup.contiguous(QKV.indices, OUT)
    x, y = torch.randn(12, in_features).bfloat16(), torch.randn(12, sum(OUT)).bfloat16()
    expected, got = y.float(), y.clone()
    reference.add_lora(expected, x.float(), arena.float(), tables, group, segs)
    torch_ops.add_lora(got, x, arena, tables, group, segs)
    torch.testing.assert_close(got.float(), expected, **BF16_TOL)


def test_bf16_arena_is_accumulated_in_fp32():
    arena, tables = build(RANKS, contiguous=True, dtype=torch.bfloat16)
    segs = Segments.from_token_slots([0, 0, 1, 2], {0: 16, 1: 8, 2: 3})
    group = SliceGroup.contiguous(QKV.indices, OUT)
    x, y = torch.randn(4, IN).bfloat16(), torch.randn(4, sum(OUT)).bfloat16()
    expected, got = y.clone(), y.clone()
    reference.add_lora(expected, x, arena, tables, group, segs)
    torch_ops.add_lora(got, x, arena, tables, group, segs)
    torch.testing.assert_close(got.float(), expected.float(), rtol=6e-2, atol=6e-2)


def test_shrink_and_expand_match_reference():
    arena, tables = build(RANKS, contiguous=False)
    segs = Segments.from_token_slots([2, 0, 0, NO_ADAPTER, 1], {0: 16, 1: 8, 2: 3})
    group = SliceGroup.contiguous(QKV.indices, OUT)
    x = torch.randn(5, IN)
    v_ref = reference.sgmv_shrink(x, arena, tables, group, segs)
    v = torch_ops.sgmv_shrink(x, arena, tables, group, segs)
    torch.testing.assert_close(v, v_ref, **TOL)
    y = torch.randn(5, sum(OUT))
    expected, got = y.clone(), y.clone()
    reference.sgmv_expand(expected, v_ref, arena, tables, group, segs)
    torch_ops.sgmv_expand(got, v_ref, arena, tables, group, segs)
    torch.testing.assert_close(got, expected, **TOL)


def test_a_batch_without_adapters_is_untouched():
    arena, tables = build({0: (2, 2, 2)}, contiguous=True)
    segs = Segments.from_token_slots([NO_ADAPTER] * 3, {})
    y = torch.randn(3, sum(OUT))
    before = y.clone()
    torch_ops.add_lora(y, torch.randn(3, IN), arena, tables, SliceGroup.contiguous(QKV.indices, OUT), segs)
    assert torch.equal(y, before)


@DTYPES
@pytest.mark.parametrize("use_c", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4)])
# 72: a 64-column chunk and an 8-column tail; one sequence: the C loop splits its KV heads across threads.
@pytest.mark.parametrize(("head_dim", "batch"), [(16, 5), (72, 5), (16, 1)])
def test_paged_attention_decode_matches_reference(use_c, heads, kv_heads, head_dim, batch, dtype, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL_THREADS", "2")
    if not use_c:
        monkeypatch.setattr(torch_ops, "c_library", lambda: None)
    else:
        assert torch_ops.c_library() is not None, "the C loop should build here (a C compiler is installed)"
    gen = torch.Generator().manual_seed(0)
    block_size, pages = 16, 40
    # One layer's views out of a two-layer arena: pages are strided, as in the real pool.
    arena = torch.randn(pages, 2, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    lens = torch.tensor([33, 17, 64, 0, 1][:batch], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:5] for _ in range(batch)]).to(torch.int32)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype)
    # In bf16: against the fp32 reference on the same values (the C loop widens them and rounds once).
    expected = reference.paged_attention_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens, 0.25)
    got = torch_ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25)
    assert got.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got.float(), expected, **tol)
    if batch > 3:
        assert torch.equal(got[3], torch.zeros_like(got[3]))


@pytest.mark.parametrize("use_c", [True, False])
# 7: starts mid-page; 16: one page; 40: spans pages; 1: only the newest token; 1000: past every context.
@pytest.mark.parametrize("window", [7, 16, 40, 1, 1000])
# Several sequences (one per thread item), and one long sequence whose KV heads the C loop splits.
@pytest.mark.parametrize("lens", [(33, 17, 64, 0, 1, 50), (75,)], ids=["batch", "one"])
def test_sliding_window_decode_matches_reference(use_c, window, lens, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL_THREADS", "2")
    if not use_c:
        monkeypatch.setattr(torch_ops, "c_library", lambda: None)
    gen = torch.Generator().manual_seed(1)
    block_size, pages, heads, kv_heads, head_dim = 16, 40, 8, 2, 72
    arena = torch.randn(pages, 2, 2, block_size, kv_heads, head_dim, generator=gen)
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    tables = torch.stack([torch.randperm(pages, generator=gen)[:5] for _ in lens]).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    lens = torch.tensor(lens, dtype=torch.int32)
    expected = reference.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25, window)
    got = torch_ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if window >= int(lens.max()):
        full = torch_ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25)
        torch.testing.assert_close(got, full, rtol=0, atol=0)


@pytest.mark.parametrize(("window", "softcap"), [(7, None), (None, 2.0), (40, 5.0)])
def test_bf16_decode_with_window_and_softcap_matches_fp32_reference(window, softcap, monkeypatch):
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL_THREADS", "2")
    gen = torch.Generator().manual_seed(2)
    block_size, pages, heads, kv_heads, head_dim = 16, 40, 8, 2, 72
    arena = torch.randn(pages, 2, 2, block_size, kv_heads, head_dim, generator=gen).bfloat16()
    k_cache, v_cache = arena[:, 1, 0], arena[:, 1, 1]
    lens = torch.tensor([33, 17, 64, 0, 1, 50], dtype=torch.int32)
    tables = torch.stack([torch.randperm(pages, generator=gen)[:5] for _ in range(6)]).to(torch.int32)
    q = torch.randn(6, heads, head_dim, generator=gen).bfloat16()
    wide = (q.float(), k_cache.float(), v_cache.float())
    expected = reference.paged_attention_decode(*wide, tables, lens, 0.25, window, softcap)
    got = torch_ops.paged_attention_decode(q, k_cache, v_cache, tables, lens, 0.25, window, softcap)
    torch.testing.assert_close(got.float(), expected, **BF16_TOL)


def test_paged_attention_refuses_tables_outside_the_cache():
    k = torch.randn(4, 16, 2, 8)
    with pytest.raises((ValueError, IndexError, RuntimeError)):
        torch_ops.paged_attention_decode(
            torch.randn(1, 2, 8),
            k,
            k,
            torch.tensor([[9]], dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            1.0,
        )
