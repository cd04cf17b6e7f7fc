"""A usage report: one row per tenant, adapter or day of a period, with totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sqlmodel import Session, col, select

from api.usage.aggregate import UsageMetrics, aggregate_usage
from api.usage.period import DAY, Period, day_label
from api.usage.storage import held_bytes, stored_objects, total_held
from core.models import Adapter, Tenant

GroupBy = Literal["tenant", "adapter", "day"]
LABEL_COLUMNS: dict[str, tuple[str, ...]] = {
    "tenant": ("tenant_id", "tenant"),
    "adapter": ("adapter_id", "model", "tenant_id", "tenant"),
    "day": ("day",),
}


@dataclass
class UsageRow:
    labels: dict[str, str | None]  # the LABEL_COLUMNS of its grouping
    metrics: UsageMetrics


@dataclass
class UsageReport:
    period: Period
    group_by: GroupBy
    rows: list[UsageRow]
    totals: UsageMetrics  # storage_bytes: everything held at the end of the period

    @property
    def label_columns(self) -> tuple[str, ...]:
        return LABEL_COLUMNS[self.group_by]


def build_report(
    session: Session, period: Period, group_by: GroupBy, *, base_model: str, tenant_id: str | None = None
) -> UsageReport:
    """The report of ``period`` for every tenant, or only ``tenant_id``'s."""
    grouped = aggregate_usage(session, period, (group_by,), tenant_id=tenant_id)
    usage = {key[0]: metrics for key, metrics in grouped.items()}
    objects = stored_objects(session, period.end, tenant_id=tenant_id)
    if group_by == "day":
        rows = []
        for day in period.days():
            metrics = usage.get(day) or UsageMetrics()
            metrics.storage_bytes = total_held(objects, min(day + DAY, period.end))
            rows.append(UsageRow({"day": day_label(day)}, metrics))
    elif group_by == "tenant":
        rows = _tenant_rows(session, usage, held_bytes(objects, period.end, "tenant"))
    else:
        held = held_bytes(objects, period.end, "adapter")
        held.pop(None, None)  # training files belong to no adapter
        rows = _adapter_rows(session, usage, held, base_model, tenant_id)
    totals = UsageMetrics()
    for row in rows:
        row.metrics = row.metrics.rounded()
        totals.add(row.metrics)
    totals.storage_bytes = total_held(objects, period.end)
    return UsageReport(period, group_by, rows, totals.rounded())


def _tenant_names(session: Session, ids: set[str]) -> dict[str, str]:
    if not ids:
        return {}
    return dict(session.exec(select(Tenant.id, Tenant.name).where(col(Tenant.id).in_(ids))).all())


def _tenant_rows(session: Session, usage: dict, held: dict[str | None, int]) -> list[UsageRow]:
    ids = {t for t in (*usage, *held) if t is not None}
    names = _tenant_names(session, ids)
    rows = []
    for tenant_id in ids:
        metrics = usage.get(tenant_id) or UsageMetrics()
        metrics.storage_bytes = held.get(tenant_id, 0)
        rows.append(UsageRow({"tenant_id": tenant_id, "tenant": names.get(tenant_id)}, metrics))
    return sorted(rows, key=lambda r: (r.labels["tenant"] or "", r.labels["tenant_id"] or ""))


def _adapter_rows(
    session: Session, usage: dict, held: dict[str | None, int], base_model: str, tenant_id: str | None
) -> list[UsageRow]:
    ids = {a for a in (*usage, *held) if a is not None}
    adapters = {}
    if ids:
        stmt = select(Adapter.id, Adapter.name, Adapter.tenant_id).where(col(Adapter.id).in_(ids))
        adapters = {a: (name, t) for a, name, t in session.exec(stmt).all()}
    names = _tenant_names(session, {t for _, t in adapters.values()} | ({tenant_id} if tenant_id else set()))
    rows = []
    for adapter_id in [*ids, *([None] if None in usage else [])]:
        metrics = usage.get(adapter_id) or UsageMetrics()
        metrics.storage_bytes = held.get(adapter_id, 0)
        if adapter_id is None:  # requests on the base model
            model, owner = base_model, tenant_id
        else:
            model, owner = adapters.get(adapter_id, (None, None))
        labels = {"adapter_id": adapter_id, "model": model, "tenant_id": owner, "tenant": names.get(owner or "")}
        rows.append(UsageRow(labels, metrics))
    return sorted(rows, key=lambda r: (r.labels["tenant"] or "", r.labels["model"] or "", r.labels["adapter_id"] or ""))
