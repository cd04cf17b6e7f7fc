"""Server-sent events as the inference servers send them (``data: {json}`` events, ``data: [DONE]`` last),
split incrementally and inspected for what the API must meter or hide from its client."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

DONE = b"[DONE]"
_SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


def encode_event(data: dict[str, Any] | bytes) -> bytes:
    """One ``data:`` event."""
    payload = data if isinstance(data, bytes) else json.dumps(data, separators=(",", ":")).encode()
    return b"data: " + payload + b"\n\n"


class EventSplitter:
    """Cuts a byte stream into complete events, whatever the chunking of the transport."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """The raw events (separator included) that ``chunk`` completes."""
        self._buffer += chunk
        while True:
            cut = _first_separator(self._buffer)
            if cut is None:
                return
            end, width = cut
            event, self._buffer = self._buffer[: end + width], self._buffer[end + width :]
            yield event

    def rest(self) -> bytes:
        """Bytes of an event the stream ended in the middle of."""
        return self._buffer


def _first_separator(buffer: bytes) -> tuple[int, int] | None:
    found = [(i, len(sep)) for sep in _SEPARATORS if (i := buffer.find(sep)) >= 0]
    return min(found) if found else None


def event_data(event: bytes) -> bytes | None:
    """The payload of an event's ``data:`` lines joined (None for comments and events without data)."""
    lines = [line for line in event.splitlines() if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[5:].removeprefix(b" ") for line in lines)


@dataclass
class Chunk:
    """One parsed stream event."""

    raw: bytes
    body: dict[str, Any] | None  # None: [DONE], a comment, or data that is not a JSON object
    done: bool = False

    @property
    def usage(self) -> dict[str, Any] | None:
        usage = self.body.get("usage") if self.body else None
        return usage if isinstance(usage, dict) else None

    @property
    def error(self) -> dict[str, Any] | None:
        error = self.body.get("error") if self.body else None
        return error if isinstance(error, dict) else None

    def pieces(self) -> int:
        """Choices in this chunk that carry generated text (one decode step each): the first such chunk is
        the answer's first output (time to first token; the answer is committed to its replica)."""
        if not self.body:
            return 0
        count = 0
        for choice in self.body.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                count += 1
        return count

    def carries_output(self) -> bool:
        """Whether sending this commits the answer to this replica: generated text, a finish, usage, an
        error or the end. A role-only opening chunk does not: it can still be replayed from another replica."""
        if self.done or self.body is None:
            return self.done
        if self.usage is not None or self.error is not None or self.pieces():
            return True
        return any(isinstance(c, dict) and c.get("finish_reason") for c in self.body.get("choices") or ())


def parse_event(event: bytes) -> Chunk:
    """Parse one raw event."""
    data = event_data(event)
    if data is None:
        return Chunk(event, None)
    if data.strip() == DONE:
        return Chunk(event, None, done=True)
    try:
        body = json.loads(data)
    except ValueError:
        return Chunk(event, None)
    return Chunk(event, body if isinstance(body, dict) else None)
