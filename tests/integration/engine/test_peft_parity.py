"""Greedy tokens of one mixed multi-adapter batch equal PEFT generating each request alone."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from bench.gpu.peft_baseline import generate_one
from core.adapter_format import inspect_adapter, load_adapter_weights
from server.engine import SamplingParams
from server.engine.tenancy import Priority, Tenancy
from server.memory.block_manager import blocks_for
from server.offline import LLM
from tests.integration.engine.models import ALL_PROJECTIONS, hf_config, save_adapter, save_model

MAX_TOKENS = 12
ADAPTERS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r16": dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r32": dict(r=32, lora_alpha=32, target_modules=ALL_PROJECTIONS),
    "qv-r2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "patterns": dict(
        r=4,
        lora_alpha=8,
        target_modules=ALL_PROJECTIONS,
        rank_pattern={"layers.1.mlp.down_proj": 12, "q_proj": 6},
        alpha_pattern={"v_proj": 3},
    ),
    "rslora-regex": dict(r=16, lora_alpha=4, use_rslora=True, target_modules=r".*\.(k_proj|up_proj)"),
}


def _peft_model(base: Path, dirs: dict[str, Path], dtype: torch.dtype = torch.float32, **kw):
    """Every adapter of ``dirs`` loaded under its name into one ``PeftModel`` over ``base`` in ``dtype``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation="eager")
    (first, path), *rest = dirs.items()
    model = PeftModel.from_pretrained(hf, path, adapter_name=first, **kw)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name, **kw)
    return model.eval()


_peft_generate = generate_one  # PEFT generating one request alone, the reference every test here compares with


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A base model, six adapters, 21 requests (3 per adapter + 3 base) and PEFT's answer to each."""
    root = tmp_path_factory.mktemp("parity")
    base = save_model(root / "base", hf_config("llama"))
    dirs = {name: save_adapter(root / name, base, seed=i + 1, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    gen = torch.Generator().manual_seed(0)
    names = [*ADAPTERS, None]
    requests = []
    for i in range(21):
        length = int(torch.randint(3, 48, (1,), generator=gen))
        prompt = torch.randint(3, 96, (length,), generator=gen).tolist()
        requests.append((prompt, names[i % len(names)]))
    peft_model = _peft_model(base, dirs)
    expected = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in requests]
    return base, dirs, requests, expected


def _run(
    base: Path, dirs: dict[str, Path], requests, pool_bytes: int, max_tokens: int = MAX_TOKENS, max_lora_rank=32, **kw
):
    llm = LLM(base, pool_bytes=pool_bytes, max_lora_rank=max_lora_rank, **kw)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([(prompt, adapter, params) for prompt, adapter in requests])
    return llm, [out.outputs[0].token_ids for out in outputs]


def test_mixed_batch_matches_peft_and_adapters_matter(case):
    base, dirs, requests, expected = case
    _, got = _run(base, dirs, requests, pool_bytes=16 << 20)
    assert got == expected
    # Every adapter changes the answer: parity is not trivially met by a zero delta.
    _, without = _run(base, {}, [(prompt, None) for prompt, _ in requests], pool_bytes=16 << 20)
    for (_, adapter), tokens, base_tokens in zip(requests, got, without, strict=True):
        assert (tokens != base_tokens) == (adapter is not None)


@pytest.fixture(scope="module")
def wide_case(case, tmp_path_factory):
    """The case with adapters of rank 1 and 64 on all seven projections beside its own (ranks 1..64), and PEFT's
    answers to requests for them."""
    base, dirs, requests, expected = case
    root = tmp_path_factory.mktemp("wide")
    extra = {
        "all-r1": save_adapter(root / "r1", base, seed=11, r=1, lora_alpha=2, target_modules=ALL_PROJECTIONS),
        "all-r64": save_adapter(root / "r64", base, seed=12, r=64, lora_alpha=64, target_modules=ALL_PROJECTIONS),
    }
    more = [(requests[i][0], name) for i, name in ((0, "all-r1"), (1, "all-r64"), (2, "all-r1"), (3, "all-r64"))]
    peft_model = _peft_model(base, extra)
    answers = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in more]
    return base, {**dirs, **extra}, requests + more, expected + answers


