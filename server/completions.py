"""Serving one completion or chat completion: resolve the adapter, queue, wait for admission, stream or collect.

The response starts only once the engine has taken the request, so a bad adapter, a full queue or a
failed load still answers with a proper 4xx/5xx status instead of an error inside a 200 stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from core.disconnect import unless_disconnected
from core.errors import ClientGone, InvalidRequest, LoraplexError
from core.protocol import REQUEST_ID_HEADER
from server.adapters.registry import KnownAdapter
from server.disconnect import EventStream
from server.engine import CompletionOutput, RequestOutput
from server.openai_params import chat_prompt, completion_prompt, sampling_params, tenancy
from server.openai_render import Kind, Renderer, TokenText
from server.openai_schemas import ChatCompletionRequest, CompletionRequest, GenerationRequest
from server.openai_tools import ToolUse, tool_use
from server.runtime import ServerRuntime
from server.tickets import EngineRequest, Ticket
from server.tool_parsers import parser_for_template

CLIENT_CLOSED = 499


class CompletionService:
    """The two generation routes over one runtime."""

    def __init__(self, runtime: ServerRuntime) -> None:
        self.runtime = runtime
        self.token_text = TokenText(runtime.front.tokenizer)
        # The tool-call format is the chat template's: read once, from the markers the template writes.
        self.tool_parser = parser_for_template(getattr(runtime.front.tokenizer, "chat_template", None))

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        return await self._serve(request, body, "completion", completion_prompt)

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        # Off the event loop: checking the parameters schemas takes up to a second for the largest allowed.
        tools = await asyncio.to_thread(
            tool_use, body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser
        )
        prompt_of = partial(chat_prompt, tools=tools.tools if tools else None)
        return await self._serve(request, body, "chat", prompt_of, tools)

    def resolve_adapter(self, body: GenerationRequest) -> KnownAdapter | None:
        """The adapter ``model`` names; a descriptor in the body registers (or refreshes) it first."""
        registry = self.runtime.registry
        if body.adapter is not None:
            if body.model != body.adapter.name:
                raise InvalidRequest(
                    f"model is {body.model!r} but the adapter descriptor is for {body.adapter.name!r}", param="model"
                )
            return registry.register_descriptor(body.adapter)
        return registry.resolve(body.model)

    async def _serve(
        self,
        request: Request,
        body: GenerationRequest,
        kind: Kind,
        prompt_of: Callable[..., list[int]],
        tools: ToolUse | None = None,
    ) -> Response:
        arrival = time.monotonic()
        runtime = self.runtime
        front = runtime.front
        adapter = self.resolve_adapter(body)
        prompt = await asyncio.to_thread(prompt_of, body, front)  # tokenizing long prompts would stall the loop
        grammar = tools.grammar() if tools else None
        params = sampling_params(body, len(prompt), front.max_model_len, runtime.config.max_n, grammar)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        # The id the client (or the API) knows the request by names it in the audit trail of loads it causes.
        known_as = request.headers.get(REQUEST_ID_HEADER) or request_id
        cause = f"request:{known_as}"[:128]
        ticket = Ticket.create(
            EngineRequest(request_id, adapter, prompt, params, arrival, tenancy(body), body.cache_salt, cause)
        )
        headers = {REQUEST_ID_HEADER: known_as}
        runtime.loop.submit(ticket)
        try:
            await unless_disconnected(request.receive, ticket.admitted)
        except ClientGone:
            runtime.loop.cancel(ticket)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            runtime.loop.cancel(ticket)  # refused (nothing to cancel) or the server is shutting down
            raise
        renderer = Renderer(
            kind,
            ticket.request_id,
            body.model,
            self.token_text,
            return_token_ids=body.return_token_ids,
            include_usage=body.include_usage,
            continuous_usage=body.continuous_usage,
            tools=tools if tools and tools.parses else None,
        )
        if body.stream:
            events = self._events(ticket, renderer)
            return EventStream(events, on_close=lambda: runtime.loop.cancel(ticket), headers=headers)
        try:
            final, completions = await unless_disconnected(request.receive, _collect(ticket))
        except ClientGone:
            runtime.loop.cancel(ticket)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            runtime.loop.cancel(ticket)
            raise
        return JSONResponse(renderer.response(final, completions, ticket.stats), headers=headers)

    async def _events(self, ticket: Ticket, renderer: Renderer) -> AsyncIterator[str]:
        try:
            opening = renderer.opening_chunk(ticket.params.n, ticket.prompt_token_ids)
            if opening is not None:
                yield _sse(opening)
            while True:
                item = await ticket.outputs.get()
                if isinstance(item, LoraplexError):
                    yield _sse(item.to_dict())
                    break
                chunk = renderer.delta_chunk(item, ticket.stats if item.finished else None)
                if chunk is not None:
                    yield _sse(chunk)
                if item.finished:
                    if renderer.include_usage:
                        yield _sse(renderer.usage_chunk(item, ticket.stats))
                    break
            yield "data: [DONE]\n\n"
        finally:
            self.runtime.loop.cancel(ticket)


async def _collect(ticket: Ticket) -> tuple[RequestOutput, list[CompletionOutput]]:
    """Wait for every completion of the request; raise the engine's error if it failed."""
    finished: dict[int, CompletionOutput] = {}
    while True:
        item = await ticket.outputs.get()
        if isinstance(item, LoraplexError):
            raise item
        for completion in item.outputs:
            if completion.finished:
                finished[completion.index] = completion
        if item.finished:
            return item, [finished[i] for i in sorted(finished)]


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
