"""Structural validation of fine-tuning JSONL, line by line, before anything is trained.

Three formats, one per file: chat (``{"messages": [{"role", "content"}, ...]}``, optionally with tools and
tool calls: ``core.dataset_tools``), prompt/completion (``{"prompt", "completion"}``), and OpenAI's preference
pairs for DPO (``{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}``,
each output one assistant message). Every problem
is reported with its 1-based line number, up to a cap, so a user can fix a file in one pass. Pure
Python: the API runs it while an upload streams in, the trainer runs it again (and adds token-length
checks that need the tokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from core.dataset_tools import check_tool_calls, check_tools
from core.hyperparameters import DPO

CHAT = "chat"
PROMPT_COMPLETION = "prompt_completion"
PREFERENCE = "preference"
SUPERVISED_FORMATS = (CHAT, PROMPT_COMPLETION)  # what supervised fine-tuning trains on; DPO takes PREFERENCE
PREFERENCE_OUTPUTS = ("preferred_output", "non_preferred_output")
ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MIN_EXAMPLES = 10
DEFAULT_MAX_PROBLEMS = 20
MAX_LINE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class DatasetProblem:
    line: int  # 1-based; 0 for problems of the file as a whole
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}" if self.line else self.message


@dataclass
class DatasetReport:
    """The outcome of validating one file."""

    format: str | None = None
    num_examples: int = 0
    problems: list[DatasetProblem] = field(default_factory=list)
    more_problems: int = 0  # problems past the cap, counted but not kept

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self, limit: int = 10, what: str = "training file") -> str:
        """One message listing the first problems, for an API error or a failed job."""
        shown = "; ".join(str(p) for p in self.problems[:limit])
        hidden = max(len(self.problems) - limit, 0) + self.more_problems
        if hidden > 0:
            shown += f"; and {hidden} more problem(s)"
        return f"invalid {what}: {shown}"


def method_format_problem(method: str, data_format: str | None) -> str | None:
    """Why a file of ``data_format`` cannot train with ``method`` (``supervised`` or ``dpo``), or None: supervised
    fine-tuning reads chat or prompt/completion examples, DPO preference pairs."""
    if data_format is None or (data_format == PREFERENCE) == (method == DPO):
        return None
    if method == DPO:
        return (
            f"method 'dpo' trains on preference pairs ('input', 'preferred_output', 'non_preferred_output'), but "
            f"the file holds {data_format} examples; use method 'supervised' for them"
        )
    return (
        "the file holds preference pairs, which train with method 'dpo'; supervised fine-tuning needs "
        f"{' or '.join(SUPERVISED_FORMATS)} examples"
    )


def _example_format(obj: dict[str, Any]) -> str | None:
    if "input" in obj or any(key in obj for key in PREFERENCE_OUTPUTS):
        return PREFERENCE
    if "messages" in obj:
        return CHAT
    if "prompt" in obj or "completion" in obj:
        return PROMPT_COMPLETION
    return None


def _check_example_tools(obj: dict[str, Any]) -> tuple[list[str], set[str] | None, bool]:
    """Problems with the example's ``tools`` and ``parallel_tool_calls``, the declared names, and that flag."""
    problems: list[str] = []
    names: set[str] | None = None
    if "tools" in obj:
        tool_problems, names = check_tools(obj["tools"])
        problems.extend(tool_problems)
    if "functions" in obj:
        problems.append("'functions' is OpenAI's deprecated format; declare them in 'tools' instead")
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        problems.append("'parallel_tool_calls' must be true or false")
    return problems, names, parallel is not False


