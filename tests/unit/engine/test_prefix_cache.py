"""Prefix caching in the pool, without a model: page keys, shared and cached pages, one reclaim order, and the
pool invariants under random admit/finish/evict/preempt sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraplex_kernels import NO_ADAPTER, KVGeometry
from server.engine.resident_adapters import ResidentAdapters
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import Sequence, SequenceStatus
from server.memory.adapter_pages import weights_identity
from server.memory.block_manager import BlockManager
from server.memory.page_keys import BASE_IDENTITY, chain_root, extend_keys
from server.memory.pool import PagePool, PageUse, PoolExhausted
from tests.unit.engine.test_pool import adapter, make_pages

BS = 16
GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, block_size=BS)


def make_scheduler(pages: int = 64, budget: int = 256, watermark: int = 0, caching: bool = True):
    pool = PagePool(GEOMETRY, pages, torch.float32, "cpu")
    manager = BlockManager(pool, BS, watermark, enable_prefix_caching=caching)
    return Scheduler(manager, budget, 64), pool


def make_seq(seq_id: int, tokens: list[int], owner: bytes = BASE_IDENTITY, index: int = 0) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", index, tokens, SamplingParams(max_tokens=None))
    seq.cache_owner = owner
    return seq


def compute(out: SchedulerOutput) -> None:
    """What the engine does after the forward pass: count computed tokens, append a sampled token."""
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.token_ids.append(5)


def run_prefill(scheduler: Scheduler, *seqs: Sequence) -> SchedulerOutput:
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    compute(out)
    return out


PROMPT = list(range(3, 3 + 40))  # two full pages and 8 tokens


def test_keys_chain_over_adapter_identity_salt_and_every_earlier_token():
    def keys(tokens, identity=BASE_IDENTITY, salt=None):
        out: list[bytes] = []
        extend_keys(out, chain_root(identity, salt), tokens, len(tokens) // BS, BS)
        return out

    base = keys(PROMPT)
    assert len(base) == 2 and base == keys(PROMPT[:32] + [9] * 8)  # the partial page is not keyed
    other_first_page = keys([4, *PROMPT[1:]])
    assert other_first_page[0] != base[0] and other_first_page[1] != base[1]  # a page's key depends on earlier ones
    assert keys(PROMPT, b"adapter-x")[0] != base[0] != keys(PROMPT, salt="tenant-1")[0]
    grown = base[:1]
    extend_keys(grown, b"ignored once the chain has started", PROMPT, 2, BS)
    assert grown == base


def test_adapter_identity_follows_weights_not_names():
    a, b = adapter(4, seed=1), adapter(4, seed=2)
    assert weights_identity(a) == weights_identity(adapter(4, seed=1)) != weights_identity(b)
    assert weights_identity(adapter(4, seed=1, scale=0.25)) != weights_identity(a)  # same tensors, other alpha


def test_a_finished_prompt_is_found_again_but_never_whole():
    scheduler, pool = make_scheduler()
    first = make_seq(0, list(PROMPT))
    run_prefill(scheduler, first)
    scheduler.finish(first)
    stats = pool.stats()
    assert (stats.kv_pages, stats.kv_cached_pages) == (0, 2)  # two full pages kept, the partial one freed
    again = make_seq(1, list(PROMPT))
    out = run_prefill(scheduler, again)
    assert again.num_cached_tokens == 32 and [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(1, 8)]
    assert pool.stats().kv_cached_pages == 0 and pool.stats().kv_pages == 3
    # A prompt of exactly two pages hits one: its last token is computed, so there are logits to sample.
    exact = make_seq(2, PROMPT[:32])
    run_prefill(scheduler, exact)
    assert exact.num_cached_tokens == 16 and exact.num_computed_tokens == 32
    manager = scheduler.block_manager
    assert (manager.num_queried_tokens, manager.num_hit_tokens) == (40 + 40 + 32, 32 + 16)


def test_pages_are_never_shared_across_adapters_or_salts():
    scheduler, _ = make_scheduler()
    run_prefill(scheduler, make_seq(0, list(PROMPT), owner=b"x"))
    y, base, x = make_seq(1, list(PROMPT), owner=b"y"), make_seq(2, list(PROMPT)), make_seq(3, list(PROMPT), b"x")
    salted = make_seq(4, list(PROMPT), owner=b"x")
    salted.cache_salt = "tenant-2"
    run_prefill(scheduler, y, base, x, salted)
    assert [s.num_cached_tokens for s in (y, base, x, salted)] == [0, 0, 32, 0]


def test_siblings_admitted_in_one_step_share_the_pages_being_computed():
    scheduler, pool = make_scheduler()
    siblings = [make_seq(i, list(PROMPT), index=i) for i in range(3)]
    out = run_prefill(scheduler, *siblings)
    assert [s.num_new_tokens for s in out.scheduled] == [40, 8, 8]
    assert siblings[0].block_table[:2] == siblings[1].block_table[:2] == siblings[2].block_table[:2]
    assert [pool.refs(p) for p in siblings[0].block_table] == [3, 3, 1]
    assert pool.stats().kv_pages == 2 + 3  # two shared pages, three private last pages
    for seq in siblings:
        scheduler.finish(seq)
    assert pool.stats().kv_pages == 0 and pool.stats().kv_cached_pages == 2


def test_a_preempted_sequence_resumes_from_its_own_cached_pages():
    scheduler, pool = make_scheduler()
    seq = make_seq(0, list(PROMPT))
    run_prefill(scheduler, seq)
    for _ in range(10):  # 51 tokens: three full pages computed
        compute(scheduler.schedule())
    scheduler._preempt(seq)
    assert seq.status is SequenceStatus.WAITING and pool.stats().kv_cached_pages == 3
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [seq.num_tokens - 48]
    assert seq.num_cached_tokens == 0  # the prompt tokens its first admission found cached (usage reports these)
    assert scheduler.block_manager.num_hit_tokens == 48  # the resumption skipped three pages


def test_allocation_takes_free_pages_then_the_least_recently_used_cached_ones():
    scheduler, pool = make_scheduler(pages=6)
    a, b = make_seq(0, list(range(3, 36))), make_seq(1, list(range(40, 73)))  # 3 pages each, 2 full
    run_prefill(scheduler, a)
    run_prefill(scheduler, b)
    scheduler.finish(a)
    scheduler.finish(b)
    a_pages = pool.stats()
    assert (a_pages.free_pages, a_pages.kv_cached_pages) == (2, 4)
    # Needs 4 pages: the 2 free ones, then a's two (released first), its last page before its first.
    c = make_seq(2, list(range(80, 130)))
    run_prefill(scheduler, c)
    assert pool.stats().kv_cached_pages == 2
    scheduler.finish(c)
    again_b, again_a = make_seq(3, list(range(40, 73))), make_seq(4, list(range(3, 36)))
    run_prefill(scheduler, again_b)
    run_prefill(scheduler, again_a)
    assert again_b.num_cached_tokens == 32 and again_a.num_cached_tokens == 0
    with pytest.raises(PoolExhausted):
        pool.allocate(pool.num_available + 1, PageUse.ADAPTER)


def test_adapter_placement_reclaims_cached_kv_and_its_eviction_drops_its_pages():
    pages = make_pages(num_pages=24, slots=3, max_rank=16)
    pool = pages.pool
    adapters = ResidentAdapters(pages)
    manager = BlockManager(pool, BS, enable_prefix_caching=True)
    scheduler = Scheduler(manager, 512, 64)
    x = adapters.place("x", adapters.plan("x", adapter(4, seed=1)))
    seq = make_seq(0, list(range(3, 3 + 16 * 8 + 1)), owner=x.identity)
    run_prefill(scheduler, seq)
    scheduler.finish(seq)
    cached = pool.stats().kv_cached_pages
    assert cached == 8 and pool.num_available == pool.num_free + 8
    adapters.remove("x")
    assert pool.stats().kv_cached_pages == 0  # keyed to x: useless without it
    run_prefill(scheduler, seq := make_seq(1, list(range(3, 3 + 16 * 18 + 1))))
    scheduler.finish(seq)
    assert pool.stats().kv_cached_pages == 18 and pool.num_free == 6
    big = adapters.plan("big", adapter(16, seed=2))
    assert big.num_pages > pool.num_free
    adapters.place("big", big)  # takes the free pages, then evicts cached KV pages
    stats = pool.stats()
    assert stats.free_pages + stats.kv_cached_pages + stats.adapter_pages == stats.total_pages
    assert pool.flush_cache() == stats.kv_cached_pages and pool.stats().kv_cached_pages == 0


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random admit/step/finish/evict/preempt/flush sequences over one pool: every page is exactly one of free,
    KV in use, KV cached or adapter; refcounts equal the block tables holding a page; a shared page holds what
    its readers expect; a flush with nothing running frees every KV page."""

    NAMES = ("a", "b")
    PREFIXES = (list(range(3, 3 + 37)), list(range(50, 50 + 20)))

    def __init__(self) -> None:
        super().__init__()
        self.pages = make_pages(num_pages=40, slots=2, max_rank=4)
        self.pool = self.pages.pool
        self.adapters = ResidentAdapters(self.pages)
        self.scheduler = Scheduler(BlockManager(self.pool, BS, 1, enable_prefix_caching=True), 48, 6)
        self.seqs: list[Sequence] = []  # unfinished
        self.names: dict[int, str | None] = {}  # seq id -> adapter name
        self.content: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # page -> (owner, tokens up to its end)
        self.next_id = 0
        self.version = 0

    @rule(name=st.sampled_from(NAMES), rank=st.sampled_from((1, 4)))
    def load(self, name: str, rank: int) -> None:
        if self.adapters.is_resident(name) or not self.pages.free_slots:
            return
        self.version += 1  # a reload under the same name may carry other weights
        plan = self.adapters.plan(name, adapter(rank, seed=self.version % 3))
        if plan.num_pages <= self.pool.num_available:
            self.adapters.place(name, plan)

    @rule(name=st.sampled_from(NAMES))
    def evict(self, name: str) -> None:
        if self.adapters.is_resident(name) and not self.adapters.in_use(name):
            self.adapters.remove(name)

    @rule(
        name=st.sampled_from((None, *NAMES)),
        prefix=st.sampled_from((0, 1)),
        suffix=st.lists(st.integers(3, 90), max_size=20),
        n=st.integers(1, 3),
    )
    def add(self, name: str | None, prefix: int, suffix: list[int], n: int) -> None:
        owner = BASE_IDENTITY
        if name is not None:
            if not self.adapters.is_resident(name):
                return
            owner = self.adapters.get(name).identity
        for index in range(n):
            if name is not None:
                self.adapters.acquire(name)
            seq = make_seq(self.next_id, self.PREFIXES[prefix] + suffix, owner, index)
            seq.adapter_slot = NO_ADAPTER if name is None else self.adapters.get(name).slot
            self.next_id += 1
            self.names[seq.seq_id] = name
            self.seqs.append(seq)
            self.scheduler.add(seq)

    @rule()
    def step(self) -> None:
        out = self.scheduler.schedule()
        for seq in out.too_long:
            self._finish(seq)
        for item in out.scheduled:  # "compute": write what each page now holds
            seq, end = item.seq, item.seq.num_computed_tokens + item.num_new_tokens
            for i in range(item.seq.num_computed_tokens // BS, -(-end // BS)):
                self.content[seq.block_table[i]] = (seq.cache_owner, tuple(seq.token_ids[: min((i + 1) * BS, end)]))
        compute(out)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data) -> None:
        self._finish(data.draw(st.sampled_from(self.seqs)))

    @precondition(lambda self: self.scheduler.running)
    @rule()
    def preempt(self) -> None:
        self.scheduler._preempt(self.scheduler.running[-1])

    @rule()
    def flush(self) -> None:
        self.pool.flush_cache()

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.remove(seq)
        name = self.names.pop(seq.seq_id)
        if name is not None:
            self.adapters.release(name)

    @invariant()
    def every_page_has_exactly_one_state(self) -> None:
        stats = self.pool.stats()
        tables = [seq.block_table for seq in self.seqs]
        held: dict[int, int] = {}
        for table in tables:
            assert len(table) == len(set(table))
            for page in table:
                held[page] = held.get(page, 0) + 1
        adapter_pages = {p for a in self.adapters.resident.values() for p in a.pages}
        cached = {p for p in range(self.pool.num_pages) if self.pool.is_cached(p)}
        assert not (adapter_pages & held.keys()) and not (adapter_pages & cached) and not (cached & held.keys())
        assert stats.kv_pages == len(held) and stats.kv_cached_pages == len(cached)
        assert stats.adapter_pages == len(adapter_pages)
        assert stats.free_pages + stats.kv_pages + stats.kv_cached_pages + stats.adapter_pages == stats.total_pages
        for page in range(self.pool.num_pages):
            assert self.pool.refs(page) == held.get(page, 0)

    @invariant()
    def computed_pages_hold_what_their_sequences_expect(self) -> None:
        for seq in self.seqs:
            for i in range(seq.num_computed_tokens // BS):
                assert self.content[seq.block_table[i]] == (seq.cache_owner, tuple(seq.token_ids[: (i + 1) * BS]))

    def teardown(self) -> None:
        for seq in list(self.seqs):
            self._finish(seq)
        self.pool.flush_cache()
        stats = self.pool.stats()
        assert stats.kv_pages == stats.kv_cached_pages == 0
        assert stats.free_pages == stats.total_pages - stats.adapter_pages


TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixCache.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
