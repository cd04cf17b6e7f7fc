"""Hermes / Qwen 2.5+ tool calls, one block per call:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers import ParsedOutput, ToolCall, call_from, call_schema, json_rule, lark_literal, marker_start

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.S)


class HermesParser:
    name = "hermes"
    markers = (START,)

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        calls: list[ToolCall] = []
        content, pos = [], 0
        for match in _BLOCK.finditer(text):
            call = _call(match.group(1))
            content.append(text[pos : match.start()] if call else text[pos : match.end()])
            if call:
                calls.append(call)
            pos = match.end()
        rest = text[pos:]
        # A model may end its turn before closing its last block; at the end that block still counts.
        if final and rest.lstrip().startswith(START) and (call := _call(rest.lstrip()[len(START) :])):
            calls.append(call)
            rest = ""
        if final or START not in rest:
            content.append(rest)
        else:  # mid-stream: an open block is not content yet
            content.append(rest[: rest.index(START)])
        # Whitespace between and after calls is layout, not content.
        kept = content[:1] + [piece for piece in content[1:] if piece.strip() or not calls]
        return ParsedOutput("".join(kept), calls)

    def call_start(self, text: str) -> int | None:
        return marker_start(text, self.markers)

    def forced_grammar(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        call = f"{lark_literal(START + chr(10))} {json_rule(call_schema(functions))} {lark_literal(chr(10) + END)}"
        more = ' ("\\n" call)*' if parallel else ""
        return f"start: call{more}\ncall: {call}\n"


def _call(body: str) -> ToolCall | None:
    try:
        return call_from(json.loads(body))
    except json.JSONDecodeError:
        return None
