"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI-compatible inference on the base model or the
caller's adapters, served by the inference server replicas (see ``api/inference/``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api.deps import Context, CurrentTenant
from api.inference.requests import ChatCompletionBody, CompletionBody
from api.inference.service import serve_inference

router = APIRouter(prefix="/v1", tags=["inference"])

STREAM_RESPONSE = {
    200: {
        "description": "A completion object, or with `stream: true` server-sent events ending in `data: [DONE]`.",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


@router.post("/chat/completions", summary="Create a chat completion", responses=STREAM_RESPONSE)
async def chat_completions(body: ChatCompletionBody, request: Request, ctx: Context, tenant: CurrentTenant) -> Response:
    """Chat with the base model or one of your fine-tuned models (``model``: its ``ft:...`` name)."""
    return await serve_inference(ctx, tenant, request, body, "/v1/chat/completions")


@router.post("/completions", summary="Create a completion", responses=STREAM_RESPONSE)
async def completions(body: CompletionBody, request: Request, ctx: Context, tenant: CurrentTenant) -> Response:
    """Complete a prompt with the base model or one of your fine-tuned models."""
    return await serve_inference(ctx, tenant, request, body, "/v1/completions")
