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
from tests.integration.engine.models import hf_config, load_hf, phi3_as_llama, rewrite_config, save_model

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


# Gemma 3: local (sliding) layers rotate with their own base, global layers with linear scaling (as 4B and up).
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
# The same, as released Gemma 3 config.json files spell it (transformers 4), without rope_parameters or layer_types.
GEMMA3_RELEASED_KEYS = {
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window_pattern": 3,
}


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
# arch "phi3" serves the Phi-3 checkpoint as it is (fused qkv_proj, gate_up_proj); with as_llama, the same weights
# split into a Llama with the same rope settings (transformers' Llama cannot rotate part of a head; its Phi-3 can).
# Gemma 2 with Gemma 2's soft-capping (attention 50, logits 30) and with caps that bind on every score (4, 3);
# `released` rewrites config.json with older keys in place of rope_parameters and layer_types.
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
    "phi3-as-llama-partial-rotary": dict(arch="phi3", as_llama=True, partial_rotary_factor=0.5),
    "phi3-mini-mha-window16": dict(arch="phi3", gqa=False, sliding_window=16),
    "phi4-mini-partial-longrope": dict(
        arch="phi3",
        partial_rotary_factor=0.75,
        original_max_position_embeddings=32,
        rope_parameters=_longrope(32, dims=6),
        engine=dict(max_model_len=45),
    ),
    "phi4-mini-tied-longrope-window24": dict(
        arch="phi3",
        tie=True,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=32,
        rope_parameters=_longrope(32, dims=6),
        sliding_window=24,
        engine=dict(max_model_len=45),
    ),
    "gemma2-gqa-window16": dict(arch="gemma2", sliding_window=16),
    "gemma2-mha-binding-caps-window24": dict(
        arch="gemma2", gqa=False, sliding_window=24, attn_logit_softcapping=4.0, final_logit_softcapping=3.0
    ),
    "gemma3-window16-local-rope": dict(
        arch="gemma3_text", sliding_window=16, sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE
    ),
    "gemma3-released-config-final-cap": dict(
        arch="gemma3_text",
        num_hidden_layers=3,
        sliding_window=16,
        final_logit_softcapping=3.0,
        released=GEMMA3_RELEASED_KEYS,
    ),
}


def _step_logits(engine: LLMEngine) -> tuple[torch.Tensor, list[int]]:
    """Run one scheduled step by hand: logits of every computed row and their positions."""
    batch = engine.scheduler.schedule()
    if engine.runner.followers is not None:
        engine.runner.followers.step(batch, all_logits=True)  # the other ranks run this step's forward with us
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
    arch, engine_fields, as_llama = spec.pop("arch"), spec.pop("engine", {}), spec.pop("as_llama", False)
    released = spec.pop("released", None)
    hf_dir = save_model(tmp_path / "hf", hf_config(arch, **spec))
    if released:
        rewrite_config(hf_dir, drop=("rope_parameters", "layer_types"), **released)
    hf = load_hf(hf_dir)
    model_dir = phi3_as_llama(hf_dir, tmp_path / "llama") if as_llama else hf_dir
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


# Tensor parallelism: a case of each family over two ranks, and the ones with four KV heads over four too (one head
# each). "llama-vocab97" splits its vocabulary unevenly (49 + 48 rows).
TP_CASES = {
    "llama-mha-bias": (2, 4),
    "llama-vocab97": (2,),
    "qwen2-gqa-bias": (2,),
    "qwen3-mha-bias-tied-yarn": (2, 4),
    "mistral-gqa-window16": (2,),
    "phi3-partial-rotary": (2,),
    "gemma2-mha-binding-caps-window24": (2, 4),
    "gemma3-window16-local-rope": (2,),
}
TP_TOLERANCE = 1e-5


