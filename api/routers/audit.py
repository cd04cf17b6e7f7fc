"""``/admin/audit``: the audit trail of adapters' bytes (``core.audit``), newest first, for admins only."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query
from pydantic import BaseModel
from sqlmodel import select

from api.deps import AdminAccess, Context
from api.pagination import After, Limit, ListPage, build_page, page_query
from core.audit import AuditAction
from core.models import AuditEvent

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminAccess])

Id = Annotated[str | None, Query(max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]


class AuditEventObject(BaseModel):
    """One thing done to an adapter's bytes, where, when and on whose behalf."""

    id: str
    object: Literal["audit.event"] = "audit.event"
    at: float
    action: AuditAction
    tenant_id: str | None
    adapter_id: str | None
    adapter_name: str | None
    replica: str | None
    sha256: str | None
    tier: str | None
    reason: str | None
    cause: str | None
    detail: str | None

    @classmethod
    def from_row(cls, row: AuditEvent) -> AuditEventObject:
        return cls.model_validate(row, from_attributes=True)


class AuditList(ListPage[AuditEventObject]):
    """A page of audit events."""


@router.get("/audit", response_model=AuditList, summary="The adapter audit trail")
def list_audit(
    ctx: Context,
    tenant_id: Id = None,
    adapter_id: Id = None,
    action: Annotated[AuditAction | None, Query()] = None,
    replica: Annotated[str | None, Query(max_length=255)] = None,
    cause: Annotated[str | None, Query(max_length=128, description="request:<id>, job:<id> or tenant:<id>.")] = None,
    since: Annotated[float | None, Query(ge=0, description="Events at or after (Unix seconds).")] = None,
    until: Annotated[float | None, Query(ge=0, description="Events before (Unix seconds).")] = None,
    after: After = None,
    limit: Limit = 20,
) -> AuditList:
    """Every verification, refusal, load, eviction and deletion of adapters, newest first, filtered by any of
    the fields; page with ``after`` (the last id of the previous page)."""
    stmt = select(AuditEvent)
    for column, value in (
        (AuditEvent.tenant_id, tenant_id),
        (AuditEvent.adapter_id, adapter_id),
        (AuditEvent.action, action),
        (AuditEvent.replica, replica),
        (AuditEvent.cause, cause),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    if since is not None:
        stmt = stmt.where(AuditEvent.at >= since)
    if until is not None:
        stmt = stmt.where(AuditEvent.at < until)
    with ctx.reading() as session:
        rows = session.exec(page_query(stmt, AuditEvent.id, after=after, limit=limit)).all()
    return build_page(AuditList, rows, limit, AuditEventObject.from_row)
