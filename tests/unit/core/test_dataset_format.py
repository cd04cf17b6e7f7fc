from __future__ import annotations

import json

from core.dataset_format import CHAT, PREFERENCE, PROMPT_COMPLETION, method_format_problem, validate_lines


def _chat(user: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})


def test_valid_files_of_both_formats() -> None:
    report = validate_lines([_chat(f"q{i}", f"a{i}") for i in range(10)])
    assert report.ok and report.format == CHAT and report.num_examples == 10
    pc = [json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) for i in range(12)]
    report = validate_lines([*pc, "", "   "])
    assert report.ok and report.format == PROMPT_COMPLETION and report.num_examples == 12


def test_every_problem_has_its_line_number() -> None:
    lines = [_chat("q", "a")] * 10
    lines[2] = "{not json"
    lines[4] = json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})
    lines[6] = json.dumps({"messages": [{"role": "user", "content": ""}]})
    lines[7] = json.dumps({"prompt": "p", "completion": "c"})
    lines[8] = json.dumps({"text": "unknown format"})
    lines.append(b"\xff\xfe broken utf-8")
    lines.append("[1, 2]")
    report = validate_lines(lines)
    found = {p.line: p.message for p in report.problems}
    assert set(found) == {3, 5, 7, 8, 9, 11, 12}
    assert "invalid JSON" in found[3]
    assert "role" in found[5]
    assert "content" in found[7]
    assert "mixes formats" in found[8]
    assert "unknown format" in found[9]
    assert "UTF-8" in found[11]
    assert "JSON object" in found[12]
    assert "line 3" in report.summary()


def test_whole_file_problems_and_cap() -> None:
    assert "no examples" in validate_lines([]).summary()
    assert "at least 10" in validate_lines([_chat("q", "a")] * 3).summary()
    report = validate_lines(["bad"] * 50, max_problems=5)
    assert len(report.problems) == 5 and report.more_problems == 45
    assert "45 more" in report.summary(limit=5)


def test_conversation_must_end_with_assistant() -> None:
    line = json.dumps({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "bye"}]})
    report = validate_lines([line] + [_chat("q", "a")] * 10)
    assert [p.line for p in report.problems] == [1] and "last message" in report.problems[0].message


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def tool_example(**changes: object) -> dict:
    """OpenAI's function-calling fine-tuning example: a call, its result, then the answer."""
    example = {
        "tools": [WEATHER_TOOL],
        "parallel_tool_calls": False,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
                "weight": 1,
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
            {"role": "assistant", "content": "18C and sunny."},
        ],
    }
    example.update(changes)
    return example


def test_tool_examples_in_openai_format_are_valid() -> None:
    ends_with_a_call = tool_example()
    ends_with_a_call["messages"] = ends_with_a_call["messages"][:2]
    del ends_with_a_call["messages"][1]["content"]  # content may be left out of a call, as well as null
    lines = [json.dumps(tool_example()), json.dumps(ends_with_a_call)] + [_chat("q", "a")] * 8

    report = validate_lines(lines)

    assert report.ok, report.summary()
    assert report.num_examples == 10 and report.format == CHAT


def _problems(example: dict) -> list[str]:
    report = validate_lines([json.dumps(example)] + [_chat("q", "a")] * 10)
    assert all(p.line == 1 for p in report.problems)
    return [str(p) for p in report.problems]


def _broken(edit) -> dict:  # type: ignore[no-untyped-def]
    example = tool_example()
    edit(example, example["messages"][1]["tool_calls"][0]["function"])
    return example


