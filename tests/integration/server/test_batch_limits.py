"""``--max-adapters-per-batch``: a request for another adapter waits, even though that adapter is resident, while
requests for the adapters already running (and for the base model) keep being admitted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integration.server.adapters import copy_adapter, variant
from tests.integration.server.harness import running, server_config, wait_until


def test_a_second_adapter_waits_for_the_first_to_leave_the_batch(tiny_model_dir: Path, peft_dir: Path, tmp_path: Path):
    root = tmp_path / "adapters"
    copy_adapter(peft_dir, root / "first")
    variant(peft_dir, root / "second", seed=3)
    config = server_config(
        tiny_model_dir, adapter_root=root, max_model_len=2048, max_resident_adapters=4, max_adapters_per_batch=1
    )
    with running(config) as server, server.http() as http:
        for name in ("first", "second"):
            assert http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name}).status_code == 200
        client = server.client()
        stream = client.completions.create(
            model="first", prompt="long", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        with ThreadPoolExecutor(1) as pool:
            second = pool.submit(client.completions.create, model="second", prompt="hi", max_tokens=3)
            wait_until(lambda: server.metrics().value("loraplex_requests_waiting") == 1, "the second adapter to queue")
            # Its own adapter and the base model are not held back.
            assert client.completions.create(model="first", prompt="hi", max_tokens=3).usage.completion_tokens == 3
            base = client.completions.create(model=server.runtime.base_name, prompt="hi", max_tokens=3)
            assert base.usage.completion_tokens == 3
            assert not second.done() and server.metrics().value("loraplex_requests_waiting") == 1
            stream.close()  # the first adapter leaves the batch
            assert second.result(timeout=120).usage.completion_tokens == 3