def test_tensor_parallel_mixed_batch_matches_peft(wide_case):
    """Split over two ranks (gloo): one mixed batch of adapters of ranks 1 to 64 on every projection gives PEFT's
    greedy tokens, each rank holding its slices of the model and of every adapter."""
    base, dirs, requests, expected = wide_case
    kw = dict(max_lora_rank=64, tensor_parallel_size=2, num_threads=1)
    llm, got = _run(base, dirs, requests, pool_bytes=16 << 20, **kw)
    assert llm.engine.runner.model.config.num_kv_heads == 1  # half of the model's two
    llm.close()
    assert got == expected


@pytest.mark.parametrize("world", [1, 2])
def test_parity_holds_when_requests_are_preempted_and_resumed(case, world):
    """Also split over two tensor-parallel ranks (gloo): rank 0 preempts, every rank recomputes."""
    base, dirs, requests, expected = case
    tp = dict(tensor_parallel_size=world, num_threads=1)
    probe = LLM(base, pool_bytes=16 << 20, max_lora_rank=32, **tp)
    adapter_pages = 0
    for name, path in dirs.items():
        probe.load_adapter(name, path)
    adapter_pages = probe.engine.pool_stats().adapter_pages
    page_bytes = probe.engine.pool_stats().page_bytes  # one rank's: its share of the KV heads and adapters
    probe.close()
    longest = max(len(prompt) for prompt, _ in requests) + MAX_TOKENS
    # Room for the adapters plus about two of the longest sequences: most requests wait or get preempted.
    kv_pages = 2 * blocks_for(longest, 16) + 1
    llm, got = _run(base, dirs, requests, pool_bytes=(adapter_pages + kv_pages) * page_bytes, watermark=0.0, **tp)
    llm.close()
    assert llm.engine.num_preemptions > 0
    assert got == expected
    stats = llm.engine.pool_stats()
    assert stats.kv_pages == 0 and stats.free_pages + stats.kv_cached_pages == stats.total_pages - stats.adapter_pages


@pytest.mark.parametrize("world", [1, 2])
def test_parity_holds_under_fair_scheduling_across_tenants(case, world):
    """Tenants with weights and classes, a flood that holds every seat until quieter tenants take their share
    (fairness preemptions), short steps while decoding: the same greedy tokens as PEFT, and the pool ends empty;
    on one rank and on two (tensor parallelism)."""
    base, dirs, requests, expected = case
    llm = LLM(
        base,
        pool_bytes=16 << 20,
        max_lora_rank=32,
        max_num_seqs=4,
        step_tokens_while_decoding=24,
        tensor_parallel_size=world,
        num_threads=1,
    )
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tenancies = [Tenancy("flood")] * 8 + [Tenancy("t1", 2.0), Tenancy("t2", 0.5, Priority.BATCH), Tenancy("t3")] * 5
    got: dict[str, list[int]] = {}
    for i, ((prompt, adapter), tenancy) in enumerate(zip(requests, tenancies[: len(requests)], strict=True)):
        engine.add_request(str(i), prompt, params, adapter, tenancy=tenancy)
        if i == 7:
            engine.step()  # the flood takes every seat first
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    llm.close()
    assert [got[str(i)] for i in range(len(requests))] == expected
    assert engine.num_preemptions > 0
    stats = engine.pool_stats()
    assert stats.kv_pages == 0 and stats.free_pages + stats.kv_cached_pages == stats.total_pages - stats.adapter_pages


def test_repetition_penalty_matches_transformers_in_a_mixed_batch(case):
    """vLLM's repetition penalty is transformers' (prompt and output tokens): penalised rows equal
    ``generate(repetition_penalty=...)`` while the plain rows beside them keep their PEFT answers."""
    base, dirs, requests, expected = case
    penalty, chosen = 1.8, list(range(0, 21, 3))  # every adapter and the base model
    peft_model = _peft_model(base, dirs)
    penalised = [_peft_generate(peft_model, *requests[i], MAX_TOKENS, repetition_penalty=penalty) for i in chosen]
    assert penalised != [expected[i] for i in chosen]  # the penalty changes answers
    llm = LLM(base, pool_bytes=16 << 20, max_lora_rank=32)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    plain = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    knob = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=penalty)
    batch = [(prompt, adapter, knob if i in chosen else plain) for i, (prompt, adapter) in enumerate(requests)]
    got = [out.outputs[0].token_ids for out in llm.generate(batch)]
    assert [got[i] for i in chosen] == penalised
    assert [g for i, g in enumerate(got) if i not in chosen] == [e for i, e in enumerate(expected) if i not in chosen]


