"""Serving benchmark: our server against transformers + PEFT (one batch per adapter), same HTTP load, same run.

Workload: a random-init Llama (``core.tiny_model``), M PEFT adapters (ranks 8/16/32 on all seven
projections, non-zero B), and N streaming clients in a closed loop over one seeded request sequence:
adapters drawn with Zipf popularity, prompt and output lengths drawn uniformly from ranges, greedy
decoding with ``ignore_eos`` so both servers produce exactly the requested tokens. Systems, one at a
time on the same cores:

  ours  ``loraplex server``, adapters under ``--adapter-root`` loaded on demand into a pool that holds
        fewer than M of them (so cold loads and evictions happen), continuous batching across adapters
  PEFT  ``bench/baseline_server.py``: every adapter loaded into one ``PeftModel``, waiting requests
        grouped by adapter, one left-padded ``generate`` per group at a time

Prints requests/s, output tokens/s, TTFT and inter-token latency p50/p99, errors, cold starts and the
servers' CPU seconds side by side, with ratios (>1: ours is better), then one ``RESULT`` line.
Run: ``python bench/serve.py --quick`` (a few minutes on 2 cores) or ``python bench/serve.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spinning OpenMP threads cost more than they bring on shared cores

import torch
from transformers.utils import logging as transformers_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import RANKS, adapter_dir_name, bench_model, make_adapters
from bench.serve_load import LoadPlan, run_load
from bench.serve_stats import RequestRecord, RunSummary, ratio, same_tokens, summarize, table
from bench.serve_systems import OursOptions, ServerUnderTest, delta, start_baseline, start_ours
from bench.serve_workload import LengthRange, WorkItem, workload
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH

# name: (hidden, layers, adapters, clients, requests, prompt lengths, output lengths)
PRESETS = {
    "quick": (256, 4, 8, 8, 96, "16:128", "8:64"),
    "full": (512, 8, 16, 16, 128, "16:256", "16:128"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run: a few minutes on 2 CPU cores")
    parser.add_argument("--hidden", type=int, help="model hidden size")
    parser.add_argument("--layers", type=int, help="decoder layers")
    parser.add_argument("--adapters", type=int, help="M: adapters in the workload")
    parser.add_argument("--clients", type=int, help="N: concurrent streaming clients")
    parser.add_argument("--requests", type=int, help="requests per system (default: the preset's)")
    parser.add_argument("--duration", type=float, help="seconds of load per system instead of a request count")
    parser.add_argument("--prompt-len", help="prompt tokens, lo:hi (uniform)")
    parser.add_argument("--output-len", help="output tokens, lo:hi (uniform; EOS ignored)")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of adapter popularity (0: uniform)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resident", type=int, help="adapters our pool may hold (default: M/2)")
    parser.add_argument("--pool-mib", type=int, default=128, help="our unified KV/adapter pool")
    parser.add_argument("--adapter-idle-ttl", type=float, default=10.0, help="our pool's idle TTL (scale to zero)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument(
        "--step-tokens", type=int, default=2048, help="our engine's tokens per step (prompts prefill in chunks)"
    )
    parser.add_argument(
        "--decoding-step-tokens", type=int, default=256, help="our engine's tokens per step while requests decode"
    )
    parser.add_argument(
        "--step-stretch", type=float, default=DEFAULT_STRETCH,
        help="our engine's bound on a step with prompt chunks, in decode-only steps (0: only the token budget)",
    )  # fmt: skip
    parser.add_argument(
        "--step-stretch-min", type=float, default=DEFAULT_MIN_STRETCH,
        help="our engine's bound while the prompt backlog clears in a few steps",
    )  # fmt: skip
    parser.add_argument("--max-batch", type=int, help="baseline requests per adapter batch (default: N)")
    args = parser.parse_args()
    if args.requests is not None and args.duration is not None:
        parser.error("give --requests or --duration, not both")
    preset = PRESETS["quick" if args.quick else "full"]
    names = ("hidden", "layers", "adapters", "clients", "requests", "prompt_len", "output_len")
    for name, value in zip(names, preset, strict=True):
        if getattr(args, name) is None and not (name == "requests" and args.duration):
            setattr(args, name, value)
    args.resident = args.resident or max(1, args.adapters // 2)
    args.max_batch = args.max_batch or args.clients
    return args


def say(line: str = "") -> None:
    print(line, flush=True)


def measure(
    server: ServerUnderTest,
    base_model: str,
    adapter_models: list[str],
    items: list[WorkItem] | None,
    args: argparse.Namespace,
) -> tuple[RunSummary, list[RequestRecord]]:
    """Wait for ``server``, warm it up on the base model, then run the load and read its counters."""
    started = time.perf_counter()
    server.wait_ready()
    say(f"[{server.label}] ready after {time.perf_counter() - started:.1f} s")
    warm_items = iter([WorkItem(-1, 0, list(range(10, 42)), 4), WorkItem(-2, 0, list(range(10, 26)), 4)])
    warm, _ = asyncio.run(run_load(server.base_url, [base_model], warm_items, LoadPlan(clients=2, requests=2)))
    if errors := [r.error for r in warm if r.error]:
        raise SystemExit(f"[{server.label}] warm-up failed: {errors}\n{server.process.log_tail()}")
    loads_before, cpu_before = server.adapter_loads(), server.cpu_seconds()
    stream = iter(items) if items is not None else _endless(args)
    plan = LoadPlan(args.clients, requests=args.requests, duration_s=args.duration)
    say(f"[{server.label}] load average {os.getloadavg()[0]:.2f}; running the load ...")
    records, wall = asyncio.run(run_load(server.base_url, adapter_models, stream, plan))
    summary = summarize(server.label, records, wall)
    summary.server_cpu_s = server.cpu_seconds() - cpu_before
    if loads_before is not None:
        summary.adapter_loads = delta(server.adapter_loads() or {}, loads_before)
    say(f"[{server.label}] {summary.completed}/{len(records)} requests completed in {wall:.1f} s")
    return summary, records


def _endless(args: argparse.Namespace) -> Iterator[WorkItem]:
    return workload(args.adapters, args.zipf, LengthRange.parse(args.prompt_len), LengthRange.parse(args.output_len),
                    args.seed)  # fmt: skip


def describe(args: argparse.Namespace, spec: TinyModelSpec, items: list[WorkItem] | None) -> None:
    ranks = "/".join(str(r) for r in RANKS)
    say(f"model: random-init Llama, hidden {spec.hidden}, {spec.layers} layers, {spec.heads} heads "
        f"({spec.kv_heads} KV), fp32 on CPU; {args.adapters} adapters, ranks {ranks}, all 7 projections")  # fmt: skip
    amount = f"{args.requests} requests" if items is not None else f"{args.duration:.0f} s"
    say(f"load: {args.clients} streaming clients, closed loop, {amount} per system; Zipf s={args.zipf} over "
        f"{args.adapters} adapters; prompts {args.prompt_len}, outputs {args.output_len} tokens (ignore_eos), "
        "greedy")  # fmt: skip
    if items is not None:
        per_adapter = Counter(item.adapter for item in items)
        counts = " ".join(str(per_adapter.get(a, 0)) for a in range(args.adapters))
        prompt, output = sum(len(i.prompt) for i in items), sum(i.max_tokens for i in items)
        say(f"requests per adapter (most popular first): {counts}; {prompt} prompt, {output} output tokens")
    say(f"ours: loraplex server, pool {args.pool_mib} MiB, at most {args.resident} of {args.adapters} adapters "
        f"resident, idle TTL {args.adapter_idle_ttl:g} s, loaded on demand from --adapter-root")  # fmt: skip
    say(f"PEFT: transformers + PEFT, all {args.adapters} adapters loaded, one generate per adapter group "
        f"(at most {args.max_batch} requests); both servers: {args.threads} torch thread(s), on 127.0.0.1")  # fmt: skip


def report(
    ours: RunSummary, peer: RunSummary, ours_records: list[RequestRecord], peer_records: list[RequestRecord]
) -> None:
    say()
    for line in table(ours, peer):
        say(line)
    same, both = same_tokens(ours_records, peer_records)
    say(f"identical greedy tokens in both systems: {same}/{both} requests "
        "(fp32; left padding and summation order can flip near-ties)")  # fmt: skip
    tok, req = ratio(ours.tokens_per_s, peer.tokens_per_s), ratio(ours.requests_per_s, peer.requests_per_s)
    ttft = ratio(peer.ttft_p50, ours.ttft_p50)
    say(f"ratios ours/PEFT: tok/s {tok:.2f}, req/s {req:.2f}, tok/CPU-s "
        f"{ratio(ours.tokens_per_cpu_s, peer.tokens_per_cpu_s):.2f}; PEFT/ours: TTFT p50 {ttft:.2f}, "
        f"TTFT p99 {ratio(peer.ttft_p99, ours.ttft_p99):.2f}, ITL p50 {ratio(peer.itl_p50, ours.itl_p50):.2f}, "
        f"ITL p99 {ratio(peer.itl_p99, ours.itl_p99):.2f}")  # fmt: skip
    say(f"RESULT tok/s ratio={tok:.2f} req/s ratio={req:.2f} ttft_p50 ratio={ttft:.2f}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # PEFT's deprecation notices from transformers
    spec = bench_model(args.hidden, args.layers)
    items = None
    if args.duration is None:
        items = list(itertools.islice(_endless(args), args.requests))
    describe(args, spec, items)
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-serve-"))
    started = time.perf_counter()
    try:
        model_dir = make_tiny_model(workdir / "base", spec)
        adapter_root = workdir / "adapters"
        adapter_root.mkdir()
        make_adapters(model_dir, adapter_root, args.adapters)
        adapter_models = [adapter_dir_name(i) for i in range(args.adapters)]
        say(f"model and adapters written in {time.perf_counter() - started:.1f} s")
        options = OursOptions(
            args.pool_mib << 20,
            args.resident,
            args.adapter_idle_ttl,
            max(RANKS),
            args.threads,
            args.step_tokens,
            args.decoding_step_tokens,
            args.step_stretch,
            args.step_stretch_min,
        )
        results = {}
        for label in ("ours", "PEFT"):
            if label == "ours":
                server = start_ours(model_dir, adapter_root, workdir, options)
            else:
                server = start_baseline(model_dir, adapter_root, workdir, threads=args.threads,
                                        max_batch=args.max_batch)  # fmt: skip
            try:
                results[label] = measure(server, model_dir.name, adapter_models, items, args)
            finally:
                server.stop()
        (ours, ours_records), (peer, peer_records) = results["ours"], results["PEFT"]
        report(ours, peer, ours_records, peer_records)
        say(f"total wall {time.perf_counter() - started:.0f} s")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
