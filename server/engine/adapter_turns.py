"""Adapters take turns when the batch may hold fewer distinct adapters than have work.

``max_adapters_per_batch`` caps the distinct adapters among running sequences (the base model does not
count). An adapter that cannot start because every seat is taken joins a queue of waiting adapters, in
the order they started waiting. While that queue is not empty and no seat is free, a running adapter
that has held its seat for ``turn_steps`` steps stops starting new sequences: its running ones finish,
its seat frees, and the adapter at the head of the queue takes it (as LoRAX's adapter cycling does).
So a waiting adapter starts within ``turn_steps`` steps plus the time the running adapters' sequences
need to finish, however busy they are. When the cap does not bind, nobody's turn ends.

Pure bookkeeping over adapter slots and step numbers, consulted by the scheduler; unit-tested alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from loraplex_kernels import NO_ADAPTER


class AdapterTurns:
    """Which adapter slots may start new sequences in the current step."""

    def __init__(self, max_adapters_per_batch: int, turn_steps: int) -> None:
        if max_adapters_per_batch < 1 or turn_steps < 1:
            raise ValueError("max_adapters_per_batch and turn_steps must be >= 1")
        self.cap = max_adapters_per_batch
        self.turn_steps = turn_steps
        self.step = 0
        self._seated: dict[int, int] = {}  # slot -> step it took its seat
        self._queue: dict[int, int] = {}  # waiting slot -> step it started waiting (insertion order = queue order)

    @property
    def seated(self) -> frozenset[int]:
        return frozenset(self._seated)

    @property
    def queue(self) -> tuple[int, ...]:
        return tuple(self._queue)

    def begin_step(self, running_slots: Iterable[int], waiting_slots: Iterable[int]) -> None:
        """Start a step: seats follow the running sequences; adapters with nothing waiting leave the queue."""
        self.step += 1
        running = {s for s in running_slots if s != NO_ADAPTER}
        for slot in [s for s in self._seated if s not in running]:
            del self._seated[slot]
        for slot in running - self._seated.keys():
            self._seated[slot] = self.step  # running without having been admitted here: seat it now
        if self._queue:
            waiting = set(waiting_slots)
            for slot in [s for s in self._queue if s not in waiting or s in self._seated]:
                del self._queue[slot]

    def needs_waiting_slots(self) -> bool:
        """Whether :meth:`begin_step` reads ``waiting_slots`` (only while adapters queue for a seat)."""
        return bool(self._queue)

    def may_start(self, slot: int) -> bool:
        """Whether a sequence of ``slot`` may start now; a refusal queues its adapter for a seat."""
        if slot == NO_ADAPTER:
            return True
        if slot in self._seated:
            return not self._turn_over(slot)  # once over, it queues again when its seat has freed
        # Free seats go to the longest-waiting adapters first.
        queue = list(self._queue)
        ahead = queue.index(slot) if slot in self._queue else len(queue)
        if ahead < self.cap - len(self._seated):
            return True
        self._queue.setdefault(slot, self.step)
        return False

    def started(self, slot: int) -> None:
        """A sequence of ``slot`` started running (after :meth:`may_start` allowed it)."""
        if slot != NO_ADAPTER and slot not in self._seated:
            self._seated[slot] = self.step
            self._queue.pop(slot, None)

    def _turn_over(self, slot: int) -> bool:
        return bool(self._queue) and len(self._seated) >= self.cap and self.step - self._seated[slot] >= self.turn_steps
