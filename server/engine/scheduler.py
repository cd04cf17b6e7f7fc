"""Continuous batching under a token budget: running sequences first, then admissions; preempt by recompute.

Every step mixes decodes (one token each) with prefill chunks. A prompt longer than what is left of the
budget is split across steps (chunked prefill). When a running sequence needs a page and none is free,
the most recently admitted running sequence is preempted: its pages are freed and it goes back to the
front of the waiting queue, to be recomputed from its prompt plus what it already generated. With prefix
caching, a sequence starts after the cached pages holding a prefix of its tokens (a preempted one usually
finds its own full pages still cached), and its chunks count only the tokens after them.

Admission follows :class:`~server.engine.fair_queue.FairQueue` (priority classes, then weighted fair
queuing over tenants by computed tokens; FCFS behind a flag) with two exceptions, both policy kept here:
a sequence whose adapter must wait for a seat in the batch is passed over
(:mod:`server.engine.adapter_turns`), and while an adapter placement waits for pages nothing new starts
beside running sequences, so their pages come free.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from server.engine.adapter_turns import AdapterTurns
from server.engine.fair_queue import FairQueue
from server.engine.sequence import Sequence, SequenceStatus
from server.engine.step_costs import BACKLOG_STEPS, StepCosts
from server.memory.block_manager import BlockManager


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so a new one is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """The step's work, ordered so sequences sharing an adapter are adjacent (one LoRA segment each)."""

    scheduled: list[ScheduledSequence]
    preempted: list[Sequence] = field(default_factory=list)
    too_long: list[Sequence] = field(default_factory=list)  # cannot fit the pool even alone; finish them

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Fair admission, budgeted steps, LIFO preemption, adapters taking turns. Pure bookkeeping: no tensors."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        turns: AdapterTurns | None = None,
        fcfs: bool = False,
        step_tokens_while_decoding: int | None = None,
        costs: StepCosts | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # Tokens per step while some sequence decodes (decodes first; prefill chunks get the rest, at least a page).
        self.step_tokens_while_decoding = step_tokens_while_decoding or max_num_batched_tokens
        # With step costs, prompt chunks beside decodes may stretch a decode-only step's time so far, within that cap
        # (:mod:`server.engine.step_costs`); without, they get whatever the cap leaves.
        self.costs = costs
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.turns = turns or AdapterTurns(max_adapters_per_batch=1 << 30, turn_steps=1)
        self.waiting = FairQueue(fcfs=fcfs)
        self.running: list[Sequence] = []  # in admission order; the last one is preempted first
        self.num_preemptions = 0
        self.hold_admissions = False  # set while an adapter placement waits for pages held by running work
        self._preempted_last_step = False

    def add(self, seq: Sequence) -> None:
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_starved(self) -> bool:
        """Whether KV pages are short: the last step preempted, or the next admission cannot get its pages."""
        if self._preempted_last_step:
            return True
        if not self.waiting:
            return False
        head = self.waiting.head()
        assert head is not None
        cached = self.block_manager.cached_prefix(head)
        start = len(cached) * self.block_manager.block_size
        chunk = min(head.num_tokens - start, self.max_num_batched_tokens)
        return not self.block_manager.can_admit(head, cached, start + chunk, admitting=True)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its pages."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        self.waiting.discard(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and how many tokens of each to compute; reserve their pages."""
        out = SchedulerOutput(scheduled=[])
        turns = self.turns
        waiting_slots = [s.adapter_slot for s in self.waiting] if turns.needs_waiting_slots() else ()
        turns.begin_step((s.adapter_slot for s in self.running), waiting_slots)
        held = self.hold_admissions and bool(self.running)
        reserved = 0  # prefill tokens kept for a newcomer's first chunk, ahead of running prefills
        if self.waiting and not held and not self.waiting.fcfs:
            reserved = self._make_room_for_fair_share(out)
        made_room = len(out.preempted)

        budget = self.max_num_batched_tokens
        # While anything decodes, prefill chunks get what is left of a smaller step, so decodes keep their pace.
        decoding = sum(1 for s in self.running if s.num_uncomputed_tokens == 1)
        page = self.block_manager.block_size
        room = max(page, self.step_tokens_while_decoding - decoding)  # what the token cap leaves prompt chunks
        prefill = budget
        if decoding and self.enable_chunked_prefill:
            # Step costs bound prompt chunks beside decodes in time too (server.engine.step_costs).
            if self.costs is not None:
                backlog = self._prompt_backlog(room * BACKLOG_STEPS)
                prefill = self.costs.prompt_budget(decoding, room, page, backlog)
            else:
                prefill = room
        if not decoding:
            reserved = 0
        # While others decode, a quiet tenant's first chunk goes first and alone, within the token cap but not the
        # time bound: its first token is the latency at stake. Running prefills wait that one step.
        reserved, prefill = (min(reserved, room), 0) if reserved else (0, prefill)
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            uncomputed = seq.num_uncomputed_tokens
            num_new = min(uncomputed, budget) if uncomputed == 1 else min(uncomputed, budget, prefill)
            if num_new == 0:
                index += 1  # a prefill with no chunk left this step: it waits for the next one
                continue
            if not self._reserve(seq, num_new, out):
                continue  # ``seq`` left the running list: the next one is now at ``index``
            out.scheduled.append(ScheduledSequence(seq, num_new))
            self.waiting.charge(seq, num_new)
            budget -= num_new
            if uncomputed > 1:
                prefill -= num_new
            index += 1

        prefill += reserved
        # Admit waiting sequences only in steps that preempted nothing for pages: they are scarce otherwise.
        starved = len(out.preempted) > made_room
        candidates = self.waiting.candidates() if not held and not starved else iter(())
        for seq in candidates:
            if min(budget, prefill) <= 0 or len(self.running) >= self.max_num_seqs:
                break
            if not turns.may_start(seq.adapter_slot):
                continue  # its adapter waits for its turn; the sequence keeps its place in the queue
            cached = self.block_manager.cached_prefix(seq)  # pages already holding a prefix: not recomputed
            start = len(cached) * self.block_manager.block_size
            remaining = seq.num_tokens - start
            num_new = min(remaining, budget, prefill)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            alone = not self.running
            if not self.block_manager.can_admit(seq, cached, start + num_new, admitting=not alone):
                if alone:  # even an empty pool cannot hold this chunk
                    self.waiting.take(seq)
                    out.too_long.append(seq)
                    continue
                break
            self.waiting.take(seq)
            self.block_manager.admit(seq, cached, start + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            turns.started(seq.adapter_slot)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            self.waiting.charge(seq, num_new)  # before the next candidate is chosen
            budget -= num_new
            prefill -= num_new
        self._preempted_last_step = starved

        # Stable sort: adapter slot order, FCFS within an adapter.
        out.scheduled.sort(key=lambda s: s.seq.adapter_slot)
        return out

    def _prompt_backlog(self, cap: int) -> int:
        """Prompt tokens left to compute, of running prefills and waiting sequences, counted up to ``cap``."""
        total = 0
        for seq in itertools.chain(self.running, self.waiting):
            if seq.num_uncomputed_tokens > 1:  # a decode has exactly one
                total += seq.num_uncomputed_tokens
                if total >= cap:
                    break
        return total

    def _make_room_for_fair_share(self, out: SchedulerOutput) -> int:
        """While other tenants wait, nobody keeps more than its share. If the next sequence to start belongs to a
        tenant below its share of seats, it starts this step: when seats or KV pages are short, the latest
        sequence of the tenant furthest above its share is preempted (its full pages stay cached: resuming is
        cheap). Returns the size of its first chunk if its tenant has nothing running (then that chunk goes
        before running prefills), else 0."""
        head = self.waiting.head()
        if head is None or not self.turns.may_start(head.adapter_slot):
            return 0
        tenant = head.tenancy.tenant
        seats: Counter[str] = Counter(s.tenancy.tenant for s in self.running)
        seat_share = self.waiting.seat_shares(self.max_num_seqs)
        if seats[tenant] + 1 > seat_share[tenant]:
            return 0  # starting it would put its tenant above its share: it waits its turn like anyone
        manager = self.block_manager
        cached = manager.cached_prefix(head)
        start = len(cached) * manager.block_size
        chunk = min(head.num_tokens - start, self.max_num_batched_tokens)
        while True:
            seats_full = len(self.running) >= self.max_num_seqs
            if not seats_full and manager.can_admit(head, cached, start + chunk, admitting=True):
                return chunk if not seats[tenant] else 0  # a tenant with nothing running: its TTFT is at stake
            held, share = (seats, seat_share) if seats_full else self._kv_pages_and_shares()
            above = [(held[t] / share[t], t) for t in held if t != tenant and held[t] > share[t]]
            if not above:
                return 0
            _, greedy = max(above)
            victim = next(s for s in reversed(self.running) if s.tenancy.tenant == greedy)
            self._preempt(victim)
            out.preempted.append(victim)
            seats[greedy] -= 1

    def _reserve(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Grow ``seq``'s block table, preempting unscheduled sequences (:meth:`_victim`) if needed."""
        total = seq.num_computed_tokens + num_new
        while not self.block_manager.can_grow(seq.block_table, total):
            victim = self._victim(seq)
            if victim is seq and len(self.running) == 1:
                self.running.remove(seq)
                self.block_manager.free(seq.block_table)
                out.too_long.append(seq)
                return False
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq.block_table, total)
        self.block_manager.publish(seq, total)
        return True

    def _victim(self, seq: Sequence) -> Sequence:
        """Who gives up its pages so ``seq`` can grow: never one scheduled earlier this step (those precede
        ``seq``). The latest sequence of the tenant furthest above its share of KV pages, if a tenant is
        above it; otherwise (and under FCFS) the latest admitted."""
        unscheduled = self.running[self.running.index(seq) :]
        if self.waiting.fcfs or len({s.tenancy.tenant for s in unscheduled}) < 2:
            return self.running[-1]
        held, share = self._kv_pages_and_shares()
        above = {s.tenancy.tenant for s in unscheduled if held[s.tenancy.tenant] > share[s.tenancy.tenant]}
        if not above:
            return self.running[-1]
        greedy = max(above, key=lambda t: held[t] / share[t])
        return next(s for s in reversed(unscheduled) if s.tenancy.tenant == greedy)

    def _kv_pages_and_shares(self) -> tuple[Counter[str], dict[str, float]]:
        """KV pages held by each tenant's running sequences, and each active tenant's fair share of them."""
        held: Counter[str] = Counter()
        for s in self.running:
            held[s.tenancy.tenant] += len(s.block_table)
        return held, self.waiting.seat_shares(sum(held.values()))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.requeue(seq)
