"""Turn one validated example into token ids and labels, with loss only where the model should learn.

Chat: the model's own chat template renders the conversation, with the example's tools if it has any;
only assistant turns (tool calls included, and the end-of-turn token after each, so generation stops
there) carry labels. Prompt/completion: the prompt is tokenized
exactly as an inference request would be, the completion follows with EOS appended, and only the
completion carries labels. Preference pairs (DPO): the input conversation followed by each output, rendered
exactly as a chat example would be; the prompt is what the two renderings share before the assistant answers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.dataset_format import CHAT, PREFERENCE, PROMPT_COMPLETION

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # the label value PyTorch's cross-entropy skips


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]
    labels: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


@dataclass(frozen=True)
class TokenizedPair:
    """A preference pair as DPO reads it: one prompt, and the preferred (chosen) and other (rejected) answers,
    each ending with the end-of-turn token the model must learn to stop on."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]

    @property
    def num_tokens(self) -> int:
        """Tokens one pass reads: the prompt once with each answer."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    @property
    def longest(self) -> int:
        """The longer of the two sequences, which ``max_seq_len`` bounds."""
        return len(self.prompt_ids) + max(len(self.chosen_ids), len(self.rejected_ids))


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) spans where ``mask`` is 1."""
    spans, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            spans.append((start, i))
            start = None
    return spans


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validated OpenAI messages as chat templates take them: tool-call ``arguments`` parsed into objects.

    Qwen2.5, Llama 3.1 and Hermes templates write arguments with ``tojson``, which would quote a string
    again; a tool result also carries the called function's ``name``, which some templates print.
    """
    out: list[dict[str, Any]] = []
    called: dict[str, str] = {}
    for m in messages:
        message: dict[str, Any] = {"role": m["role"], "content": m.get("content")}
        if m.get("tool_calls"):
            if message["content"] is None:
                del message["content"]  # as transformers' tool-use docs write a call without text
            message["tool_calls"] = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                }
                for c in m["tool_calls"]
            ]
            called.update((c["id"], c["function"]["name"]) for c in m["tool_calls"])
        if m["role"] == "tool":
            message["tool_call_id"] = m["tool_call_id"]
            message["name"] = called.get(m["tool_call_id"], "")
        out.append(message)
    return out


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def _spans_by_prefix(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], full: list[int], tools: list[Any] | None
) -> list[tuple[int, int]]:
    """Assistant spans for templates without ``{% generation %}`` markers, found by rendering prefixes.

    Each assistant turn is what rendering up to it adds after the generation prompt; this needs a
    template whose renderings of a conversation's prefixes are prefixes of each other (most are).
    """
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        upto = _render(tokenizer, messages[: i + 1], tools=tools)
        if upto[: len(before)] != before or full[: len(upto)] != upto:
            raise ValueError(
                "the base model's chat template renders a conversation differently from its prefixes, so "
                "assistant turns cannot be located; add {% generation %} markers to the template"
            )
        spans.append((len(before), len(upto)))
    return spans


def tokenize_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], tools: list[Any] | None = None
) -> TokenizedExample:
    """Render ``messages`` and ``tools`` with the chat template; labels on assistant turns whose ``weight`` isn't 0."""
    plain = template_messages(messages)
    encoded = tokenizer.apply_chat_template(
        plain, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    input_ids = list(encoded["input_ids"])
    assistant = [m for m in messages if m["role"] == "assistant"]
    spans = _runs(encoded.get("assistant_masks") or [])
    if len(spans) != len(assistant):
        spans = _spans_by_prefix(tokenizer, plain, input_ids, tools)
    labels = [IGNORE_INDEX] * len(input_ids)
    for (start, end), message in zip(spans, assistant, strict=True):
        if message.get("weight", 1) != 0:
            labels[start:end] = input_ids[start:end]
    return TokenizedExample(input_ids, labels)


def tokenize_prompt_completion(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str) -> TokenizedExample:
    """Prompt with the tokenizer's special tokens (as at inference), then completion + EOS as the labels."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the base model's tokenizer has no EOS token, so a completion could never end")
    prompt_ids = list(tokenizer(prompt).input_ids)
    completion_ids = [*tokenizer(completion, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    return TokenizedExample(prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids)


def _answer(tokenized: TokenizedExample) -> tuple[int, list[int]]:
    """Where the one supervised (assistant) span starts, and its tokens."""
    supervised = [i for i, label in enumerate(tokenized.labels) if label != IGNORE_INDEX]
    return supervised[0], tokenized.input_ids[supervised[0] : supervised[-1] + 1]


def tokenize_preference(tokenizer: PreTrainedTokenizerBase, example: dict[str, Any]) -> TokenizedPair:
    """The input conversation with each output, through :func:`tokenize_chat`, so a pair is tokenized exactly
    as the same conversation would be for supervised training (and as chat completions render its prompt)."""
    messages, tools = example["input"]["messages"], example["input"].get("tools")
    chosen = tokenize_chat(tokenizer, [*messages, example["preferred_output"][0]], tools)
    rejected = tokenize_chat(tokenizer, [*messages, example["non_preferred_output"][0]], tools)
    chosen_start, chosen_ids = _answer(chosen)
    rejected_start, rejected_ids = _answer(rejected)
    if chosen.input_ids[:chosen_start] != rejected.input_ids[:rejected_start]:
        raise ValueError("the chat template renders the input differently before each output")
    return TokenizedPair(chosen.input_ids[:chosen_start], chosen_ids, rejected_ids)


def tokenize_example(
    tokenizer: PreTrainedTokenizerBase, example: dict[str, Any], fmt: str
) -> TokenizedExample | TokenizedPair:
    """Tokenize one validated example of format ``fmt`` (``CHAT``, ``PROMPT_COMPLETION`` or ``PREFERENCE``)."""
    if fmt == PREFERENCE:
        return tokenize_preference(tokenizer, example)
    if fmt == CHAT:
        return tokenize_chat(tokenizer, example["messages"], example.get("tools"))
    if fmt == PROMPT_COMPLETION:
        return tokenize_prompt_completion(tokenizer, example["prompt"], example["completion"])
    raise ValueError(f"unknown dataset format {fmt!r}")