def test_parity_with_triton_kernels(case, monkeypatch):
    """The Triton SGMV and paged-attention kernels (interpreted on CPU) give the same tokens: with whole prompts, and
    with 16-token chunks, where one varlen launch per layer attends to later chunks (earlier tokens read back from
    pages) beside decode rows."""
    from loraplex_kernels import TritonBackend

    base, dirs, requests, expected = case
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported")
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")  # read when the engine is built, below
    launches: list[tuple[list[int], list[int]]] = []  # (new tokens, cached tokens) per sequence, per launch
    launch = TritonBackend.paged_attention_prefill

    def recorded(self, q, k_cache, v_cache, query_starts, query_lens, context_lens, *args):
        launches.append((query_lens.tolist(), context_lens.tolist()))
        return launch(self, q, k_cache, v_cache, query_starts, query_lens, context_lens, *args)

    monkeypatch.setattr(TritonBackend, "paged_attention_prefill", recorded)
    subset = [0, 2, 3, 6, 8]  # attention-only, all seven, q/v, base, rank 16 MLP: every kernel path
    small_dirs = {name: dirs[name] for name in ("attn-r8", "all-r32", "qv-r2", "mlp-r16")}
    for chunk in (2048, 16):
        launches.clear()
        llm, got = _run(
            base,
            small_dirs,
            [requests[i] for i in subset],
            pool_bytes=16 << 20,
            max_tokens=4,
            max_num_batched_tokens=chunk,
        )
        assert llm.engine.runner.model.kernels.name == "triton"
        assert got == [expected[i][:4] for i in subset]
        assert launches
    mixed = [(n, c) for lens, contexts in launches if 1 in lens for n, c in zip(lens, contexts, strict=True)]
    assert any(n > 1 and c > 0 for n, c in mixed)  # a later chunk and a decode row in one launch


@dataclass
class GraphLog:
    pads: list[tuple[int, int]] = field(default_factory=list)  # (decoding sequences, bucket) per step
    replays: list[bool] = field(default_factory=list)  # with LoRA, per replay


def _with_decode_graphs(llm: LLM, largest: int) -> GraphLog:
    """Give ``llm``'s runner decode graphs up to batch ``largest``, prepared but not captured (no CUDA here): every
    decode step then runs padded to its bucket over the graphs' fixed inputs."""
    from server.engine.cuda_graphs import DecodeGraphs, graph_buckets

    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.buffers, llm.engine.pool, graph_buckets(largest), 32, max_blocks=8, capture=False
    )
    graphs.capture_all()
    log, pad, replay = GraphLog(), graphs.pad, graphs.replay

    def logged_pad(num_seqs: int, bucket: int, slots: list[int]) -> None:
        log.pads.append((num_seqs, bucket))
        pad(num_seqs, bucket, slots)

    def logged_replay(bucket: int, with_lora: bool) -> torch.Tensor:
        log.replays.append(with_lora)
        return replay(bucket, with_lora)

    graphs.pad, graphs.replay = logged_pad, logged_replay
    runner.graphs = graphs
    return log


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_parity_with_decode_graphs(case, kernels, monkeypatch):
    """Decode steps padded to a graph's batch size (the CUDA graph path, run eagerly here) give PEFT's tokens: padding
    rows touch no sequence's pages, one segment per row applies each row's adapter, and base-only steps take the
    graph without LoRA. At most five sequences decode together, in graphs of 1, 2, 4 and 5: a step of 3 runs as 4."""
    base, dirs, requests, expected = case
    if kernels == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported")
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    subset = range(len(requests)) if kernels == "torch" else [0, 2, 6, 8, 9]  # triton: fewer, under the interpreter
    max_tokens = MAX_TOKENS if kernels == "torch" else 4
    llm = LLM(base, pool_bytes=16 << 20, max_lora_rank=32, max_num_seqs=5)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    free_before = llm.engine.pool_stats().free_pages
    log = _with_decode_graphs(llm, largest=5)
    assert llm.engine.pool_stats().free_pages == free_before - 1  # the padding rows' scratch page
    # Lengths that differ end sequences at different steps, so decode batches take every size.
    lengths = [max_tokens - i % 3 for i in subset]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate([(*requests[i], p) for i, p in zip(subset, params, strict=True)])
    got = [out.outputs[0].token_ids for out in outputs]
    assert got == [expected[i][:n] for i, n in zip(subset, lengths, strict=True)]
    assert len(log.replays) == len(log.pads) and any(log.replays)
    # The base model alone replays the graphs without LoRA; three sequences decode as a graph of four.
    first_base = next(i for i in subset if requests[i][1] is None)
    log.replays.clear()
    outputs = llm.generate([(requests[first_base][0], None, params[0])] * 3)
    assert [out.outputs[0].token_ids for out in outputs] == [expected[first_base][:max_tokens]] * 3
    assert log.replays and not any(log.replays)
    assert (3, 4) in log.pads


