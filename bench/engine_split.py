"""The engine in its own process against the engine on a thread of the HTTP process: same HTTP load.

In one process the engine thread waits for the interpreter whenever the HTTP thread holds it (parsing,
rendering, streaming every token); ``loraplex server`` now runs the engine in a process of its own
(``server/engine_process.py``). This bench measures what that buys on ``bench/serve.py --quick``'s load: a
random-init Llama (hidden 256, 4 layers), 8 PEFT adapters of rank 8/16/32 with at most 4 resident, 8
streaming clients in a closed loop, Zipf popularity, prompts of 16-128 tokens, 8-64 out, greedy with
``ignore_eos``. Each round draws a new request sequence and runs it on a fresh server per mode, the modes'
order alternating between rounds, so machine noise hits both alike.

Prints per mode: output tok/s, TTFT p50, inter-token latency p50/p90/p99 and p99/p50 (means over rounds), and
the process's tok/s and ITL p99 as ratios to the thread's measured in the same rounds.
Run: ``python bench/engine_split.py [--rounds 4] [--requests 200] [--threads 1] [--step-stretch 3]
[--step-stretch-min 1.5]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process only drives the load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import RANKS, adapter_dir_name, make_adapters
from bench.serve import PRESETS, measure
from bench.serve_stats import percentile
from bench.serve_systems import OursOptions, start_ours
from bench.serve_workload import LengthRange, WorkItem, workload
from bench.step_stretch import Rounds
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH

HIDDEN, LAYERS, ADAPTERS, CLIENTS, _, PROMPT_LEN, OUTPUT_LEN = PRESETS["quick"]
RESIDENT = ADAPTERS // 2
MODES = {"thread": False, "process": True}


def one_round(
    model_dir: Path, adapter_root: Path, workdir: Path, process: bool, args: argparse.Namespace, items: list[WorkItem]
) -> tuple[float, float, tuple[float, float, float]]:
    """A fresh server in one mode under ``items``: output tok/s, TTFT p50, ITL p50/p90/p99."""
    options = OursOptions(128 << 20, RESIDENT, 10.0, max(RANKS), args.threads, step_stretch=args.step_stretch,
                          step_stretch_min=args.step_stretch_min, engine_process=process)  # fmt: skip
    server = start_ours(model_dir, adapter_root, workdir, options)
    load = argparse.Namespace(clients=CLIENTS, requests=len(items), duration=None)
    try:
        names = [adapter_dir_name(i) for i in range(ADAPTERS)]
        summary, records = measure(server, model_dir.name, names, items, load)
    finally:
        server.stop()
    if summary.errors:
        raise SystemExit(f"engine {'process' if process else 'thread'}: requests failed: {summary.errors}")
    gaps = [g for r in records for g in r.token_gaps()]
    return summary.tokens_per_s, summary.ttft_p50, (summary.itl_p50, percentile(gaps, 90), summary.itl_p99)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200, help="requests per server per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--step-stretch", type=float, default=DEFAULT_STRETCH, help="both servers' --step-stretch")
    parser.add_argument(
        "--step-stretch-min", type=float, default=DEFAULT_MIN_STRETCH, help="both servers' --step-stretch-min"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-split-"))
    try:
        spec = TinyModelSpec(hidden=HIDDEN, layers=LAYERS, heads=4, kv_heads=2, seed=0)
        model_dir = make_tiny_model(workdir / "base", spec)
        adapter_root = workdir / "adapters"
        adapter_root.mkdir()
        make_adapters(model_dir, adapter_root, ADAPTERS)
        print(f"{CLIENTS} streaming clients, {args.requests} requests a round, {ADAPTERS} adapters "
              f"({RESIDENT} resident), prompts {PROMPT_LEN}, outputs {OUTPUT_LEN}, {args.threads} engine "
              f"thread(s), step stretch {args.step_stretch_min:g} to {args.step_stretch:g}; "
              f"{args.rounds} rounds")  # fmt: skip
        results = {mode: Rounds() for mode in MODES}
        for round_no in range(args.rounds):
            stream = workload(
                ADAPTERS, 1.0, LengthRange.parse(PROMPT_LEN), LengthRange.parse(OUTPUT_LEN), seed=round_no
            )
            items = list(itertools.islice(stream, args.requests))
            order = list(MODES) if round_no % 2 == 0 else list(reversed(MODES))
            for mode in order:
                tok_s, ttft, itl = one_round(model_dir, adapter_root, workdir, MODES[mode], args, items)
                results[mode].tok_s.append(tok_s)
                results[mode].ttft_p50.append(ttft)
                results[mode].itl.append(itl)
                print(f"round {round_no} engine {mode:>7}: {tok_s:7.1f} tok/s, TTFT p50 {1e3 * ttft:6.1f} ms, "
                      f"ITL p50/p90/p99 {'/'.join(f'{1e3 * x:.1f}' for x in itl)} ms", flush=True)  # fmt: skip
        base = results["thread"]
        print(f"\n{'engine':>8} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} {'p90':>6} {'p99':>6} {'p99/p50':>8} "
              f"{'tok/s vs thread':>16} {'ITL p99 vs thread':>18}")  # fmt: skip
        for mode, r in results.items():
            p50, p90, p99 = (statistics.fmean(x[k] for x in r.itl) for k in range(3))
            tok_ratio = statistics.fmean(a / b for a, b in zip(r.tok_s, base.tok_s, strict=True))
            p99_ratio = statistics.fmean(a[2] / b[2] for a, b in zip(r.itl, base.itl, strict=True))
            print(f"{mode:>8} {statistics.fmean(r.tok_s):>8.1f} {1e3 * statistics.fmean(r.ttft_p50):>7.1f}ms "
                  f"{1e3 * p50:>6.1f}ms {1e3 * p90:>6.1f} {1e3 * p99:>6.1f} {p99 / p50:>8.2f} "
                  f"{tok_ratio:>16.2f} {p99_ratio:>18.2f}")  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
