"""Which waiting sequence starts next: strict priority classes, then weighted fair queuing over tenants.

A tenant's *service* is the tokens the engine computed for it (prefill chunks and decodes), divided by its
weight. Admission offers first the head of the tenant whose head would finish first in fair time (its
service plus the head's tokens over its weight: WFQ's finish tag), within the most urgent class present,
so over time each busy tenant gets computed tokens in proportion to its weight,
whatever its prompt lengths or request count: a tenant with 64 long prompts queued cannot keep one with
a single short prompt waiting behind them. Tokens, not requests, are the unit, as in the virtual token
counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024).

Only active tenants (with a sequence waiting or running) compete. A tenant that becomes active starts at
the least service among the active ones (it cannot bank credit while idle, nor arrive owing any), so a
newcomer is offered the next free seat and then shares by weight.

Classes are strict: a ``batch`` sequence starts only when no ``interactive`` one waits (OpenAI's
``service_tier: "flex"``). Within a class no tenant starves: every admission raises the admitted tenant's
service, so a waiting tenant's turn comes after the others have been served at most the gap between them
plus one chunk each.

``fcfs=True`` keeps the old behaviour (one queue in arrival order) for comparison.

Pure bookkeeping over sequences, consulted by the scheduler; unit- and property-tested alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from server.engine.sequence import Sequence, SequenceStatus

_Flow = tuple[int, str]  # (priority, tenant): one FIFO each


class FairQueue:
    """The scheduler's waiting sequences, offered for admission in fair order."""

    def __init__(self, fcfs: bool = False) -> None:
        self.fcfs = fcfs
        self._flows: dict[_Flow, deque[Sequence]] = {}
        self._size = 0
        # tenant -> weighted tokens computed; kept for an inactive tenant only while above the floor
        self._service: dict[str, float] = {}
        self._weight: dict[str, float] = {}  # tenant -> its latest request's weight (active tenants)
        self._live: dict[str, int] = {}  # tenant -> its sequences waiting or running (active tenants)
        self._floor = 0.0  # the least service among active tenants, last time it was computed

    # ----- the queue -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Sequence]:
        for flow in self._flows.values():
            yield from flow

    def add(self, seq: Sequence) -> None:
        """A new sequence: last in its tenant's queue; its tenant becomes active if it was not."""
        tenancy = seq.tenancy
        if self._live.get(tenancy.tenant, 0) == 0:
            floor = self.floor()
            self._service[tenancy.tenant] = max(self._service.get(tenancy.tenant, 0.0), floor)
        self._live[tenancy.tenant] = self._live.get(tenancy.tenant, 0) + 1
        self._weight[tenancy.tenant] = tenancy.weight
        self._queue_of(seq).append(seq)
        self._size += 1

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence: first in its tenant's queue again (it stays live)."""
        self._queue_of(seq).appendleft(seq)
        self._size += 1

    def take(self, seq: Sequence) -> None:
        """``seq`` leaves the queue to run."""
        key = self._flow(seq)
        flow = self._flows[key]
        if flow[0] is seq:
            flow.popleft()
        else:
            flow.remove(seq)
        if not flow:
            del self._flows[key]
        self._size -= 1

    def discard(self, seq: Sequence) -> None:
        """``seq`` finished (or was aborted), waiting or running: it no longer counts for its tenant."""
        flow = self._flows.get(self._flow(seq))
        if seq.status is SequenceStatus.WAITING and flow is not None and seq in flow:
            self.take(seq)
        tenant = seq.tenancy.tenant
        left = self._live.get(tenant, 0) - 1
        if left > 0:
            self._live[tenant] = left
            return
        self._live.pop(tenant, None)
        self._weight.pop(tenant, None)
        if not self._live:
            self._service.clear()  # nobody competes: nobody is owed or owes anything
            return
        floor = self.floor()
        if self._service.get(tenant, 0.0) <= floor:
            self._service.pop(tenant, None)  # it would restart at the floor anyway: forget it
        elif len(self._service) > 2 * len(self._live) + 64:  # bounded memory: forget those the floor passed
            for idle in [t for t, v in self._service.items() if v <= floor and t not in self._live]:
                del self._service[idle]

    # ----- the policy ------------------------------------------------------------------------------

    def charge(self, seq: Sequence, tokens: int) -> None:
        """The engine computes ``tokens`` of ``seq`` this step."""
        tenant = seq.tenancy.tenant
        self._service[tenant] = self._service.get(tenant, 0.0) + tokens / self._weight.get(tenant, 1.0)

    def candidates(self) -> Iterator[Sequence]:
        """Waiting sequences in the order to try them: the most urgent class, then the tenant whose head would
        finish first in fair time (its service plus the head's tokens over its weight: WFQ's finish tag, so a
        newcomer's short prompt goes before a long one at the same service), FIFO within a tenant. Tags are
        re-read at every yield, so admissions charged meanwhile count."""
        flows = {key: list(flow) for key, flow in self._flows.items()}
        position = dict.fromkeys(flows, 0)

        def finish_tag(key: _Flow) -> tuple[int, float, int, int]:
            head = flows[key][position[key]]
            work = (head.num_tokens - head.num_computed_tokens) / self._weight.get(key[1], 1.0)
            # Ties (a newcomer starts at the least service) go to the tenant with fewer sequences in the engine.
            return key[0], self._service.get(key[1], 0.0) + work, self._live.get(key[1], 0), head.seq_id

        while flows:
            key = min(flows, key=finish_tag)
            seq = flows[key][position[key]]
            position[key] += 1
            if position[key] == len(flows[key]):
                del flows[key]
            yield seq

    def head(self) -> Sequence | None:
        """The first candidate, if any."""
        return next(self.candidates(), None)

    def floor(self) -> float:
        """The least service among active tenants (the last one seen when none is active)."""
        if self._live:
            self._floor = min(self._service.get(t, 0.0) for t in self._live)
        return self._floor

    def seat_shares(self, seats: int) -> dict[str, float]:
        """Each active tenant's fair share of ``seats`` (or pages), by weight."""
        total = sum(self._weight.get(t, 1.0) for t in self._live)
        return {t: seats * self._weight.get(t, 1.0) / total for t in self._live}

    def weight(self, tenant: str) -> float:
        """An active tenant's weight (its latest request's); 1.0 for one not active."""
        return self._weight.get(tenant, 1.0)

    def waiting_by_tenant(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for (_, tenant), flow in self._flows.items():
            counts[tenant] = counts.get(tenant, 0) + len(flow)
        return counts

    def _flow(self, seq: Sequence) -> _Flow:
        return (0, "") if self.fcfs else (int(seq.tenancy.priority), seq.tenancy.tenant)

    def _queue_of(self, seq: Sequence) -> deque[Sequence]:
        return self._flows.setdefault(self._flow(seq), deque())
