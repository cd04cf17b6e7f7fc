"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. ``[TOOL_CALLS]`` is a special
token that ``skip_special_tokens`` removes, so a completion that is only such a list counts as calls too."""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers import ParsedOutput, call_from, call_schema, json_rule, lark_literal, marker_start

MARKER = "[TOOL_CALLS]"


class MistralParser:
    name = "mistral"
    markers = (MARKER,)

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        start = text.find(MARKER)
        if start < 0 and text.lstrip().startswith("[{"):
            start = 0
        if start < 0:
            return ParsedOutput(text, [])
        if not final:
            return ParsedOutput(text[:start], [])
        body = text[start:].removeprefix(MARKER).strip()
        try:
            obj, end = json.JSONDecoder().raw_decode(body)
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_from(item) for item in items]
        if not calls or any(c is None for c in calls) or body[end:].strip():
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start], [c for c in calls if c is not None])

    def call_start(self, text: str) -> int | None:
        if text.lstrip().startswith("["):
            return 0
        return marker_start(text, self.markers)

    def forced_grammar(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        more = ' ("," call)*' if parallel else ""
        return f'start: {lark_literal(MARKER + "[")} call{more} "]"\ncall: {json_rule(call_schema(functions))}\n'
