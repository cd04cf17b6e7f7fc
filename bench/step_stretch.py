"""Steady decodes against prefill speed: our server at several ``--step-stretch`` values, same HTTP load.

The stretch bounds a step that carries prompt chunks beside decodes to that many times a decode-only step
(``server/engine/step_costs.py``); 0 leaves only the token cap (``--step-tokens-while-decoding``). A value is
``S`` (a fixed stretch: ``--step-stretch S --step-stretch-min S``) or ``MIN:MAX`` (the stretch follows the prompt
backlog between the two, as the server's defaults ``1.5:3`` do). Workload as
in ``bench/serve.py --quick``: a random-init Llama (hidden 256, 4 layers), 8 PEFT adapters of rank 8/16/32 with
at most 4 resident, 8 streaming clients in a closed loop, Zipf adapter popularity, prompts of 16-128 tokens,
8-64 out, greedy with ``ignore_eos``. Each round draws a new request sequence and runs it on a fresh server per
value, the values' order rotating from round to round, so machine noise hits them alike.

Prints per value: output tok/s, TTFT p50, inter-token latency p50/p90/p99 and p99/p50 (means over rounds), and
each value's tok/s and ITL p99 as ratios to the first value's measured in the same rounds.
Run: ``python bench/step_stretch.py [--stretch 3 1.5 1.5:3] [--rounds 3] [--requests 200]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spinning OpenMP threads cost more than they bring on shared cores

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import RANKS, adapter_dir_name, make_adapters
from bench.serve import PRESETS, measure
from bench.serve_stats import percentile
from bench.serve_systems import OursOptions, start_ours
from bench.serve_workload import LengthRange, WorkItem, workload
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH

# The serving benchmark's quick preset: same model, adapters, clients and lengths.
HIDDEN, LAYERS, ADAPTERS, CLIENTS, _, PROMPT_LEN, OUTPUT_LEN = PRESETS["quick"]
RESIDENT = ADAPTERS // 2


@dataclass
class Rounds:
    """One stretch value's figures, a list entry per round."""

    tok_s: list[float] = field(default_factory=list)
    ttft_p50: list[float] = field(default_factory=list)
    itl: list[tuple[float, float, float]] = field(default_factory=list)  # p50, p90, p99 in seconds


def stretches(value: str) -> tuple[float, float]:
    """``S`` or ``MIN:MAX`` as (step_stretch_min, step_stretch); 0 (no time bound) keeps the server's minimum."""
    low, _, high = value.partition(":")
    if not high:
        fixed = float(low)
        return (fixed or DEFAULT_MIN_STRETCH, fixed)
    return float(low), float(high)


def quick_options(low: float, high: float, threads: int = 1, engine_process: bool = True) -> OursOptions:
    """Our server for the quick load: ``--step-stretch-min low --step-stretch high``."""
    return OursOptions(128 << 20, RESIDENT, 10.0, max(RANKS), threads, 2048, 256, high, low, engine_process)


def measure_round(
    model_dir: Path, adapter_root: Path, workdir: Path, options: OursOptions, items: list[WorkItem], label: str
) -> tuple[float, float, tuple[float, float, float]]:
    """A fresh server with ``options`` under ``items``, measured as ``bench/serve.py`` measures it: output tok/s,
    TTFT p50, ITL p50/p90/p99."""
    server = start_ours(model_dir, adapter_root, workdir, options)
    load = argparse.Namespace(clients=CLIENTS, requests=len(items), duration=None)
    try:
        names = [adapter_dir_name(i) for i in range(ADAPTERS)]
        summary, records = measure(server, model_dir.name, names, items, load)
    finally:
        server.stop()
    if summary.errors:
        raise SystemExit(f"{label}: requests failed: {summary.errors}")
    gaps = [g for r in records for g in r.token_gaps()]
    return summary.tokens_per_s, summary.ttft_p50, (summary.itl_p50, percentile(gaps, 90), summary.itl_p99)


def compare(variants: dict[str, OursOptions], rounds: int, requests: int, setting: str) -> None:
    """Each variant on a fresh server per round under that round's request sequence, the order rotating from
    round to round; prints each round, then means and each variant's ratios to the first one's."""
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-stretch-"))
    try:
        spec = TinyModelSpec(hidden=HIDDEN, layers=LAYERS, heads=4, kv_heads=2, seed=0)
        model_dir = make_tiny_model(workdir / "base", spec)
        adapter_root = workdir / "adapters"
        adapter_root.mkdir()
        make_adapters(model_dir, adapter_root, ADAPTERS)
        print(f"{CLIENTS} streaming clients, {requests} requests a round, {ADAPTERS} adapters ({RESIDENT} "
              f"resident), prompts {PROMPT_LEN}, outputs {OUTPUT_LEN}; {setting}; {rounds} rounds")  # fmt: skip
        names = list(variants)
        results = {name: Rounds() for name in names}
        for round_no in range(rounds):
            stream = workload(
                ADAPTERS, 1.0, LengthRange.parse(PROMPT_LEN), LengthRange.parse(OUTPUT_LEN), seed=round_no
            )
            items = list(itertools.islice(stream, requests))
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                tok_s, ttft, itl = measure_round(model_dir, adapter_root, workdir, variants[name], items, name)
                results[name].tok_s.append(tok_s)
                results[name].ttft_p50.append(ttft)
                results[name].itl.append(itl)
                print(f"round {round_no} {name}: {tok_s:7.1f} tok/s, TTFT p50 {1e3 * ttft:6.1f} ms, "
                      f"ITL p50/p90/p99 {'/'.join(f'{1e3 * x:.1f}' for x in itl)} ms", flush=True)  # fmt: skip
        base, width = results[names[0]], max(len(n) for n in names)
        print(f"\n{'':>{width}} {'tok/s':>8} {'TTFT p50':>9} {'ITL p50':>8} {'p90':>6} {'p99':>6} {'p99/p50':>8} "
              f"{'tok/s vs first':>15} {'ITL p99 vs first':>17}")  # fmt: skip
        for name, r in results.items():
            p50, p90, p99 = (statistics.fmean(x[k] for x in r.itl) for k in range(3))
            tok_ratio = statistics.fmean(a / b for a, b in zip(r.tok_s, base.tok_s, strict=True))
            p99_ratio = statistics.fmean(a[2] / b[2] for a, b in zip(r.itl, base.itl, strict=True))
            print(f"{name:>{width}} {statistics.fmean(r.tok_s):>8.1f} {1e3 * statistics.fmean(r.ttft_p50):>7.1f}ms "
                  f"{1e3 * p50:>6.1f}ms {1e3 * p90:>6.1f} {1e3 * p99:>6.1f} {p99 / p50:>8.2f} "
                  f"{tok_ratio:>15.2f} {p99_ratio:>17.2f}")  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--stretch", nargs="+", default=[f"{DEFAULT_STRETCH:g}", f"{DEFAULT_MIN_STRETCH:g}",
                                         f"{DEFAULT_MIN_STRETCH:g}:{DEFAULT_STRETCH:g}"],
        help="values, S or MIN:MAX; the first is the base",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200, help="requests per server per round")
    args = parser.parse_args()
    variants = {f"stretch {value}": quick_options(*stretches(value)) for value in args.stretch}
    compare(variants, args.rounds, args.requests, f"stretch {' '.join(args.stretch)}")


if __name__ == "__main__":
    main()
