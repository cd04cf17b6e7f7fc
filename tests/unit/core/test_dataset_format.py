from __future__ import annotations

import json

from core.dataset_format import CHAT, PROMPT_COMPLETION, validate_lines


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
