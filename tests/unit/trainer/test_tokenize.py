"""Loss masks: the model learns what the assistant (or the completion) says, EOS included, nothing else."""

from __future__ import annotations

from core.tiny_model import CHAT_TEMPLATE
from trainer.tokenize import (
    IGNORE_INDEX,
    TokenizedExample,
    tokenize_chat,
    tokenize_preference,
    tokenize_prompt_completion,
)


def learned_text(tokenizer, example: TokenizedExample) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.decode([t for t in example.labels if t != IGNORE_INDEX])


CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Sky colour?"},
    {"role": "assistant", "content": "Blue"},
    {"role": "user", "content": "Grass colour?"},
    {"role": "assistant", "content": "Green"},
]


def test_prompt_completion_learns_only_the_completion_and_its_eos(tokenizer) -> None:  # type: ignore[no-untyped-def]
    example = tokenize_prompt_completion(tokenizer, "Q: capital of France?\nA:", " Paris")

    assert learned_text(tokenizer, example) == " Paris</s>"
    assert (
        example.input_ids[: len(tokenizer("Q: capital of France?\nA:").input_ids)]
        == tokenizer("Q: capital of France?\nA:").input_ids
    )  # the prompt is tokenized exactly as an inference request is
    assert example.labels[-1] == tokenizer.eos_token_id == example.input_ids[-1]
    assert len(example.labels) == len(example.input_ids)


def test_chat_learns_every_assistant_turn_and_nothing_the_user_or_system_said(tokenizer) -> None:  # type: ignore[no-untyped-def]
    example = tokenize_chat(tokenizer, CONVERSATION)

    assert learned_text(tokenizer, example) == "Blue</s>Green</s>"
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"]
    assert example.input_ids == list(rendered)


def test_an_assistant_turn_with_weight_zero_is_not_learned(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["weight"] = 0

    assert learned_text(tokenizer, tokenize_chat(tokenizer, messages)) == "Green</s>"


def test_templates_without_generation_markers_still_mask_by_turn(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        example = tokenize_chat(tokenizer, CONVERSATION)
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE

    # Found by rendering prefixes, each turn runs to where the next one starts: the newline after EOS too.
    assert learned_text(tokenizer, example) == "Blue</s>\nGreen</s>\n"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "assistant", "content": "18C."},
]
# What the model learns to say when it calls a tool: Hermes' <tool_call> JSON, arguments as an object.
LEARNED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call></s>'


def test_tool_calls_are_learned_and_tool_results_and_the_tools_block_are_not(tokenizer) -> None:  # type: ignore[no-untyped-def]
    example = tokenize_chat(tokenizer, TOOL_CONVERSATION, [WEATHER_TOOL])

    assert learned_text(tokenizer, example) == LEARNED_CALL + "18C.</s>"
    rendered = tokenizer.decode(example.input_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in rendered
    assert "<|tool|>\n<tool_response>\n18C\n</tool_response></s>" in rendered
    assert rendered.count("Be brief.") == 1  # the system prompt heads the tools turn, once


def test_a_tool_call_turn_with_weight_zero_is_not_learned(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [dict(m) for m in TOOL_CONVERSATION]
    messages[2]["weight"] = 0

    assert learned_text(tokenizer, tokenize_chat(tokenizer, messages, [WEATHER_TOOL])) == "18C.</s>"


def test_tool_turns_are_found_by_prefix_without_generation_markers(tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    try:
        example = tokenize_chat(tokenizer, TOOL_CONVERSATION, [WEATHER_TOOL])
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE

    assert learned_text(tokenizer, example) == LEARNED_CALL + "\n18C.</s>\n"


def test_a_preference_pair_shares_the_prompt_a_chat_request_renders_and_ends_each_answer_with_eos(tokenizer) -> None:  # type: ignore[no-untyped-def]
    question = CONVERSATION[:2]
    pair = tokenize_preference(
        tokenizer,
        {
            "input": {"messages": question},
            "preferred_output": [{"role": "assistant", "content": "Blue"}],
            "non_preferred_output": [{"role": "assistant", "content": "Green, or grey"}],
        },
    )

    rendered = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert pair.prompt_ids == list(rendered["input_ids"])  # as chat completions render the question
    assert tokenizer.decode(pair.chosen_ids) == "Blue</s>"
    assert tokenizer.decode(pair.rejected_ids) == "Green, or grey</s>"
    supervised = tokenize_chat(tokenizer, [*question, {"role": "assistant", "content": "Blue"}])
    assert pair.prompt_ids + pair.chosen_ids == supervised.input_ids[: len(pair.prompt_ids) + len(pair.chosen_ids)]
