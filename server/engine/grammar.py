"""Structured outputs: JSON-schema grammars (llguidance), compiled once per schema, one matcher per completion.

A compiled grammar is kept as a template matcher in a bounded LRU keyed by the canonical schema text; every
completion gets its own ``deep_copy`` of it, which advances with each token the completion accepts. The
sampler has :class:`TokenMasks` forbid, in place, what each constrained row's grammar does not allow.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import torch.nn.functional as F
from llguidance import LLMatcher

from core.errors import InvalidRequest
from loraplex_kernels.cpu_library import c_library

JSON_OBJECT_SCHEMA = '{"type":"object"}'  # response_format {type: json_object}: any JSON object
# Compact separators, no free whitespace: a model (a random one especially) cannot loop on blanks forever.
COMPILE_OPTIONS = {"whitespace_flexible": False}
DEFAULT_CACHE_SIZE = 64


def canonical_schema(schema: Any) -> str:
    """One text per schema whatever its spacing: the cache key and what the engine compiles.

    Key order is kept: properties are generated in the order the schema lists them, as OpenAI does.
    """
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class GrammarCache:
    """Compiles JSON schemas against one engine's tokenizer; the tokenizer info is built once, on first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], capacity: int = DEFAULT_CACHE_SIZE):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.capacity = capacity
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self.compilations = 0  # how many schemas were compiled (cache misses)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            if self._hf_tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; response_format needs one", param="response_format")
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                )
            except ValueError as exc:  # only fast (Rust) tokenizers are supported
                raise InvalidRequest(
                    f"response_format is not available for this model: {exc}", param="response_format"
                ) from None
        return self._tokenizer

    def matcher(self, schema: str, *, lark: bool = False) -> LLMatcher:
        """A fresh matcher for ``schema`` (canonical text; a Lark grammar if ``lark``: forced tool calls); a 400
        naming what the grammar engine cannot enforce."""
        key = f"lark:{schema}" if lark else schema  # a JSON schema's text starts with "{"
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(schema, lark)
            self._compiled[key] = template
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()

    def _compile(self, schema: str, lark: bool = False) -> LLMatcher:
        param, what = ("tools", "the tools' parameters schemas") if lark else ("response_format", "this JSON schema")
        try:
            grammar = schema if lark else LLMatcher.grammar_from_json_schema(schema, overrides=COMPILE_OPTIONS)
        except ValueError as exc:
            raise InvalidRequest(f"{param}: the JSON schema is not valid: {exc}", param=param) from None
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"{param}: {what} cannot be enforced: {_one_line(matcher.get_error())}; "
                "remove or rewrite that part of the schema",
                param=param,
            )
        self.compilations += 1
        return matcher


def _one_line(message: str) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip() and set(line.strip()) != {"^"})
    return text[:400] or "unknown error"


def advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed an accepted token to a completion's matcher; True when the grammar is complete (only EOS may follow)."""
    matcher.consume_token(token_id)
    return matcher.is_stopped()


class TokenMasks:
    """Fills a bitmask for the constrained rows of a step and applies it in place.

    The grammar engine fills a mask without the GIL, so :meth:`start` begins filling on a helper thread before
    the forward pass (the rows that will sample, and their matchers' states, are known once the step is
    prepared) and :meth:`apply_` takes the result. The rows are filled one after another on that one thread:
    llguidance's parallel executor took 0.6-0.7 ms for 16 rows of a 32k vocabulary where the plain loop takes
    0.25 ms, and its worker threads competed with the forward pass for the cores.
    """

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._pending: tuple[list[LLMatcher], int, Future[torch.Tensor]] | None = None

    def start(self, matchers: list[LLMatcher], vocab_size: int) -> None:
        """Begin filling the masks of ``matchers`` for the coming :meth:`apply_` (a no-op for none)."""
        self._pending = None
        if not matchers:
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-masks")
        self._pending = (list(matchers), vocab_size, self._thread.submit(self._fill, matchers, vocab_size))

    def apply_(self, logits: torch.Tensor, rows: list[int], matchers: list[LLMatcher]) -> None:
        """Set to -inf, in place, the logits of ``rows`` (fp32 ``[N, vocab]``) that each row's matcher forbids next."""
        pending, self._pending = self._pending, None
        vocab = logits.shape[1]
        same = pending is not None and pending[1] == vocab and len(pending[0]) == len(matchers)
        if pending is not None and same and all(a is b for a, b in zip(pending[0], matchers, strict=True)):
            bitmask = pending[2].result()
        else:
            bitmask = self._fill(matchers, vocab)
        apply_bitmask_(logits, rows, bitmask)

    def _fill(self, matchers: list[LLMatcher], vocab_size: int) -> torch.Tensor:
        """``[len(matchers), ceil(vocab / 32)]`` int32: bit b of word w allows token ``32 * w + b``.

        A new tensor each call: a fill still running for an abandoned step cannot write into this one."""
        bitmask = torch.empty(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
        for index, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, index)
        return bitmask


# [byte, bit]: 0 where the bit allows the token, -inf where it does not (bytes of a little-endian int32 word).
_BYTE_TABLE = torch.where(((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


def apply_bitmask_(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, *, use_c: bool = True) -> None:
    """Set ``logits[rows[i], t]`` to -inf where bit ``t`` of ``bitmask[i]`` is clear, and past the mask's end.

    On CPU in fp32 the C loop reads the mask word by word (about 0.1 ms for 16 rows of a 32k vocabulary);
    elsewhere the byte table turns it into an additive mask: expanding it bit by bit with tensor ops and then
    ``masked_fill`` cost about 5 ms at that size, as much as the tiny model's whole step.
    """
    vocab, words = logits.shape[1], bitmask.shape[1]
    lib = c_library() if use_c and logits.device.type == "cpu" and logits.dtype == torch.float32 else None
    if lib is not None and logits.stride(1) == 1 and bitmask.is_contiguous():
        index = torch.tensor(rows, dtype=torch.int64)
        lib.apply_token_bitmask(
            logits.data_ptr(), logits.stride(0), index.data_ptr(), len(rows), bitmask.data_ptr(), words, vocab
        )
        return
    additive = F.embedding(bitmask.contiguous().view(torch.uint8).long(), _BYTE_TABLE).view(len(rows), words * 32)
    if vocab > words * 32:
        additive = F.pad(additive, (0, vocab - words * 32), value=float("-inf"))
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).add_(additive[:, :vocab].to(logits.device, non_blocking=True))
    logits.index_copy_(0, index, masked)
