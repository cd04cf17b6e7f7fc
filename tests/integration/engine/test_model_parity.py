"""Our forward pass gives the logits of ``transformers`` on the same weights (fp32, max abs diff <= 1e-4).

Checked through every attention path: a whole-prompt prefill, a prompt split into chunks (later chunks
read earlier chunks' K/V back from pages), and single-token decodes over the paged cache.
"""

from __future__ import annotations

import json

import pytest
import torch

from core.errors import ConfigError
from server.engine import EngineConfig, LLMEngine, SamplingParams
from tests.integration.engine.models import hf_config, load_hf, save_model

TOLERANCE = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-mha-bias": dict(arch="llama", gqa=False, bias=True),
    "llama3-rope-tied": dict(arch="llama", tie=True, rope_parameters=LLAMA3_ROPE),
    "mistral-gqa": dict(arch="mistral"),
    "mistral-mha": dict(arch="mistral", gqa=False),
    "qwen2-gqa-bias": dict(arch="qwen2"),
    "qwen2-mha-bias-tied": dict(arch="qwen2", gqa=False, tie=True),
}


def _step_logits(engine: LLMEngine) -> tuple[torch.Tensor, list[int]]:
    """Run one scheduled step by hand: logits of every computed row and their positions."""
    batch = engine.scheduler.schedule()
    inputs = engine.runner.prepare(batch)
    with torch.inference_mode():
        hidden = engine.runner.model.forward(inputs.input_ids, inputs.positions, inputs.attention, inputs.segments)
        logits = engine.runner.model.compute_logits(hidden)
    for item in batch.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
    return logits, inputs.positions.tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, tmp_path):
    spec = dict(CASES[name])
    model_dir = save_model(tmp_path, hf_config(spec.pop("arch"), **spec))
    hf = load_hf(model_dir)
    prompt = torch.randint(3, 96, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    continuation = [5, 17, 88, 23]
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt + continuation])).logits[0]

    # Whole prompt in one step.
    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=4 << 20))
    engine.add_request("whole", prompt, SamplingParams(temperature=0.0))
    logits, positions = _step_logits(engine)
    assert (logits - reference[positions]).abs().max().item() <= TOLERANCE

    # Chunks of 16 tokens, then decodes of the continuation one token at a time.
    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=4 << 20, max_num_batched_tokens=16))
    engine.add_request("chunked", prompt, SamplingParams(temperature=0.0))
    seen = []
    while len(seen) < len(prompt):
        logits, positions = _step_logits(engine)
        assert (logits - reference[positions]).abs().max().item() <= TOLERANCE
        seen += positions
    seq = engine.scheduler.running[0]
    for token in continuation:
        seq.token_ids.append(token)
        logits, positions = _step_logits(engine)
        assert positions == [seq.num_tokens - 1]
        assert (logits - reference[positions]).abs().max().item() <= TOLERANCE


def test_sliding_window_shorter_than_context_is_refused(tmp_path):
    model_dir = save_model(tmp_path, hf_config("mistral"))
    config = json.loads((model_dir / "config.json").read_text())
    config["sliding_window"] = 64
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="sliding-window"):
        LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=1 << 20))
    # A context that fits inside the window is served exactly.
    LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=1 << 20, max_model_len=64))


def test_sharded_checkpoint_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = save_model(tmp_path / "one", hf_config("llama"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    a = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=1 << 20))
    b = LLMEngine(EngineConfig(model=str(tmp_path / "sharded"), pool_bytes=1 << 20))
    for wa, wb in zip(a.runner.model.weights.layers, b.runner.model.weights.layers, strict=True):
        assert torch.equal(wa.qkv.dense_weight_t(), wb.qkv.dense_weight_t())
        assert torch.equal(wa.down.dense_weight_t(), wb.down.dense_weight_t())
