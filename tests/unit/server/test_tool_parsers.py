"""Tool-call parsers (Hermes, Llama 3 JSON, Mistral), the stream that turns them into deltas, and the grammars
that force a call."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from core.errors import InvalidRequest
from server.openai_tools import tool_use
from server.tool_parsers import parser_for_template
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.llama3 import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser
from server.tool_parsers.streaming import ToolCallStream

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]
HERMES_TWO = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


def named(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_several_calls_and_keeps_the_text_outside_them():
    parsed = HermesParser().parse(HERMES_TWO)
    assert named(parsed.calls) == [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]
    assert parsed.content.strip() == "Let me check."
    assert len({c.id for c in parsed.calls}) == 2 and all(c.id.startswith("call_") for c in parsed.calls)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n{not json}\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        "plain answer",
        '<tool_call>\n{"name": "f", "argum',  # cut mid-call
    ],
)
def test_hermes_malformed_calls_stay_plain_content(text):
    parsed = HermesParser().parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_unclosed_last_call_counts_at_the_end_only():
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'
    assert named(HermesParser().parse(text).calls) == [("add", {"a": 1})]
    assert HermesParser().parse(text, final=False).calls == []


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "parameters": {"a": 1}}',
    ],
)
def test_llama3_json_calls(text):
    calls = Llama3JsonParser().parse(text).calls
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert Llama3JsonParser().parse(text).content == ""


@pytest.mark.parametrize("text", ['{"name": "f", "parameters": {"a": 1}} and more', '{"city": "Oslo"}', "Sure."])
def test_llama3_anything_else_is_content(text):
    assert Llama3JsonParser().parse(text).calls == [] and Llama3JsonParser().parse(text).content == text


@pytest.mark.parametrize("marker", ["[TOOL_CALLS]", ""])  # the marker is a special token skip_special_tokens drops
def test_mistral_calls(marker):
    text = f'{marker}[{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}, {{"name": "add", "arguments": {{}}}}]'
    parsed = MistralParser().parse(text)
    assert named(parsed.calls) == [("get_weather", {"city": "Oslo"}), ("add", {})]
    assert parsed.content == ""


@pytest.mark.parametrize("text", ['[TOOL_CALLS][{"name": "f", "arguments": {', "[TOOL_CALLS] oops", "[1, 2]"])
def test_mistral_malformed_is_content(text):
    assert MistralParser().parse(text).calls == [] and MistralParser().parse(text).content == text


def test_the_template_picks_the_parser():
    assert parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for_template("{{ messages }}") is None and parser_for_template(None) is None


def stream_pieces(parser, text: str, size: int, parallel: bool = True):
    stream = ToolCallStream(parser, parallel)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    contents, calls = [], []
    for i, piece in enumerate(pieces):
        content, deltas = stream.add(piece, i == len(pieces) - 1)
        contents.append(content)
        calls.extend(deltas)
    return contents, calls


def merged(deltas) -> list[dict]:
    """Tool-call deltas put back together by index, as the openai SDK does."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += d.get("id", "")
        call["name"] += d.get("function", {}).get("name", "")
        call["arguments"] += d.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_stream_holds_markup_back_and_sends_calls_as_deltas(size):
    contents, calls = stream_pieces(HermesParser(), HERMES_TWO, size)
    assert "".join(contents) == "Let me check.\n"
    assert not any("<" in c for c in contents)
    assert sorted({c["index"] for c in calls}) == [0, 1]
    whole = merged(calls)
    assert [(c["name"], json.loads(c["arguments"])) for c in whole] == named(HermesParser().parse(HERMES_TWO).calls)
    assert all(c["id"].startswith("call_") for c in whole) and whole[0]["id"] != whole[1]["id"]


HERMES_NESTED = (
    '<tool_call>\n{"name": "add", "arguments": {"a": {"b": [1, "}\\"x"]}, "c": "{ ] <"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


@pytest.mark.parametrize("text", [HERMES_TWO, HERMES_NESTED])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_stream_sends_the_name_first_then_argument_fragments(text, size):
    contents, deltas = stream_pieces(HermesParser(), text, size)
    assert not any("<" in c or "{" in c for c in contents)
    for index in (0, 1):
        mine = [d for d in deltas if d["index"] == index]
        # First the call's head: id, type, name, empty (or, sent whole at once, all) arguments.
        assert set(mine[0]) == {"index", "id", "type", "function"} and mine[0]["type"] == "function"
        assert mine[0]["id"].startswith("call_") and set(mine[0]["function"]) == {"name", "arguments"}
        # Then only argument fragments, none empty.
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in mine[1:])
        assert all(d["function"]["arguments"] for d in mine[1:])
        if size < 1000:
            assert mine[0]["function"]["arguments"] == "" and len(mine) > 2
    # Deltas of call 0 all come before call 1's.
    assert [d["index"] for d in deltas] == sorted(d["index"] for d in deltas)
    expected = HermesParser().parse(text).calls
    assert [(c["name"], json.loads(c["arguments"])) for c in merged(deltas)] == named(expected)


