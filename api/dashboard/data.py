"""What the dashboard shows, gathered from the database (usage, jobs) and the replica registry."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sqlmodel import Session, col, func, select

from api.context import ApiContext
from api.usage.aggregate import UsageMetrics, aggregate_usage
from api.usage.period import DAY, Period, day_label
from api.usage.storage import stored_objects, total_held
from core.errors import ServiceUnavailable
from core.ids import now
from core.models import Adapter, FineTuneJob, Tenant
from core.protocol import ReplicaStatus, TenantLoad

DASHBOARD_DAYS = 14
TOP_ADAPTERS = 10


@dataclass
class ReplicaView:
    """A replica as the dashboard lists it, with adapter ids resolved to model names."""

    status: ReplicaStatus
    resident: list[str]
    host: list[str]
    heartbeat_age_s: float
    tenants: list[tuple[str, TenantLoad]] = field(default_factory=list)  # (tenant name, its load), busiest first

    @property
    def pool_pages(self) -> dict[str, int]:
        pool = self.status.pool
        return {"kv": pool.kv, "adapter": pool.adapter, "free": pool.free}


@dataclass
class DashboardData:
    period: Period
    days: list[str]  # MM-DD per column
    tokens_by_tenant: dict[str, list[int]]
    requests_by_tenant: dict[str, list[int]]
    top_adapters: list[tuple[str, float]]
    job_outcomes: list[tuple[str, float]]
    totals: UsageMetrics
    replicas: list[ReplicaView] | None = None  # None: the registry (Redis) is unreachable
    replica_error: str | None = None
    generated_at: int = field(default_factory=now)


def gather_usage(session: Session, base_model: str, days: int = DASHBOARD_DAYS) -> DashboardData:
    """Usage per tenant per day, top adapters and job outcomes over the last ``days`` days."""
    moment = now()
    today = moment - moment % DAY
    period = Period(today - (days - 1) * DAY, today + DAY)
    day_starts = period.days()
    per_tenant_day = aggregate_usage(session, period, ("tenant", "day"))
    names = dict(session.exec(select(Tenant.id, Tenant.name)).all())
    tokens: dict[str, list[int]] = {}
    requests: dict[str, list[int]] = {}
    for (tenant_id, day), metrics in sorted(per_tenant_day.items(), key=lambda kv: names.get(kv[0][0], "")):
        name = names.get(tenant_id, tenant_id)
        index = day_starts.index(day)
        tokens.setdefault(name, [0] * len(day_starts))[index] += metrics.prompt_tokens + metrics.completion_tokens
        requests.setdefault(name, [0] * len(day_starts))[index] += metrics.requests

    per_adapter = aggregate_usage(session, period, ("adapter",))
    ids = [key[0] for key in per_adapter if key[0] is not None]
    models = dict(session.exec(select(Adapter.id, Adapter.name).where(col(Adapter.id).in_(ids))).all()) if ids else {}
    tokens_per_model = [
        (models.get(a, a) if a else base_model, m.prompt_tokens + m.completion_tokens)
        for (a,), m in per_adapter.items()
    ]
    ranked = sorted(tokens_per_model, key=lambda item: -item[1])
    outcomes = session.exec(
        select(FineTuneJob.status, func.count())
        .where(col(FineTuneJob.created_at) >= period.start, col(FineTuneJob.created_at) < period.end)
        .group_by(FineTuneJob.status)
    ).all()
    totals = UsageMetrics()
    for metrics in per_adapter.values():
        totals.add(metrics)
    totals.storage_bytes = total_held(stored_objects(session, period.end), period.end)
    return DashboardData(
        period=period,
        days=[day_label(d)[5:] for d in day_starts],
        tokens_by_tenant=tokens,
        requests_by_tenant=requests,
        top_adapters=[item for item in ranked if item[1] > 0][:TOP_ADAPTERS],
        job_outcomes=sorted(((status, float(count)) for status, count in outcomes), key=lambda item: -item[1]),
        totals=totals.rounded(),
    )


async def gather_replicas(ctx: ApiContext, data: DashboardData) -> None:
    """Fill in the live replicas of every base (or why they cannot be listed)."""
    try:
        replicas = [replica for router in ctx.routers.values() for replica in await router.registry.read()]
    except ServiceUnavailable as exc:
        data.replica_error = exc.message
        return
    ids = {a for r in replicas for a in (*r.resident_adapters, *r.host_adapters)}
    tenant_ids = {t.tenant for r in replicas for t in r.tenants}
    with ctx.reading() as session:
        rows = session.exec(select(Adapter.id, Adapter.name).where(col(Adapter.id).in_(ids))).all() if ids else []
        found = (
            session.exec(select(Tenant.id, Tenant.name).where(col(Tenant.id).in_(tenant_ids))).all()
            if tenant_ids
            else []
        )
    names, tenant_names = dict(rows), dict(found)
    data.replicas = [
        ReplicaView(
            status=r,
            resident=[names.get(a, a) for a in r.resident_adapters],
            host=[names.get(a, a) for a in r.host_adapters if a not in r.resident_adapters],
            heartbeat_age_s=max(0.0, time.time() - r.updated_at),
            tenants=[(tenant_names.get(t.tenant, t.tenant), t) for t in r.tenants],
        )
        for r in replicas
    ]
