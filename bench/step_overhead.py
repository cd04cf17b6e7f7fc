"""The engine's per-step time on a model too small for compute to matter: what is left is the Python step
(scheduling, step metadata, sampling, outputs) and torch's per-op dispatch.

Workload: a random-init Llama of hidden 64 and 2 layers, 4 resident adapters of rank 8/16/32, 32 sequences
(four in five on an adapter) decoding 96 tokens each, greedy, one thread; the median step time of each round
(the first and last few steps left out), best round kept. ``--checkout DIR`` (repeatable) measures other
checkouts of this repository too (e.g. ``git worktree add /tmp/before <commit>``), each in its own process,
rounds interleaved, and prints each one's time as a ratio to the first.
Run: ``python bench/step_overhead.py [--checkout /tmp/before] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def measure(root: Path, rounds: int) -> list[float]:
    """Median step seconds of each round, from the code under ``root`` (run in this process)."""
    sys.path.insert(0, str(root))
    import torch

    torch.set_num_threads(1)
    from bench.common import make_adapters
    from core.tiny_model import TinyModelSpec, make_tiny_model
    from server.engine import SamplingParams
    from server.offline import LLM

    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-step-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    model_dir = make_tiny_model(work / "base", TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, seed=0))
    llm = LLM(model_dir, pool_bytes=64 << 20)
    for i, adapter in enumerate(make_adapters(model_dir, work / "adapters", 4)):
        llm.load_adapter(f"a{i}", adapter)
    engine = llm.engine
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    medians = []
    for round_ in range(rounds):
        for r in range(32):
            prompt = [1 + (r * 7 + j) % 200 for j in range(16 + r)]
            engine.add_request(f"r{round_}-{r}", prompt, params, f"a{r % 4}" if r % 5 else None)
        times = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        medians.append(statistics.median(times[5:-5]))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", type=Path, default=[], help="another checkout to measure")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every checkout")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(min(measure(args.child, 2)))
        return
    roots = [HERE, *(c.resolve() for c in args.checkout)]
    best = {root: float("inf") for root in roots}
    for round_ in range(args.rounds):
        for root in roots:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(root)], capture_output=True, text=True, check=True
            )
            step = float(out.stdout.strip().splitlines()[-1])
            best[root] = min(best[root], step)
            print(f"round {round_ + 1}: {root}: median step {step * 1e3:.3f} ms", flush=True)
    for root in roots:
        print(f"{root}: {best[root] * 1e3:.3f} ms, {best[root] / best[HERE]:.2f}x this checkout's")


if __name__ == "__main__":
    main()
