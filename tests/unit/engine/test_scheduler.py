"""Scheduler without a model: token budget, chunked prefill, decode-first, preemption order and resumption,
adapters taking turns under the per-batch cap, KV starvation and held admissions."""

from __future__ import annotations

import torch

from loraplex_kernels import KVGeometry
from server.engine.adapter_turns import AdapterTurns
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.step_costs import StepCosts
from server.memory.block_manager import BlockManager
from server.memory.pool import PagePool

GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1, block_size=16)


def make_scheduler(
    pages: int = 64,
    budget: int = 64,
    max_seqs: int = 16,
    watermark: int = 0,
    chunked: bool = True,
    turns: AdapterTurns | None = None,
):
    pool = PagePool(GEOMETRY, pages, torch.float32, "cpu")
    return Scheduler(BlockManager(pool, 16, watermark), budget, max_seqs, chunked, turns), pool


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
    assert scheduler.waiting.head() is seqs[1] and seqs[1].num_computed_tokens == 0 and not seqs[1].block_table
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


def run_adapters(scheduler: Scheduler, arrivals, steps: int, output_len: int = 3) -> dict[int, int]:
    """Step a workload where ``arrivals(step)`` lists the (slot, prompt_len) of sequences arriving before that
    step and every sequence stops after ``output_len`` tokens; returns the step each slot first ran."""
    return run_adapters_by_step(scheduler, arrivals, steps, output_len)[0]


def run_adapters_by_step(scheduler: Scheduler, arrivals, steps: int, output_len: int = 3):
    """:func:`run_adapters`, plus the slots each step ran."""
    first_run: dict[int, int] = {}
    by_step: list[set[int]] = []
    next_id = 0
    for step in range(steps):
        for slot, prompt_len in arrivals(step):
            scheduler.add(make_seq(next_id, prompt_len, slot))
            next_id += 1
        out = scheduler.schedule()
        for item in out.scheduled:
            first_run.setdefault(item.seq.adapter_slot, step)
        by_step.append({item.seq.adapter_slot for item in out.scheduled})
        finish_step(out)
        for item in out.scheduled:
            if item.seq.num_output_tokens >= output_len:
                scheduler.finish(item.seq)
    return first_run, by_step


def busy_adapter_and_a_latecomer(step: int) -> list[tuple[int, int]]:
    """Adapter 0 gets a new request every step; adapter 1 sends one at step 2; the base model one at step 3."""
    return [(0, 4)] + [(1, 4)] * (step == 2) + [(-1, 4)] * (step == 3)


def test_a_waiting_adapter_gets_its_turn_within_a_bounded_number_of_steps():
    turn_steps, output_len = 5, 3
    scheduler, _ = make_scheduler(max_seqs=64, turns=AdapterTurns(max_adapters_per_batch=1, turn_steps=turn_steps))
    first_run, by_step = run_adapters_by_step(scheduler, busy_adapter_and_a_latecomer, 40, output_len)
    assert first_run[-1] == 3  # the base model never waits for a seat
    # Adapter 0's turn ends turn_steps after it started; its running sequences need output_len more steps.
    assert 2 < first_run[1] <= turn_steps + output_len + 1
    assert all(len(slots - {-1}) <= 1 for slots in by_step)  # never two adapters in one batch
    # Adapter 1's one request done, adapter 0 takes the seat back: its requests waited, none was lost.
    assert 0 in by_step[-1] and not any(s.adapter_slot == 1 for s in [*scheduler.waiting, *scheduler.running])


def test_without_turns_a_busy_adapter_keeps_the_only_seat():
    """The starvation the turns prevent: with turns that never end, adapter 1 never runs."""
    scheduler, _ = make_scheduler(max_seqs=64, turns=AdapterTurns(max_adapters_per_batch=1, turn_steps=10_000))
    first_run = run_adapters(scheduler, busy_adapter_and_a_latecomer, steps=40)
    assert 1 not in first_run and first_run[-1] == 3


def test_adapters_take_turns_in_the_order_they_started_waiting():
    def three_busy_adapters(step: int) -> list[tuple[int, int]]:
        return [(slot, 4) for slot in (0, 1, 2) if step >= slot]

    turns = AdapterTurns(max_adapters_per_batch=1, turn_steps=3)
    scheduler, _ = make_scheduler(max_seqs=64, turns=turns)
    first_run = run_adapters(scheduler, three_busy_adapters, steps=60)
    assert first_run[0] == 0 and first_run[0] < first_run[1] < first_run[2] <= 2 * (3 + 3 + 1)
    ran: list[int] = []
    for _ in range(60):  # keep going: the seat keeps rotating through all three
        for slot in (0, 1, 2):
            scheduler.add(make_seq(1000 + len(ran) * 3 + slot, 4, slot))
        out = scheduler.schedule()
        ran += [item.seq.adapter_slot for item in out.scheduled]
        finish_step(out)
        for item in out.scheduled:
            if item.seq.num_output_tokens >= 3:
                scheduler.finish(item.seq)
        assert len({item.seq.adapter_slot for item in out.scheduled}) <= 1
    assert set(ran) == {0, 1, 2}


