"""Greedy tokens of one mixed multi-adapter batch equal PEFT generating each request alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from server.engine import SamplingParams
from server.memory.block_manager import blocks_for
from server.offline import LLM
from tests.integration.engine.models import ALL_PROJECTIONS, hf_config, load_hf, save_adapter, save_model

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


def _peft_generate(model, prompt: list[int], adapter: str | None, max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, **kwargs)
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, **kwargs)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """A base model, six adapters, 21 requests (3 per adapter + 3 base) and PEFT's answer to each."""
    from peft import PeftModel

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
    peft_model = PeftModel.from_pretrained(load_hf(base), dirs["attn-r8"], adapter_name="attn-r8")
    for name, path in dirs.items():
        if name != "attn-r8":
            peft_model.load_adapter(path, adapter_name=name)
    peft_model.eval()
    expected = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in requests]
    return base, dirs, requests, expected


def _run(base: Path, dirs: dict[str, Path], requests, pool_bytes: int, max_tokens: int = MAX_TOKENS, **kw):
    llm = LLM(base, pool_bytes=pool_bytes, max_lora_rank=32, **kw)
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


def test_parity_holds_when_requests_are_preempted_and_resumed(case):
    base, dirs, requests, expected = case
    probe = LLM(base, pool_bytes=16 << 20, max_lora_rank=32)
    adapter_pages = 0
    for name, path in dirs.items():
        probe.load_adapter(name, path)
    adapter_pages = probe.engine.pool_stats().adapter_pages
    page_bytes = probe.engine.pool_stats().page_bytes
    longest = max(len(prompt) for prompt, _ in requests) + MAX_TOKENS
    # Room for the adapters plus about two of the longest sequences: most requests wait or get preempted.
    kv_pages = 2 * blocks_for(longest, 16) + 1
    llm, got = _run(base, dirs, requests, pool_bytes=(adapter_pages + kv_pages) * page_bytes, watermark=0.0)
    assert llm.engine.num_preemptions > 0
    assert got == expected
    stats = llm.engine.pool_stats()
    assert stats.kv_pages == 0 and stats.free_pages == stats.total_pages - stats.adapter_pages


def test_parity_with_triton_kernels(case, monkeypatch):
    """The Triton SGMV and paged-attention kernels (interpreted on CPU) give the same tokens."""
    base, dirs, requests, expected = case
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before triton is imported")
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")  # read when the engine is built, below
    subset = [0, 2, 3, 6, 8]  # attention-only, all seven, q/v, base, rank 16 MLP: every kernel path
    small_dirs = {name: dirs[name] for name in ("attn-r8", "all-r32", "qv-r2", "mlp-r16")}
    llm, got = _run(base, small_dirs, [requests[i] for i in subset], pool_bytes=16 << 20, max_tokens=4)
    assert llm.engine.runner.model.kernels.name == "triton"
    assert got == [expected[i][:4] for i in subset]


def test_windowed_base_matches_peft(tmp_path):
    """Adapters over a Mistral base with a 16-token sliding window, generating past the window, equal PEFT."""
    from peft import PeftModel

    base = save_model(tmp_path / "base", hf_config("mistral", sliding_window=16))
    names = ("all-r32", "qv-r2")
    dirs = {name: save_adapter(tmp_path / name, base, seed=i + 1, **ADAPTERS[name]) for i, name in enumerate(names)}
    gen = torch.Generator().manual_seed(4)
    requests = [
        (torch.randint(3, 96, (n,), generator=gen).tolist(), name)
        for n, name in ((30, names[0]), (41, names[1]), (20, None))
    ]
    peft_model = PeftModel.from_pretrained(load_hf(base), dirs[names[0]], adapter_name=names[0])
    peft_model.load_adapter(dirs[names[1]], adapter_name=names[1])
    peft_model.eval()
    expected = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in requests]
    _, got = _run(base, dirs, requests, pool_bytes=16 << 20, max_num_batched_tokens=16)
    assert got == expected


def test_qwen3_adapters_match_peft(tmp_path):
    """Adapters over Qwen3 (q/k norms, head_dim twice hidden / heads) equal PEFT, and change the answers."""
    from peft import PeftModel

    base = save_model(tmp_path / "base", hf_config("qwen3"))
    names = ("all-r32", "attn-r8", "qv-r2")
    dirs = {name: save_adapter(tmp_path / name, base, seed=i + 1, **ADAPTERS[name]) for i, name in enumerate(names)}
    gen = torch.Generator().manual_seed(5)
    lengths = {names[0]: 9, names[1]: 30, names[2]: 17, None: 24}
    requests = [(torch.randint(3, 96, (n,), generator=gen).tolist(), name) for name, n in lengths.items()]
    peft_model = PeftModel.from_pretrained(load_hf(base), dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(dirs[name], adapter_name=name)
    peft_model.eval()
    expected = [_peft_generate(peft_model, prompt, adapter, MAX_TOKENS) for prompt, adapter in requests]
    without = [_peft_generate(peft_model, prompt, None, MAX_TOKENS) for prompt, _ in requests]
    _, got = _run(base, dirs, requests, pool_bytes=16 << 20, max_num_batched_tokens=16)
    assert got == expected
    assert [a != b for a, b in zip(expected, without, strict=True)] == [True, True, True, False]
