"""Llama 3.1+ JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``; several
separated by ``;``. The whole completion is the call(s), or it is plain content."""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers import ParsedOutput, ToolCall, call_from, call_schema, json_rule

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        if not final:  # a call is only known once the completion is: trailing text would make it content
            return ParsedOutput(text, [])
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls: list[ToolCall] = []
        decoder, pos = json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            call = call_from(obj, "parameters")
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ParsedOutput("" if calls else text, calls)

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("{") or PYTHON_TAG.startswith(stripped[: len(PYTHON_TAG)]):
            return 0
        return None

    def forced_grammar(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: {json_rule(call_schema(functions, 'parameters'))}\n"
