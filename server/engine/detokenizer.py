"""Streaming text: token ids to text deltas that never split a UTF-8 character nor leak a stop string."""

from __future__ import annotations

from typing import Protocol

# Prompt tokens decoded with the output, so tokenizers that render a token differently at the start of
# a text (sentencepiece's leading space) produce the same text as decoding the whole sequence.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decodes a growing token list; holds back text while the last character is incomplete."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens and return the newly complete text (possibly empty)."""
        self.tokens.extend(token_ids)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""


class StopStringFilter:
    """Cuts the text at the first stop string; while streaming, holds back a possible stop-string prefix."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.emitted = 0

    def add(self, delta: str) -> tuple[str, str | None]:
        """Append a delta; return the text safe to emit now and the stop string found, if any."""
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            return self.flush(), stop
        limit = len(self.text) - self.holdback
        if limit <= self.emitted:
            return "", None
        out = self.text[self.emitted : limit]
        self.emitted = limit
        return out, None

    def flush(self) -> str:
        """Everything not yet emitted (when the completion ends for another reason)."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
