"""``/admin/tenants/{tenant}/limits``: a tenant's own rate limits, overriding the platform defaults, and its
weight when inference servers are busy."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.deps import AdminAccess, Context
from api.rate_limits import TenantLimits
from core.accounts import get_tenant
from core.models import Tenant

router = APIRouter(prefix="/admin/tenants", tags=["admin"], dependencies=[AdminAccess])

PER_MINUTE_MAX = 10**12


class LimitsUpdate(BaseModel):
    """The tenant's own limits; null returns to the platform default, 0 lifts the limit."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(default=None, ge=0, le=PER_MINUTE_MAX)
    tokens_per_minute: int | None = Field(default=None, ge=0, le=PER_MINUTE_MAX)
    scheduling_weight: float | None = Field(
        default=None, gt=0, le=1000, description="Share of a busy inference server relative to other tenants; null: 1."
    )


class LimitsObject(BaseModel):
    tenant_id: str
    object: str = "tenant_limits"
    requests_per_minute: int | None = Field(description="The tenant's own value; null: the platform default.")
    tokens_per_minute: int | None
    effective_requests_per_minute: int = Field(description="The limit in force (0: none).")
    effective_tokens_per_minute: int
    scheduling_weight: float | None
    effective_scheduling_weight: float

    @classmethod
    def of(cls, tenant: Tenant, ctx: Context) -> LimitsObject:
        effective = TenantLimits.of(tenant, ctx.settings)
        return cls(
            tenant_id=tenant.id,
            requests_per_minute=tenant.requests_per_minute,
            tokens_per_minute=tenant.tokens_per_minute,
            effective_requests_per_minute=effective.requests_per_minute,
            effective_tokens_per_minute=effective.tokens_per_minute,
            scheduling_weight=tenant.scheduling_weight,
            effective_scheduling_weight=tenant.scheduling_weight or 1.0,
        )


@router.get("/{tenant}/limits", response_model=LimitsObject, summary="A tenant's rate limits")
def get_limits(tenant: str, ctx: Context) -> LimitsObject:
    """The tenant's own limits and the ones in force."""
    with ctx.reading() as session:
        return LimitsObject.of(get_tenant(session, tenant), ctx)


@router.put("/{tenant}/limits", response_model=LimitsObject, summary="Set a tenant's rate limits")
def set_limits(tenant: str, body: LimitsUpdate, ctx: Context) -> LimitsObject:
    """Replace the tenant's own limits (every field; null: the default). Applies to its next request."""
    with ctx.session() as session:
        row = get_tenant(session, tenant)
        row.requests_per_minute = body.requests_per_minute
        row.tokens_per_minute = body.tokens_per_minute
        row.scheduling_weight = body.scheduling_weight
        session.add(row)
        return LimitsObject.of(row, ctx)
