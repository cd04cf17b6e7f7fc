"""Adapter metadata at scale: bytes per known adapter, and the engine thread's adapter work per step as the
number of adapters a server has seen grows.

- **Registry**: the server's memory per registered adapter (tracemalloc, Python objects) after registering
  10,000 descriptors the way proxied completion requests register them, and the time to list them all.
- **Host tier**: the adapter manager's bookkeeping per adapter that has passed through the pool and waits in
  host RAM (entries, LRU nodes, plan objects; the packed weights themselves are counted apart, as bytes).
- **Per step**: ``AdapterManager.tick()`` and the tier snapshot, which the engine loop runs around every step,
  timed with N adapters known to the host tier, N = 10 ... 10,000. With a pool of ``--resident`` adapters it
  should not grow with N.
- **Pool tables**: the LoRA row tables' bytes per slot (fixed at start-up by ``--max-adapters``; registered
  adapters never touch them).

Run: ``python bench/adapter_registry.py [--known 10 1000 10000] [--registered 10000]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import adapter_dir_name, make_adapters
from core.descriptor import AdapterDescriptor
from core.projections import NUM_PROJECTIONS
from core.tiny_model import TinyModelSpec, make_tiny_model
from loraplex_kernels import LoraTables
from server.adapters.fetch import AdapterFetcher
from server.adapters.host_cache import HostCache
from server.adapters.manager import AdapterLimits, AdapterManager
from server.adapters.registry import AdapterRegistry
from server.adapters.sources import LocalSource, local_key
from server.engine import LLMEngine
from server.engine.config import EngineConfig
from server.metrics import ServerMetrics

BASE = "base"


def descriptor(i: int) -> AdapterDescriptor:
    """A stored adapter as the control plane describes it: 97 tenants' fine-tunes of the same base."""
    tenant, adapter_id = f"tenant-{i % 97}", f"adapter-{i:08x}"
    return AdapterDescriptor(
        id=adapter_id,
        name=f"ft:{BASE}:{tenant}:run-{i}",
        base_model=BASE,
        storage_prefix=f"adapters/{tenant}/{adapter_id}/",
        sha256=f"{i:064x}",
        config_sha256=f"{i + 1:064x}",
        rank=16,
    )


def registry_figures(count: int) -> tuple[float, float]:
    """Bytes per registered adapter, and milliseconds to list ``count`` of them."""
    registry = AdapterRegistry(BASE, None)
    # Built before measuring: the API sends these with each request, the server only keeps them.
    descriptors = [descriptor(i) for i in range(count)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for described in descriptors:
        registry.register_descriptor(described)
    per_adapter = (tracemalloc.get_traced_memory()[0] - before) / count
    tracemalloc.stop()
    started = time.perf_counter()
    listed = registry.adapters()
    list_ms = 1e3 * (time.perf_counter() - started)
    assert len(listed) == count
    return per_adapter, list_ms


class Bench:
    """A tiny engine and the server's adapter manager, driven on this thread as the engine loop drives them."""

    def __init__(self, workdir: Path, resident: int) -> None:
        model = make_tiny_model(workdir / "base", TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=1, seed=0))
        root = workdir / "adapters"
        root.mkdir()
        make_adapters(model, root, 1)  # every registration loads this directory under a key of its own
        self.path = root / adapter_dir_name(0)
        self.engine = LLMEngine(EngineConfig(model=str(model), pool_bytes=64 << 20, max_lora_rank=8,
                                             max_adapters=resident))  # fmt: skip
        fetcher = AdapterFetcher(None, self.engine.model_config.base_shapes(), 8, workdir / "scratch", root)
        self.host = HostCache(16 << 30, idle_ttl=3600.0)
        self.inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        limits = AdapterLimits(max_resident=resident, pool_idle_ttl=3600.0, reserve_pages=0)
        self.manager = AdapterManager(self.engine, fetcher, self.host, limits, ServerMetrics(), self.inbox.put)
        self.known = 0

    def learn(self, count: int) -> None:
        """Load adapters until ``count`` have passed through the pool (the rest wait in host RAM)."""
        pending = 0

        def done(_error: object) -> None:
            nonlocal pending
            pending -= 1

        while self.known < count:
            key = local_key("bench", self.known)
            self.known += 1
            pending += 1
            self.manager.want(key, LocalSource("bench", self.path.name, self.path), done, time.monotonic())
            while pending > 8 or (self.known == count and pending):  # a few loads in flight, like real traffic
                self.inbox.get()()
                self.manager.tick(time.monotonic())

    def tick_us(self, rounds: int) -> float:
        """Median microseconds of the adapter work the engine loop does around every step: ``tick``, then the
        tier snapshot it publishes for metrics and heartbeats."""
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            self.manager.tick(time.monotonic())
            self.manager.snapshot()
            times.append(time.perf_counter() - started)
        return 1e6 * statistics.median(times)

    def close(self) -> None:
        self.manager.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--known", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--registered", type=int, default=10000)
    parser.add_argument("--resident", type=int, default=32, help="adapters the pool holds")
    parser.add_argument("--rounds", type=int, default=2000, help="ticks timed per count")
    args = parser.parse_args()

    per_adapter, list_ms = registry_figures(args.registered)
    print(f"registry: {per_adapter:.0f} bytes per registered adapter at {args.registered:,}; "
          f"listing them all: {list_ms:.1f} ms")  # fmt: skip

    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-registry-"))
    bench = Bench(workdir, args.resident)
    try:
        for layers, rank in ((8, 32), (32, 64)):
            slot = LoraTables.empty(1, layers, rank, num_projections=NUM_PROJECTIONS)
            slot_bytes = sum(t.nbytes for t in (slot.a_rows, slot.b_rows, slot.ranks, slot.scales))
            print(f"pool tables: {slot_bytes / 1024:.0f} KiB per slot for {layers} layers up to rank {rank} "
                  "(slots are fixed at start-up; registering adapters adds none)")  # fmt: skip
        print(f"{'adapters known':>15} {'step work (us)':>15} {'host entries':>13} {'metadata B/adapter':>19} "
              f"{'packed KiB/adapter':>19}")  # fmt: skip
        for count in sorted(args.known):
            gc.collect()
            tracemalloc.start()
            before, known_before = tracemalloc.get_traced_memory()[0], bench.known
            bench.learn(count)
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            learned = max(1, bench.known - known_before)
            packed = bench.host.nbytes / max(1, len(bench.host.keys()))
            print(f"{count:>15,} {bench.tick_us(args.rounds):>15.1f} {len(bench.host.keys()):>13,} "
                  f"{grown / learned:>19.0f} {packed / 1024:>19.1f}")  # fmt: skip
    finally:
        bench.close()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
