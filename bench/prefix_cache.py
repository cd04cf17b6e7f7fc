"""Prefix caching on CPU: TTFT and output tok/s with caching on against off, measured in the same run.

Workload (issue 27): a random-init Llama (hidden 256, 4 layers), 8 adapters of rank 8/16/32, each with its own
512-token system prompt; ``--requests`` (256) requests on adapter ``i % 8``, each that adapter's system prompt
plus a random suffix of 32-128 tokens, generating 16-64 tokens (EOS ignored), driven in a closed loop of
``--concurrency`` (16) requests in flight. A second workload ("unshared") gives every request its own random
prompt of the same length, where caching can only cost. Systems, in interleaved rounds:

  (a) caching off  (``enable_prefix_caching=False``)
  (b) caching on, starting cold (the cache is flushed before each round)

Prints, per workload and system, TTFT p50/p99 (arrival to first token, queueing included) and output tok/s of
its fastest round, the ratio on/off, and the hit rate: prompt tokens found cached over prompt tokens looked up
(at most 512 / 592 here: suffixes are never shared), and over system-prompt tokens sent. Targets (issue
27): shared TTFT p50 at least 3x better and tok/s at least 1.5x with caching, hit rate above 85%; unshared tok/s
no more than 3% lower with caching on.
Run: ``python bench/prefix_cache.py [--requests 256] [--concurrency 16] [--rounds 2] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import make_adapters, pct
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.engine import SamplingParams
from server.offline import LLM

NUM_ADAPTERS, SYSTEM_PROMPT = 8, 512
SUFFIX, OUTPUT = (32, 128), (16, 64)
VOCAB_LOW, VOCAB_HIGH = 3, 250  # token ids drawn from the tiny model's byte range
Request = tuple[list[int], int, int]  # prompt token ids, adapter index, max_tokens


def workload(num_requests: int, shared: bool, seed: int = 0, draw: int = 0) -> list[Request]:
    """``(prompt token ids, adapter index, max_tokens)`` per request; ``shared``: one system prompt per adapter.
    ``seed`` fixes the system prompts and ``draw`` the rest, so draws of one seed differ only in what follows
    the system prompts (a server whose cache is warm from one draw hits on the next one's system prompts only)."""
    system_rng, rng = random.Random(seed), random.Random(f"{seed}/{draw}")

    def tokens(n: int, source: random.Random) -> list[int]:
        return [source.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]

    systems = [tokens(SYSTEM_PROMPT, system_rng) for _ in range(NUM_ADAPTERS)]
    requests = []
    for i in range(num_requests):
        suffix = tokens(rng.randint(*SUFFIX), rng)
        head = systems[i % NUM_ADAPTERS] if shared else tokens(SYSTEM_PROMPT, rng)
        requests.append((head + suffix, i % NUM_ADAPTERS, rng.randint(*OUTPUT)))
    return requests


def closed_loop(llm: LLM, requests: list[Request], concurrency: int) -> tuple[float, list[float], int]:
    """Keep ``concurrency`` requests in the engine until all are done: wall seconds, TTFTs, output tokens."""
    engine = llm.engine
    queue = deque(enumerate(requests))
    in_flight, ttfts, tokens = 0, [], 0

    def submit() -> None:
        nonlocal in_flight
        i, (prompt, adapter, max_tokens) = queue.popleft()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        engine.add_request(f"r{i}", prompt, params, f"a{adapter}")
        in_flight += 1

    start = time.perf_counter()
    while queue and in_flight < concurrency:
        submit()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ttfts.append(out.first_token_time - out.arrival_time)
                tokens += out.num_completion_tokens
                in_flight -= 1
                if queue:
                    submit()
    return time.perf_counter() - start, ttfts, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", TinyModelSpec(hidden=256, layers=4, heads=8, kv_heads=4))
        adapter_dirs = make_adapters(model_dir, Path(tmp) / "adapters", NUM_ADAPTERS)
        systems = {}
        for label, caching in (("off", False), ("on", True)):
            llm = LLM(model_dir, pool_bytes=256 << 20, max_model_len=1024, max_lora_rank=32,
                      enable_prefix_caching=caching)  # fmt: skip
            for i, path in enumerate(adapter_dirs):
                llm.load_adapter(f"a{i}", path)
            closed_loop(llm, workload(8, True, seed=99), args.concurrency)  # warm-up
            systems[label] = llm
        results: dict[tuple[str, str], tuple[float, list[float], int, float]] = {}
        for name, shared in (("shared", True), ("unshared", False)):
            requests = workload(args.requests, shared)
            for _ in range(args.rounds):
                for label, llm in systems.items():
                    llm.engine.flush_prefix_cache()
                    before = llm.engine.prefix_cache_stats()
                    wall, ttfts, tokens = closed_loop(llm, requests, args.concurrency)
                    after = llm.engine.prefix_cache_stats()
                    queried = after.queried_tokens - before.queried_tokens
                    hits = after.hit_tokens - before.hit_tokens
                    rates = (hits / queried if queried else 0.0, hits / (len(requests) * SYSTEM_PROMPT))
                    best = results.get((name, label))
                    if best is None or wall < best[0]:
                        results[(name, label)] = (wall, ttfts, tokens, rates)
    print(f"{args.requests} requests on {NUM_ADAPTERS} adapters, {SYSTEM_PROMPT}-token system prompts, suffixes "
          f"{SUFFIX[0]}-{SUFFIX[1]}, outputs {OUTPUT[0]}-{OUTPUT[1]}, closed loop of {args.concurrency}, "
          f"best of {args.rounds}")  # fmt: skip
    for name in ("shared", "unshared"):
        for label in ("off", "on"):
            wall, ttfts, tokens, (of_prompts, of_systems) = results[(name, label)]
            print(f"  {name:8s} caching {label:3s}: TTFT p50 {pct(ttfts, 50):6.3f} s  p99 {pct(ttfts, 99):6.3f} s  "
                  f"{tokens / wall:7.1f} output tok/s  hit rate {of_prompts:5.1%} of prompt tokens, "
                  f"{of_systems:5.1%} of system-prompt tokens")  # fmt: skip
        off, on = results[(name, "off")], results[(name, "on")]
        ttft = pct(off[1], 50) / pct(on[1], 50)
        speed = (on[2] / on[0]) / (off[2] / off[0])
        target = "TTFT >= 3x, tok/s >= 1.5x" if name == "shared" else "tok/s >= 0.97x"
        print(f"  {name:8s} on/off: TTFT p50 {ttft:.2f}x better, tok/s {speed:.2f}x  (target {target})")


if __name__ == "__main__":
    main()