def test_stream_sends_argument_fragments_while_the_call_is_written():
    stream = ToolCallStream(HermesParser())
    _, deltas = stream.add('<tool_call>\n{"name": "get_we', False)
    assert deltas == []
    _, deltas = stream.add('ather", "argu', False)
    assert [d["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""}]
    _, deltas = stream.add('ments": {"city": "Os', False)
    assert deltas == [{"index": 0, "function": {"arguments": '{"city": "Os'}}]
    _, deltas = stream.add('lo"}}\n</tool', False)
    assert deltas == [{"index": 0, "function": {"arguments": 'lo"}'}}]
    content, deltas = stream.add("_call>", True)
    assert content == "" and deltas == [] and stream.called


def test_stream_arguments_written_as_a_string_are_sent_whole_at_the_end():
    text = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    _, deltas = stream_pieces(HermesParser(), text, 2)
    assert [(c["name"], json.loads(c["arguments"])) for c in merged(deltas)] == [("add", {"a": 1})]


@pytest.mark.parametrize("size", [1, 5])
def test_stream_unclosed_last_call_is_finished_at_the_end(size):
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'
    _, deltas = stream_pieces(HermesParser(), text, size)
    assert [(c["name"], json.loads(c["arguments"])) for c in merged(deltas)] == [("add", {"a": 1})]


def test_stream_sends_the_first_call_before_the_second_is_written():
    stream = ToolCallStream(HermesParser())
    first_end = HERMES_TWO.index("</tool_call>") + len("</tool_call>")
    _, deltas = stream.add(HERMES_TWO[:first_end], False)
    assert [d["function"]["name"] for d in deltas] == ["get_weather"]
    _, deltas = stream.add(HERMES_TWO[first_end:], True)
    assert [(d["index"], d["function"]["name"]) for d in deltas] == [(1, "add")]


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HermesParser(), "a < b but <tool_call>\n{bad}\n</tool_call> so <tool"),
        (Llama3JsonParser(), '{"not": "a call"}'),
        (MistralParser(), "[1, 2] is a list"),
    ],
)
def test_stream_releases_held_text_that_was_not_a_call(parser, text, size):
    contents, calls = stream_pieces(parser, text, size)
    assert calls == [] and "".join(contents) == text


def test_stream_without_parallel_calls_sends_only_the_first():
    _, calls = stream_pieces(HermesParser(), HERMES_TWO, 5, parallel=False)
    assert [(c["name"], json.loads(c["arguments"])) for c in merged(calls)] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser(), MistralParser()])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_grammars_compile_and_their_sentences_parse(parser, parallel):
    functions = [("get_weather", WEATHER), ("add", {"type": "object"})]
    grammar = parser.forced_grammar(functions, parallel)
    assert LLMatcher.validate_grammar(grammar) == ""
    sample = {
        "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
        "llama3_json": '{"name":"get_weather","parameters":{"city":"Oslo"}}',
        "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}}]',
    }[parser.name]
    assert named(parser.parse(sample).calls) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param"),
    [
        ("x", None, None, "tools"),
        ([{"type": "function"}], None, None, "tools[0]"),
        ([{"type": "function", "function": {"name": "bad name"}}], None, None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            None,
            None,
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
            None,
            None,
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, None, "tools[0].function.extra"),
        (TOOLS + TOOLS[:1], None, None, "tools[2].function.name"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
        (TOOLS, "sometimes", None, "tool_choice"),
        (None, "required", None, "tool_choice"),
        (TOOLS, None, "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tool_fields_are_400s_naming_them(tools, choice, parallel, param):
    with pytest.raises(InvalidRequest) as raised:
        tool_use(tools, choice, parallel, HermesParser())
    assert raised.value.param == param


def test_tool_choice_modes():
    assert tool_use(TOOLS, None, None, HermesParser()).choice == "auto"
    assert tool_use(None, "none", None, HermesParser()) is None
    named_use = tool_use(TOOLS, {"type": "function", "function": {"name": "add"}}, None, HermesParser())
    assert named_use.choice == "named" and '"add"' in named_use.grammar() and "get_weather" not in named_use.grammar()
    assert tool_use(TOOLS, "auto", None, HermesParser()).grammar() is None
    assert "anyOf" in tool_use(TOOLS, "required", False, HermesParser()).grammar()
    with pytest.raises(InvalidRequest, match="tool-call format"):
        tool_use(TOOLS, "auto", None, None)
