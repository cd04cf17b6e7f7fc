"""Scheduler without a model: token budget, chunked prefill, decode-first, preemption order and resumption."""

from __future__ import annotations

import torch

from loraplex_kernels import KVGeometry
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import Sequence, SequenceStatus
from server.memory.block_manager import BlockManager
from server.memory.pool import PagePool

GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, block_size=16)


def make_scheduler(pages: int = 64, budget: int = 64, max_seqs: int = 16, watermark: int = 0, chunked: bool = True):
    pool = PagePool(GEOMETRY, pages, torch.float32, "cpu")
    return Scheduler(BlockManager(pool, 16, watermark), budget, max_seqs, chunked), pool


def make_seq(seq_id: int, prompt_len: int, slot: int = -1) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(prompt_len)), SamplingParams(max_tokens=None), slot)


def finish_step(out: SchedulerOutput) -> None:
    """What the engine does after the forward pass: count computed tokens, append a sampled token."""
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        if samples:
            item.seq.token_ids.append(7)


def plan(out: SchedulerOutput) -> list[tuple[int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled]


def test_token_budget_splits_the_last_prompt_that_does_not_fit():
    scheduler, _ = make_scheduler(budget=25)
    for i in range(3):
        scheduler.add(make_seq(i, 10))
    out = scheduler.schedule()
    assert plan(out) == [(0, 10), (1, 10), (2, 5)]
    assert out.num_tokens == 25
    assert [s.samples for s in out.scheduled] == [True, True, False]


def test_chunked_prefill_then_decodes_ride_along_with_new_prefills():
    scheduler, _ = make_scheduler(budget=16)
    long = make_seq(0, 50)
    scheduler.add(long)
    chunks = []
    for _ in range(4):
        out = scheduler.schedule()
        chunks.append(plan(out))
        finish_step(out)
    assert chunks == [[(0, 16)], [(0, 16)], [(0, 16)], [(0, 2)]]
    assert long.num_output_tokens == 1  # sampled only after the last chunk
    scheduler.add(make_seq(1, 40))
    out = scheduler.schedule()
    assert plan(out) == [(0, 1), (1, 15)]  # the running decode first, then the new prompt gets what is left


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    scheduler, _ = make_scheduler(budget=32, chunked=False)
    scheduler.add(make_seq(0, 20))
    scheduler.add(make_seq(1, 20))
    assert plan(scheduler.schedule()) == [(0, 20)]


def test_max_num_seqs_limits_admissions():
    scheduler, _ = make_scheduler(max_seqs=2)
    for i in range(4):
        scheduler.add(make_seq(i, 3))
    assert [sid for sid, _ in plan(scheduler.schedule())] == [0, 1]


def test_step_order_groups_sequences_by_adapter():
    scheduler, _ = make_scheduler()
    for i, slot in enumerate([2, -1, 0, 2, 0, -1]):
        scheduler.add(make_seq(i, 3, slot))
    out = scheduler.schedule()
    assert [(s.seq.adapter_slot, s.seq.seq_id) for s in out.scheduled] == [
        (-1, 1), (-1, 5), (0, 2), (0, 4), (2, 0), (2, 3)
    ]  # fmt: skip


def test_preemption_takes_the_latest_admitted_first_and_resumes_it_with_its_tokens():
    # 5 pages of 16 tokens; prompts of 30 tokens take 2 pages each, a third once they pass 32 tokens.
    # A 60-token budget leaves no room to start a third prompt in the first step.
    scheduler, pool = make_scheduler(pages=5, budget=60)
    seqs = [make_seq(i, 30) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    finish_step(scheduler.schedule())  # two fit (2 pages each); the third waits for pages
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING, SequenceStatus.RUNNING, SequenceStatus.WAITING]
    generated = []
    while not any(s.num_preemptions for s in seqs):
        out = scheduler.schedule()
        generated.append(plan(out))
        finish_step(out)
    # Sequence 2 was admitted last, so it is the one preempted, and it waits at the front of the queue.
    assert seqs[1].num_preemptions == 1 and seqs[0].num_preemptions == 0
    assert scheduler.waiting[0] is seqs[1] and seqs[1].num_computed_tokens == 0 and not seqs[1].block_table
    kept = list(seqs[1].token_ids)
    assert len(kept) > 30  # what it generated survives preemption
    # Finish sequence 0: the preempted one comes back, recomputing prompt + generated tokens at once.
    scheduler.finish(seqs[0])
    out = scheduler.schedule()
    assert (seqs[1].seq_id, len(kept)) in plan(out)
    assert seqs[1].token_ids == kept
    assert pool.stats().kv_pages == sum(len(s.block_table) for s in seqs)


def test_a_sequence_too_long_for_the_whole_pool_is_reported():
    scheduler, _ = make_scheduler(pages=2, budget=64)
    seq = make_seq(0, 40)  # needs 3 pages
    scheduler.add(seq)
    out = scheduler.schedule()
    assert out.too_long == [seq] and out.is_empty


def test_finishing_frees_every_page():
    scheduler, pool = make_scheduler()
    seqs = [make_seq(i, 20) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    finish_step(scheduler.schedule())
    assert pool.stats().kv_pages == 6
    for seq in seqs:
        scheduler.finish(seq)
    assert pool.stats().kv_pages == 0 and pool.num_free == pool.num_pages
    assert not scheduler.has_unfinished()