@pytest.mark.parametrize(("name", "world"), [(name, world) for name, worlds in TP_CASES.items() for world in worlds])
def test_tensor_parallel_logits_match_one_rank(name, world, tmp_path):
    """Split over ``world`` ranks (gloo), every prefill chunk and decode gives the one-rank engine's logits."""
    spec = dict(CASES.get(name) or dict(arch="llama", vocab_size=97))
    arch, engine_fields = spec.pop("arch"), spec.pop("engine", {})
    model_dir = save_model(tmp_path / "hf", hf_config(arch, **spec))
    prompt = torch.randint(3, 96, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = []
    for tp in (1, world):
        config = EngineConfig(
            model=str(model_dir),
            pool_bytes=4 << 20,
            max_num_batched_tokens=16,
            tensor_parallel_size=tp,
            num_threads=1,
            **engine_fields,
        )
        engine = LLMEngine(config)
        try:
            engine.add_request("chunked", prompt, SamplingParams(temperature=0.0))
            steps = [_step_logits(engine)[0] for _ in range(3)]  # 16 + 16 + 9 prompt tokens
            seq = engine.scheduler.running[0]
            for token in (5, 17, 88, 23):
                seq.token_ids.append(token)
                steps.append(_step_logits(engine)[0])
        finally:
            engine.close()
        runs.append(steps)
    for one, split in zip(*runs, strict=True):
        assert one.shape == split.shape and (one - split).abs().max().item() <= TP_TOLERANCE


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


# Phi-4-mini's shape in small: fused weights, LongRoPE (short factors up to 128 tokens), 3/4 of each head
# rotated, tied embeddings; with Phi-3-mini's sliding window, every layer, here 16 tokens.
PHI4_MINI_LIKE = dict(
    tie=True,
    partial_rotary_factor=0.75,
    original_max_position_embeddings=128,
    rope_parameters=_longrope(128, dims=6),
    sliding_window=16,
)
# A 16-token window on the first layer (every layer but Gemma's global ones), soft-capped for Gemma 2.
WINDOWED = {
    "mistral": dict(arch="mistral", sliding_window=16),
    "phi3": dict(arch="phi3", **PHI4_MINI_LIKE),
    "gemma2": dict(arch="gemma2", sliding_window=16),
    "gemma3": dict(arch="gemma3_text", sliding_window=16, sliding_window_pattern=2, rope_parameters=GEMMA3_ROPE),
}


@pytest.mark.parametrize("family", list(WINDOWED))
def test_batch_of_mixed_lengths_matches_transformers(family, tmp_path):
    """One step prefilling prompts shorter and longer than the window, then batched decodes: each request's
    logits equal transformers' on that request alone."""
    spec = dict(WINDOWED[family])
    model_dir = save_model(tmp_path, hf_config(spec.pop("arch"), **spec))
    hf = load_hf(model_dir)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 41, 16, 23)]
    continuation = [5, 17, 88]
    with torch.inference_mode():
        reference = [hf(torch.tensor([prompt + continuation])).logits[0] for prompt in prompts]
    engine = LLMEngine(EngineConfig(model=str(model_dir), pool_bytes=4 << 20))
    assert engine.runner.model.config.layer_windows[0] == 16
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0))
    logits, positions = _step_logits(engine)
    assert positions == [j for prompt in prompts for j in range(len(prompt))]  # all four in one step
    expected = torch.cat([ref[: len(prompt)] for ref, prompt in zip(reference, prompts, strict=True)])
    assert (logits - expected).abs().max().item() <= TOLERANCE
    seqs = sorted(engine.scheduler.running, key=lambda seq: int(seq.request_id))
    for step, token in enumerate(continuation):
        for seq in seqs:
            seq.token_ids.append(token)
        logits, positions = _step_logits(engine)
        rows = [len(prompt) + step for prompt in prompts]
        order = [int(seq.request_id) for seq in engine.scheduler.running]
        assert positions == [rows[i] for i in order]
        expected = torch.stack([reference[i][rows[i]] for i in order])
        assert (logits - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("family", list(WINDOWED))
def test_greedy_continuation_of_a_windowed_model_matches_transformers(family, tmp_path):
    """Tokens generated far past a 16-token window, by prompts prefilled whole and in chunks, equal transformers'."""
    spec = dict(WINDOWED[family])
    model_dir = save_model(tmp_path, hf_config(spec.pop("arch"), **spec))
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


# bf16: the plainest case of every family among CASES (every family listed in models.py has cases there).
BF16_CASES = {}
for _name, _spec in CASES.items():
    if not _spec.get("as_llama"):
        BF16_CASES.setdefault(_spec["arch"], _name)
BF16_SLACK = 1.5  # our bf16 error may be at most this multiple of transformers' own bf16 error


@pytest.mark.parametrize("name", list(BF16_CASES.values()))
def test_bf16_logits_are_as_close_to_fp32_transformers_as_its_bf16(name, tmp_path):
    """Our engine in bf16 (prefill in chunks of 16, then decodes through the paged cache) against transformers'
    fp32 logits: max and mean abs error at most 1.5x those of transformers' own bf16 forward."""
    from transformers import AutoModelForCausalLM

    spec = dict(CASES[name])
    arch, engine_fields, released = spec.pop("arch"), spec.pop("engine", {}), spec.pop("released", None)
    hf_dir = save_model(tmp_path / "hf", hf_config(arch, **spec))
    if released:
        rewrite_config(hf_dir, drop=("rope_parameters", "layer_types"), **released)
    prompt = torch.randint(3, 96, (41,), generator=torch.Generator().manual_seed(1)).tolist()
    continuation = [5, 17, 88, 23]
    tokens = torch.tensor([prompt + continuation])
    with torch.inference_mode():
        reference = load_hf(hf_dir)(tokens).logits[0]
        hf_bf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, attn_implementation="eager")
        theirs = hf_bf16.eval()(tokens).logits[0].float()

    engine = LLMEngine(
        EngineConfig(
            model=str(hf_dir), pool_bytes=4 << 20, max_num_batched_tokens=16, dtype="bfloat16", **engine_fields
        )
    )
    assert engine.runner.model.weights.embed.dtype == torch.bfloat16
    engine.add_request("chunked", prompt, SamplingParams(temperature=0.0))
    ours = torch.empty_like(reference)
    seen = []
    while len(seen) < len(prompt):
        logits, positions = _step_logits(engine)
        ours[positions] = logits
        seen += positions
    seq = engine.scheduler.running[0]
    for token in continuation:
        seq.token_ids.append(token)
        logits, positions = _step_logits(engine)
        ours[positions] = logits
    errors = {
        who: ((got - reference).abs().max().item(), (got - reference).abs().mean().item())
        for who, got in (("ours", ours), ("transformers", theirs))
    }
    report = f"{name}: bf16 max/mean abs error vs fp32 transformers: " + ", ".join(
        f"{who} {worst:.4f}/{mean:.5f}" for who, (worst, mean) in errors.items()
    )
    print(report)
    (our_max, our_mean), (their_max, their_mean) = errors["ours"], errors["transformers"]
    assert our_max <= BF16_SLACK * their_max and our_mean <= BF16_SLACK * their_mean, report


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_load_as_they_are(stored, tmp_path):
    """A bf16 or fp16 checkpoint serves in the engine's compute dtype: bf16 weights unchanged in bf16, every
    weight exact in fp32."""
    from transformers import AutoModelForCausalLM

    model_dir = save_model(tmp_path / "fp32", hf_config("llama"))
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=stored).save_pretrained(tmp_path / "half")
    stored_qkv = None
    for dtype in ("float32", "bfloat16"):
        engine = LLMEngine(EngineConfig(model=str(tmp_path / "half"), pool_bytes=1 << 20, dtype=dtype))
        qkv = engine.runner.model.weights.layers[0].qkv.dense_weight_t()
        assert qkv.dtype == getattr(torch, dtype)
        if dtype == "float32":
            stored_qkv = qkv.to(stored)
            assert torch.equal(stored_qkv.float(), qkv)  # fp32 holds every half-precision value exactly
        else:
            assert torch.equal(qkv, stored_qkv.to(torch.bfloat16))
        engine.add_request("r", list(range(3, 20)), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
