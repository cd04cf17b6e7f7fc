"""The audit trail: which adapter bytes were verified, refused, loaded, evicted and deleted, when, where, and
on whose behalf.

Replicas report what they do to adapters as ``core.protocol.AdapterAuditEvent`` entries on
``AUDIT_STREAM`` (they never touch the database); the API stores them (``api.background.audit``). The
control plane records deletions itself, in the transaction that marks the adapter deleted. Admins read the
rows at ``GET /admin/audit``; tenants cannot.
"""

from __future__ import annotations

import time
from enum import StrEnum

from sqlmodel import Session

from core.ids import new_id
from core.models import Adapter, AuditEvent
from core.protocol import AdapterAuditEvent


class AuditAction(StrEnum):
    VERIFY = "verify"  # fetched and checked: sha256, format, shapes, base fingerprint
    REFUSE = "refuse"  # the checks failed; ``reason`` is the error's code, ``detail`` its message
    LOAD = "load"  # placed in the pool; ``tier`` says where the bytes came from (store, local, host RAM)
    EVICT = "evict"  # left the pool or host RAM (``tier``), for ``reason``
    DELETE = "delete"  # its objects were deleted from the store by the control plane


def event_rows(events: list[AdapterAuditEvent], tenant_of: dict[str, str]) -> list[AuditEvent]:
    """Rows of a batch of replica events, their ids in the order the events happened (ids made in the same
    millisecond would otherwise sort by their random part)."""
    ordered = sorted(events, key=lambda e: e.at)
    ids = sorted(new_id("audit") for _ in ordered)
    return [event_row(e, tenant_of.get(e.adapter_id or ""), row_id) for e, row_id in zip(ordered, ids, strict=True)]


def event_row(event: AdapterAuditEvent, tenant_id: str | None, row_id: str | None = None) -> AuditEvent:
    """The row of a replica's event; ``tenant_id`` is the adapter's owner, looked up by the API. Strings are cut
    to their columns' widths: one overlong field must not make a batch fail to store, again and again."""
    return AuditEvent(
        id=row_id or new_id("audit"),
        at=event.at,
        action=event.action,
        tenant_id=tenant_id,
        adapter_id=event.adapter_id[:40] if event.adapter_id else None,
        adapter_name=event.adapter_name[:512],
        replica=event.replica[:255] or None,
        sha256=event.sha256[:64] if event.sha256 else None,
        tier=event.tier[:16],
        reason=event.reason[:64],
        cause=event.cause[:128] if event.cause else None,
        detail=event.detail[:1000] if event.detail else None,
    )


def record_deletion(session: Session, adapter: Adapter, *, cause: str, reason: str) -> None:
    """Add the ``delete`` row of ``adapter`` to ``session`` (committed with the deletion itself)."""
    session.add(
        AuditEvent(
            id=new_id("audit"),
            at=time.time(),
            action=AuditAction.DELETE,
            tenant_id=adapter.tenant_id,
            adapter_id=adapter.id,
            adapter_name=adapter.name.split("#retired-")[0],
            sha256=adapter.sha256,
            tier="store",
            reason=reason,
            cause=cause,
        )
    )
