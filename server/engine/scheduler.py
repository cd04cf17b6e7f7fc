"""Continuous batching under a token budget: running sequences first, then admissions; preempt by recompute.

Every step mixes decodes (one token each) with prefill chunks. A prompt longer than what is left of the
budget is split across steps (chunked prefill). When a running sequence needs a page and none is free,
the most recently admitted running sequence is preempted: its pages are freed and it goes back to the
front of the waiting queue, to be recomputed from its prompt plus what it already generated. With prefix
caching, a sequence starts after the cached pages holding a prefix of its tokens (a preempted one usually
finds its own full pages still cached), and its chunks count only the tokens after them.

Admission is FCFS with two exceptions, both policy kept here: a sequence whose adapter must wait for a
seat in the batch is passed over (:mod:`server.engine.adapter_turns`), and while an adapter placement
waits for pages nothing new starts beside running sequences, so their pages come free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from server.engine.adapter_turns import AdapterTurns
from server.engine.sequence import Sequence, SequenceStatus
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
    """FCFS admission, budgeted steps, LIFO preemption, adapters taking turns. Pure bookkeeping: no tensors."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        enable_chunked_prefill: bool = True,
        turns: AdapterTurns | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.enable_chunked_prefill = enable_chunked_prefill
        self.turns = turns or AdapterTurns(max_adapters_per_batch=1 << 30, turn_steps=1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last one is preempted first
        self.num_preemptions = 0
        self.hold_admissions = False  # set while an adapter placement waits for pages held by running work
        self._preempted_last_step = False

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def kv_starved(self) -> bool:
        """Whether KV pages are short: the last step preempted, or the next admission cannot get its pages."""
        if self._preempted_last_step:
            return True
        if not self.waiting:
            return False
        head = self.waiting[0]
        cached = self.block_manager.cached_prefix(head)
        start = len(cached) * self.block_manager.block_size
        chunk = min(head.num_tokens - start, self.max_num_batched_tokens)
        return not self.block_manager.can_admit(head, cached, start + chunk, admitting=True)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and how many tokens of each to compute; reserve their pages."""
        budget = self.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        turns = self.turns
        waiting_slots = [s.adapter_slot for s in self.waiting] if turns.needs_waiting_slots() else ()
        turns.begin_step((s.adapter_slot for s in self.running), waiting_slots)

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_new, out):
                continue  # ``seq`` left the running list: the next one is now at ``index``
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
            index += 1

        # Admit waiting sequences only in steps that preempted nothing: pages are scarce otherwise.
        held = self.hold_admissions and bool(self.running)
        passed_over: list[Sequence] = []  # their adapter waits for its turn; they keep their place in the queue
        while self.waiting and budget > 0 and not held and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not turns.may_start(seq.adapter_slot):
                passed_over.append(self.waiting.popleft())
                continue
            cached = self.block_manager.cached_prefix(seq)  # pages already holding a prefix: not recomputed
            start = len(cached) * self.block_manager.block_size
            remaining = seq.num_tokens - start
            num_new = min(remaining, budget)
            if num_new < remaining and not self.enable_chunked_prefill:
                break
            alone = not self.running
            if not self.block_manager.can_admit(seq, cached, start + num_new, admitting=not alone):
                if alone:  # even an empty pool cannot hold this chunk
                    out.too_long.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, cached, start + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            turns.started(seq.adapter_slot)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))
        self._preempted_last_step = bool(out.preempted)

        # Stable sort: adapter slot order, FCFS within an adapter.
        out.scheduled.sort(key=lambda s: s.seq.adapter_slot)
        return out

    def _reserve(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Grow ``seq``'s block table, preempting the latest-admitted unscheduled sequences if needed."""
        total = seq.num_computed_tokens + num_new
        while not self.block_manager.can_grow(seq.block_table, total):
            victim = self.running[-1]  # never one scheduled earlier this step: those precede ``seq``
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

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
