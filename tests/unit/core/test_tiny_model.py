from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from core.tiny_model import BOS_ID, BYTE_OFFSET, EOS_ID, TinyModelSpec, make_tiny_model


def _make(out: Path, *extra: str) -> None:
    exe = str(Path(sys.executable).parent / "loraplex")
    subprocess.run([exe, "make-tiny-model", str(out), *extra], check=True, capture_output=True)


def test_same_arguments_give_identical_files_across_processes(tmp_path: Path) -> None:
    _make(tmp_path / "a", "--hidden", "64", "--layers", "1", "--seed", "3")
    _make(tmp_path / "b", "--hidden", "64", "--layers", "1", "--seed", "3")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    _make(tmp_path / "c", "--hidden", "64", "--layers", "1", "--seed", "4")
    assert (tmp_path / "a/model.safetensors").read_bytes() != (tmp_path / "c/model.safetensors").read_bytes()


def _random_text(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x4E00, 0x4FFF), (0x1F300, 0x1F6FF), (0x10000, 0x10FFF)]
    chars = []
    for _ in range(rng.randint(0, 40)):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


def test_loads_offline_and_tokenizer_round_trips_utf8(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.initializer_range == pytest.approx(0.1)
    rng = random.Random(0)
    for _ in range(200):
        text = _random_text(rng)
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID
        assert ids[1:] == [b + BYTE_OFFSET for b in text.encode("utf-8")]
        assert tok.decode(ids, skip_special_tokens=True) == text
    with torch.no_grad():
        logits = model(torch.tensor([tok("hello")["input_ids"]])).logits
    assert logits.shape[-1] == model.config.vocab_size


def test_chat_template_marks_assistant_text(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    learned = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert learned == [ord("y") + BYTE_OFFSET, ord("o") + BYTE_OFFSET, EOS_ID]
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|assistant|>\n")


def test_conversations_without_tools_render_as_before_tools_were_supported(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Sky?"},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "Grass?"},
    ]

    # The bytes every adapter trained so far saw: a change here would retrain them all.
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<s><|system|>\nAnswer in one word.</s>\n<|user|>\nSky?</s>\n<|assistant|>\nBlue</s>\n"
        "<|user|>\nGrass?</s>\n<|assistant|>\n"
    )
    assert tok.apply_chat_template(messages[:3], tokenize=False, tools=[]) == tok.apply_chat_template(
        messages[:3], tokenize=False
    )


def test_tools_render_as_hermes_does(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}},  # a string as is
    ]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Calling.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "one"},
    ]

    text = tok.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)

    assert text == (
        "<s><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call></s>\n'
        "<|user|>\ngo</s>\n"
        '<|assistant|>\nCalling.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call></s>\n'
        "<|tool|>\n<tool_response>\none\n</tool_response></s>\n<|assistant|>\n"
    )


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_each_family_loads_as_its_transformers_class_with_every_weight(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    out = make_tiny_model(tmp_path, TinyModelSpec(family=family, hidden=64, layers=2))
    config = json.loads((out / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert config["model_type"] == family and type(model).__name__ == config["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if family == "mistral":  # a window as long as the context
        assert model.config.sliding_window == model.config.max_position_embeddings
    else:  # the window fields are there, switched off
        assert set(model.config.layer_types) == {"full_attention"}
    assert model.config.head_dim == (32 if family == "qwen3" else 16)  # Qwen3 heads are twice hidden / heads
    biases = [n for n, _ in model.named_parameters() if n.endswith("_proj.bias")]
    assert len(biases) == (6 if family == "qwen2" else 0)


def test_a_window_that_binds_can_be_asked_for(tmp_path: Path) -> None:
    from transformers import AutoConfig

    _make(tmp_path / "q", "--family", "qwen3", "--layers", "4", "--hidden", "64", "--sliding-window", "8")
    config = AutoConfig.from_pretrained(tmp_path / "q")
    assert config.sliding_window == 8 and config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    mistral = TinyModelSpec(family="mistral", sliding_window=8).config()
    assert mistral["sliding_window"] == 8
    with pytest.raises(subprocess.CalledProcessError):
        _make(tmp_path / "bad", "--family", "gemma")


def test_phi3_is_fused_longrope_partially_rotated_tied_and_windowed(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    _make(tmp_path / "phi3", "--family", "phi3", "--hidden", "64", "--layers", "2")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "phi3", output_loading_info=True)
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"} <= names
    rope, config = model.config.rope_parameters, model.config
    assert (rope["rope_type"], rope["partial_rotary_factor"]) == ("longrope", 0.75)
    assert len(rope["short_factor"]) == len(rope["long_factor"]) == 6  # 3/4 of 16 dims, one per pair
    assert rope["short_factor"] != rope["long_factor"]
    assert rope["original_max_position_embeddings"] < config.max_position_embeddings
    assert config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.sliding_window == 16  # binds for prompts longer than 16 tokens
    with pytest.raises(ValueError, match="head-dim"):
        TinyModelSpec(family="phi3", head_dim=32)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_is_tied_soft_capped_or_locally_roped_and_windowed(tmp_path: Path, family: str) -> None:
    from transformers import AutoModelForCausalLM

    _make(tmp_path / family, "--family", family, "--hidden", "64", "--layers", "2")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / family, output_loading_info=True)
    config = model.config
    assert type(model).__name__ == ("Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM")
    assert config.model_type == ("gemma2" if family == "gemma2" else "gemma3_text")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert config.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert config.query_pre_attn_scalar == config.head_dim == 16
    # A 16-token window on the first layer, binding for test prompts; the second layer is global.
    assert config.sliding_window == 16 and config.layer_types == ["sliding_attention", "full_attention"]
    if family == "gemma2":  # Gemma 2's released soft-capping
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    else:  # Gemma 3 1B's: no capping, local layers on their own rope base
        assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
        rope = config.rope_parameters
        assert (rope["sliding_attention"]["rope_theta"], rope["full_attention"]["rope_theta"]) == (1e4, 1e6)
    norms = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    assert len(norms) == 2 * (6 if family == "gemma3" else 4) + 1 and all(not p.any() for p in norms)  # 1 + w = 1
