"""Fair admission without a model: shares follow weights on tokens, newcomers neither bank nor owe credit,
priority classes are strict, nobody starves, and FCFS is still there behind the flag."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.step_costs import StepCosts
from server.engine.tenancy import Priority, Tenancy
from tests.unit.engine.test_scheduler import finish_step, make_scheduler, make_seq

OUTPUT_LEN = 4


def seq_of(seq_id: int, prompt_len: int, tenant: str, weight: float = 1.0, batch: bool = False) -> Sequence:
    seq = make_seq(seq_id, prompt_len)
    seq.tenancy = Tenancy(tenant, weight, Priority.BATCH if batch else Priority.INTERACTIVE)
    return seq


class Simulation:
    """Steps a scheduler like the engine does; sequences finish after ``OUTPUT_LEN`` tokens."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.next_id = 0
        self.tokens: Counter[str] = Counter()  # computed tokens per tenant
        self.first_step: dict[int, int] = {}  # seq id -> step it first ran
        self.step_no = 0

    def add(self, prompt_len: int, tenant: str, weight: float = 1.0, batch: bool = False) -> Sequence:
        seq = seq_of(self.next_id, prompt_len, tenant, weight, batch)
        self.next_id += 1
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[Sequence]:
        self.step_no += 1
        out = self.scheduler.schedule()
        for item in out.scheduled:
            self.tokens[item.seq.tenancy.tenant] += item.num_new_tokens
            self.first_step.setdefault(item.seq.seq_id, self.step_no)
        finish_step(out)
        done = [item.seq for item in out.scheduled if item.seq.num_output_tokens >= OUTPUT_LEN]
        for seq in done + out.too_long:
            self.scheduler.finish(seq)
        return done


def test_a_short_request_starts_next_step_behind_a_flood_of_long_ones():
    for fcfs in (False, True):
        scheduler, _ = make_scheduler(pages=256, budget=64, max_seqs=64)
        scheduler.waiting.fcfs = fcfs
        sim = Simulation(scheduler)
        for _ in range(24):
            sim.add(60, "flood")
        sim.step()
        quiet = sim.add(8, "quiet")
        sim.step()
        started = quiet.status is SequenceStatus.RUNNING
        assert started is not fcfs  # FCFS makes it wait for every long prompt queued before it


def test_a_tenant_holding_every_seat_gives_one_up_to_a_waiting_tenant_below_its_share():
    scheduler, _ = make_scheduler(pages=256, budget=64, max_seqs=4)
    sim = Simulation(scheduler)
    flood = [sim.add(8, "flood") for _ in range(6)]
    sim.step()
    assert sum(s.status is SequenceStatus.RUNNING for s in flood) == 4
    quiet = sim.add(8, "quiet")
    sim.step()
    assert quiet.status is SequenceStatus.RUNNING  # started at once, in the seat of the latest flood sequence
    assert flood[3].num_preemptions == 1 and flood[3].status is SequenceStatus.WAITING
    assert sum(s.tenancy.tenant == "flood" for s in scheduler.running) == 3
    scheduler.waiting.fcfs = True  # the old behaviour: nobody gives up a seat
    late = sim.add(8, "late")
    sim.step()
    assert late.status is SequenceStatus.WAITING


def test_a_tenant_at_its_share_waits_for_a_seat_like_anyone():
    scheduler, _ = make_scheduler(pages=256, budget=64, max_seqs=2)
    sim = Simulation(scheduler)
    a = sim.add(8, "a")
    b = [sim.add(8, "b") for _ in range(2)]
    sim.step()
    assert a.status is SequenceStatus.RUNNING and b[0].status is SequenceStatus.RUNNING
    sim.step()
    assert b[1].status is SequenceStatus.WAITING and not scheduler.num_preemptions  # b holds its one seat of two


def test_backlogged_tenants_share_computed_tokens_by_weight_whatever_their_prompt_lengths():
    scheduler, _ = make_scheduler(pages=512, budget=48, max_seqs=4)
    sim = Simulation(scheduler)
    for _ in range(300):
        for tenant, prompt_len, weight in (("long", 40, 1.0), ("short", 6, 3.0)):
            if scheduler.waiting.waiting_by_tenant().get(tenant, 0) < 4:
                sim.add(prompt_len, tenant, weight)
        sim.step()
    ratio = sim.tokens["short"] / sim.tokens["long"]
    assert 2.6 < ratio < 3.4, sim.tokens


def test_a_newcomer_neither_banks_credit_nor_owes_it():
    scheduler, _ = make_scheduler(pages=512, budget=32, max_seqs=2)
    sim = Simulation(scheduler)
    for _ in range(100):  # "old" is served alone for a long time
        if len(scheduler.waiting) < 4:
            sim.add(12, "old")
        sim.step()
    before = Counter(sim.tokens)
    for _ in range(100):
        for tenant in ("old", "new"):
            if scheduler.waiting.waiting_by_tenant().get(tenant, 0) < 4:
                sim.add(12, tenant)
        sim.step()
    old, new = sim.tokens["old"] - before["old"], sim.tokens["new"] - before["new"]
    assert 0.8 < new / old < 1.25, (old, new)  # from its arrival on, "new" shares equally: no catch-up