# Families beyond Llama's shape: Mistral (a 16-token window on every layer); Qwen2 (q/k/v biases, a window on the
# upper layer); Qwen3 (q/k norms, head_dim twice hidden / heads); Gemma 2 (four norms a layer, GeGLU, soft-capped
# attention and logits, every other layer in a 16-token window); Gemma 3 (q/k norms, local layers with their own
# rope base, global ones with linear scaling). Phi-3 has its own fixture below: its adapters name fused modules.
FAMILIES = {
    "mistral": dict(arch="mistral", sliding_window=16),
    "qwen2": dict(arch="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(arch="qwen3"),
    "gemma2": dict(arch="gemma2", sliding_window=16),
    "gemma3": dict(
        arch="gemma3_text",
        sliding_window=16,
        sliding_window_pattern=2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_adapters_match_peft(family, tmp_path):
    """Adapters of one mixed batch equal PEFT and change the answers; also when a small pool preempts requests."""
    spec = dict(FAMILIES[family])
    base = save_model(tmp_path / "base", hf_config(spec.pop("arch"), **spec))
    names = ("all-r32", "attn-r8", "qv-r2")
    dirs = {name: save_adapter(tmp_path / name, base, seed=i + 1, **ADAPTERS[name]) for i, name in enumerate(names)}
    gen = torch.Generator().manual_seed(5)
    lengths = {names[0]: 9, names[1]: 30, names[2]: 17, None: 24}
    requests = [(torch.randint(3, 96, (n,), generator=gen).tolist(), name) for name, n in lengths.items()]
    peft_model = _peft_model(base, dirs)
    expected = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in requests]
    without = [_peft_generate(peft_model, prompt, None, MAX_TOKENS) for prompt, _ in requests]
    llm, got = _run(base, dirs, requests, pool_bytes=16 << 20, max_num_batched_tokens=16)
    assert got == expected
    assert [a != b for a, b in zip(expected, without, strict=True)] == [True, True, True, False]
    # Room for the adapters and about one sequence: requests wait, are preempted and recomputed.
    stats = llm.engine.pool_stats()
    kv_pages = blocks_for(max(len(prompt) for prompt, _ in requests) + MAX_TOKENS, 16) + 1
    llm, got = _run(base, dirs, requests, pool_bytes=(stats.adapter_pages + kv_pages) * stats.page_bytes, watermark=0.0)
    assert llm.engine.num_preemptions > 0
    assert got == expected


PHI3_ALL = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
PHI3_ADAPTERS = {  # PEFT names Phi-3's fused modules; each becomes its projections sharing one A
    "attn-r1": dict(r=1, lora_alpha=2, target_modules=["qkv_proj", "o_proj"]),
    "mlp-r64": dict(r=64, lora_alpha=32, target_modules=["gate_up_proj", "down_proj"]),
    "all-r8-rslora": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=PHI3_ALL),
    "qkv-r16-patterns": dict(
        r=16, lora_alpha=16, target_modules=["qkv_proj", "gate_up_proj"], rank_pattern={"layers.1.mlp.gate_up_proj": 4}
    ),
}


@pytest.fixture(scope="module")
def phi3_case(tmp_path_factory):
    """A Phi-4-mini-like base (fused weights, LongRoPE, 3/4 rotary, tied, 16-token window), four adapters on its
    fused modules, ten requests (some past the window) and PEFT's answer to each."""
    root = tmp_path_factory.mktemp("phi3")
    config = hf_config(
        "phi3",
        tie=True,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0],
            "rope_theta": 10000.0,
        },
        sliding_window=16,
    )
    base = save_model(root / "base", config)
    dirs = {
        name: save_adapter(root / name, base, seed=i + 1, **kw) for i, (name, kw) in enumerate(PHI3_ADAPTERS.items())
    }
    gen = torch.Generator().manual_seed(7)
    names = [*PHI3_ADAPTERS, None]
    requests = []
    for i in range(10):
        prompt = torch.randint(3, 96, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
        requests.append((prompt, names[i % len(names)]))
    peft_model = _peft_model(base, dirs)
    expected = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in requests]
    without = [_peft_generate(peft_model, prompt, None, MAX_TOKENS) for prompt, _ in requests]
    return base, dirs, requests, expected, without


