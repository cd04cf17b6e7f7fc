"""The unified pool: page accounting, adapter row packing, and tables the kernels read correctly."""

from __future__ import annotations

import pytest
import torch

from core.adapter_format import PROJECTIONS, AdapterWeights, BaseShapes, LoraTensors
from loraplex_kernels import KVGeometry, LoraTables, Segments, SliceGroup, reference
from loraplex_kernels.layout import DOWN, GATE_UP, QKV
from server.memory.adapter_pages import AdapterPages, AdapterRankTooLarge, NoFreeAdapterSlot, pack_blocks, row_blocks
from server.memory.pool import PagePool, PageUse, PoolExhausted

SHAPES = BaseShapes(num_layers=2, hidden_size=32, intermediate_size=48, q_size=32, kv_size=16)
GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)  # 2048-element pages


def adapter(rank: int, projections=PROJECTIONS, seed: int = 0, scale: float = 0.5) -> AdapterWeights:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for layer in range(SHAPES.num_layers):
        for proj in projections:
            in_f, out_f = SHAPES.in_out(proj)
            a, b = torch.randn(rank, in_f, generator=gen), torch.randn(out_f, rank, generator=gen)
            modules[(layer, proj)] = LoraTensors(a, b, scale)
    return AdapterWeights(modules)


def make_pages(num_pages: int = 64, slots: int = 4, max_rank: int = 32) -> AdapterPages:
    pool = PagePool(GEOMETRY, num_pages, torch.float32, "cpu")
    return AdapterPages(pool, LoraTables.empty(slots, SHAPES.num_layers, max_rank), SHAPES)


def test_pool_accounting_is_exact_and_all_or_nothing():
    pool = PagePool(GEOMETRY, 10, torch.float32, "cpu")
    kv = pool.allocate(3, PageUse.KV)
    ad = pool.allocate(4, PageUse.ADAPTER)
    stats = pool.stats()
    assert (stats.free_pages, stats.kv_pages, stats.adapter_pages, stats.kv_capacity_pages) == (3, 3, 4, 6)
    with pytest.raises(PoolExhausted):
        pool.allocate(4, PageUse.KV)
    assert pool.num_free == 3  # nothing was taken by the failed request
    with pytest.raises(ValueError):
        pool.release(kv, PageUse.ADAPTER)
    pool.release(kv, PageUse.KV)
    pool.release(ad, PageUse.ADAPTER)
    assert pool.stats().free_pages == 10 and len(set(kv + ad)) == 7
    assert PagePool.pages_for_bytes(10 * GEOMETRY.page_elems * 4 + 5, GEOMETRY, torch.float32) == 10


def test_rows_never_cross_pages_and_groups_stay_contiguous():
    ranks = {(layer, p): 32 for layer in range(2) for p in range(7)}
    blocks = row_blocks(ranks, SHAPES, GEOMETRY.page_elems)
    pages, placements = pack_blocks(blocks, GEOMETRY.page_elems)
    for placement in placements:
        assert placement.offset + placement.block.elems <= GEOMETRY.page_elems
    fills = [0] * pages
    for placement in placements:
        fills[placement.page] += placement.block.elems
    assert max(fills) <= GEOMETRY.page_elems
    # A q/k/v A block of 96 rows x 32 = 3072 elements exceeds a page: split at row boundaries only.
    qkv_a = [b for b in blocks if b.kind == "A" and b.layer == 0 and b.rows[0][0] in QKV]
    assert sum(len(b.rows) for b in qkv_a) == 96 and all(b.elems <= GEOMETRY.page_elems for b in qkv_a)
    total = sum(b.elems for b in blocks)
    assert pages == -(-total // GEOMETRY.page_elems)  # first-fit decreasing wastes no whole page here


def test_pages_grow_with_rank_not_with_max_rank():
    pages = make_pages()
    small, large = pages.pages_needed(adapter(8)), pages.pages_needed(adapter(32))
    assert 0.2 <= small / large <= 0.3


def test_placed_rows_are_what_the_kernels_read():
    pages = make_pages()
    weights = adapter(5, seed=1, scale=0.75)
    slot = pages.place("a", weights).slot
    x = torch.randn(3, SHAPES.hidden_size)
    for layer in range(SHAPES.num_layers):
        tables = pages.tables.layer(layer)
        for group in (QKV, GATE_UP):
            widths = tuple(SHAPES.in_out(PROJECTIONS[p])[1] for p in group)
            slices = SliceGroup.contiguous(group, widths)
            y = torch.zeros(3, sum(widths))
            segs = Segments.from_token_slots([slot] * 3, {slot: 5})
            reference.add_lora(y, x, pages.pool.arena, tables, slices, segs)
            modules = [weights.modules[(layer, PROJECTIONS[p])] for p in group]
            expected = torch.cat([0.75 * (x @ m.a.T) @ m.b.T for m in modules], dim=1)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    assert pages.slot_max_rank[slot] == 5


def test_unload_returns_pages_and_clears_the_slot():
    pages = make_pages()
    before = pages.pool.stats()
    placed = pages.place("a", adapter(16, projections=("q_proj", "down_proj")))
    assert (
        pages.pool.stats().adapter_pages == placed.num_pages == pages.pages_needed(adapter(16, ("q_proj", "down_proj")))
    )
    assert int(pages.tables.ranks[placed.slot, 1, DOWN[0]]) == 16
    assert int(pages.tables.ranks[placed.slot, 1, GATE_UP[0]]) == 0  # untouched projections stay rank 0
    pages.remove("a")
    assert pages.pool.stats() == before
    assert int(pages.tables.ranks[placed.slot].abs().sum()) == 0


def test_limits_are_enforced_with_clear_errors():
    pages = make_pages(num_pages=8, slots=2, max_rank=16)
    with pytest.raises(AdapterRankTooLarge):
        pages.place("big", adapter(32))
    pages.place("a", adapter(2, projections=("q_proj",)))
    pages.place("b", adapter(2, projections=("q_proj",)))
    with pytest.raises(NoFreeAdapterSlot):
        pages.place("c", adapter(2, projections=("q_proj",)))
    pages.remove("b")
    free_before = pages.pool.num_free
    with pytest.raises(PoolExhausted):
        pages.place("huge", adapter(16))
    assert pages.pool.num_free == free_before and "huge" not in pages.resident


def test_row_alignment_is_promised_only_when_every_row_start_is_aligned():
    from loraplex_kernels import ROW_ALIGN
    from server.memory.adapter_pages import row_alignment

    assert row_alignment(SHAPES, GEOMETRY.page_elems) == ROW_ALIGN  # widths 16/32/48, page 2048
    odd = BaseShapes(num_layers=2, hidden_size=36, intermediate_size=52, q_size=36, kv_size=12)
    assert row_alignment(odd, GEOMETRY.page_elems) == 1
    pages = make_pages()
    for name, rank in (("a", 3), ("b", 7), ("c", 5)):
        pages.place(name, adapter(rank, seed=rank))
    ranks = pages.tables.ranks
    for rows in (pages.tables.a_rows, pages.tables.b_rows):
        used = rows[torch.arange(rows.shape[-1]) < ranks.unsqueeze(-1).long()]
        assert used.numel() > 0 and bool((used % ROW_ALIGN == 0).all())
