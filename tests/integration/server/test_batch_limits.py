"""``--max-adapters-per-batch``: a request for another adapter waits, even though that adapter is resident, while
the base model is never held back; once another adapter waits, the running one's turn ends (``--adapter-turn-steps``)
and its new requests queue behind the waiting adapter instead of keeping the seat forever."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.integration.server.adapters import copy_adapter, variant
from tests.integration.server.harness import NO_EOS, running, server_config, wait_until


def test_adapters_take_turns_for_the_one_seat(tiny_model_dir: Path, peft_dir: Path, tmp_path: Path):
    root = tmp_path / "adapters"
    copy_adapter(peft_dir, root / "first")
    variant(peft_dir, root / "second", seed=3)
    config = server_config(
        tiny_model_dir,
        adapter_root=root,
        max_model_len=2048,
        max_resident_adapters=4,
        max_adapters_per_batch=1,
        adapter_turn_steps=1,
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
        done_at: dict[str, float] = {}

        def complete(name: str) -> int:
            tokens = client.completions.create(
                model=name, prompt="hi", max_tokens=3, extra_body=NO_EOS
            ).usage.completion_tokens
            done_at[name] = time.monotonic()
            return tokens

        waiting = lambda: server.metrics().value("loraplex_requests_waiting")  # noqa: E731
        with ThreadPoolExecutor(2) as pool:
            second = pool.submit(complete, "second")
            wait_until(lambda: waiting() == 1, "the second adapter to queue")
            # The base model is not held back.
            base = client.completions.create(
                model=server.runtime.base_name, prompt="hi", max_tokens=3, extra_body=NO_EOS
            )
            assert base.usage.completion_tokens == 3
            # The first adapter's turn is over while the second waits: its new request queues too.
            again = pool.submit(complete, "first")
            wait_until(lambda: waiting() == 2, "the first adapter's new request to queue")
            assert not second.done() and not again.done()
            stream.close()  # the first adapter's running request leaves the batch
            assert second.result(timeout=120) == 3 and again.result(timeout=120) == 3
            assert done_at["second"] < done_at["first"]  # the adapter that waited longer went first