def test_phi3_fused_adapters_match_peft_in_one_batch(phi3_case):
    base, dirs, requests, expected, without = phi3_case
    _, got = _run(base, dirs, requests, pool_bytes=16 << 20, max_lora_rank=64, max_num_batched_tokens=32)
    assert got == expected
    assert [a != b for a, b in zip(expected, without, strict=True)] == [adapter is not None for _, adapter in requests]


def test_phi3_parity_holds_when_requests_are_preempted_and_resumed(phi3_case):
    base, dirs, requests, expected, _ = phi3_case
    probe = LLM(base, pool_bytes=16 << 20, max_lora_rank=64)
    for name, path in dirs.items():
        probe.load_adapter(name, path)
    adapter_pages, page_bytes = probe.engine.pool_stats().adapter_pages, probe.engine.pool_stats().page_bytes
    longest = max(len(prompt) for prompt, _ in requests) + MAX_TOKENS
    kv_pages = 2 * blocks_for(longest, 16) + 1
    llm, got = _run(
        base, dirs, requests, pool_bytes=(adapter_pages + kv_pages) * page_bytes, max_lora_rank=64, watermark=0.0
    )
    assert llm.engine.num_preemptions > 0
    assert got == expected


def _peft_logits(dtype: torch.dtype, base: Path, dirs: dict[str, Path], requests, **kw) -> list[torch.Tensor]:
    """PEFT's logits over each request's prompt, with the base model in ``dtype`` (PEFT keeps adapters in fp32)."""
    model = _peft_model(base, dirs, dtype, **kw)
    logits = []
    with torch.inference_mode():
        for prompt, adapter in requests:
            model.set_adapter(adapter)
            logits.append(model(torch.tensor([prompt])).logits[0].float())
    return logits