def _check_message(i: int, msg: dict[str, Any], names: set[str] | None, parallel: bool, called: set[str]) -> list[str]:
    """Problems with ``messages[i]``; adds the tool call ids it makes to ``called``."""
    problems = []
    role, content = msg.get("role"), msg.get("content")
    if role not in ROLES:
        hint = "; use 'tool' with 'tool_call_id' instead" if role == "function" else ""
        problems.append(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}{hint}")
    calls = role == "assistant" and "tool_calls" in msg
    if calls:  # a message that calls tools may say nothing else
        if content is not None and not isinstance(content, str):
            problems.append(f"messages[{i}].content must be a string or null")
    elif not isinstance(content, str) or not content.strip():
        problems.append(f"messages[{i}].content must be a non-empty string")
    allowed = {"role", "content", "name", "weight"}
    allowed |= {"tool_calls"} if role == "assistant" else {"tool_call_id"} if role == "tool" else set()
    extra = set(msg) - allowed
    if extra:
        hint = "; use 'tool_calls' instead" if "function_call" in extra else ""
        problems.append(f"messages[{i}] has unsupported keys {sorted(extra)}{hint}")
    weight = msg.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        problems.append(f"messages[{i}].weight must be 0 or 1, got {weight!r}")
    if calls:
        call_problems, ids = check_tool_calls(f"messages[{i}]", msg["tool_calls"], names, parallel)
        problems.extend(call_problems)
        for call_id in ids:
            if call_id in called:
                problems.append(f"messages[{i}].tool_calls id {call_id!r} is used by an earlier call")
            called.add(call_id)
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            problems.append(f"messages[{i}].tool_call_id must be the id of an earlier assistant tool call")
        elif call_id not in called:
            problems.append(f"messages[{i}].tool_call_id {call_id!r} matches no earlier assistant tool call")
    return problems


def _check_chat(obj: dict[str, Any]) -> list[str]:
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["'messages' must be a non-empty list"]
    problems, names, parallel = _check_example_tools(obj)
    called: set[str] = set()
    has_assistant = False
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            problems.append(f"messages[{i}] must be an object with 'role' and 'content'")
            continue
        problems.extend(_check_message(i, msg, names, parallel, called))
        if msg.get("role") == "assistant":
            has_assistant = True
    if not problems and not has_assistant:
        problems.append("the conversation needs at least one assistant message to learn from")
    if not problems and messages[-1].get("role") != "assistant":
        problems.append("the last message must be from the assistant")
    return problems


def _check_prompt_completion(obj: dict[str, Any]) -> list[str]:
    problems = []
    for key in ("prompt", "completion"):
        value = obj.get(key)
        if not isinstance(value, str) or not value.strip():
            problems.append(f"'{key}' must be a non-empty string")
    extra = set(obj) - {"prompt", "completion"}
    if extra:
        problems.append(f"unsupported keys {sorted(extra)}")
    return problems


def _check_preference(obj: dict[str, Any]) -> list[str]:
    """OpenAI's DPO line: a conversation to answer (``input``), and the answer preferred over another."""
    inp = obj.get("input")
    if not isinstance(inp, dict):
        return ["'input' must be an object with 'messages' (the conversation to answer)"]
    messages = inp.get("messages")
    if not isinstance(messages, list) or not messages:
        return ["'input.messages' must be a non-empty list"]
    problems, names, parallel = _check_example_tools(inp)
    extra = set(inp) - {"messages", "tools", "parallel_tool_calls"}
    if extra:
        problems.append(f"'input' has unsupported keys {sorted(extra)}")
    called: set[str] = set()
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            problems.append(f"input.messages[{i}] must be an object with 'role' and 'content'")
            continue
        problems.extend(f"input.{p}" for p in _check_message(i, msg, names, parallel, called))
    if not problems and messages[-1].get("role") == "assistant":
        problems.append("the last input message must not be from the assistant: the outputs answer it")
    answers = []
    for key in PREFERENCE_OUTPUTS:
        output = obj.get(key)
        if not isinstance(output, list) or len(output) != 1 or not isinstance(output[0], dict):
            problems.append(f"'{key}' must be a list of exactly one assistant message")
            continue
        message = output[0]
        if message.get("role") != "assistant":
            problems.append(f"{key}[0].role must be 'assistant', got {message.get('role')!r}")
            continue
        # Same rules as an assistant turn of a chat example, checked against the input's tools and calls.
        problems.extend(
            p.replace("messages[0]", f"{key}[0]") for p in _check_message(0, message, names, parallel, set(called))
        )
        if "weight" in message:
            problems.append(f"{key}[0] has unsupported keys ['weight']")
        answers.append(json.dumps(message, sort_keys=True))
    if len(answers) == 2 and answers[0] == answers[1]:
        problems.append("'preferred_output' and 'non_preferred_output' are the same; a pair must differ")
    extra = set(obj) - {"input", *PREFERENCE_OUTPUTS}
    if extra:
        problems.append(f"unsupported keys {sorted(extra)}")
    return problems


