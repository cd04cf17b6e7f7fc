"""What clients send to ``/v1/completions`` and ``/v1/chat/completions``: cheap checks of the mistakes
clients make (the server checks what depends on the model, such as context length), and the body
forwarded to a replica."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.descriptor import AdapterDescriptor
from core.errors import InvalidRequest
from core.protocol import ADAPTER_FIELD, STATS_FIELD, TENANT_FIELD, TenantTag

# Fields only the API may set: a client could otherwise name another tenant's adapter, or pose as it.
RESERVED_FIELDS = (ADAPTER_FIELD, STATS_FIELD, TENANT_FIELD)
MAX_TOKENS_WITHOUT_CONTEXT = 1 << 20  # when the base model's config does not say its context length


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = Field(default=None, description="Send a final chunk with token usage.")
    continuous_usage_stats: bool | None = Field(
        default=None, description="With include_usage: every chunk carries the usage so far (vLLM's extension)."
    )


class UsageShown(StrEnum):
    """Which of a stream's usage the client asked to see."""

    NONE = "none"
    FINAL = "final"  # include_usage: a last chunk with the usage; every other chunk says "usage": null
    EVERY_CHUNK = "every_chunk"  # and continuous_usage_stats: each chunk has the usage so far


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(min_length=1, description="system, user, assistant, ...")
    content: str | list[dict[str, Any]] | None = None


class InferenceBody(BaseModel):
    """Fields common to both endpoints; any other OpenAI sampling field is passed to the server as sent."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="The base model or one of your fine-tuned models (ft:...).")
    n: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    def token_caps(self) -> dict[str, int | None]:
        return {"max_tokens": self.max_tokens}


class ChatCompletionBody(InferenceBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_caps(self) -> dict[str, int | None]:
        return {"max_tokens": self.max_tokens, "max_completion_tokens": self.max_completion_tokens}


class CompletionBody(InferenceBody):
    prompt: str | list[str] | list[int] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt: str | list[Any]) -> str | list[Any]:
        if not prompt or (isinstance(prompt, list) and any(not p for p in prompt if isinstance(p, str | list))):
            raise ValueError("the prompt is empty: send text or token ids")
        return prompt


def check_request(body: InferenceBody, *, max_n: int, context_length: int | None) -> None:
    """Refuse (400) what no replica would serve: too many choices, absurd token caps, misplaced options."""
    if body.n is not None and body.n > max_n:
        raise InvalidRequest(f"n is {body.n}; at most {max_n} completions per request", param="n")
    limit = context_length or MAX_TOKENS_WITHOUT_CONTEXT
    for name, value in body.token_caps().items():
        if value is not None and value > limit:
            raise InvalidRequest(f"{name} is {value}, beyond the model's context length of {limit} tokens", param=name)
    if body.stream_options is not None and not body.stream:
        raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")


def upstream_body(
    raw: dict[str, Any], adapter: AdapterDescriptor | None, tenant: TenantTag
) -> tuple[dict[str, Any], UsageShown]:
    """The body a replica gets (tagged with its tenant), and which usage its client asked to see.

    Streams always ask the server for the usage on every chunk: a stream that ends early (the client
    leaves, the replica dies) is then metered at exactly the tokens of the chunks that went out, its
    prompt included. The relay takes out again what the client did not ask for.
    """
    body = {key: value for key, value in raw.items() if key not in RESERVED_FIELDS}
    shown = UsageShown.NONE
    if body.get("stream"):
        options = dict(body.get("stream_options") or {})
        if options.get("include_usage"):
            shown = UsageShown.EVERY_CHUNK if options.get("continuous_usage_stats") else UsageShown.FINAL
        options["include_usage"] = options["continuous_usage_stats"] = True
        body["stream_options"] = options
    if adapter is not None:
        body[ADAPTER_FIELD] = adapter.model_dump(mode="json")
    body[TENANT_FIELD] = tenant.model_dump(mode="json")
    return body, shown
