"""A pool that holds three adapters serves twelve under concurrent load: adapters are loaded, evicted and
reloaded behind the requests' backs, and every request gets exactly the tokens it gets when served alone.
Among tenants, the one holding more than its share of the pool gives an adapter back first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from core.descriptor import AdapterDescriptor
from core.protocol import ADAPTER_FIELD, TENANT_FIELD
from core.storage import S3ObjectStore
from server.adapters.sources import descriptor_key
from server.config import ServerConfig
from server.engine import SamplingParams
from server.offline import LLM
from tests.integration.server.adapters import upload, variant
from tests.integration.server.harness import running, server_config

NUM_ADAPTERS = 12
RESIDENT = 3
CLIENTS = 8
MAX_TOKENS = 6
PROMPTS = ["Tell me a story", "1 2 3 4"]
KV_PAGES = 24  # room for CLIENTS requests of two pages each, and some to spare


@pytest.fixture(scope="module")
def adapter_dirs(peft_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("twelve")
    return [variant(peft_dir, root / f"a{i}", seed=100 + i) for i in range(NUM_ADAPTERS)]


@pytest.fixture(scope="module")
def alone(tiny_model_dir: Path, adapter_dirs: list[Path]) -> tuple[dict[tuple[int, str], list[int]], int, int]:
    """Each (adapter, prompt) generated alone by an offline engine; and the pages one adapter and one page take."""
    llm = LLM(tiny_model_dir, pool_bytes=4 << 20, max_model_len=256, num_threads=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {}
    for i, directory in enumerate(adapter_dirs):
        llm.load_adapter("a", directory)
        pages = llm.engine.adapters.resident["a"].num_pages
        for prompt in PROMPTS:
            (out,) = llm.generate([(prompt, "a", params)])
            tokens[(i, prompt)] = out.outputs[0].token_ids
        llm.unload_adapter("a")
    return tokens, pages, llm.engine.pool_stats().page_bytes


def pool_of_three(
    tiny_model_dir: Path, alone: tuple[object, int, int], adapter_dir: Path | None = None, world: int = 1
) -> tuple[ServerConfig, int]:
    """A server whose pool holds RESIDENT adapters and KV_PAGES pages of KV, its engine in a process of its own
    as `loraplex server` runs it: loads, evictions and the pool view all cross the pipe. Over ``world``
    tensor-parallel ranks, each rank's pool is sized by its own pages (its slices of the KV heads and adapters).
    Returns the config and the pages one adapter takes."""
    _, adapter_pages, page_bytes = alone
    if world > 1:
        with LLM(tiny_model_dir, pool_bytes=4 << 20, max_model_len=256, tensor_parallel_size=world) as probe:
            probe.load_adapter("a", adapter_dir)
            adapter_pages = probe.engine.adapters.resident["a"].num_pages
            page_bytes = probe.engine.pool_stats().page_bytes
    config = server_config(
        tiny_model_dir,
        max_model_len=256,
        pool_bytes=(RESIDENT * adapter_pages + KV_PAGES) * page_bytes,
        max_resident_adapters=RESIDENT,
        engine_process=True,
        tensor_parallel_size=world,
    )
    return config, adapter_pages


@pytest.mark.parametrize("world", [1, 2])
def test_twelve_adapters_through_a_pool_of_three(tiny_model_dir, adapter_dirs, alone, s3_store: S3ObjectStore, world):
    """Also with the model and every adapter split over two tensor-parallel ranks: rank 0 evicts and places,
    rank 1 writes its slices where rank 0 put them, and every answer is still the one-rank engine's."""
    expected, _, _ = alone
    assert len({tuple(t) for t in expected.values()}) > NUM_ADAPTERS  # the adapters really differ
    config, adapter_pages = pool_of_three(tiny_model_dir, alone, adapter_dirs[0], world)
    with running(config, s3_store) as server:
        base = server.runtime.base_name
        descriptors: list[AdapterDescriptor] = [upload(s3_store, d, base) for d in adapter_dirs]
        client = server.client()

        def ask(job: tuple[int, str, bool]) -> list[int]:
            i, prompt, stream = job
            args = dict(model=descriptors[i].name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            body = {ADAPTER_FIELD: descriptors[i].model_dump(), "ignore_eos": True, "return_token_ids": True}
            if not stream:
                return client.completions.create(**args, extra_body=body).choices[0].token_ids
            chunks = client.completions.create(**args, stream=True, extra_body=body)
            return [t for chunk in chunks for choice in chunk.choices for t in choice.token_ids]

        # Interleaved so consecutive requests name different adapters: the pool must keep swapping.
        jobs = [(i, prompt, (i + k) % 2 == 0) for k, prompt in enumerate(PROMPTS) for i in range(NUM_ADAPTERS)]
        jobs += [(i, PROMPTS[0], False) for i in reversed(range(NUM_ADAPTERS))]
        with ThreadPoolExecutor(CLIENTS) as pool:
            results = list(pool.map(ask, jobs))
        for (i, prompt, _), tokens in zip(jobs, results, strict=True):
            assert tokens == expected[(i, prompt)], f"adapter {i}, prompt {prompt!r}"

        metrics = server.metrics()
        assert metrics.value("loraplex_adapter_loads_total", tier="store") == NUM_ADAPTERS  # each downloaded once
        loads = metrics.value("loraplex_adapter_loads_total", tier="store") + metrics.value(
            "loraplex_adapter_loads_total", tier="host"
        )
        evictions = metrics.value("loraplex_adapter_evictions_total", reason="pressure")
        assert evictions >= NUM_ADAPTERS - RESIDENT
        assert loads - evictions == metrics.value("loraplex_adapters_resident", tier="pool") <= RESIDENT
        assert metrics.value("loraplex_pool_pages", kind="adapter") <= RESIDENT * adapter_pages
        assert metrics.value("loraplex_pool_pages", kind="kv") == 0
        assert metrics.value("loraplex_adapters_resident", tier="host") == NUM_ADAPTERS


def test_the_tenant_above_its_share_of_the_pool_is_evicted_first(tiny_model_dir, adapter_dirs, alone, s3_store):
    """Tenant B's adapter is the idlest, so recency alone would evict it; but tenant A holds two of the three
    adapters (twice B's pages, its fair share being half), so A's idler adapter makes room for B's next."""
    with running(pool_of_three(tiny_model_dir, alone)[0], s3_store) as server:
        base = server.runtime.base_name
        b0, a0, a1, b1 = (upload(s3_store, adapter_dirs[i], base) for i in range(4))
        client = server.client()

        def ask(tenant: str, descriptor: AdapterDescriptor) -> None:
            body = {ADAPTER_FIELD: descriptor.model_dump(), TENANT_FIELD: {"id": tenant}, "ignore_eos": True}
            client.completions.create(model=descriptor.name, prompt="1 2", max_tokens=2, extra_body=body)

        for tenant, descriptor in (("b", b0), ("a", a0), ("a", a1), ("b", b1)):
            ask(tenant, descriptor)
        resident = set(server.runtime.loop.view.tiers.resident)  # published after every step
        assert resident == {descriptor_key(d) for d in (b0, a1, b1)}, resident
