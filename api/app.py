"""The app factory: ``create_app(settings)`` builds a FastAPI app with its own context; nothing is global."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import APIRouter, FastAPI

from api.background import start_background, stop_background
from api.body_limit import BodyLimit
from api.context import build_context
from api.errors import install_error_handlers
from api.inference.service import insert_usage
from api.openapi_links import install_links
from api.routers import (
    adapters,
    admin,
    audit,
    completions,
    dashboard,
    files,
    fine_tuning,
    health,
    metrics,
    models,
    tenant_limits,
    usage,
)
from core.settings import Settings

# Every router the app serves, mounted in this order. A new resource adds its router here.
ROUTERS: tuple[APIRouter, ...] = (
    health.router,
    metrics.router,
    files.router,
    fine_tuning.router,
    adapters.router,
    models.router,
    completions.router,
    usage.router,
    admin.router,
    audit.router,
    tenant_limits.router,
    dashboard.router,
)

DESCRIPTION = """OpenAI-compatible control plane of loraplex: upload training files, run LoRA fine-tuning jobs,
bring your own PEFT adapters, call them (`/v1/completions`, `/v1/chat/completions`) and read your usage.
Authenticate with `Authorization: Bearer` and a tenant key; `/admin` routes take the admin key."""


def create_app(settings: Settings) -> FastAPI:
    """A ready app for ``settings``; its clients live in ``app.state.context`` (see ``api/context.py``)."""
    ctx = build_context(settings)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        background = start_background(ctx)
        yield
        await stop_background(background)
        await ctx.usage_backlog.flush(partial(insert_usage, ctx))  # a last try for rows that waited
        await ctx.scaler.close()  # local replicas stop with the API
        await ctx.aclose()
        ctx.close()

    app = FastAPI(title="loraplex", version="0.1.0", description=DESCRIPTION, lifespan=lifespan)
    app.state.context = ctx
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    for router in ROUTERS:
        app.include_router(router)
    install_links(app)
    return app