_CHECKS = {CHAT: _check_chat, PROMPT_COMPLETION: _check_prompt_completion, PREFERENCE: _check_preference}


class DatasetValidator:
    """Feed lines as they arrive (``feed``), then ``finish`` for the report."""

    def __init__(self, *, min_examples: int = DEFAULT_MIN_EXAMPLES, max_problems: int = DEFAULT_MAX_PROBLEMS) -> None:
        self.report = DatasetReport()
        self._min = min_examples
        self._max = max_problems
        self._line = 0

    def _problem(self, line: int, message: str) -> None:
        if len(self.report.problems) < self._max:
            self.report.problems.append(DatasetProblem(line, message))
        else:
            self.report.more_problems += 1

    def feed(self, raw: bytes | str) -> dict[str, Any] | None:
        """Validate the next line; returns the parsed example when it is valid."""
        self._line += 1
        line = self._line
        if isinstance(raw, bytes):
            if len(raw) > MAX_LINE_BYTES:
                self._problem(line, f"line is longer than {MAX_LINE_BYTES} bytes")
                return None
            if b"\x00" in raw:  # valid UTF-8, but what UTF-16 (or a binary file) looks like read as UTF-8
                self._problem(line, "contains NUL bytes (is the file UTF-16?); save the file as UTF-8")
                return None
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                self._problem(line, f"not valid UTF-8 (byte {exc.start}); save the file as UTF-8")
                return None
        text = raw.strip().lstrip("\ufeff")
        if not text:
            return None  # blank lines are tolerated
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            self._problem(line, f"invalid JSON: {exc.msg} (column {exc.colno})")
            return None
        except RecursionError:  # json's answer to deeply nested input
            self._problem(line, "invalid JSON: nested too deeply")
            return None
        if not isinstance(obj, dict):
            self._problem(line, "each line must be a JSON object")
            return None
        fmt = _example_format(obj)
        if fmt is None:
            self._problem(
                line,
                "unknown format: expected 'messages' (chat), 'prompt' and 'completion', or 'input', "
                "'preferred_output' and 'non_preferred_output' (preference pairs for DPO)",
            )
            return None
        if self.report.format is None:
            self.report.format = fmt
        elif fmt != self.report.format:
            self._problem(line, f"mixes formats: this line is {fmt} but the file started as {self.report.format}")
            return None
        problems = _CHECKS[fmt](obj)
        for message in problems:
            self._problem(line, message)
        if problems:
            return None
        self.report.num_examples += 1
        return obj

    def finish(self) -> DatasetReport:
        """Close the file: adds whole-file problems (empty, too few examples)."""
        if self.report.num_examples == 0 and not self.report.problems:
            self._problem(0, "the file has no examples")
        elif self.report.ok and self.report.num_examples < self._min:
            self._problem(0, f"the file has {self.report.num_examples} example(s); at least {self._min} are needed")
        return self.report


def validate_lines(lines: Iterable[bytes | str], **kwargs: int) -> DatasetReport:
    """Validate a whole file given as lines."""
    validator = DatasetValidator(**kwargs)
    for raw in lines:
        validator.feed(raw)
    return validator.finish()
