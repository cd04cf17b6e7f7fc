"""Usage reports: ``/admin/usage`` for every tenant (admin key), ``/v1/usage`` for the caller's own tenant."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response
from fastapi.responses import JSONResponse

from api.dashboard.auth import AdminOrSession
from api.deps import Context, CurrentTenant
from api.usage.export import report_csv, report_json
from api.usage.period import parse_period
from api.usage.report import GroupBy, build_report

router = APIRouter(tags=["usage"])

From = Annotated[
    str | None,
    Query(alias="from", description="Start (inclusive): Unix seconds or ISO 8601; default 30 days before `to`."),
]
To = Annotated[str | None, Query(description="End (exclusive): Unix seconds or ISO 8601; default now.")]
Format = Annotated[Literal["json", "csv"], Query(description="`csv` for a spreadsheet; same rows as `json`.")]
REPORT_RESPONSES = {
    200: {
        "description": "The usage report: rows per group and totals (JSON), or the rows as CSV.",
        "content": {"application/json": {}, "text/csv": {}},
    }
}


def _answer(ctx: Context, group_by: GroupBy, start: str | None, end: str | None, fmt: str, tenant_id: str | None):  # type: ignore[no-untyped-def]
    period = parse_period(start, end)
    with ctx.reading() as session:
        report = build_report(session, period, group_by, base_model=ctx.bases.label, tenant_id=tenant_id)
    if fmt == "csv":
        name = f"usage-{group_by}-{period.start}-{period.end}.csv"
        return Response(
            report_csv(report),
            media_type="text/csv; charset=utf-8",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )
    return JSONResponse(report_json(report))


@router.get("/admin/usage", summary="Usage of every tenant", responses=REPORT_RESPONSES, dependencies=[AdminOrSession])
def admin_usage(
    ctx: Context,
    start: From = None,
    end: To = None,
    group_by: Annotated[GroupBy, Query(description="One row per tenant, adapter or UTC day.")] = "tenant",
    format: Format = "json",
) -> Response:
    """Requests, tokens, training tokens and compute, GPU-seconds, cold starts, adapter residency
    (page-seconds) and storage held at the end of the period, per group."""
    return _answer(ctx, group_by, start, end, format, None)


@router.get("/v1/usage", summary="Your usage", responses=REPORT_RESPONSES)
def tenant_usage(
    ctx: Context,
    tenant: CurrentTenant,
    start: From = None,
    end: To = None,
    group_by: Annotated[GroupBy, Query(description="One row per adapter or UTC day (or one for you).")] = "day",
    format: Format = "json",
) -> Response:
    """The caller's own usage, in the same shape as ``/admin/usage``."""
    return _answer(ctx, group_by, start, end, format, tenant.id)