def test_each_malformed_tool_field_is_named_with_its_line() -> None:
    def arguments(e, f):  # type: ignore[no-untyped-def]
        f["arguments"] = '{"city": '

    def unknown_function(e, f):  # type: ignore[no-untyped-def]
        f["name"] = "get_time"

    def dict_arguments(e, f):  # type: ignore[no-untyped-def]
        f["arguments"] = {"city": "Paris"}

    def unanswered_id(e, f):  # type: ignore[no-untyped-def]
        e["messages"][2]["tool_call_id"] = "call_9"

    def bad_schema(e, f):  # type: ignore[no-untyped-def]
        e["tools"] = [{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "parameters": {"type": "array"}}}]

    def bad_property(e, f):  # type: ignore[no-untyped-def]
        params = {"type": "object", "properties": {"city": {"type": "str"}}}
        e["tools"] = [{**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "parameters": params}}]

    def two_calls(e, f):  # type: ignore[no-untyped-def]
        calls = e["messages"][1]["tool_calls"]
        calls.append({**calls[0], "id": "call_2"})

    def no_tools(e, f):  # type: ignore[no-untyped-def]
        del e["tools"]

    def bad_weight(e, f):  # type: ignore[no-untyped-def]
        e["messages"][1]["weight"] = 0.5

    cases = {
        arguments: "line 1: messages[1].tool_calls[0].function.arguments is not valid JSON",
        dict_arguments: "line 1: messages[1].tool_calls[0].function.arguments must be a string holding a JSON object",
        unknown_function: (
            "line 1: messages[1].tool_calls[0].function.name 'get_time' is not one of the example's tools (get_weather)"
        ),
        unanswered_id: "line 1: messages[2].tool_call_id 'call_9' matches no earlier assistant tool call",
        bad_schema: "line 1: tools[0].function.parameters.type must be 'object', got 'array'",
        bad_property: "line 1: tools[0].function.parameters.properties.city.type must be one of",
        two_calls: "line 1: messages[1].tool_calls has 2 calls but the example sets parallel_tool_calls false",
        no_tools: "line 1: messages[1].tool_calls[0].function.name 'get_weather' needs the example's 'tools' list",
        bad_weight: "line 1: messages[1].weight must be 0 or 1, got 0.5",
    }
    for edit, expected in cases.items():
        problems = _problems(_broken(edit))
        assert len(problems) == 1 and problems[0].startswith(expected), (edit.__name__, problems)


def test_legacy_function_calling_is_refused_with_the_way_forward() -> None:
    legacy = {
        "functions": [WEATHER_TOOL["function"]],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}},
        ],
    }

    problems = " ".join(_problems(legacy))

    assert "declare them in 'tools'" in problems and "use 'tool_calls' instead" in problems
    tool_without_call = {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert "tool_call_id must be the id of an earlier assistant tool call" in " ".join(_problems(tool_without_call))


def _pair(user: str, preferred: object, other: object, **extra: object) -> str:
    return json.dumps(
        {
            "input": {"messages": [{"role": "user", "content": user}]},
            "preferred_output": preferred,
            "non_preferred_output": other,
            **extra,
        }
    )


def _say(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def test_preference_pairs_in_openai_dpo_format_are_their_own_format() -> None:
    report = validate_lines([_pair(f"q{i}", _say(f"good {i}"), _say(f"bad {i}")) for i in range(10)])
    assert report.ok and report.format == PREFERENCE and report.num_examples == 10


def test_every_problem_of_a_preference_pair_has_its_line_number() -> None:
    lines = [_pair("q", _say("good"), _say("bad"))] * 12
    lines[1] = _pair("q", _say("same"), _say("same"))
    lines[2] = _pair("q", _say("good"), [{"role": "user", "content": "bad"}])
    lines[3] = _pair("q", _say("good"), [*_say("bad"), *_say("worse")])
    lines[4] = json.dumps(
        {"input": {"messages": _say("hi")}, "preferred_output": _say("a"), "non_preferred_output": _say("b")}
    )
    lines[5] = json.dumps({"input": "q", "preferred_output": _say("a"), "non_preferred_output": _say("b")})
    lines[6] = _pair("q", _say(""), _say("bad"))
    lines[7] = _pair("q", _say("good"), _say("bad"), extra=1)
    lines[8] = _chat("q", "a")
    report = validate_lines(lines)
    found = {p.line: p.message for p in report.problems}
    assert set(found) == {2, 3, 4, 5, 6, 7, 8, 9}
    assert "must differ" in found[2]
    assert "non_preferred_output[0].role must be 'assistant'" in found[3]
    assert "exactly one assistant message" in found[4]
    assert "last input message must not be from the assistant" in found[5]
    assert "'input' must be an object" in found[6]
    assert "preferred_output[0].content must be a non-empty string" in found[7]
    assert "unsupported keys ['extra']" in found[8]
    assert "mixes formats" in found[9]


def test_each_method_names_the_formats_it_trains_on() -> None:
    assert method_format_problem("dpo", PREFERENCE) is None
    assert method_format_problem("supervised", CHAT) is None
    assert method_format_problem("supervised", PROMPT_COMPLETION) is None
    assert "method 'supervised'" in (method_format_problem("dpo", CHAT) or "")
    assert "method 'dpo'" in (method_format_problem("supervised", PREFERENCE) or "")
