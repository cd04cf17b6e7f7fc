"""Tool definitions are bounded in number and size before their schemas are checked."""

from __future__ import annotations

import pytest

from core.errors import InvalidRequest
from server.openai_tools import MAX_TOOLS, MAX_TOOLS_BYTES, tool_use


def function(name: str, parameters: dict | None = None) -> dict:
    body: dict = {"name": name}
    if parameters is not None:
        body["parameters"] = parameters
    return {"type": "function", "function": body}


def test_at_most_128_functions() -> None:
    assert tool_use([function(f"f{i}") for i in range(MAX_TOOLS)], "none", None, None) is not None
    with pytest.raises(InvalidRequest, match="lists 129 functions; at most 128") as refused:
        tool_use([function(f"f{i}") for i in range(MAX_TOOLS + 1)], "none", None, None)
    assert refused.value.param == "tools"


def test_definitions_past_the_byte_bound_are_refused_before_their_schemas_are_checked() -> None:
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}  # ~270 KiB
    with pytest.raises(InvalidRequest, match=f"bytes of JSON; at most {MAX_TOOLS_BYTES}"):
        tool_use([function("f", wide)], "none", None, None)
    narrow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    assert tool_use([function("f", narrow)], "none", None, None) is not None


def test_cyclic_parameters_are_checked_not_followed() -> None:
    cyclic = {"type": "object", "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    used = tool_use([function("loop", cyclic)], "none", None, None)
    assert used is not None and used.tools[0]["function"]["parameters"] == cyclic
