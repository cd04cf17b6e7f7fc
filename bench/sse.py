"""Server-sent events, line by line: what an OpenAI-style stream's ``data:`` lines carry."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx

DONE = "[DONE]"
_LINE_BREAK = re.compile(r"\r\n|\n|\r")  # the only line ends of an event stream


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The stream's lines, split where the SSE spec splits them: at CRLF, LF or CR, and nowhere else.

    httpx's ``aiter_lines`` splits as ``str.splitlines`` does, also at U+0085, U+2028 and the other separators
    a JSON string may carry unescaped (vLLM sends non-ASCII text raw), which cuts such an event in two."""
    pending = ""
    async for text in response.aiter_text():
        pending += text
        held = "\r" if pending.endswith("\r") else ""  # maybe the first half of a CRLF: wait for the next text
        *lines, pending = _LINE_BREAK.split(pending[: len(pending) - len(held)])
        pending += held
        for line in lines:
            yield line
    if pending:
        *lines, last = _LINE_BREAK.split(pending)
        for line in lines:
            yield line
        if last:
            yield last


@dataclass
class SseParser:
    """Feed it the stream's lines (without their line endings); a blank line completes an event."""

    _data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> str | None:
        """The completed event's data (its ``data:`` lines joined by newlines), or None mid-event."""
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, _, value = line.partition(":")
        if name == "data":
            # The spec strips exactly one leading space from the value.
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None  # event:, id: and retry: carry nothing an OpenAI stream needs

    def close(self) -> str | None:
        """Data of an event the stream ended without terminating (servers may omit the final blank line)."""
        return self.feed("")


def parse_chunk(data: str) -> dict[str, Any]:
    """One event's JSON payload; ``ValueError`` when it is not a JSON object."""
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise ValueError(f"stream event is not a JSON object: {data[:80]!r}")
    return payload


def chunk_token_ids(chunk: dict[str, Any]) -> list[int] | None:
    """Token ids of a completion chunk's choices, or None when the server does not send them."""
    ids: list[int] | None = None
    for choice in chunk.get("choices") or []:
        if (token_ids := choice.get("token_ids")) is not None:
            ids = (ids or []) + list(token_ids)
    return ids


def chunk_tokens(chunk: dict[str, Any]) -> int:
    """Tokens a completion chunk carries: its ``token_ids`` when the server returns them, else one per
    choice with text (a streamed detokenizer may hold back partial characters, so that undercounts)."""
    count = 0
    for choice in chunk.get("choices") or []:
        token_ids = choice.get("token_ids")
        if token_ids is not None:
            count += len(token_ids)
        elif choice.get("text"):
            count += 1
    return count
