"""Tool calls in a stream: content flows until a call may begin; calls go out as OpenAI ``delta.tool_calls``
once the parser knows them, and held-back text that turned out not to be a call is released at the end.

Hermes calls stream as OpenAI does: a first delta with ``index``, ``id``, ``type`` and the name (``arguments``
empty) once the name is written, then ``index`` + ``function.arguments`` fragments of the arguments object's
text as it grows. Other formats send each call whole once it is complete."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from server.tool_parsers import ToolCall, ToolParser, call_id
from server.tool_parsers.hermes import END, START, _call

# The head of a Hermes call body, up to the name's closing quote, then on to where the arguments value begins.
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'\s*,\s*"arguments"\s*:\s*')


@dataclass
class _Streaming:
    """A Hermes call whose first delta went out: how much of its arguments text has followed."""

    index: int
    sent: str = ""  # arguments text sent so far
    done: bool = False


class ToolCallStream:
    """One completion's stream: feed it each new text, get the content delta and the tool-call deltas."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.calls_sent = 0
        self._blocks: dict[int, _Streaming] = {}  # Hermes: call block number -> its streamed call

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def add(self, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += new_text
        parsed = self.parser.parse(self.text, final=finished)
        deltas = self._hermes_deltas(finished) if self.parser.name == "hermes" else self._new_calls(parsed.calls)
        if finished:
            if parsed.calls:
                raw = parsed.content or ""
                rest = raw[self.sent :] if raw.startswith(self.text[: self.sent]) else ""
                content = rest if rest.strip() else ""
            else:
                content = self.text[self.sent :]
            self.sent = len(self.text)
            return content, deltas
        start = self.parser.call_start(self.text)
        upto = len(self.text) if start is None else max(start, self.sent)
        content, self.sent = self.text[self.sent : upto], upto
        return content, deltas

    def _new_calls(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        if not self.parallel:
            calls = calls[:1]
        deltas = []
        for index in range(self.calls_sent, len(calls)):
            deltas.append({"index": index, **calls[index].to_dict()})
        self.calls_sent = max(self.calls_sent, len(calls))
        return deltas

    # ----- Hermes, incrementally ---------------------------------------------------------------------------

    def _hermes_deltas(self, finished: bool) -> list[dict[str, Any]]:
        """Walk the call blocks: closed ones (and at the end an unclosed last one) are finished off from the
        parsed call; the open one streams its name, then its arguments text as far as it is known."""
        deltas: list[dict[str, Any]] = []
        pos, block = 0, 0
        while (begin := self.text.find(START, pos)) >= 0:
            body_at = begin + len(START)
            end = self.text.find(END, body_at)
            body = self.text[body_at:] if end < 0 else self.text[body_at:end]
            state = self._blocks.get(block)
            if end >= 0 or finished:
                # As the parser: an unclosed block counts at the end only when nothing but layout precedes it.
                call = _call(body) if end >= 0 or not self.text[pos:begin].strip() else None
                if call is not None:
                    deltas += self._finish_block(block, state, call, body)
            else:
                deltas += self._grow_block(block, state, body)
            if end < 0:
                break
            pos, block = end + len(END), block + 1
        return deltas

    def _open(self, block: int) -> _Streaming | None:
        if not self.parallel and self.calls_sent:
            return None
        state = self._blocks[block] = _Streaming(self.calls_sent)
        self.calls_sent += 1
        return state

    def _grow_block(self, block: int, state: _Streaming | None, body: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        head = _NAME.match(body)
        if head is None:
            return deltas
        if state is None:
            try:
                name = json.loads(f'"{head.group(1)}"')
            except json.JSONDecodeError:
                return deltas
            if not name or (state := self._open(block)) is None:
                return deltas
            first = ToolCall(name, "", call_id())
            deltas.append({"index": state.index, **first.to_dict()})
        if state.done or not (key := _ARGS.match(body, head.end())):
            return deltas
        known = _object_prefix(body[key.end() :])
        if known is not None and len(known) > len(state.sent) and known.startswith(state.sent):
            deltas.append({"index": state.index, "function": {"arguments": known[len(state.sent) :]}})
            state.sent = known
        return deltas

    def _finish_block(self, block: int, state: _Streaming | None, call: ToolCall, body: str) -> list[dict[str, Any]]:
        if state is None:
            if (state := self._open(block)) is None:
                return []
            state.done = True
            return [{"index": state.index, **call.to_dict()}]
        if state.done:
            return []
        state.done = True
        # The arguments text as written, when it is what was streamed so far; else (written as a JSON string,
        # or after the name of an unusual layout) the parsed arguments, which only fit if nothing was sent.
        head = _NAME.match(body)
        key = _ARGS.match(body, head.end()) if head else None
        written = _object_prefix(body[key.end() :]) if key else None
        if written is None or not _complete(written) or json.loads(written) != json.loads(call.arguments):
            written = call.arguments if not state.sent else None
        if written is None or not written.startswith(state.sent) or written == state.sent:
            return []
        rest, state.sent = written[len(state.sent) :], written
        return [{"index": state.index, "function": {"arguments": rest}}]


def _object_prefix(text: str) -> str | None:
    """The text of a JSON object that ``text`` begins with, up to its closing brace if written, else as far as
    written; None if ``text`` does not begin with an object."""
    if not text.startswith("{"):
        return None
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return text


def _complete(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
