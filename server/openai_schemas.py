"""Request bodies of the OpenAI-compatible routes (plus the vLLM extensions and the platform's adapter field).

Nothing is silently dropped: an unknown field is a 400 naming it, and fields we cannot honour exactly (echo,
suffix) are refused likewise. The only exceptions are ``IGNORED_FIELDS``, which OpenAI clients send and
which change nothing about the tokens generated here (docs/api.md lists them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.descriptor import AdapterDescriptor
from core.protocol import ADAPTER_FIELD, CAUSE_PATTERN, TENANT_FIELD, TenantTag
from server.engine.sampling_params import MAX_LOGPROBS

# Accepted and ignored: bookkeeping and routing hints of OpenAI's own platform. ``parallel_tool_calls`` is here
# because without tools (completions, or a chat request without them) it means nothing.
IGNORED_FIELDS = (
    "user", "store", "metadata", "parallel_tool_calls", "safety_identifier", "prompt_cache_key"
)  # fmt: skip
# OpenAI's tiers; "flex" (cheaper, slower) runs in the batch class, after every interactive request.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM extension: with include_usage, every chunk has the usage so far


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: Any = None  # text, json_object or json_schema; checked by hand (openai_params.response_schema)
    # vLLM extensions
    repetition_penalty: float | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # only equal salts share prefixes
    service_tier: ServiceTier | None = None
    # The platform's adapter descriptor and tenant, sent by the control plane (holder of the internal token) only.
    adapter: AdapterDescriptor | None = Field(default=None, alias=ADAPTER_FIELD)
    tenant: TenantTag | None = Field(default=None, alias=TENANT_FIELD)
    # IGNORED_FIELDS: any value is accepted and none has an effect.
    user: Any = None
    store: Any = None
    metadata: Any = None
    parallel_tool_calls: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Any = None  # a string or a list of token ids; checked by hand for a clear message
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: Any = None  # checked by hand: role/content shapes get messages that say which one is wrong
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: Any = None  # checked by hand (openai_tools.tool_use), like tool_choice and parallel_tool_calls
    tool_choice: Any = None
    add_generation_prompt: bool = True  # vLLM extension


class LoadAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter``: a local directory (vLLM) or a descriptor (the platform's prefetch)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=512)
    lora_path: str | None = None
    adapter: AdapterDescriptor | None = None
    pinned: bool | None = None  # extension: keep it in the pool (true) or let it be evicted again (false)
    cause: str | None = Field(default=None, pattern=CAUSE_PATTERN)  # extension: the job behind it, for the audit


class UnloadAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter``."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1, max_length=512)
    cause: str | None = Field(default=None, pattern=CAUSE_PATTERN)  # extension: who deleted it, for the audit
