"""One completion being generated: its tokens, KV block table, adapter and stopping state."""

from __future__ import annotations

from enum import Enum
from typing import Any

from loraplex_kernels import NO_ADAPTER
from server.engine.detokenizer import IncrementalDetokenizer, StopStringFilter
from server.engine.outputs import FinishReason, TokenLogprob
from server.engine.penalties import TokenCounts
from server.engine.sampling_params import SamplingParams
from server.engine.tenancy import DIRECT, Tenancy
from server.memory.page_keys import BASE_IDENTITY


class SequenceStatus(Enum):
    WAITING = "waiting"  # not started, or preempted (its KV freed, to be recomputed)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Completion ``index`` of request ``request_id``. ``token_ids`` is prompt + output."""

    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        adapter_slot: int = NO_ADAPTER,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.adapter_slot = adapter_slot
        self.tenancy: Tenancy = DIRECT  # set by the engine from the request
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        # Prefix caching: the adapter identity its pages are keyed under (set by the engine), an optional salt,
        # the keys of its full pages so far (tokens never change, so they survive preemption), how many pages
        # of the block table carry their key, and the prompt tokens its first admission found cached.
        self.cache_owner = BASE_IDENTITY
        self.cache_salt: str | None = None
        self.page_keys: list[bytes] = []
        self.num_keyed_pages = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.detokenizer = detokenizer
        self.stop_filter = StopStringFilter(params.stop) if detokenizer is not None else None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Penalties: token counts kept by the sampler (they survive preemption, like the output tokens).
        self.token_counts = TokenCounts(self.token_ids, self.num_prompt_tokens) if params.penalised else None
        # Structured outputs: this completion's grammar matcher (llguidance ``LLMatcher``), set by the engine. It
        # has consumed exactly the output tokens, so a preempted sequence keeps it: recompute only rebuilds KV.
        self.matcher: Any = None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.finish_reported = False
        # Delta since the last time outputs were taken.
        self.pending_token_ids: list[int] = []
        self.pending_text = ""
        self.pending_logprobs: list[TokenLogprob] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def text(self) -> str:
        return self.stop_filter.text if self.stop_filter is not None else ""

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, slot={self.adapter_slot})"
        )
