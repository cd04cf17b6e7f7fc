"""Engine outputs as OpenAI response bodies and stream chunks (completions and chat completions)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from core.protocol import STATS_FIELD, RequestStats
from server.engine import CompletionOutput, RequestOutput, TokenLogprob
from server.tool_parsers.streaming import ToolCallStream

if TYPE_CHECKING:
    from server.openai_tools import ToolUse

Kind = Literal["completion", "chat"]


class TokenText:
    """How a token id is shown in logprobs (its decoded text; the id when there is no tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def usage(final: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens read from the prefix cache instead of computed."""
    return {
        "prompt_tokens": final.num_prompt_tokens,
        "completion_tokens": final.num_completion_tokens,
        "total_tokens": final.num_prompt_tokens + final.num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens},
    }


@dataclass
class Renderer:
    """Builds one request's response, or its chunks, in the shape its route promises."""

    kind: Kind
    request_id: str
    model: str
    token_text: TokenText
    return_token_ids: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk's usage is the usage so far, not null
    tools: ToolUse | None = None  # chat with tools whose calls are parsed out of the text
    created: int = field(default_factory=lambda: int(time.time()))
    _text_offsets: dict[int, int] = field(default_factory=dict)
    _tool_streams: dict[int, ToolCallStream] = field(default_factory=dict)

    # ----- whole responses -------------------------------------------------------------------------

    def response(self, final: RequestOutput, completions: list[CompletionOutput], stats: RequestStats | None) -> dict:
        """The non-streaming body, from each completion's finished output."""
        choices = []
        for c in completions:
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            text, logprobs = c.text or "", c.logprobs
            if self.kind == "chat":
                choice["message"] = self._message(text, choice)
                choice["logprobs"] = self._chat_logprobs(logprobs)
            else:
                choice["text"] = text
                choice["logprobs"] = self._legacy_logprobs(c.index, logprobs)
            if self.return_token_ids:
                choice["token_ids"] = list(c.token_ids or [])
            choices.append(choice)
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage(final),
        }
        if self.return_token_ids:
            body["prompt_token_ids"] = list(final.prompt_token_ids)
        if stats is not None:
            body[STATS_FIELD] = stats.model_dump()
        return body

    def _message(self, text: str, choice: dict[str, Any]) -> dict[str, Any]:
        """The assistant message; with tools, calls are parsed out of ``text`` and the choice finishes with them."""
        if self.tools is None or self.tools.parser is None:
            return {"role": "assistant", "content": text}
        parsed = self.tools.parser.parse(text)
        calls = parsed.calls if self.tools.parallel else parsed.calls[:1]
        if not calls:
            return {"role": "assistant", "content": text}
        if choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        content = (parsed.content or "").strip() or None
        return {"role": "assistant", "content": content, "tool_calls": [call.to_dict() for call in calls]}

    def _chat_delta(self, c: CompletionOutput, choice: dict[str, Any]) -> dict[str, Any]:
        """A chat choice's delta; with tools, call markup is held back and sent as ``tool_calls`` deltas."""
        if self.tools is None or self.tools.parser is None:
            return {"content": c.new_text} if c.new_text or not c.finished else {}
        stream = self._tool_streams.get(c.index)
        if stream is None:
            stream = self._tool_streams[c.index] = ToolCallStream(self.tools.parser, self.tools.parallel)
        content, calls = stream.add(c.new_text or "", c.finished)
        delta: dict[str, Any] = {}
        if content or not (calls or c.finished):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        if c.finished and stream.called and choice["finish_reason"] == "stop":
            choice["finish_reason"] = "tool_calls"
        return delta

    # ----- streams ---------------------------------------------------------------------------------

    def opening_chunk(self, n: int, prompt_token_ids: list[int]) -> dict | None:
        """Chat streams open with the assistant role; ``prompt_token_ids`` ride on the first chunk."""
        if self.kind != "chat" and not self.return_token_ids:
            return None
        if self.kind == "chat":
            choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None} for i in range(n)]  # fmt: skip
        else:
            choices = []
        chunk = self._chunk(choices)
        if self.return_token_ids:
            chunk["prompt_token_ids"] = list(prompt_token_ids)
        return chunk

    def delta_chunk(self, out: RequestOutput, stats: RequestStats | None) -> dict | None:
        """One step's deltas (with the usage so far, when continuous); the last chunk carries the stats
        unless a usage chunk follows."""
        choices = []
        for c in out.outputs:
            if not (c.new_text or c.new_token_ids or c.finished):
                continue
            choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
            if self.kind == "chat":
                choice["delta"] = self._chat_delta(c, choice)
                choice["logprobs"] = self._chat_logprobs(c.new_logprobs) if c.new_logprobs else None
            else:
                choice["text"] = c.new_text
                choice["logprobs"] = self._legacy_logprobs(c.index, c.new_logprobs) if c.new_logprobs else None
            if self.return_token_ids:
                choice["token_ids"] = list(c.new_token_ids)
            choices.append(choice)
        if not choices:
            return None
        chunk = self._chunk(choices)
        if self.continuous_usage:
            chunk["usage"] = usage(out)
        if out.finished and stats is not None and not self.include_usage:
            chunk[STATS_FIELD] = stats.model_dump()
        return chunk

    def usage_chunk(self, final: RequestOutput, stats: RequestStats | None) -> dict:
        """``stream_options.include_usage``: a last chunk with no choices, the usage and the stats."""
        chunk = self._chunk([])
        chunk["usage"] = usage(final)
        if stats is not None:
            chunk[STATS_FIELD] = stats.model_dump()
        return chunk

    def _chunk(self, choices: list[dict]) -> dict:
        chunk: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    # ----- logprobs ----------------------------------------------------------------------------------

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        if logprobs is None:
            return None
        return {"content": [self._chat_token(lp) for lp in logprobs]}

    def _chat_token(self, lp: TokenLogprob) -> dict:
        text = self.token_text(lp.token_id)
        top = []
        for token_id, logprob in lp.top:
            alt = self.token_text(token_id)
            top.append({"token": alt, "logprob": logprob, "bytes": list(alt.encode())})
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": top}

    def _legacy_logprobs(self, index: int, logprobs: list[TokenLogprob] | None) -> dict | None:
        """The completions API's ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
        if logprobs is None:
            return None
        tokens, offsets = [], []
        offset = self._text_offsets.get(index, 0)
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }
