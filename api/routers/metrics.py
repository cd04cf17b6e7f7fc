"""``/metrics``: the API's Prometheus metrics (``api.metrics``), unauthenticated like a server's health, for
Prometheus and the autoscaler that reads ``loraplex_api_replicas_wanted``. It says nothing about any tenant."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import Context

router = APIRouter(tags=["health"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics(ctx: Context) -> Response:
    """Per base model: requests running and waiting, tokens per second, replicas live and wanted, cold starts."""
    return Response(await ctx.metrics.render(ctx.scaler), media_type=CONTENT_TYPE_LATEST)
