"""The engine in its own process against the engine on a thread of the HTTP process: same HTTP load.

In one process the engine thread waits for the interpreter whenever the HTTP thread holds it (parsing,
rendering, streaming every token); ``loraplex server`` now runs the engine in a process of its own
(``server/engine_process.py``). This bench measures what that buys on ``bench/serve.py --quick``'s load: a
random-init Llama (hidden 256, 4 layers), 8 PEFT adapters of rank 8/16/32 with at most 4 resident, 8
streaming clients in a closed loop, Zipf popularity, prompts of 16-128 tokens, 8-64 out, greedy with
``ignore_eos``. Each round draws a new request sequence and runs it on a fresh server per mode, the modes'
order alternating between rounds, so machine noise hits both alike (``bench.step_stretch.compare``).

Prints per mode: output tok/s, TTFT p50, inter-token latency p50/p90/p99 and p99/p50 (means over rounds), and
the process's tok/s and ITL p99 as ratios to the thread's measured in the same rounds.
Run: ``python bench/engine_split.py [--rounds 4] [--requests 200] [--threads 1] [--step-stretch 3]
[--step-stretch-min 1.5]``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # this process only drives the load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.step_stretch import compare, quick_options
from server.engine.step_costs import DEFAULT_MIN_STRETCH, DEFAULT_STRETCH


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
    variants = {
        f"engine {mode}": quick_options(args.step_stretch_min, args.step_stretch, args.threads, mode == "process")
        for mode in ("thread", "process")
    }
    setting = f"{args.threads} engine thread(s), step stretch {args.step_stretch_min:g} to {args.step_stretch:g}"
    compare(variants, args.rounds, args.requests, setting)


if __name__ == "__main__":
    main()
