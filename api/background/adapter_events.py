"""Adapter events on ``ADAPTER_EVENTS_CHANNEL``: a finished job's adapter is prefetched on the replica its
requests will be routed to; a deleted adapter is unloaded from every replica. Both best effort: a
replica loads an adapter on its first request anyway and evicts idle ones by itself."""

from __future__ import annotations

import json
import logging
import re

import httpx
from pydantic import ValidationError

from api.background.retry import keep_running
from api.context import ApiContext
from core.descriptor import AdapterDescriptor
from core.errors import ServiceUnavailable
from core.protocol import CAUSE_PATTERN
from core.queue import ADAPTER_EVENTS_CHANNEL

log = logging.getLogger(__name__)

POLL_S = 5.0
REPLICA_CALL_TIMEOUT_S = 30.0


async def consume_adapter_events(ctx: ApiContext) -> None:
    """Follow the channel for the life of the app."""
    await keep_running("adapter events", lambda: _follow(ctx))


async def _follow(ctx: ApiContext) -> None:
    pubsub = ctx.redis.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(ADAPTER_EVENTS_CHANNEL)
        while True:
            # A timeout rather than a blocking listen: the client's socket timeout would end that.
            message = await pubsub.get_message(timeout=POLL_S)
            if message is not None and message.get("type") == "message":
                await handle_adapter_event(ctx, message["data"])
    finally:
        await pubsub.aclose()


async def handle_adapter_event(ctx: ApiContext, data: bytes | str) -> None:
    """Act on one event for one of our base models; anything else on the channel is ignored."""
    try:
        message = json.loads(data)
        event = message["event"]
        adapter = AdapterDescriptor.model_validate(message["adapter"])
        cause = message.get("cause")
        if cause is not None and not (isinstance(cause, str) and re.fullmatch(CAUSE_PATTERN, cause)):
            cause = None
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError):
        log.warning("ignoring a malformed adapter event: %.200r", data)
        return
    if adapter.base_model not in ctx.bases:
        return
    if event == "prefetch":
        await prefetch(ctx, adapter, cause=cause)
    elif event == "unload":
        await unload_everywhere(ctx, adapter, cause=cause)


async def prefetch(ctx: ApiContext, adapter: AdapterDescriptor, *, cause: str | None = None) -> str | None:
    """Ask the replica that requests for ``adapter`` will go to to load it now; its id, or None."""
    try:
        candidates = await ctx.routers[adapter.base_model].candidates(adapter.id)
    except ServiceUnavailable as exc:
        log.info("not prefetching %s: %s", adapter.id, exc.message)
        return None
    body = {"lora_name": adapter.name, "adapter": adapter.model_dump(mode="json"), "cause": cause}
    for replica in candidates[: ctx.settings.upstream_attempts]:
        if await _call(ctx, replica.url, "/v1/load_lora_adapter", body):
            log.info("prefetched %s on %s", adapter.id, replica.id)
            return replica.id
    return None


async def unload_everywhere(ctx: ApiContext, adapter: AdapterDescriptor, *, cause: str | None = None) -> list[str]:
    """Ask every live replica of its base to drop ``adapter``; the ids of those that confirmed."""
    try:
        replicas = await ctx.routers[adapter.base_model].registry.read()
    except ServiceUnavailable as exc:
        log.warning("could not unload %s: %s", adapter.id, exc.message)
        return []
    body = {"lora_name": adapter.name, "cause": cause}
    return [r.id for r in replicas if await _call(ctx, r.url, "/v1/unload_lora_adapter", body)]


async def _call(ctx: ApiContext, url: str, path: str, body: dict) -> bool:
    try:
        response = await ctx.upstream.client.post(
            url.rstrip("/") + path, json=body, headers=ctx.upstream.headers(), timeout=REPLICA_CALL_TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        log.info("%s%s failed: %r", url, path, exc)
        return False
    if response.status_code >= 400:
        log.info("%s%s answered %d: %.200s", url, path, response.status_code, response.text)
    return response.status_code < 400
