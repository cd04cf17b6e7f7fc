"""Validation before training: every problem, structural or token length, reported with its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.dataset_format import CHAT, PROMPT_COMPLETION
from trainer.dataset import prepare_dataset
from trainer.errors import InvalidTrainingData


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def pair(i: int, completion: str = " ok") -> str:
    return json.dumps({"prompt": f"Q{i}:", "completion": completion})


def test_a_good_file_is_tokenized_in_order_with_its_line_numbers(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lines = [pair(i) for i in range(12)]
    lines.insert(5, "")  # blank lines are skipped but still counted
    data = prepare_dataset(write_lines(tmp_path / "d.jsonl", lines), tokenizer, max_seq_len=64)

    assert data.format == PROMPT_COMPLETION
    assert len(data.examples) == 12
    assert data.lines == [1, 2, 3, 4, 5, *range(7, 14)]
    assert data.num_tokens == sum(e.num_tokens for e in data.examples) > 0


def test_every_problem_is_reported_with_its_line_number(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lines = [pair(i) for i in range(14)]
    lines[1] = '{"prompt": "Q1:", '
    lines[4] = json.dumps({"prompt": "Q4:", "completion": " " + "long " * 40})
    lines[8] = json.dumps({"prompt": "Q8:", "completion": ""})
    lines[11] = json.dumps({"messages": [{"role": "assistant", "content": "hi"}]})

    with pytest.raises(InvalidTrainingData) as caught:
        prepare_dataset(write_lines(tmp_path / "d.jsonl", lines), tokenizer, max_seq_len=64)

    error = caught.value
    assert (error.code, error.param) == ("invalid_training_file", "training_file")
    assert [p.line for p in error.report.problems] == [2, 5, 9, 12]
    assert "line 2: invalid JSON" in error.message
    assert "line 5: example is" in error.message and "longer than max_seq_len 64" in error.message
    assert "line 9: 'completion' must be a non-empty string" in error.message
    assert "line 12: mixes formats" in error.message


def test_problems_past_the_cap_are_counted_not_listed(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    lines = [pair(i, completion=" " + "x" * 100) for i in range(30)]

    with pytest.raises(InvalidTrainingData) as caught:
        prepare_dataset(write_lines(tmp_path / "d.jsonl", lines), tokenizer, max_seq_len=32, max_problems=5)

    report = caught.value.report
    assert len(report.problems) == 5 and report.more_problems == 25
    assert "and 25 more problem(s)" in caught.value.message


def test_too_few_examples_and_a_bad_validation_file_name_what_to_fix(tokenizer, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidTrainingData, match="at least 10 are needed"):
        prepare_dataset(write_lines(tmp_path / "few.jsonl", [pair(i) for i in range(3)]), tokenizer, max_seq_len=64)

    chat = [json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})]
    ok = prepare_dataset(
        write_lines(tmp_path / "v.jsonl", chat), tokenizer, max_seq_len=64, min_examples=1, param="validation_file"
    )
    assert ok.format == CHAT
    with pytest.raises(InvalidTrainingData) as caught:
        prepare_dataset(
            write_lines(tmp_path / "bad.jsonl", ["nope"]), tokenizer, max_seq_len=64, param="validation_file"
        )
    assert (caught.value.code, caught.value.param) == ("invalid_validation_file", "validation_file")
    assert caught.value.message.startswith("invalid validation file: line 1:")