def test_bf16_adapter_logits_are_as_close_to_peft_fp32_as_peft_bf16(case):
    """One bf16 step prefilling a request per adapter (the C loop reading the bf16 arena) against PEFT's fp32
    logits: max and mean abs error at most 1.5x those of PEFT in bf16 (base and adapters)."""
    from server.engine import EngineConfig, LLMEngine
    from tests.integration.engine.test_model_parity import BF16_SLACK, _step_logits

    base, dirs, requests, _ = case
    requests = [(prompt, adapter) for prompt, adapter in requests if adapter is not None][: len(dirs)]
    assert sorted(adapter for _, adapter in requests) == sorted(dirs)
    reference = torch.cat(_peft_logits(torch.float32, base, dirs, requests))
    # PEFT over a bf16 base keeps its adapters in fp32 unless told not to; ours live in the bf16 arena.
    theirs = torch.cat(_peft_logits(torch.bfloat16, base, dirs, requests, autocast_adapter_dtype=False))
    fp32_adapters = torch.cat(_peft_logits(torch.bfloat16, base, dirs, requests))
    engine = LLMEngine(EngineConfig(model=str(base), pool_bytes=8 << 20, max_lora_rank=32, dtype="bfloat16"))
    for name, path in dirs.items():
        spec = inspect_adapter(path, engine.model_config.base_shapes(), 32)
        engine.load_adapter(name, load_adapter_weights(spec))
    assert engine.pool.arena.dtype == torch.bfloat16
    for i, (prompt, adapter) in enumerate(requests):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0), adapter)
    logits, positions = _step_logits(engine)
    assert positions == [j for prompt, _ in requests for j in range(len(prompt))]  # every request in one step
    errors = {
        who: ((got - reference).abs().max().item(), (got - reference).abs().mean().item())
        for who, got in (("ours", logits), ("PEFT", theirs), ("PEFT with fp32 adapters", fp32_adapters))
    }
    report = "bf16 max/mean abs error vs PEFT fp32: " + ", ".join(
        f"{who} {worst:.4f}/{mean:.5f}" for who, (worst, mean) in errors.items()
    )
    print(report)
    (our_max, our_mean), (their_max, their_mean) = errors["ours"], errors["PEFT"]
    assert our_max <= BF16_SLACK * their_max and our_mean <= BF16_SLACK * their_mean, report


# ----- prefix caching: same greedy tokens with and without it; pages shared only under the same adapter weights ----


