"""What this API process learnt about replicas between heartbeats: which refused us and which said 429."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ReplicaMarks:
    """Per-replica deadlines (monotonic seconds) until which a replica is skipped or deprioritised."""

    unreachable_until: dict[str, float] = field(default_factory=dict)
    busy_until: dict[str, float] = field(default_factory=dict)

    def mark_unreachable(self, replica_id: str, until: float) -> None:
        """It refused or dropped a connection: try others first until ``until``."""
        self.unreachable_until[replica_id] = until

    def mark_busy(self, replica_id: str, until: float) -> None:
        """It answered 429: spill over until ``until``."""
        self.busy_until[replica_id] = until

    def mark_healthy(self, replica_id: str) -> None:
        """It answered: forget that it failed."""
        self.unreachable_until.pop(replica_id, None)

    def unreachable(self, replica_id: str, now: float) -> bool:
        return self.unreachable_until.get(replica_id, 0.0) > now

    def busy(self, replica_id: str, now: float) -> bool:
        return self.busy_until.get(replica_id, 0.0) > now

    def forget_expired(self, now: float) -> None:
        """Drop deadlines in the past so the maps do not grow with replicas that left."""
        for marks in (self.unreachable_until, self.busy_until):
            for replica_id in [r for r, until in marks.items() if until <= now]:
                del marks[replica_id]
