"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request: checked, and turned into what the chat
template renders and, for ``required`` or a named function, the grammar that forces a call."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from core.dataset_tools import FUNCTION_NAME
from core.errors import InvalidRequest
from server.tool_parsers import ToolParser

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MAX_TOOLS = 128  # OpenAI's own limit on functions per request
# Checking a schema against the JSON Schema meta-schema costs about 7 us a byte (1 s for 140 KiB of parameters,
# 11 s for 1.3 MB), and the definitions go into the prompt anyway: bound them before anything is checked.
MAX_TOOLS_BYTES = 128 * 1024


@dataclass
class ToolUse:
    """A request's tools: ``choice`` is auto, none, required or named (then ``named`` is the function)."""

    tools: list[dict[str, Any]]  # as the chat template receives them
    choice: str
    parallel: bool
    parser: ToolParser | None  # None only when choice is none
    named: str | None = None

    @property
    def parses(self) -> bool:
        """Whether output is read for calls (``none`` leaves it as text)."""
        return self.choice != "none" and self.parser is not None

    def grammar(self) -> str | None:
        """The Lark grammar that forces a call, for ``required`` and a named function; None otherwise."""
        if self.choice not in ("required", "named") or self.parser is None:
            return None
        functions = [
            (t["function"]["name"], t["function"].get("parameters") or EMPTY_PARAMETERS)
            for t in self.tools
            if self.named is None or t["function"]["name"] == self.named
        ]
        return self.parser.forced_grammar(functions, self.parallel and self.named is None)


def tool_use(raw_tools: Any, raw_choice: Any, raw_parallel: Any, parser: ToolParser | None) -> ToolUse | None:
    """The checked tool fields, or None when the request has no tools; a 400 naming the field that is wrong."""
    if raw_parallel is not None and not isinstance(raw_parallel, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    if raw_tools is None or raw_tools == []:
        if raw_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools: list the functions the model may call", param="tool_choice")
        return None
    _check_size(raw_tools)
    tools = _checked_tools(raw_tools)
    names = [t["function"]["name"] for t in tools]
    choice, named = _checked_choice(raw_choice, names)
    if parser is None and choice != "none":
        raise InvalidRequest(
            "this model's chat template has no tool-call format this server can read "
            "(Hermes <tool_call>, Mistral [TOOL_CALLS] or Llama 3 <|python_tag|>)",
            param="tools",
        )
    return ToolUse(tools, choice, raw_parallel is not False, parser, named)


def _check_size(raw: Any) -> None:
    if isinstance(raw, list) and len(raw) > MAX_TOOLS:
        raise InvalidRequest(f"tools lists {len(raw)} functions; at most {MAX_TOOLS} per request", param="tools")
    try:
        size = len(json.dumps(raw, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError):
        raise InvalidRequest("tools must be plain JSON, nested at most a few hundred levels", param="tools") from None
    if size > MAX_TOOLS_BYTES:
        raise InvalidRequest(
            f"the tool definitions are {size} bytes of JSON; at most {MAX_TOOLS_BYTES} per request: describe "
            "fewer or smaller functions",
            param="tools",
        )


def _checked_tools(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise InvalidRequest("tools must be a list of {type: function, function: {...}}", param="tools")
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidRequest(f"{where} must be {{type: function, function: {{name, ...}}}}", param=where)
        unknown = set(tool) - {"type", "function"}
        if unknown:
            raise InvalidRequest(f"{where}: unknown field {sorted(unknown)[0]}", param=f"{where}.{sorted(unknown)[0]}")
        function = tool["function"]
        fwhere = f"{where}.function"
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            field = sorted(unknown)[0]
            raise InvalidRequest(f"{fwhere}: unknown field {field}", param=f"{fwhere}.{field}")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise InvalidRequest(f"{fwhere}.name must be 1-64 letters, digits, _ or -", param=f"{fwhere}.name")
        if name in seen:
            raise InvalidRequest(f"{fwhere}.name: {name!r} is listed twice", param=f"{fwhere}.name")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise InvalidRequest(f"{fwhere}.description must be a string", param=f"{fwhere}.description")
        if not isinstance(function.get("strict", False), bool):
            raise InvalidRequest(f"{fwhere}.strict must be true or false", param=f"{fwhere}.strict")
        parameters = function.get("parameters")
        if parameters is not None:
            _check_parameters(parameters, f"{fwhere}.parameters")
        tools.append({"type": "function", "function": dict(function)})
    return tools


def _check_parameters(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON schema object", param=where)
    if schema.get("type", "object") != "object":
        raise InvalidRequest(f"{where} must describe an object (type: object)", param=where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise InvalidRequest(f"{where} is not a valid JSON schema: {exc.message}", param=where) from None


def _checked_choice(raw: Any, names: list[str]) -> tuple[str, str | None]:
    if raw is None:
        return "auto", None
    if raw in ("auto", "none", "required"):
        return raw, None
    function = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(
            'tool_choice must be "auto", "none", "required" or {type: function, function: {name}}', param="tool_choice"
        )
    if function["name"] not in names:
        raise InvalidRequest(
            f"tool_choice names {function['name']!r}, which is not in tools ({', '.join(names)})", param="tool_choice"
        )
    return "named", function["name"]
