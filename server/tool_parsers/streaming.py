"""Tool calls in a stream: content flows until a call may begin; calls go out as OpenAI ``delta.tool_calls``
once the parser knows them, and held-back text that turned out not to be a call is released at the end."""

from __future__ import annotations

from typing import Any

from server.tool_parsers import ToolCall, ToolParser


class ToolCallStream:
    """One completion's stream: feed it each new text, get the content delta and the tool-call deltas."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.sent = 0  # characters of ``text`` already sent as content
        self.calls_sent = 0

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def add(self, new_text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        self.text += new_text
        parsed = self.parser.parse(self.text, final=finished)
        deltas = self._new_calls(parsed.calls)
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
