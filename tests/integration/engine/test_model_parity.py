"""Our forward pass gives the logits of ``transformers`` on the same weights (fp32, max abs diff <= 1e-4).

Checked through every attention path: a whole-prompt prefill, a prompt split into chunks (later chunks
read earlier chunks' K/V back from pages), and single-token decodes over the paged cache; with sliding
windows (every layer for Mistral, the layers from ``max_window_layers`` on for Qwen2) shorter than the
prompt, one page long and spanning page boundaries.
"""

from __future__ import annotations

import pytest
import torch

from core.tiny_model import FAMILIES, TinyModelSpec, make_tiny_model
from server.engine import EngineConfig, LLMEngine, SamplingParams
from server.offline import LLM
from tests.integration.engine.models import hf_config, load_hf, phi3_as_llama, save_model

TOLERANCE = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 500000.0,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1000000.0}
SHORT_FACTORS = [1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5]
LONG_FACTORS = [1.0, 1.3, 2.0, 3.5, 6.0, 9.0, 12.0, 16.0]


def _longrope(original: int, dims: int = 8) -> dict:
    """LongRoPE without `factor`: transformers then scales cos/sin by max_position_embeddings / original."""
    return {
        "rope_type": "longrope",
        "short_factor": SHORT_FACTORS[:dims],
        "long_factor": LONG_FACTORS[:dims],
        "original_max_position_embeddings": original,
        "rope_theta": 10000.0,
    }


# The prompt and continuation are 45 tokens. `engine` holds EngineConfig fields: a context (max_model_len)
# of 45 makes dynamic NTK and LongRoPE use the frequencies of transformers' one forward over all 45 tokens.
# arch "phi3" runs transformers' Phi-3 and serves the same weights as a Llama with the same rope settings.
CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-mha-bias": dict(arch="llama", gqa=False, bias=True),
    "llama3-rope-tied": dict(arch="llama", tie=True, rope_parameters=LLAMA3_ROPE),
    "mistral-gqa": dict(arch="mistral"),
    "mistral-mha": dict(arch="mistral", gqa=False),
    "qwen2-gqa-bias": dict(arch="qwen2"),
    "qwen2-mha-bias-tied": dict(arch="qwen2", gqa=False, tie=True),
    "mistral-gqa-window16": dict(arch="mistral", sliding_window=16),
    "mistral-mha-window24": dict(arch="mistral", gqa=False, sliding_window=24),
    "qwen2-window24-layer1": dict(arch="qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=1),
    "qwen3-gqa-headdim32": dict(arch="qwen3"),
    "qwen3-mha-bias-tied-yarn": dict(arch="qwen3", gqa=False, bias=True, tie=True, rope_parameters=dict(YARN_ROPE)),
    "llama-rope-linear": dict(arch="llama", rope_parameters={"rope_type": "linear", "factor": 4.0}),
    "llama-rope-yarn": dict(arch="llama", rope_parameters=dict(YARN_ROPE)),
    "llama-rope-dynamic-within": dict(
        arch="llama", max_position_embeddings=64, rope_parameters={"rope_type": "dynamic", "factor": 2.0}
    ),
    "llama-rope-dynamic-past": dict(
        arch="llama",
        max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0},
        engine=dict(max_model_len=45),
    ),
    "llama-longrope-short": dict(arch="llama", rope_parameters=_longrope(64), engine=dict(max_model_len=64)),
    "llama-longrope-long": dict(arch="llama", rope_parameters=_longrope(32), engine=dict(max_model_len=45)),
    "phi3-partial-rotary": dict(arch="phi3", partial_rotary_factor=0.5),
    "phi4-mini-partial-longrope": dict(
        arch="phi3",
        partial_rotary_factor=0.75,
        original_max_position_embeddings=32,
        rope_parameters=_longrope(32, dims=6),
        engine=dict(max_model_len=45),
    ),
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
    arch, engine_fields = spec.pop("arch"), spec.pop("engine", {})
    hf_dir = save_model(tmp_path / "hf", hf_config(arch, **spec))
    hf = load_hf(hf_dir)
    model_dir = phi3_as_llama(hf_dir, tmp_path / "llama") if arch == "phi3" else hf_dir
    prompt = torch.randint(3, 96, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    continuation = [5, 17, 88, 23]
    with torch.inference_mode():
        reference = hf(torch.tensor([prompt + continuation])).logits[0]

    # Whole prompt in one step.
    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=4 << 20, **engine_fields))
    engine.add_request("whole", prompt, SamplingParams(temperature=0.0))
    logits, positions = _step_logits(engine)
    assert (logits - reference[positions]).abs().max().item() <= TOLERANCE

    # Chunks of 16 tokens, then decodes of the continuation one token at a time.
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), pool_bytes=4 << 20, max_num_batched_tokens=16, **engine_fields)
    )
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


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_of_every_family_matches_transformers(family, tmp_path):
    """`loraplex make-tiny-model --family` writes what both transformers and the engine read the same way."""
    model_dir = make_tiny_model(tmp_path, TinyModelSpec(family=family, hidden=64, layers=2))
    prompt = torch.randint(4, 260, (29,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        reference = load_hf(model_dir)(torch.tensor([prompt])).logits[0]
    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=4 << 20))
    engine.add_request("whole", prompt, SamplingParams(temperature=0.0))
    logits, positions = _step_logits(engine)
    assert (logits - reference[positions]).abs().max().item() <= TOLERANCE


def test_sliding_window_changes_only_positions_past_it(tmp_path):
    """Same weights with and without a 16-token window: equal logits inside the window, different past it."""
    prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    logits = []
    for window in (None, 16):
        model_dir = save_model(tmp_path / str(window), hf_config("mistral", sliding_window=window))
        engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=4 << 20))
        assert engine.runner.model.config.layer_windows == (window, window)
        engine.add_request("r", prompt, SamplingParams(temperature=0.0))
        logits.append(_step_logits(engine)[0])
    full, windowed = logits
    assert (full[:16] - windowed[:16]).abs().max().item() <= TOLERANCE
    assert (full[16:] - windowed[16:]).abs().amax(dim=1).min().item() > 100 * TOLERANCE


def test_greedy_continuation_of_a_windowed_model_matches_transformers(tmp_path):
    """Tokens generated far past a 16-token window, by prompts prefilled whole and in chunks, equal transformers'."""
    model_dir = save_model(tmp_path, hf_config("mistral", sliding_window=16))
    hf = load_hf(model_dir)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 23, 41)]
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        expected = [hf.generate(torch.tensor([p]), **kwargs)[0, len(p) :].tolist() for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for chunk in (2048, 16):
        llm = LLM(model_dir, pool_bytes=4 << 20, max_num_batched_tokens=chunk)
        outputs = llm.generate([(prompt, None, params) for prompt in prompts])
        assert [out.outputs[0].token_ids for out in outputs] == expected


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