def test_the_cap_counts_distinct_adapters_and_leaves_free_seats_open():
    scheduler, _ = make_scheduler(turns=AdapterTurns(max_adapters_per_batch=2, turn_steps=1))
    for i, slot in enumerate((0, 0, 1, 2, 1)):
        scheduler.add(make_seq(i, 4, slot))
    out = scheduler.schedule()
    assert plan(out) == [(0, 4), (1, 4), (2, 4), (4, 4)]  # adapter 2 waits; its place in the queue is kept
    assert [s.seq_id for s in scheduler.waiting] == [3]


def test_kv_starvation_is_reported_by_the_scheduler():
    scheduler, _ = make_scheduler(pages=4, budget=64, watermark=1)
    assert not scheduler.kv_starved()
    scheduler.add(make_seq(0, 40))  # 3 pages
    finish_step(scheduler.schedule())
    assert not scheduler.kv_starved()
    scheduler.add(make_seq(1, 20))  # 2 pages (+1 watermark) while 1 is free
    assert scheduler.kv_starved()


def test_held_admissions_start_nothing_beside_running_work():
    scheduler, _ = make_scheduler()
    scheduler.hold_admissions = True
    scheduler.add(make_seq(0, 4))
    out = scheduler.schedule()
    assert plan(out) == [(0, 4)]  # nothing runs, so holding would only stall: it starts
    finish_step(out)
    scheduler.add(make_seq(1, 4))
    assert plan(scheduler.schedule()) == [(0, 1)]  # held while sequence 0 runs
    scheduler.hold_admissions = False
    assert (1, 4) in plan(scheduler.schedule())


def eight_decoding(step_tokens_while_decoding: int, costs: StepCosts | None = None) -> Scheduler:
    """A scheduler whose sequences 0-7 have prefilled their 4-token prompts and decode from the next step on."""
    pool = PagePool(GEOMETRY, 256, torch.float32, "cpu")
    scheduler = Scheduler(BlockManager(pool, 16, 0), 256, 64, step_tokens_while_decoding=step_tokens_while_decoding,
                          costs=costs)  # fmt: skip
    for i in range(8):
        scheduler.add(make_seq(i, 4))
    finish_step(scheduler.schedule())  # nothing decodes yet: the prompts take what they need
    return scheduler


def test_while_sequences_decode_prefill_chunks_get_what_is_left_of_a_smaller_step():
    scheduler = eight_decoding(40)
    scheduler.add(make_seq(100, 200))
    out = scheduler.schedule()
    assert plan(out)[:8] == [(i, 1) for i in range(8)] and plan(out)[8] == (100, 32)  # 40 - 8 decodes
    finish_step(out)
    assert plan(scheduler.schedule())[8] == (100, 32)  # and again, while they decode
    many = [make_seq(200 + i, 4) for i in range(40)]
    for seq in many:
        scheduler.add(seq)
    out = scheduler.schedule()
    assert sum(n for _, n in plan(out)) <= 8 + 16 + 16  # beyond the step, at least a page of prefill


def test_with_step_costs_prompt_chunks_beside_decodes_fit_the_stretch_of_a_decode_only_step():
    costs = StepCosts(stretch=2.0, min_stretch=2.0)  # a fixed stretch, whatever the backlog
    for decodes in (2, 4, 8, 12) * 4:  # 3 ms a step plus 0.25 ms a decode; a prompt token costs 0.125 ms
        costs.observe(decodes, 0, 3e-3 + 0.25e-3 * decodes)
    costs.observe(8, 64, 3e-3 + 0.25e-3 * 8 + 0.125e-3 * 64)
    scheduler = eight_decoding(256, costs)
    scheduler.add(make_seq(100, 500))
    out = scheduler.schedule()
    # A decode-only step of 8 takes 5 ms; a stretch of 2 leaves 5 ms for the prompt: 40 tokens, not 256 - 8.
    assert plan(out)[:8] == [(i, 1) for i in range(8)] and plan(out)[8] == (100, 40)


def test_prompt_chunks_beside_decodes_grow_with_the_prompt_backlog():
    """One prompt waiting: chunks within the steady stretch (it clears in a few steps anyway). A backlog of long
    prompts: chunks up to the full stretch, so their first tokens do not wait on a trickle."""
    costs = StepCosts(stretch=3.0, min_stretch=1.5)
    for decodes in (2, 4, 8, 12) * 4:  # 3 ms a step plus 0.25 ms a decode; a prompt token costs 0.125 ms
        costs.observe(decodes, 0, 3e-3 + 0.25e-3 * decodes)
    costs.observe(8, 64, 3e-3 + 0.25e-3 * 8 + 0.125e-3 * 64)
    # A decode-only step of 8 takes 5 ms, 40 prompt tokens' worth: stretch 1.5 leaves 20 tokens, stretch 3 80.
    scheduler = eight_decoding(256, costs)
    scheduler.add(make_seq(100, 240))  # 240 / BACKLOG_STEPS = 15: the steady stretch's 20 are more
    assert plan(scheduler.schedule())[8] == (100, 20)

    scheduler = eight_decoding(256, costs)
    scheduler.add(make_seq(100, 800))  # 800 / BACKLOG_STEPS = 50
    assert plan(scheduler.schedule())[8] == (100, 50)

    scheduler = eight_decoding(256, costs)
    for i in range(6):
        scheduler.add(make_seq(100 + i, 400))  # 2,400 prompt tokens waiting: the full stretch
    out = scheduler.schedule()
    assert sum(n for _, n in plan(out)[8:]) == 80
