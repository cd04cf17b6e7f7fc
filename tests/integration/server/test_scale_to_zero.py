"""Idle adapters leave the pool after ``--adapter-idle-ttl`` (their pages go back to KV), then host RAM after
``--host-idle-ttl`` (scale to zero); the next request reloads them transparently, with the same tokens.
Pinned adapters are exempt until unpinned."""

from __future__ import annotations

from pathlib import Path

from core.protocol import ADAPTER_FIELD, STATS_FIELD
from core.storage import S3ObjectStore
from tests.integration.server.adapters import copy_adapter, upload, variant
from tests.integration.server.harness import Metrics, running, server_config, wait_until

POOL_TTL_S = 0.5
HOST_TTL_S = 2.0


def test_idle_adapters_scale_to_zero_and_come_back(tiny_model_dir: Path, peft_dir: Path, tmp_path: Path,
                                                   s3_store: S3ObjectStore) -> None:  # fmt: skip
    config = server_config(tiny_model_dir, adapter_idle_ttl=POOL_TTL_S, host_idle_ttl=HOST_TTL_S)
    with running(config, s3_store) as server:
        adapter = upload(s3_store, variant(peft_dir, tmp_path / "a", seed=11), server.runtime.base_name)
        client = server.client()

        def ask() -> tuple[list[int], dict]:
            out = client.completions.create(
                model=adapter.name, prompt="Scale to zero", max_tokens=6, temperature=0,
                extra_body={ADAPTER_FIELD: adapter.model_dump(), "ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            return out.choices[0].token_ids, getattr(out, STATS_FIELD)

        tokens, stats = ask()
        assert stats["cold_start"] is True
        first = server.metrics()
        total = sum(first.value("loraplex_pool_pages", kind=k) for k in ("kv", "kv_cached", "adapter", "free"))
        assert first.value("loraplex_adapter_loads_total", tier="store") == 1

        def out_of_pool() -> Metrics | None:
            m = server.metrics()
            return m if m.value("loraplex_adapters_resident", tier="pool") == 0 else None

        idle = wait_until(out_of_pool, "the idle adapter to leave the pool")
        assert idle.value("loraplex_adapter_evictions_total", reason="idle") == 1
        assert idle.value("loraplex_pool_pages", kind="adapter") == 0
        # Every page is KV's again, free: the adapter took the KV pages cached under it along.
        assert idle.value("loraplex_pool_pages", kind="free") == total

        again, stats = ask()
        assert again == tokens and stats["cold_start"] is True
        reloaded = server.metrics()
        loads = reloaded.value("loraplex_adapter_loads_total", tier="store") + reloaded.value(
            "loraplex_adapter_loads_total", tier="host"
        )
        assert loads == 2

        def out_of_ram() -> Metrics | None:
            m = server.metrics()
            gone = m.value("loraplex_adapters_resident", tier="host") == 0
            return m if gone and m.value("loraplex_adapters_resident", tier="pool") == 0 else None

        zero = wait_until(out_of_ram, "the adapter to leave host RAM too")
        assert zero.value("loraplex_adapter_evictions_total", reason="host_idle") >= 1
        assert server.runtime.replica_status().host_adapters == []
        downloads = zero.value("loraplex_adapter_loads_total", tier="store")

        last, stats = ask()
        assert last == tokens and stats["cold_start"] is True
        assert server.metrics().value("loraplex_adapter_loads_total", tier="store") == downloads + 1

        # The audit trail holds each step, for this adapter's bytes, caused by a request each time it loaded.
        events = [e for e in server.runtime.audit.take() if e.adapter_id == adapter.id]
        replica = server.runtime.config.replica_id
        assert {(e.sha256, e.adapter_name, e.replica) for e in events} == {(adapter.sha256, adapter.name, replica)}
        steps = [(e.action, e.tier, e.reason) for e in events]
        verified, loaded, idle = ("verify", "store", "ok"), ("load", "store", "request"), ("evict", "pool", "idle")
        assert steps[:3] == [verified, loaded, idle]
        # The second request found it in host RAM, unless host RAM had let it go already.
        assert steps[3:-3] in ([("load", "host", "request"), idle], [verified, loaded, idle])
        assert steps[-3:] == [("evict", "host", "host_idle"), verified, loaded]
        loads = [e for e in events if e.action == "load"]
        assert len(loads) == 3 and all(e.cause and e.cause.startswith("request:cmpl-") for e in loads)
        assert len({e.cause for e in loads}) == 3


def test_pinned_adapters_stay_until_unpinned(tiny_model_dir: Path, peft_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    copy_adapter(peft_dir, root / "pinned")
    variant(peft_dir, root / "loose", seed=12)
    config = server_config(tiny_model_dir, adapter_root=root, adapter_idle_ttl=POOL_TTL_S, host_idle_ttl=HOST_TTL_S)
    with running(config) as server, server.http() as http:
        for name in ("pinned", "loose"):
            body = {"lora_name": name, "lora_path": name, "pinned": name == "pinned"}
            assert http.post("/v1/load_lora_adapter", json=body).status_code == 200

        def settled() -> Metrics | None:
            m = server.metrics()
            host_gone = m.value("loraplex_adapter_evictions_total", reason="host_idle") >= 1
            return m if host_gone and m.value("loraplex_adapters_resident", tier="host") == 1 else None

        # The unpinned one leaves the pool, then host RAM; the pinned one stays in both.
        metrics = wait_until(settled, "the unpinned adapter to scale to zero")
        assert metrics.value("loraplex_adapters_resident", tier="pool") == 1
        assert metrics.value("loraplex_adapter_evictions_total", reason="idle") == 1

        unpin = {"lora_name": "pinned", "lora_path": "pinned", "pinned": False}
        assert http.post("/v1/load_lora_adapter", json=unpin).status_code == 200
        wait_until(
            lambda: server.metrics().value("loraplex_adapters_resident", tier="pool") == 0, "the unpinned adapter to go"
        )
