"""Two tenants on one engine: a quiet tenant's time to first token while another floods, fair against FCFS.

Workload (issue 18): a random-init Llama (hidden 256, 4 layers), 9 adapters of rank 8/16/32. Tenant A floods:
``--flood`` (64) requests always in flight over its 8 adapters, prompts of 512-1024 random tokens, 32-64
output tokens. Tenant B sends one request every ``--interval`` (1) seconds on its own adapter: a 64-token
prompt, 16 output tokens. The engine runs at most ``--max-seqs`` (32) sequences, so A's flood queues. EOS is
ignored; each run lasts ``--seconds`` (20). Runs, interleaved in every round:

  (b-alone)  B's requests alone            (a-alone)  A's flood alone
  (fair)     both, fair scheduling (default) (fcfs)   both, first come first served (``--fcfs``)

Prints B's TTFT p50/p99 (arrival to first token, over every round's requests) and A's output tok/s (mean of
rounds) per run, then the ratios the issue sets targets for: B's TTFT p99 under the flood within 2x of B
alone, and A keeping at least 80% of its solo throughput, for fair and FCFS side by side.
Run: ``python bench/fairness.py [--seconds 20] [--rounds 2] [--threads 0]``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import make_adapters, pct
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.engine import SamplingParams
from server.engine.tenancy import Tenancy
from server.offline import LLM

A_ADAPTERS = 8
A_PROMPT, A_OUTPUT = (512, 1024), (32, 64)
B_PROMPT, B_OUTPUT = 64, 16
VOCAB_LOW, VOCAB_HIGH = 3, 250  # token ids drawn from the tiny model's byte range


@dataclass
class Run:
    b_ttfts: list[float] = field(default_factory=list)
    a_tok_s: list[float] = field(default_factory=list)


def run(llm: LLM, seconds: float, flood: int, interval: float | None, seed: int) -> tuple[list[float], float]:
    """Drive the engine for ``seconds``: A's closed loop of ``flood`` (0: none) and B's open loop every
    ``interval`` seconds (None: none). Returns B's TTFTs and A's output tokens per second."""
    engine, rng = llm.engine, random.Random(seed)
    tokens = lambda n: [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]  # noqa: E731
    counter, a_in_flight, a_tokens, seen = 0, 0, 0, {}
    b_ttfts: list[float] = []

    def submit_a() -> None:
        nonlocal counter, a_in_flight
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(*A_OUTPUT), ignore_eos=True, detokenize=False)
        engine.add_request(f"a{counter}", tokens(rng.randint(*A_PROMPT)), params, f"a{counter % A_ADAPTERS}",
                           tenancy=Tenancy("A"))  # fmt: skip
        counter += 1
        a_in_flight += 1

    engine.flush_prefix_cache()  # runs repeat prompts (same seeds): no run may find another's pages
    start = time.monotonic()
    next_b = start + interval if interval is not None else float("inf")  # B arrives once the flood is under way
    for _ in range(flood):
        submit_a()
    while (now := time.monotonic()) - start < seconds:
        if now >= next_b:
            params = SamplingParams(temperature=0.0, max_tokens=B_OUTPUT, ignore_eos=True, detokenize=False)
            # Stamped when it was due, not when the driver got to it: the step in progress when it arrives counts.
            engine.add_request(f"b{counter}", tokens(B_PROMPT), params, "b", arrival_time=next_b, tenancy=Tenancy("B"))
            counter += 1
            next_b += interval or 0.0
        if not engine.has_unfinished_requests():
            time.sleep(min(0.001, max(0.0, next_b - now)))
            continue
        for out in engine.step():
            if out.request_id.startswith("a"):
                a_tokens += out.num_completion_tokens - seen.get(out.request_id, 0)
                seen[out.request_id] = out.num_completion_tokens
                if out.finished:
                    a_in_flight -= 1
                    submit_a()
            elif out.finished:
                b_ttfts.append(out.first_token_time - out.arrival_time)
    elapsed = time.monotonic() - start
    for request_id in list(engine._requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return b_ttfts, a_tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--flood", type=int, default=64)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--max-seqs", type=int, default=32)
    parser.add_argument(
        "--decoding-step-tokens",
        type=int,
        default=None,
        help="the engine's step_tokens_while_decoding (default: the engine's)",
    )
    parser.add_argument(
        "--step-stretch", type=float, default=None, help="the engine's step_stretch (default: the engine's; 0: off)"
    )
    parser.add_argument(
        "--step-stretch-min", type=float, default=None, help="the engine's step_stretch_min (default: the engine's)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", TinyModelSpec(hidden=256, layers=4, heads=8, kv_heads=4))
        adapter_dirs = make_adapters(model_dir, Path(tmp) / "adapters", A_ADAPTERS + 1)
        engines = {}
        for label, fair in (("fair", True), ("fcfs", False)):
            step = {"step_tokens_while_decoding": args.decoding_step_tokens} if args.decoding_step_tokens else {}
            if args.step_stretch is not None:
                step["step_stretch"] = args.step_stretch
            if args.step_stretch_min is not None:
                step["step_stretch_min"] = args.step_stretch_min
            llm = LLM(model_dir, pool_bytes=512 << 20, max_model_len=2048, max_lora_rank=32,
                      max_num_seqs=args.max_seqs, fair_scheduling=fair, **step)  # fmt: skip
            for i, path in enumerate(adapter_dirs[:A_ADAPTERS]):
                llm.load_adapter(f"a{i}", path)
            llm.load_adapter("b", adapter_dirs[A_ADAPTERS])
            run(llm, 2.0, 8, 0.25, seed=99)  # warm-up
            engines[label] = llm
        plan = {  # run -> (engine, flood, B's interval)
            "b-alone": ("fair", 0, args.interval),
            "a-alone": ("fair", args.flood, None),
            "fair": ("fair", args.flood, args.interval),
            "fcfs": ("fcfs", args.flood, args.interval),
        }
        runs = {name: Run() for name in plan}
        for round_no in range(args.rounds):
            for name, (engine, flood, interval) in plan.items():
                ttfts, tok_s = run(engines[engine], args.seconds, flood, interval, seed=round_no)
                runs[name].b_ttfts += ttfts
                runs[name].a_tok_s.append(tok_s)
    print(f"A: {args.flood} in flight over {A_ADAPTERS} adapters, prompts {A_PROMPT[0]}-{A_PROMPT[1]}, outputs "
          f"{A_OUTPUT[0]}-{A_OUTPUT[1]}; B: one {B_PROMPT}-token request every {args.interval} s, {B_OUTPUT} out; "
          f"max {args.max_seqs} sequences; {args.rounds} rounds of {args.seconds} s")  # fmt: skip
    for name, result in runs.items():
        b = f"B TTFT p50 {pct(result.b_ttfts, 50) * 1000:7.1f} ms  p99 {pct(result.b_ttfts, 99) * 1000:7.1f} ms" \
            f" ({len(result.b_ttfts)} requests)" if result.b_ttfts else " " * 47  # fmt: skip
        a = f"A {statistics.mean(result.a_tok_s):7.1f} output tok/s" if any(result.a_tok_s) else ""
        print(f"  {name:8s} {b}  {a}")
    alone_p99, alone_a = pct(runs["b-alone"].b_ttfts, 99), statistics.mean(runs["a-alone"].a_tok_s)
    for name in ("fair", "fcfs"):
        ttft = pct(runs[name].b_ttfts, 99) / alone_p99
        keep = statistics.mean(runs[name].a_tok_s) / alone_a
        print(f"RESULT {name}: B TTFT p99 {ttft:.2f}x alone (target <= 2), A keeps {keep:.0%} of solo tok/s "
              f"(target >= 80%)")  # fmt: skip


if __name__ == "__main__":
    main()
