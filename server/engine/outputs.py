"""What :meth:`LLMEngine.step` returns: per-request deltas a streaming server forwards as they come."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability (of the model's raw distribution) and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions. ``new_*`` fields hold this step's delta.

    ``text`` never ends inside a UTF-8 character and never includes a stop string; ``token_ids``,
    ``text`` and ``logprobs`` hold the whole completion once ``finish_reason`` is set.
    """

    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprob] | None
    num_tokens: int  # completion tokens so far
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    token_ids: list[int] | None = None
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's progress in one step; ``outputs`` lists only completions that changed."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_completion_tokens: int  # over all n completions, so far
    arrival_time: float
    first_token_time: float | None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed (of completion 0)