def test_batch_starts_only_when_no_interactive_request_waits():
    scheduler, _ = make_scheduler(pages=256, budget=16, max_seqs=64)
    sim = Simulation(scheduler)
    batch = [sim.add(8, "a", batch=True) for _ in range(3)]
    interactive = [sim.add(8, "b") for _ in range(3)] + [sim.add(8, "a") for _ in range(3)]
    while any(s.status is SequenceStatus.WAITING for s in interactive):
        sim.step()
        started = [s for s in interactive if s.status is not SequenceStatus.WAITING]
        assert all(b.status is SequenceStatus.WAITING for b in batch) or len(started) == len(interactive)
    for _ in range(20):
        sim.step()
    assert all(b.status is not SequenceStatus.WAITING for b in batch)


def test_finished_tenants_are_forgotten():
    scheduler, _ = make_scheduler(pages=256, budget=64, max_seqs=64)
    sim = Simulation(scheduler)
    for tenant in range(50):
        sim.add(4, f"t{tenant}")
    while scheduler.has_unfinished():
        sim.step()
    assert not scheduler.waiting._service and not scheduler.waiting._live


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 70), st.sampled_from([0.5, 1.0, 4.0]), st.booleans()),
        min_size=1,
        max_size=40,
    ),
    st.integers(16, 96),
    st.integers(1, 6),
)
def test_every_request_starts_and_the_pool_ends_empty(arrivals, budget, max_seqs):
    """Random tenants, weights, classes and prompt lengths arriving over time: the queue's counts stay exact,
    every sequence runs to its end (nobody starves once arrivals stop), and every page comes back."""
    scheduler, pool = make_scheduler(pages=64, budget=budget, max_seqs=max_seqs)
    sim = Simulation(scheduler)
    seqs = []
    for i, (tenant, prompt_len, weight, batch) in enumerate(arrivals):
        seqs.append(sim.add(prompt_len, f"t{tenant}", weight, batch))
        if i % 3 == 0:
            sim.step()
        assert len(scheduler.waiting) == sum(1 for s in seqs if s.status is SequenceStatus.WAITING)
    total_tokens = sum(len(s.token_ids) + OUTPUT_LEN for s in seqs)
    for _ in range(total_tokens * 2):  # generous: every step computes at least one token
        if not scheduler.has_unfinished():
            break
        sim.step()
    assert not scheduler.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert not scheduler.waiting._live and len(scheduler.waiting) == 0
    pool.flush_cache()
    assert pool.stats().free_pages == pool.stats().total_pages


def tight_step_costs() -> StepCosts:
    """Costs under which the stretch leaves prompt chunks beside a few decodes no more than a page."""
    costs = StepCosts(stretch=1.5)
    for decodes in (2, 4, 6) * 4:
        costs.observe(decodes, 0, 1e-3)
    costs.observe(4, 100, 1e-3 + 100 * 1e-3)  # a prompt token costs a whole decode-only step
    return costs


@pytest.mark.parametrize("costs", [None, tight_step_costs()], ids=["token cap", "step costs"])
def test_a_quiet_tenants_first_chunk_runs_beside_decodes_only(costs: StepCosts | None):
    """The step answering a quiet tenant's first token carries the others' decodes but not their prefills, and
    its chunk is bounded by the token cap, not by the stretch (its first token is the latency at stake)."""
    pool_scheduler, _ = make_scheduler(pages=256, budget=256, max_seqs=16)
    pool_scheduler.costs = costs
    sim = Simulation(pool_scheduler)
    busy = [sim.add(4, "busy") for _ in range(4)]
    sim.step()
    long_prompt = sim.add(600, "busy")  # prefills in chunks while the others decode
    sim.step()
    quiet = sim.add(20, "quiet")
    out = pool_scheduler.schedule()
    planned = {item.seq.seq_id: item.num_new_tokens for item in out.scheduled}
    assert planned == {**{s.seq_id: 1 for s in busy}, quiet.seq_id: 20}
    assert long_prompt.status is SequenceStatus.RUNNING  # it resumes its chunks next step


def test_when_pages_run_out_the_tenant_above_its_share_of_pages_gives_them_up():
    """Not the latest-admitted sequence (LIFO) but the latest of the tenant holding more pages than its share."""
    for fcfs, victim_tenant in ((False, "big"), (True, "small")):
        scheduler, _ = make_scheduler(pages=12, budget=256, max_seqs=8)
        scheduler.waiting.fcfs = fcfs
        sim = Simulation(scheduler)
        big = [sim.add(40, "big") for _ in range(2)]  # 3 pages each
        sim.step()
        small = sim.add(20, "small")  # 2 pages, admitted last
        sim.step()
        assert all(s.status is SequenceStatus.RUNNING for s in [*big, small])
        preempted = []
        for _ in range(40):  # everyone decodes until the 12 pages run out
            out = scheduler.schedule()
            preempted += out.preempted
            finish_step(out)
            if preempted:
                break
        assert preempted and preempted[0].tenancy.tenant == victim_tenant
