"""One inference request from start to end: check it, admit it, find its replica, answer, meter it."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.context import ApiContext
from api.errors import error_body
from api.inference.metering import InferenceMeter, Outcome
from api.inference.relay import StreamRelay
from api.inference.requests import InferenceBody, check_request, upstream_body
from api.inference.target import find_model
from api.inference.upstream import Opened
from core.disconnect import unless_disconnected
from core.errors import ClientGone, LoraplexError
from core.ids import new_id
from core.models import Tenant, UsageRecord
from core.protocol import STATS_FIELD, TenantTag

log = logging.getLogger(__name__)


async def serve_inference(
    ctx: ApiContext, tenant: Tenant, request: Request, body: InferenceBody, path: str
) -> Response:
    """Answer ``body`` (already validated by its schema) for ``tenant`` through a replica's ``path``."""
    target = await run_in_threadpool(find_model, ctx, tenant, body.model)
    check_request(body, max_n=ctx.settings.inference_max_n, context_length=target.base.context_length)
    adapter = target.adapter
    await ctx.limits.admit(tenant)
    base = target.base.name
    await ctx.scaler.touch(base)
    try:
        await ctx.scaler.ready(target.base)  # holds the request while a replica starts, if none runs
    except LoraplexError:
        ctx.metrics.requests.labels(base, "unavailable").inc()
        raise
    raw: dict[str, Any] = await request.json()  # the body as sent (schema defaults are not added)
    tag = TenantTag(id=tenant.id, weight=tenant.scheduling_weight or 1.0)
    forwarded, usage_shown = upstream_body(raw, adapter.descriptor() if adapter else None, tag)
    request_id = new_id("req")
    meter = InferenceMeter(
        tenant=tenant,
        model=body.model,
        adapter_id=adapter.id if adapter else None,
        request_id=request_id,
        base_model=base,
    )
    stream = bool(body.stream)
    router = ctx.routers[base]
    try:
        # A client that leaves before the answer starts (or, not streaming, before it is complete) stops
        # the replica's work, and is billed for nothing: nothing reached it.
        opened = await unless_disconnected(
            request.receive,
            ctx.upstream.open(router, path, forwarded, meter.adapter_id, stream=stream, request_id=request_id),
        )
    except ClientGone:
        meter.status = Outcome.CLIENT_DISCONNECTED
        await finish_request(ctx, meter)
        return Response(status_code=ClientGone.status_code)
    except LoraplexError as exc:
        ctx.metrics.requests.labels(base, "overloaded" if exc.status_code == 429 else "unavailable").inc()
        raise
    meter.replica = opened.replica.id
    if stream and not opened.refused:
        return StreamRelay(opened, meter, usage_shown, finish=lambda m: finish_request(ctx, m))
    try:
        return answer_in_full(opened, meter)
    finally:
        await opened.close()
        await finish_request(ctx, meter)


def answer_in_full(opened: Opened, meter: InferenceMeter) -> Response:
    """A replica's complete answer (or refusal) for the client, without the metering fields."""
    headers = {"x-request-id": meter.request_id}
    try:
        data = json.loads(opened.body or b"")
    except ValueError:
        data = None
    if opened.refused:
        meter.status = Outcome.REJECTED
        return JSONResponse(openai_error(data, opened), status_code=opened.status_code, headers=headers)
    if not isinstance(data, dict):
        return Response(opened.body, status_code=opened.status_code, headers=headers, media_type="application/json")
    stats = data.pop(STATS_FIELD, None)
    meter.stats = stats if isinstance(stats, dict) else None
    usage = data.get("usage")
    meter.usage = usage if isinstance(usage, dict) else None
    return JSONResponse(data, status_code=opened.status_code, headers=headers)


def openai_error(data: object, opened: Opened) -> dict[str, Any]:
    """A replica's refusal in the OpenAI error shape, whatever shape it came in."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data
    detail = data.get("detail") if isinstance(data, dict) else None
    if isinstance(detail, str):
        message = detail
    elif detail is not None:
        message = json.dumps(detail)
    else:
        message = (opened.body or b"").decode(errors="replace")[:500] or f"HTTP {opened.status_code}"
    return error_body(message, "invalid_request_error")


async def finish_request(ctx: ApiContext, meter: InferenceMeter) -> None:
    """Charge the request's tokens to the tenant's limit and store its usage record (once), before the
    client sees the end of the answer: its next request then finds both."""
    if meter.finished:
        return
    meter.finished = True
    row = meter.record()
    ctx.metrics.requests.labels(meter.base_model, meter.status).inc()
    ctx.scaler.delivered(meter.base_model, row.completion_tokens)
    await ctx.limits.debit_tokens(meter.tenant, meter.limited_tokens(ctx.settings.charge_cached_tokens))
    try:
        await run_in_threadpool(_insert, ctx, row)
    except Exception as exc:  # the database is away: the row waits and is stored once it answers
        log.warning("usage of request %s waits for the database: %s", meter.request_id, exc)
        ctx.usage_backlog.add(row)
    await ctx.scaler.touch(meter.base_model)  # last: the usage row matters more than the idle clock


def _insert(ctx: ApiContext, row: object) -> None:
    with ctx.session() as session:
        session.add(row)


def insert_usage(ctx: ApiContext, rows: list[UsageRecord]) -> None:
    """Store ``rows`` in one transaction (the backlog's writer)."""
    with ctx.session() as session:
        session.add_all(rows)
