"""The engine a server drives: ``add_request``, ``abort_request``, adapter (un)loading and ``step``.

Single-threaded by design, as nano-vllm's: one thread (the server's engine loop, or an offline caller)
makes every call, so nothing here locks. Other threads reach the engine by posting work to that thread.
Requests are validated and queued at once (errors raised to the caller); the next ``step`` runs them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from core.adapter_format import AdapterWeights
from core.errors import InvalidRequest
from loraplex_kernels import NO_ADAPTER
from server.engine.builder import EngineParts, build_engine_parts
from server.engine.config import EngineConfig
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.errors import DuplicateRequest, PromptTooLong
from server.engine.front import EngineFront, encode_prompt
from server.engine.grammar import GrammarCache, advance
from server.engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence
from server.engine.tenancy import DIRECT, Tenancy, TenantLoad
from server.memory.block_manager import blocks_for
from server.memory.page_keys import BASE_IDENTITY
from server.memory.pool import PoolStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters: tokens of admitted sequences looked up, and those found cached."""

    queried_tokens: int
    hit_tokens: int


@dataclass
class _Request:
    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    finished_time: float | None = None


class LLMEngine:
    """Continuous-batching multi-LoRA generation over one base model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        parts: EngineParts = build_engine_parts(config)
        self.model_config = parts.model_config
        self.device = parts.device
        self.max_model_len = parts.max_model_len
        self.tokenizer = parts.tokenizer
        self.pool = parts.pool
        self.adapters = parts.adapters  # the one owner of residency and adapter references
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.followers = parts.followers  # tensor parallelism: the other ranks, stopped by close()
        self.eos_token_ids = set(parts.eos_token_ids)
        self.grammars = GrammarCache(self.tokenizer, self.model_config.vocab_size, list(self.eos_token_ids))
        self._requests: dict[str, _Request] = {}
        self._aborted: set[str] = set()  # aborted since the last step: their final output is still owed
        self._next_seq_id = 0

    def close(self) -> None:
        """Release what outlives a dropped engine: the tensor-parallel ranks' processes (idempotent)."""
        if self.followers is not None:
            self.followers.stop()

    # ----- requests -------------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (with the tokenizer's special tokens, e.g. BOS)."""
        return encode_prompt(self.tokenizer, prompt)

    def front(self) -> EngineFront:
        """What request handlers read of this engine (picklable, for an HTTP process beside it)."""
        return EngineFront(self.tokenizer, self.model_config, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        adapter: str | None = None,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        tenancy: Tenancy = DIRECT,
    ) -> None:
        """Validate and queue a request; it starts in the next :meth:`step`, when the scheduler's fair order
        reaches it (``tenancy``: its tenant, weight and class). Requests share cached KV pages only with
        requests of the same adapter weights, the same tenant and the same ``cache_salt``."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not token_ids:
            raise PromptTooLong("the prompt is empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len}", param="prompt"
            )
        if any(not 0 <= t < self.model_config.vocab_size for t in token_ids):
            raise PromptTooLong("prompt token ids must be within the vocabulary", param="prompt")
        if blocks_for(len(token_ids) + 1, self.config.block_size) > self.pool.stats().kv_capacity_pages:
            raise PromptTooLong("the prompt does not fit the KV pool even alone", param="prompt")
        if any(t >= self.model_config.vocab_size for t in params.logit_bias):
            raise InvalidRequest(
                f"logit_bias token ids must be below the vocabulary size {self.model_config.vocab_size}",
                param="logit_bias",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequest("stop strings need a tokenizer; this model directory has none", param="stop")
        if request_id in self._requests:
            raise DuplicateRequest(f"request id {request_id!r} is already in use", param="request_id")
        # Compiled (or found in the cache) before anything is held: an unsupported schema is a 400 here.
        if params.json_schema or params.grammar:
            source, lark = (params.grammar, True) if params.grammar else (params.json_schema, False)
            matchers = [self.grammars.matcher(source, lark=lark) for _ in range(params.n)]
        else:
            matchers = []
        resident = self.adapters.acquire(adapter) if adapter is not None else None
        slot = resident.slot if resident is not None else NO_ADAPTER
        owner = resident.identity if resident is not None else BASE_IDENTITY
        # A tenant's pages are its own: sharing them would let one tenant time another's prompts.
        salt = cache_salt if not tenancy.tenant else f"{tenancy.tenant}\x00{cache_salt or ''}"
        request = _Request(request_id, adapter, token_ids, params, arrival_time or time.monotonic())
        self._requests[request_id] = request
        for index in range(params.n):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            seq = Sequence(self._next_seq_id, request_id, index, token_ids, params, slot, detok)
            seq.matcher = matchers[index] if matchers else None
            seq.cache_owner, seq.cache_salt = owner, salt
            seq.tenancy = tenancy
            self._next_seq_id += 1
            request.seqs.append(seq)
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Stop a request now, freeing its pages; its final output (finish_reason ``abort``) comes next step."""
        request = self._requests.get(request_id)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        self._aborted.add(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def hold_admissions(self, hold: bool) -> None:
        """While held, no waiting request starts beside running ones (an adapter placement waits for their pages)."""
        self.scheduler.hold_admissions = hold

    def kv_starved(self) -> bool:
        """Whether the last step lacked KV pages (it preempted, or the next admission cannot get its pages)."""
        return self.scheduler.kv_starved()

    def tenant_loads(self) -> dict[str, TenantLoad]:
        """Per tenant: sequences waiting for and running in the engine, the KV pages they hold, and its weight."""
        queue = self.scheduler.waiting
        loads = {t: TenantLoad(waiting=n, weight=queue.weight(t)) for t, n in queue.waiting_by_tenant().items()}
        for seq in self.scheduler.running:
            load = loads.setdefault(seq.tenancy.tenant, TenantLoad(weight=seq.tenancy.weight))
            load.running += 1
            load.kv_pages += len(seq.block_table)
        return loads

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # ----- adapters and pool ------------------------------------------------------------------------

    def load_adapter(self, name: str, weights: AdapterWeights, identity: bytes | None = None) -> int:
        """Place an adapter's weights in pool pages; returns its slot. Raises if pages or slots run out.
        ``identity``: the weights' content digest if already known (else computed here)."""
        return self.adapters.place(name, self.adapters.plan(name, weights, identity)).slot

    def unload_adapter(self, name: str) -> None:
        """Return an adapter's pages to the pool. Refused while unfinished requests use it."""
        self.adapters.remove(name)

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        manager = self.scheduler.block_manager
        return PrefixCacheStats(manager.num_queried_tokens, manager.num_hit_tokens)

    def flush_prefix_cache(self) -> int:
        """Forget every cached prefix (pages in use keep running, uncached); returns the pages freed."""
        return self.pool.flush_cache()

    # ----- stepping -----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit queued work, run one batched forward pass, and report every request that progressed."""
        started = time.perf_counter()
        touched, self._aborted = self._aborted, set()
        batch = self.scheduler.schedule()
        now = time.monotonic()
        for seq in batch.too_long:
            self._finish(seq, "length")
            touched.add(seq.request_id)
        if not batch.is_empty:
            results = self.runner.execute(batch)
            now = time.monotonic()
            for item in batch.scheduled:
                item.seq.num_computed_tokens += item.num_new_tokens
            for seq, token_id, logprob in results:
                self._append_token(seq, token_id, logprob, now)
                touched.add(seq.request_id)
        outputs = self._collect(touched, now)
        if self.scheduler.costs is not None and not batch.is_empty:
            decodes = sum(1 for item in batch.scheduled if item.num_new_tokens == 1)
            prompt_tokens = batch.num_tokens - decodes
            self.scheduler.costs.observe(decodes, prompt_tokens, time.perf_counter() - started)
        return outputs

    def _append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, now: float) -> None:
        request = self._requests[seq.request_id]
        if request.first_token_time is None:
            request.first_token_time = now
        seq.token_ids.append(token_id)
        seq.pending_token_ids.append(token_id)
        if logprob is not None and seq.logprobs is not None:
            seq.logprobs.append(logprob)
            seq.pending_logprobs.append(logprob)
        params = seq.params
        grammar_done = seq.matcher is not None and advance(seq.matcher, token_id)
        if token_id in params.stop_token_ids:
            self._finish(seq, "stop", token_id)
            return
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self._finish(seq, "stop")
            return
        if seq.detokenizer is not None and seq.stop_filter is not None:
            text, stop = seq.stop_filter.add(seq.detokenizer.add([token_id]))
            seq.pending_text += text
            if stop is not None:
                self._finish(seq, "stop", stop)
                return
        if grammar_done:  # the structured output is complete: only EOS could follow, so stop now
            self._finish(seq, "stop")
            return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) or (
            seq.num_tokens >= self.max_model_len
        ):
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq.stop_filter is not None:
            seq.pending_text += seq.stop_filter.flush()
        self.scheduler.finish(seq)

    def _collect(self, touched: set[str], now: float) -> list[RequestOutput]:
        outputs = []
        for request_id in sorted(touched, key=lambda r: self._requests[r].arrival_time):
            request = self._requests[request_id]
            completions = []
            for seq in request.seqs:
                unreported_finish = seq.is_finished and not seq.finish_reported
                if seq.pending_token_ids or seq.pending_text or unreported_finish:
                    completions.append(self._completion(seq))
            finished = all(seq.is_finished for seq in request.seqs)
            if finished:
                request.finished_time = now
                del self._requests[request_id]
                if request.adapter is not None:
                    self.adapters.release(request.adapter)
            outputs.append(
                RequestOutput(
                    request_id=request_id,
                    adapter=request.adapter,
                    prompt_token_ids=request.prompt_token_ids,
                    outputs=completions,
                    finished=finished,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_completion_tokens=sum(s.num_output_tokens for s in request.seqs),
                    arrival_time=request.arrival_time,
                    first_token_time=request.first_token_time,
                    finished_time=request.finished_time,
                    num_cached_tokens=request.seqs[0].num_cached_tokens,
                )
            )
        return outputs

    def _completion(self, seq: Sequence) -> CompletionOutput:
        out = CompletionOutput(
            index=seq.index,
            new_token_ids=seq.pending_token_ids,
            new_text=seq.pending_text,
            new_logprobs=seq.pending_logprobs if seq.logprobs is not None else None,
            num_tokens=seq.num_output_tokens,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        if seq.finish_reason is not None:
            out.token_ids = seq.output_token_ids
            out.text = seq.text
            out.logprobs = list(seq.logprobs) if seq.logprobs is not None else None
            seq.finish_reported = True
        seq.pending_token_ids = []
        seq.pending_text = ""
        seq.pending_logprobs = []
        return out
