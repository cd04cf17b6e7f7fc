"""Pure routing decisions: the order in which replicas are tried for one request.

An adapter goes to the replica with the highest rendezvous score for its id, so it stays warm in one
place and only the adapters of a replica that leaves move (to their second-highest replica). When
that replica is overloaded, the request spills over to the least-loaded healthy one, preferring a
replica that already holds the adapter. Base-model requests need no warm adapter and go least-loaded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

from api.routing.marks import ReplicaMarks
from core.protocol import ReplicaStatus


def rendezvous_score(key: str, replica_id: str) -> int:
    """A stable pseudo-random weight of ``replica_id`` for ``key`` (same on every API process)."""
    digest = hashlib.blake2b(f"{key}\0{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replicas: Iterable[ReplicaStatus]) -> list[ReplicaStatus]:
    """``replicas`` from the highest to the lowest score for ``key``."""
    return sorted(replicas, key=lambda r: (rendezvous_score(key, r.id), r.id), reverse=True)


def replica_load(replica: ReplicaStatus, in_flight: Mapping[str, int]) -> int:
    """Work at a replica: what its last heartbeat reported plus what this process sent it since."""
    return replica.running + replica.waiting + in_flight.get(replica.id, 0)


def plan_route(
    replicas: Sequence[ReplicaStatus],
    adapter_id: str | None,
    marks: ReplicaMarks,
    in_flight: Mapping[str, int],
    now: float,
) -> list[ReplicaStatus]:
    """Every replica, in the order to try them for a request on ``adapter_id`` (None: the base model).

    Replicas that recently refused connections come last: their heartbeat may not have expired yet.
    """
    reachable = [r for r in replicas if not marks.unreachable(r.id, now)]
    unreachable = rendezvous_order(adapter_id or "", (r for r in replicas if marks.unreachable(r.id, now)))

    def busy(replica: ReplicaStatus) -> bool:
        return replica.overloaded or marks.busy(replica.id, now)

    if adapter_id is None:
        ordered = sorted(reachable, key=lambda r: (busy(r), replica_load(r, in_flight), r.id))
        return ordered + unreachable

    ranked = rendezvous_order(adapter_id, reachable)
    if not ranked or not busy(ranked[0]):
        return ranked + unreachable
    spill = sorted(
        (r for r in ranked[1:] if not busy(r)),
        key=lambda r: (adapter_id not in r.resident_adapters, replica_load(r, in_flight), r.id),
    )
    spilled = {r.id for r in spill}
    # When every replica is busy the adapter's own replica still comes first: queueing there beats
    # loading the adapter somewhere just as busy.
    return spill + [r for r in ranked if r.id not in spilled] + unreachable
