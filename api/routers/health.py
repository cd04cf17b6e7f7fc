"""``/health`` (the process is up) and ``/ready`` (its database, object store and queue answer)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter
from pydantic import BaseModel
from sqlalchemy import text

from api.deps import Context

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: Literal["ok"] = "ok"


@router.get("/health", response_model=Health, summary="Liveness")
def health() -> Health:
    """Answers while the process serves requests (no dependency is checked)."""
    return Health()


@router.get("/ready", response_model=Health, summary="Readiness")
def ready(ctx: Context) -> Health:
    """Answers 200 when the database, object store and job queue all respond, else 503 naming the first down."""
    with ctx.engine.connect() as conn:  # a plain read: no write lock needed to see the database answers
        conn.execute(text("SELECT 1"))
    ctx.store.ping()
    ctx.jobs.ping()
    return Health()