def _waves(llm: LLM, waves, max_tokens: int = MAX_TOKENS, n: int = 1) -> tuple[list[list[int]], list[int]]:
    """Run each wave of ``(prompt, adapter)`` to completion before the next (so later waves find earlier pages);
    the greedy tokens of every request and the prompt tokens each found cached, in order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)
    tokens, cached = [], []
    for wave in waves:
        for out in llm.generate([(prompt, adapter, params) for prompt, adapter in wave]):
            tokens.append([t for c in out.outputs for t in c.token_ids])
            cached.append(out.num_cached_tokens)
    return tokens, cached


def _prefixed(seed: int, prefix_len: int = 37, suffix_lens=(5, 9, 14)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 96, (prefix_len,), generator=gen).tolist()
    return [prefix + torch.randint(3, 96, (n,), generator=gen).tolist() for n in suffix_lens]


def _llm(base: Path, dirs: dict[str, Path], names, **kw) -> LLM:
    llm = LLM(base, pool_bytes=kw.pop("pool_bytes", 16 << 20), max_lora_rank=32, **kw)
    for name in names:
        llm.load_adapter(name, dirs[name])
    return llm


@pytest.mark.parametrize("world", [1, 2])
def test_prefix_cache_keeps_greedy_tokens_and_never_crosses_adapters(case, world):
    """One prompt prefix under adapter X (k/v carry LoRA), adapter Y and the base, interleaved over waves: the
    tokens equal those without caching (also with 16-token chunks), and only the same adapter finds the pages;
    also over two tensor-parallel ranks, where rank 0 shares the pages every rank computed."""
    base, dirs, _, _ = case
    x, y = "attn-r8", "all-r32"
    p = _prefixed(11)
    waves = [[(p[0], x)], [(p[0], y), (p[0], None), (p[1], x)], [(p[2], None), (p[1], y), (p[2], x)]]
    off, off_cached = _waves(_llm(base, dirs, (x, y), enable_prefix_caching=False), waves)
    assert off_cached == [0] * 7
    for kw in ({}, {"max_num_batched_tokens": 16}):
        llm = _llm(base, dirs, (x, y), tensor_parallel_size=world, num_threads=1, **kw)
        on, cached = _waves(llm, waves)
        llm.close()
        assert on == off
        # Wave 2: Y and the base miss X's pages; X finds its two full prefix pages. Wave 3: everyone hits.
        assert cached == [0, 0, 0, 32, 32, 32, 32]
        stats = llm.engine.prefix_cache_stats()
        assert stats.hit_tokens == 4 * 32 and stats.queried_tokens == sum(len(q) for w in waves for q, _ in w)
    assert len({tuple(t) for t in on[1:4]}) == 3  # the three owners really answer differently


def test_prefix_cache_parity_when_requests_are_preempted_and_resumed(case):
    base, dirs, _, _ = case
    names = ("attn-r8", "all-r32")
    prompts = _prefixed(12, prefix_len=40, suffix_lens=(3, 8, 20, 30, 6, 11))
    requests = [(prompt, names[i % 2] if i % 3 else None) for i, prompt in enumerate(prompts)]
    waves = [requests[:2], requests]
    off, _ = _waves(_llm(base, dirs, names, enable_prefix_caching=False), waves)
    probe = _llm(base, dirs, names).engine.pool_stats()
    kv_pages = 2 * blocks_for(max(len(p) for p in prompts) + MAX_TOKENS, 16) + 1
    llm = _llm(base, dirs, names, pool_bytes=(probe.adapter_pages + kv_pages) * probe.page_bytes, watermark=0.0)
    on, cached = _waves(llm, waves)
    assert llm.engine.num_preemptions > 0 and sum(cached) > 0
    assert on == off
    stats = llm.engine.pool_stats()
    assert stats.kv_pages == 0 and stats.free_pages + stats.kv_cached_pages == stats.total_pages - stats.adapter_pages
    llm.engine.flush_prefix_cache()
    assert llm.engine.pool_stats().free_pages == stats.total_pages - stats.adapter_pages


def test_prefix_cache_after_eviction_reload_and_replacement_under_the_same_name(case):
    """Evicting an adapter drops its cached pages; reloaded, it recomputes and matches. Replaced by other weights
    under the same name while a twin of the old weights keeps their pages cached, it never hits them."""
    base, dirs, _, _ = case
    prompt = _prefixed(13)[2]
    reference = _llm(base, dirs, ("attn-r8", "qv-r2"), enable_prefix_caching=False)
    want_x, _ = _waves(reference, [[(prompt, "attn-r8")]])
    want_q, _ = _waves(reference, [[(prompt, "qv-r2")]])
    llm = _llm(base, dirs, ())
    llm.load_adapter("x", dirs["attn-r8"])
    assert _waves(llm, [[(prompt, "x")], [(prompt, "x")]]) == (want_x * 2, [0, 48])
    llm.unload_adapter("x")
    assert llm.engine.pool_stats().kv_cached_pages == 0
    llm.load_adapter("x", dirs["attn-r8"])
    assert _waves(llm, [[(prompt, "x")]]) == (want_x, [0])
    llm.load_adapter("twin", dirs["attn-r8"])  # same weights: same identity, so it may share x's pages
    assert _waves(llm, [[(prompt, "twin")]]) == (want_x, [48])
    llm.unload_adapter("x")
    assert llm.engine.pool_stats().kv_cached_pages > 0  # kept: the twin still computes exactly these K/V
    llm.load_adapter("x", dirs["qv-r2"])  # other weights under the old name
    assert _waves(llm, [[(prompt, "x")], [(prompt, "twin")]]) == (want_q + want_x, [0, 48])


def test_prefix_cache_shares_the_prompt_between_the_n_completions(case):
    base, dirs, _, _ = case
    prompt = _prefixed(14)[1]
    llm = _llm(base, dirs, ("all-r32",))
    (tokens,), (cached,) = _waves(llm, [[(prompt, "all-r32")]], n=3)
    (single,), _ = _waves(_llm(base, dirs, ("all-r32",), enable_prefix_caching=False), [[(prompt, "all-r32")]])
    assert tokens == single * 3 and cached == 0  # completion 0 computed the prompt ...
    assert llm.engine.prefix_cache_stats().hit_tokens == 2 * 32  # ... and completions 1 and 2 shared its pages


def test_prefix_cache_with_triton_kernels(case, monkeypatch):
    """The Triton decode kernel reads shared pages (interpreted on CPU) and gives the same tokens."""
    base, dirs, _, _ = case
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported")
    prompt = _prefixed(15)[0]
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    want, _ = _waves(_llm(base, dirs, ("attn-r8",), enable_prefix_caching=False), [[(prompt, "attn-r8")]], 4)
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    llm = _llm(base, dirs, ("attn-r8",))
    assert llm.engine.runner.model.kernels.name == "triton"
    assert _waves(llm, [[(prompt, "attn-r8")], [(prompt, "attn-r8")]], 4) == (want * 2, [0, 32])
