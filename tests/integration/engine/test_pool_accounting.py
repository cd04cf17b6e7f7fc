"""Adapters and KV share one pool: loading shrinks KV capacity by exactly the adapter's pages."""

from __future__ import annotations

from server.engine import SamplingParams
from server.offline import LLM
from tests.integration.engine.models import ALL_PROJECTIONS, hf_config, save_adapter, save_model


def test_adapter_pages_come_out_of_kv_capacity_and_go_back(tmp_path):
    base = save_model(tmp_path / "base", hf_config("llama", num_hidden_layers=4))
    r8 = save_adapter(tmp_path / "r8", base, seed=1, r=8, lora_alpha=8, target_modules=ALL_PROJECTIONS)
    r32 = save_adapter(tmp_path / "r32", base, seed=2, r=32, lora_alpha=32, target_modules=ALL_PROJECTIONS)
    llm = LLM(base, pool_bytes=8 << 20, max_lora_rank=32)
    engine = llm.engine
    empty = engine.pool_stats()
    assert empty.adapter_pages == 0 and empty.kv_capacity_pages == empty.total_pages == empty.free_pages

    llm.load_adapter("r8", r8)
    pages_r8 = engine.adapters.resident["r8"].num_pages
    after_r8 = engine.pool_stats()
    assert after_r8.kv_capacity_pages == empty.kv_capacity_pages - pages_r8
    assert after_r8.free_pages == empty.free_pages - pages_r8 and after_r8.adapter_pages == pages_r8

    llm.load_adapter("r32", r32)
    pages_r32 = engine.adapters.resident["r32"].num_pages
    both = engine.pool_stats()
    assert both.kv_capacity_pages == empty.kv_capacity_pages - pages_r8 - pages_r32
    assert 0.2 <= pages_r8 / pages_r32 <= 0.3  # unpadded ranks: about a quarter

    # While requests run, every page is accounted for exactly once.
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i, adapter in enumerate(["r8", "r32", None]):
        engine.add_request(str(i), list(range(3, 40 + 10 * i)), params, adapter)
    engine.step()
    running = engine.pool_stats()
    assert running.kv_pages > 0
    assert running.free_pages + running.kv_pages + running.adapter_pages == running.total_pages
    while engine.has_unfinished_requests():
        engine.step()

    # Finished requests leave their full pages cached; an adapter leaving the pool takes its cached pages along.
    done = engine.pool_stats()
    assert done.kv_pages == 0 and done.kv_cached_pages > 0
    assert done.free_pages + done.kv_cached_pages + done.adapter_pages == done.total_pages
    llm.unload_adapter("r32")
    assert engine.pool_stats().kv_cached_pages < done.kv_cached_pages
    assert engine.flush_prefix_cache() > 0
    assert engine.pool_stats() == after_r8
    llm.unload_adapter("r8")
    assert engine.pool_stats() == empty
