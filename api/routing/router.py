"""Which replica serves a request: the registry's live replicas ordered by ``plan_route``, plus what this
process saw since their last heartbeat (in-flight requests, refusals, 429s)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from api.routing.marks import ReplicaMarks
from api.routing.plan import plan_route
from api.routing.registry import ReplicaRegistry
from core.errors import ServiceUnavailable
from core.protocol import HEARTBEAT_S, REPLICA_TTL_S, ReplicaStatus

NO_REPLICA_RETRY_AFTER_S = 2 * HEARTBEAT_S  # a starting server registers within a heartbeat or two


class ReplicaRouter:
    """Orders replicas for each request; remembers failures for as long as a dead replica's key may live."""

    def __init__(self, registry: ReplicaRegistry, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.clock = clock
        self.marks = ReplicaMarks()
        self.in_flight: Counter[str] = Counter()
        # When a request here last ended (Unix seconds): activity for the idle clock from the moment the replica's
        # answer is over, before the request's own bookkeeping touches it (api.scaling.scaler.idle_for).
        self.last_finished = 0.0

    async def candidates(self, adapter_id: str | None) -> list[ReplicaStatus]:
        """Replicas to try, best first; ``ServiceUnavailable`` (with retry-after) when there is none."""
        replicas = await self.registry.live()
        if not replicas:
            raise ServiceUnavailable(
                f"no inference server for {self.registry.base_model!r} is running; retry shortly",
                retry_after=NO_REPLICA_RETRY_AFTER_S,
                code="no_replica",
            )
        now = self.clock()
        self.marks.forget_expired(now)
        return plan_route(replicas, adapter_id, self.marks, self.in_flight, now)

    def unreachable(self, replica_id: str) -> None:
        """It refused or dropped us before answering; its heartbeat expires within ``REPLICA_TTL_S``."""
        self.marks.mark_unreachable(replica_id, self.clock() + REPLICA_TTL_S)

    def busy(self, replica_id: str, seconds: float) -> None:
        """It answered 429: send new work elsewhere for ``seconds``."""
        self.marks.mark_busy(replica_id, self.clock() + seconds)

    def answered(self, replica_id: str) -> None:
        self.marks.mark_healthy(replica_id)

    def start(self, replica_id: str) -> None:
        """A request is now in flight at ``replica_id`` (counted as load until ``finish``)."""
        self.in_flight[replica_id] += 1

    def finish(self, replica_id: str) -> None:
        """A request at ``replica_id`` ended."""
        self.last_finished = time.time()
        self.in_flight[replica_id] -= 1
        if self.in_flight[replica_id] <= 0:
            del self.in_flight[replica_id]
