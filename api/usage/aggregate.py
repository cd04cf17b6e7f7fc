"""Summing usage records in the database, grouped by tenant, adapter, day, or pairs of them."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import ColumnElement, and_, case, func
from sqlmodel import Session, col, select

from api.usage.period import DAY, Period
from core.models import UsageRecord

GROUP_COLUMNS: dict[str, ColumnElement[Any]] = {
    "tenant": col(UsageRecord.tenant_id),
    "adapter": col(UsageRecord.adapter_id),
    "day": (col(UsageRecord.created_at) // DAY) * DAY,
}


@dataclass
class UsageMetrics:
    """Everything a report counts for one group. Storage is what was held at the end of the period."""

    requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    completion_tokens: int = 0
    training_tokens: int = 0
    job_compute_seconds: float = 0.0
    gpu_seconds: float = 0.0
    cold_starts: int = 0
    residency_page_seconds: float = 0.0
    storage_bytes: int = 0

    def add(self, other: UsageMetrics) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def rounded(self) -> UsageMetrics:
        """Seconds to the microsecond, so every export of a report shows the same numbers."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return UsageMetrics(**{k: round(v, 6) if isinstance(v, float) else v for k, v in values.items()})


METRIC_NAMES = tuple(f.name for f in fields(UsageMetrics))


def _metric_columns() -> list[ColumnElement[Any]]:
    inference = col(UsageRecord.kind) == "inference"
    return [
        func.count(case((inference, 1))),
        func.count(case((and_(inference, col(UsageRecord.status) != "completed"), 1))),
        func.coalesce(func.sum(UsageRecord.prompt_tokens), 0),
        func.coalesce(func.sum(UsageRecord.cached_tokens), 0),
        func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
        func.coalesce(func.sum(UsageRecord.training_tokens), 0),
        func.coalesce(func.sum(UsageRecord.compute_seconds), 0.0),
        func.coalesce(func.sum(UsageRecord.gpu_seconds), 0.0),
        func.count(case((and_(inference, col(UsageRecord.cold_start)), 1))),
        func.coalesce(func.sum(UsageRecord.page_seconds), 0.0),
    ]


def aggregate_usage(
    session: Session, period: Period, group_by: tuple[str, ...], *, tenant_id: str | None = None
) -> dict[tuple[Any, ...], UsageMetrics]:
    """Usage records in ``period`` summed per value of the ``group_by`` columns (storage left at 0)."""
    keys = [GROUP_COLUMNS[name] for name in group_by]
    stmt = select(*keys, *_metric_columns()).where(
        col(UsageRecord.created_at) >= period.start, col(UsageRecord.created_at) < period.end
    )
    if tenant_id is not None:
        stmt = stmt.where(col(UsageRecord.tenant_id) == tenant_id)
    if keys:
        stmt = stmt.group_by(*keys)
    result: dict[tuple[Any, ...], UsageMetrics] = {}
    for row in session.exec(stmt).all():
        key, values = tuple(row[: len(keys)]), row[len(keys) :]
        if not keys and not values[0] and not any(values[1:]):
            continue  # no records at all: an aggregate without GROUP BY still returns one row
        metrics = UsageMetrics(*(v if isinstance(v, int) else float(v) for v in values))
        result[key] = metrics
    return result
