"""Checks for function calling in chat training examples, in OpenAI's fine-tuning format.

An example may declare ``tools`` (``[{"type": "function", "function": {"name", "description",
"parameters"}}]``) and ``parallel_tool_calls``; its assistant messages may carry ``tool_calls``
(``[{"id", "type": "function", "function": {"name", "arguments": "<JSON object as a string>"}}]``),
answered by ``tool`` messages naming the call's ``tool_call_id``. Every problem names the field, as
``messages[2].tool_calls[0].function.arguments``, so a user can find it in the line.
"""

from __future__ import annotations

import json
import re
from typing import Any

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _schema_problems(schema: dict[str, Any], where: str) -> list[str]:
    """JSON Schema ``type`` values that are no JSON Schema type, anywhere under ``schema``.

    Walked with a stack, not recursion: a hostile file may nest schemas as deep as JSON allows.
    """
    problems = []
    stack = [(schema, where)]
    while stack:
        node, path = stack.pop()
        kind = node.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        if "type" in node and (not kinds or any(k not in SCHEMA_TYPES for k in kinds)):
            problems.append(f"{path}.type must be one of {', '.join(SCHEMA_TYPES)}, got {kind!r}")
        properties = node.get("properties")
        if "properties" in node and not isinstance(properties, dict):
            problems.append(f"{path}.properties must be an object")
        elif isinstance(properties, dict):
            stack.extend(
                (sub, f"{path}.properties.{name}") for name, sub in properties.items() if isinstance(sub, dict)
            )
        if isinstance(node.get("items"), dict):
            stack.append((node["items"], f"{path}.items"))
    return sorted(problems)


def check_tools(tools: Any) -> tuple[list[str], set[str]]:
    """Problems with an example's ``tools`` list, and the function names it declares."""
    if not isinstance(tools, list) or not tools:
        return ['\'tools\' must be a non-empty list of {"type": "function", "function": {...}}'], set()
    problems: list[str] = []
    names: set[str] = set()
    for t, tool in enumerate(tools):
        where = f"tools[{t}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            problems.append(f"{where}.type must be 'function'")
            continue
        function = tool.get("function")
        if not isinstance(function, dict):
            problems.append(f"{where}.function must be an object with 'name' and 'parameters'")
            continue
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            problems.append(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        elif name in names:
            problems.append(f"{where}.function.name {name!r} is declared twice")
        else:
            names.add(name)
        if "description" in function and not isinstance(function["description"], str):
            problems.append(f"{where}.function.description must be a string")
        parameters = function.get("parameters")
        if "parameters" not in function:
            pass  # a function without arguments
        elif not isinstance(parameters, dict):
            problems.append(f"{where}.function.parameters must be a JSON Schema object")
        elif parameters.get("type", "object") != "object":
            problems.append(f"{where}.function.parameters.type must be 'object', got {parameters['type']!r}")
        else:
            problems.extend(_schema_problems(parameters, f"{where}.function.parameters"))
        extra = set(function) - {"name", "description", "parameters", "strict"}
        if extra:
            problems.append(f"{where}.function has unsupported keys {sorted(extra)}")
    return problems, names


def check_tool_calls(where: str, calls: Any, names: set[str] | None, parallel: bool) -> tuple[list[str], list[str]]:
    """Problems with one assistant message's ``tool_calls``, and the call ids it makes.

    ``names`` are the functions the example declares (None: it declares no ``tools``).
    """
    if not isinstance(calls, list) or not calls:
        return [f"{where}.tool_calls must be a non-empty list"], []
    problems: list[str] = []
    ids: list[str] = []
    if not parallel and len(calls) > 1:
        problems.append(f"{where}.tool_calls has {len(calls)} calls but the example sets parallel_tool_calls false")
    for c, call in enumerate(calls):
        at = f"{where}.tool_calls[{c}]"
        if not isinstance(call, dict):
            problems.append(f"{at} must be an object with 'id', 'type' and 'function'")
            continue
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            problems.append(f"{at}.id must be a non-empty string")
        else:
            ids.append(call_id)
        if call.get("type") != "function":
            problems.append(f"{at}.type must be 'function'")
        function = call.get("function")
        if not isinstance(function, dict):
            problems.append(f"{at}.function must be an object with 'name' and 'arguments'")
            continue
        name = function.get("name")
        if not isinstance(name, str) or not name:
            problems.append(f"{at}.function.name must be a non-empty string")
        elif names is None:
            problems.append(f"{at}.function.name {name!r} needs the example's 'tools' list to declare it")
        elif name not in names:
            declared = ", ".join(sorted(names))
            problems.append(f"{at}.function.name {name!r} is not one of the example's tools ({declared})")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            problems.append(f"{at}.function.arguments must be a string holding a JSON object")
            continue
        try:
            parsed = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            problems.append(f"{at}.function.arguments is not valid JSON")
            continue
        if not isinstance(parsed, dict):
            problems.append(f"{at}.function.arguments must be a JSON object, got {type(parsed).__name__}")
    return problems, ids
