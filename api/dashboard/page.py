"""The dashboard and login pages as HTML."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import cache
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup

from api.dashboard.charts import STATUS_COLORS, horizontal_bars, human, pool_bar, stacked_columns
from api.dashboard.data import DASHBOARD_DAYS, DashboardData


@cache
def templates() -> Environment:
    """The page templates (loaded once; they ship with the package)."""
    return Environment(
        loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=select_autoescape(["html"])
    )


def login_page(error: str | None = None) -> str:
    return templates().get_template("login.html").render(error=error)


def dashboard_page(data: DashboardData, base_model: str) -> str:
    """The whole dashboard: totals, charts of usage and jobs, and the replicas with their pools."""
    t = data.totals
    tiles = [
        ("requests", human(t.requests)),
        ("failed requests", human(t.failed_requests)),
        ("prompt tokens", human(t.prompt_tokens)),
        ("completion tokens", human(t.completion_tokens)),
        ("training tokens", human(t.training_tokens)),
        ("GPU-seconds", human(t.gpu_seconds)),
        ("cold starts", human(t.cold_starts)),
        ("adapter page-seconds", human(t.residency_page_seconds)),
        ("storage held", human(t.storage_bytes) + "B"),
    ]
    charts = {
        "tokens": stacked_columns(
            "usage-over-time", "Tokens per day by tenant", data.days, data.tokens_by_tenant, "tokens"
        ),
        "requests": stacked_columns(
            "requests-over-time", "Requests per day by tenant", data.days, data.requests_by_tenant, "requests"
        ),
        "adapters": horizontal_bars("top-adapters", "Top models by tokens", data.top_adapters, "tokens"),
        "jobs": horizontal_bars("job-outcomes", "Fine-tuning jobs by status", data.job_outcomes, "jobs", STATUS_COLORS),
    }
    replica_charts = [
        Markup(pool_bar("pool-occupancy", f"Memory pool of {r.status.id}", r.pool_pages)) for r in data.replicas or []
    ]
    return (
        templates()
        .get_template("dashboard.html")
        .render(
            base_model=base_model,
            days=DASHBOARD_DAYS,
            generated=datetime.fromtimestamp(data.generated_at, UTC).strftime("%Y-%m-%d %H:%M UTC"),
            tiles=tiles,
            charts={name: Markup(svg) for name, svg in charts.items()},
            replicas=data.replicas or [],
            replica_charts=replica_charts,
            replica_error=data.replica_error,
        )
    )
