"""What this replica did to adapters' bytes, on its way to the control plane's audit trail (``core.audit``).

The adapter tiers call :func:`audit_event` where they verify, refuse, load and evict; the events gather in
an :class:`AuditTrail` (any thread, either process: the engine process relays them over its pipe), and the
replica's heartbeat thread (``server.replica_registry``) sends them to ``AUDIT_STREAM``. Events that could
not be sent wait for the next beat; if Redis stays away long enough to pile up ``MAX_UNSENT`` of them, the
oldest are dropped and the loss is logged (a replica must keep serving, not grow without bound). Every event
is also logged here, so a standalone server without Redis keeps its trail in its log (and the last
``MAX_UNSENT`` events in memory, which nothing sends).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from core.protocol import AdapterAuditEvent
from server.adapters.sources import AdapterSource, LocalSource, adapter_id_of_key

log = logging.getLogger(__name__)

MAX_UNSENT = 4096


def audit_event(
    action: str,
    key: str,
    source: AdapterSource | None,
    *,
    tier: str,
    reason: str,
    cause: str | None = None,
    detail: str | None = None,
) -> AdapterAuditEvent:
    """The event of ``action`` on the adapter cached under ``key``, which came from ``source`` (None: the tiers
    no longer know it, as when host RAM lets go of an adapter nobody asked for since)."""
    if source is None:
        name, sha256 = key, None
    elif isinstance(source, LocalSource):
        name, sha256 = source.name, None  # local directories are not hashed; their path is the identity
    else:
        name, sha256 = source.descriptor.name, source.descriptor.sha256
    return AdapterAuditEvent(
        action=action,  # type: ignore[arg-type]
        adapter_id=adapter_id_of_key(key),
        adapter_name=name,
        sha256=sha256,
        tier=tier,
        reason=reason,
        cause=cause,
        detail=detail[:1000] if detail else None,
        at=time.time(),
    )


class AuditTrail:
    """Events not yet sent to the control plane, oldest first."""

    def __init__(self, replica_id: str, max_unsent: int = MAX_UNSENT) -> None:
        self.replica_id = replica_id
        self._unsent: deque[AdapterAuditEvent] = deque()
        self._max = max_unsent
        self._dropped = 0
        self._lock = threading.Lock()

    def record(self, event: AdapterAuditEvent) -> None:
        """Keep ``event`` (stamped with this replica) until it is sent."""
        event = event.model_copy(update={"replica": self.replica_id})
        log.info(
            "audit: %s %s (%s) tier=%s reason=%s cause=%s",
            event.action,
            event.adapter_name,
            event.adapter_id or "local",
            event.tier,
            event.reason,
            event.cause or "-",
        )
        with self._lock:
            self._unsent.append(event)
            while len(self._unsent) > self._max:
                self._unsent.popleft()
                self._dropped += 1

    def take(self) -> list[AdapterAuditEvent]:
        """Every unsent event; give back what could not be sent with :meth:`give_back`."""
        with self._lock:
            events, self._unsent = list(self._unsent), deque()
            dropped, self._dropped = self._dropped, 0
        if dropped:
            log.warning("dropped %d audit events: the control plane was unreachable for too long", dropped)
        return events

    def give_back(self, events: list[AdapterAuditEvent]) -> None:
        """Put unsent ``events`` back in front of any recorded since, keeping the bound."""
        with self._lock:
            self._unsent.extendleft(reversed(events))
            while len(self._unsent) > self._max:
                self._unsent.popleft()
                self._dropped += 1
