"""The unified pool: page accounting, adapter row packing, and tables the kernels read correctly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from core.adapter_format import AdapterWeights, BaseShapes, LoraTensors
from core.projections import DOWN, GATE_UP, NUM_PROJECTIONS, PROJECTIONS, QKV
from loraplex_kernels import KVGeometry, LoraTables, Segments, SliceGroup, reference
from server.engine.errors import AdapterAlreadyLoaded, AdapterInUse, AdapterNotLoaded
from server.engine.resident_adapters import ResidentAdapters
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
    return AdapterPages(
        pool, LoraTables.empty(slots, SHAPES.num_layers, max_rank, num_projections=NUM_PROJECTIONS), SHAPES
    )


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
    qkv_a = [b for b in blocks if b.kind == "A" and b.layer == 0 and b.rows[0][0] in QKV.indices]
    assert sum(len(b.rows) for b in qkv_a) == 96 and all(b.elems <= GEOMETRY.page_elems for b in qkv_a)
    total = sum(b.elems for b in blocks)
    assert pages == -(-total // GEOMETRY.page_elems)  # first-fit decreasing wastes no whole page here


def make_adapters(num_pages: int = 64, slots: int = 4, max_rank: int = 32) -> ResidentAdapters:
    return ResidentAdapters(make_pages(num_pages, slots, max_rank))


def place(adapters: ResidentAdapters, name: str, weights: AdapterWeights):
    return adapters.place(name, adapters.plan(name, weights))


def test_pages_grow_with_rank_not_with_max_rank():
    pages = make_pages()
    small, large = pages.plan("s", adapter(8)).num_pages, pages.plan("l", adapter(32)).num_pages
    assert 0.2 <= small / large <= 0.3


def test_placed_rows_are_what_the_kernels_read():
    pages = make_pages()
    weights = adapter(5, seed=1, scale=0.75)
    slot, _ = pages.write(pages.plan("a", weights))
    x = torch.randn(3, SHAPES.hidden_size)
    for layer in range(SHAPES.num_layers):
        tables = pages.tables.layer(layer)
        for group in (QKV, GATE_UP):
            widths = tuple(SHAPES.in_out(p)[1] for p in group.projections)
            slices = SliceGroup.contiguous(group.indices, widths)
            y = torch.zeros(3, sum(widths))
            segs = Segments.from_token_slots([slot] * 3, {slot: 5})
            reference.add_lora(y, x, pages.pool.arena, tables, slices, segs)
            modules = [weights.modules[(layer, p)] for p in group.projections]
            expected = torch.cat([0.75 * (x @ m.a.T) @ m.b.T for m in modules], dim=1)
            torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    assert pages.slot_max_rank[slot] == 5


def test_unload_returns_pages_and_clears_the_slot():
    pages = make_pages()
    adapters = ResidentAdapters(pages)
    before = pages.pool.stats()
    plan = adapters.plan("a", adapter(16, projections=("q_proj", "down_proj")))
    placed = adapters.place("a", plan)
    assert pages.pool.stats().adapter_pages == placed.num_pages == plan.num_pages
    assert int(pages.tables.ranks[placed.slot, 1, DOWN.indices[0]]) == 16
    assert int(pages.tables.ranks[placed.slot, 1, GATE_UP.indices[0]]) == 0  # untouched projections stay rank 0
    adapters.remove("a")
    assert pages.pool.stats() == before
    assert int(pages.tables.ranks[placed.slot].abs().sum()) == 0


def test_limits_are_enforced_with_clear_errors():
    pages = make_pages(num_pages=8, slots=2, max_rank=16)
    adapters = ResidentAdapters(pages)
    with pytest.raises(AdapterRankTooLarge):
        adapters.plan("big", adapter(32))
    place(adapters, "a", adapter(2, projections=("q_proj",)))
    place(adapters, "b", adapter(2, projections=("q_proj",)))
    with pytest.raises(NoFreeAdapterSlot):
        place(adapters, "c", adapter(2, projections=("q_proj",)))
    adapters.remove("b")
    free_before = pages.pool.num_free
    with pytest.raises(PoolExhausted):
        place(adapters, "huge", adapter(16))
    assert pages.pool.num_free == free_before and not adapters.is_resident("huge")
    assert pages.free_slots == 1  # a failed placement takes no slot either


def test_row_alignment_is_promised_only_when_every_row_start_is_aligned():
    from loraplex_kernels import ROW_ALIGN
    from server.memory.adapter_pages import row_alignment

    assert row_alignment(SHAPES, GEOMETRY.page_elems) == ROW_ALIGN  # widths 16/32/48, page 2048
    odd = BaseShapes(num_layers=2, hidden_size=36, intermediate_size=52, q_size=36, kv_size=12)
    assert row_alignment(odd, GEOMETRY.page_elems) == 1
    pages = make_pages()
    for name, rank in (("a", 3), ("b", 7), ("c", 5)):
        pages.write(pages.plan(name, adapter(rank, seed=rank)))
    ranks = pages.tables.ranks
    for rows in (pages.tables.a_rows, pages.tables.b_rows):
        used = rows[torch.arange(rows.shape[-1]) < ranks.unsqueeze(-1).long()]
        assert used.numel() > 0 and bool((used % ROW_ALIGN == 0).all())


class ResidencyMachine(RuleBasedStateMachine):
    """Random load/unload/request/finish/evict/KV sequences: one reference count, always consistent with pages."""

    NAMES = ("a", "b", "c", "d", "e")

    def __init__(self) -> None:
        super().__init__()
        self.pages = make_pages(num_pages=24, slots=3, max_rank=16)
        self.adapters = ResidentAdapters(self.pages)
        self.refs: dict[str, int] = {}  # the test's own count of requests per adapter
        self.kv: list[list[int]] = []

    @rule(name=st.sampled_from(NAMES), rank=st.sampled_from((1, 4, 16)), attention_only=st.booleans())
    def load(self, name: str, rank: int, attention_only: bool) -> None:
        projections = PROJECTIONS[:4] if attention_only else PROJECTIONS
        plan = self.adapters.plan(name, adapter(rank, projections=projections))
        expected_error = None
        if self.adapters.is_resident(name):
            expected_error = AdapterAlreadyLoaded
        elif self.pages.free_slots == 0:
            expected_error = NoFreeAdapterSlot
        elif plan.num_pages > self.pages.pool.num_free:
            expected_error = PoolExhausted
        if expected_error is None:
            assert self.adapters.place(name, plan).num_pages == plan.num_pages
        else:
            with pytest.raises(expected_error):
                self.adapters.place(name, plan)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        if not self.adapters.is_resident(name):
            with pytest.raises(AdapterNotLoaded):
                self.adapters.remove(name)
        elif self.refs.get(name):
            with pytest.raises(AdapterInUse):
                self.adapters.remove(name)
        else:
            self.adapters.remove(name)

    @rule(name=st.sampled_from(NAMES))
    def request(self, name: str) -> None:
        if not self.adapters.is_resident(name):
            with pytest.raises(AdapterNotLoaded):
                self.adapters.acquire(name)
            return
        self.adapters.acquire(name)
        self.refs[name] = self.refs.get(name, 0) + 1

    @rule(name=st.sampled_from(NAMES))
    def finish(self, name: str) -> None:
        if not self.refs.get(name):
            with pytest.raises(RuntimeError):
                self.adapters.release(name)
            return
        self.adapters.release(name)
        self.refs[name] -= 1

    @rule()
    def evict_unused(self) -> None:
        """What the tier manager does under pressure: every adapter the registry calls unused can go."""
        for name in list(self.adapters.resident):
            if not self.adapters.in_use(name):
                self.adapters.remove(name)

    @rule(count=st.integers(1, 6))
    def kv_grow(self, count: int) -> None:
        if count <= self.pages.pool.num_free:
            self.kv.append(self.pages.pool.allocate(count, PageUse.KV))

    @rule()
    def kv_free(self) -> None:
        if self.kv:
            self.pages.pool.release(self.kv.pop(0), PageUse.KV)

    @invariant()
    def one_count_consistent_with_pages(self) -> None:
        resident = self.adapters.resident
        stats = self.pages.pool.stats()
        assert stats.adapter_pages == sum(a.num_pages for a in resident.values())
        assert stats.kv_pages == sum(len(t) for t in self.kv)
        assert stats.free_pages + stats.adapter_pages + stats.kv_pages == stats.total_pages
        held = [p for a in resident.values() for p in a.pages] + [p for t in self.kv for p in t]
        assert len(held) == len(set(held))
        assert self.pages.free_slots + len(resident) == self.pages.tables.max_slots
        assert len({a.slot for a in resident.values()}) == len(resident)
        for name in self.NAMES:
            assert self.adapters.refs(name) == self.refs.get(name, 0)
            assert self.adapters.in_use(name) == bool(self.refs.get(name))
            if self.refs.get(name):
                assert self.adapters.is_resident(name)  # a reference keeps its adapter resident
        seated = {a.slot for a in resident.values()}
        for slot in range(self.pages.tables.max_slots):
            if slot not in seated:
                assert self.pages.slot_max_rank[slot] == 0
                assert int(self.pages.tables.ranks[slot].abs().sum()) == 0


TestResidency = ResidencyMachine.TestCase
TestResidency.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
