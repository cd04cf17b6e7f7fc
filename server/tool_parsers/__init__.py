"""Tool calls in model output: one parser per chat-template family, chosen from the template's text.

A parser turns a completion's text into the content outside calls and the calls themselves, and writes the
Lark grammar (llguidance) that forces a valid call when ``tool_choice`` is ``required`` or names a function.
Malformed calls are not calls: their text stays in the content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call, ``arguments`` as JSON text (OpenAI's shape)."""

    name: str
    arguments: str
    id: str = field(default_factory=call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    """``content``: the text outside the calls (None when only whitespace is left); ``calls``: in order."""

    content: str | None
    calls: list[ToolCall]


class ToolParser(Protocol):
    """What every format provides."""

    name: str
    # Text that opens a call section: a stream holds its text back from this point (or a prefix of it) on.
    markers: tuple[str, ...]

    def parse(self, text: str, final: bool = True) -> ParsedOutput:
        """Split ``text``; with ``final=False`` (mid-stream) only calls that later text cannot change are returned."""
        ...

    def call_start(self, text: str) -> int | None:
        """Where a call section begins in ``text``, or may begin (a marker's prefix at the end); None if nowhere."""
        ...

    def forced_grammar(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> str:
        """A Lark grammar whose every sentence is one call (several if ``parallel``) of one of ``functions``
        (name, parameters schema)."""
        ...


def call_from(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded ``{"name": ..., arguments_key: {...}}`` object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: dict[str, Any]) -> str:
    """An llguidance ``%json`` rule body: compact JSON, no free whitespace (a random model could pad forever)."""
    return "%json" + json.dumps({**schema, "x-guidance": {"whitespace_flexible": False}}, separators=(",", ":"))


def call_schema(functions: list[tuple[str, dict[str, Any]]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The schema of one call object ``{"name": ..., arguments_key: {...}}`` to any of ``functions``."""
    schemas = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, arguments_key: parameters},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for name, parameters in functions
    ]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def marker_start(text: str, markers: tuple[str, ...]) -> int | None:
    """The first full marker in ``text``, else the start of a marker prefix ending ``text``, else None."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    if found:
        return min(found)
    for i in range(max(0, len(text) - max(len(m) for m in markers) + 1), len(text)):
        if any(m.startswith(text[i:]) for m in markers):
            return i
    return None


def parser_for_template(template: str | None) -> ToolParser | None:
    """The parser for the format a chat template teaches, from the markers its text mentions."""
    from server.tool_parsers.hermes import HermesParser
    from server.tool_parsers.llama3 import Llama3JsonParser
    from server.tool_parsers.mistral import MistralParser

    if not template:
        return None
    if "<tool_call>" in template:
        return HermesParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template:
        return Llama3JsonParser()
    return None
