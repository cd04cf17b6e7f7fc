"""Multi-LoRA serving throughput on CPU: our engine against PEFT, measured in the same run.

Workload: a random-init Llama (hidden 512, 8 layers, 8 heads, 4 KV heads), 16 adapters of rank 8/16/32
on all seven projections, 64 requests (prompts of 16-128 tokens, outputs drawn from {8..256}, EOS
ignored so every system produces exactly those tokens). Systems:

  (a) our engine, all 16 adapters resident, one continuous batch
  (b) PEFT, all adapters loaded, one left-padded generate(adapter_names=...) over the 64 requests
  (c) PEFT, one request at a time (set_adapter)
  (d) our engine without adapters
  (e) our engine with one adapter merged into the base weights

Prints useful output tokens/s per system, a/b, a/c, LoRA overhead d/a - 1, and the fraction of the
machine's matmul FLOP rate (measured here) that (a) achieves. ``--dtype bf16`` runs every system in fp32 and in
bf16 (PEFT's base model in bf16 too), interleaved, and prints bf16/fp32 tok/s per system. Process CPU seconds
are printed too: when other jobs share the cores, wall time swings by tens of percent while CPU time tracks
the work. Every system first runs a few short requests untimed, then ``--repeats`` interleaved rounds; each
system keeps its fastest round.
Run: ``python bench/engine_cpu.py [--dtype bf16]`` (``--threads 1`` is steadier on a busy 2-core machine: OpenMP
threads that spin while another process holds the core cost far more than they bring).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import RANKS, load_peft, make_adapters
from bench.gpu.peft_baseline import generate_mixed_batch
from core.tiny_model import TinyModelSpec, make_tiny_model
from server.engine import SamplingParams
from server.model.linear import Linear
from server.offline import LLM

OUTPUT_LENGTHS = (8, 16, 32, 64, 128, 256)
# --dtype: the engine's dtype name and torch dtype of each compute dtype a run compares.
DTYPES = {"fp32": ("float32", torch.float32), "bf16": ("bfloat16", torch.bfloat16)}


@dataclass
class Run:
    """One system's run: wall and process CPU seconds, useful tokens produced."""

    wall: float
    cpu: float
    produced: int


class Stopwatch:
    """Wall and CPU time of a block; CPU time shows the work itself when other jobs share the cores."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def make_workload(num_requests: int, num_adapters: int, seed: int) -> list[tuple[list[int], int, int]]:
    """``(prompt token ids, adapter index, output length)`` per request."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(4, 260) for _ in range(rng.randint(16, 128))]
        requests.append((prompt, i % num_adapters, rng.choice(OUTPUT_LENGTHS)))
    return requests


def matmul_gflops(seconds: float = 1.5, dtype: torch.dtype = torch.float32) -> float:
    """The machine's matmul rate in ``dtype`` on a large GEMM of the model's shapes (GFLOP/s): the faster of
    torch's plain matmul and the engine's own projection (panel GEMM or oneDNN-packed), so that the fraction (a)
    reaches is of the best rate this machine shows, not of a slow one."""
    a, w = torch.randn(1024, 512, dtype=dtype), torch.randn(512, 1408, dtype=dtype)
    engine_linear = Linear(w)
    best = 0.0
    for matmul in (lambda: a @ w, lambda: engine_linear(a)):
        matmul()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            matmul()
            count += 1
        best = max(best, 2 * 1024 * 512 * 1408 * count / (time.perf_counter() - start) / 1e9)
    return best


def run_ours(model_dir: Path, workload, adapter_dirs: list[Path] | None, pool_bytes: int, dtype: str) -> Run:
    """Time to finish the workload with our engine (computing in ``dtype``), and the output tokens produced."""
    llm = LLM(model_dir, pool_bytes=pool_bytes, max_lora_rank=32, max_adapters=16, dtype=dtype)
    names = []
    for i, path in enumerate(adapter_dirs or []):
        names.append(f"a{i}")
        llm.load_adapter(names[-1], path)

    def requests_of(work):
        # Token ids out, like the PEFT baselines: no detokenization.
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for *_, n in work]
        return [(prompt, names[a] if names else None, p) for (prompt, a, _), p in zip(work, params, strict=True)]

    llm.generate(requests_of(warm_up(workload)))
    with Stopwatch() as watch:
        outputs = llm.generate(requests_of(workload))
    return Run(watch.wall, watch.cpu, sum(len(out.outputs[0].token_ids) for out in outputs))


def warm_up(workload):
    """A few short requests every system runs untimed first: one-time costs (lazy kernel builds, allocator
    growth, oneDNN's per-shape kernels) stay out of the steady-state rate the benchmark compares."""
    return [(prompt[:32], a, 8) for prompt, a, _ in workload[:16]]


def run_peft_batched(model, workload, *, warm: bool = True) -> Run:
    """One left-padded generate over every request; only each request's own output length is useful."""
    if warm:
        run_peft_batched(model, warm_up(workload), warm=False)
    requests = [(prompt, f"a{a}", n) for prompt, a, n in workload]
    with Stopwatch() as watch:
        useful = generate_mixed_batch(model, requests)
    return Run(watch.wall, watch.cpu, useful)


def run_peft_sequential(model, workload, *, warm: bool = True) -> Run:
    if warm:
        run_peft_sequential(model, warm_up(workload)[:4], warm=False)
    produced = 0
    with Stopwatch() as watch, torch.inference_mode():
        for prompt, a, n in workload:
            model.set_adapter(f"a{a}")
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
            )
            produced += out.shape[1] - len(prompt)
    return Run(watch.wall, watch.cpu, produced)


def lora_flops_per_token(adapter_ranks: list[int], hidden: int, intermediate: int, kv: int, layers: int) -> float:
    """Mean LoRA FLOPs per token over the adapters (all seven projections)."""
    a_widths = 6 * hidden + intermediate  # q, k, v, o, gate, up read hidden; down reads intermediate
    b_widths = 3 * hidden + 2 * kv + 2 * intermediate  # q, o, down write hidden; k, v kv; gate, up intermediate
    per_rank = a_widths + b_widths
    return 2 * layers * per_rank * sum(adapter_ranks) / len(adapter_ranks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-mib", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None, help="torch threads for every system (default: torch's)")
    parser.add_argument("--skip-peft", action="store_true", help="only our systems (quick iterations)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of every system; each keeps its fastest")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="bf16: every system in fp32 and in bf16, side by side"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    spec = TinyModelSpec(hidden=512, layers=8, heads=8, kv_heads=4, seed=0)
    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    try:
        model_dir = make_tiny_model(work / "base", spec)
        adapter_dirs = make_adapters(model_dir, work, args.adapters)
        workload = make_workload(args.requests, args.adapters, args.seed)
        wanted = sum(n for _, _, n in workload)
        prompt_tokens = sum(len(p) for p, _, _ in workload)
        pool = args.pool_mib << 20
        say(f"threads={torch.get_num_threads()} requests={len(workload)} adapters={args.adapters}")
        say(f"prompt tokens={prompt_tokens} output tokens={wanted} load average={os.getloadavg()[0]:.2f}")
        dtypes = ["fp32"] if args.dtype == "fp32" else ["fp32", args.dtype]
        peaks = {}
        for name in dtypes:
            peaks[name] = matmul_gflops(dtype=DTYPES[name][1])
            say(f"matmul rate (1024x512x1408 {name}, best of torch and the engine's projection): "
                f"{peaks[name]:.1f} GFLOP/s")  # fmt: skip

        merged = merge_one(model_dir, adapter_dirs[0], work / "merged")
        systems = {}
        for name in dtypes:
            engine_dtype, torch_dtype = DTYPES[name]
            systems[name, "a"] = lambda d=engine_dtype: run_ours(model_dir, workload, adapter_dirs, pool, d)
            systems[name, "d"] = lambda d=engine_dtype: run_ours(model_dir, workload, None, pool, d)
            systems[name, "e"] = lambda d=engine_dtype: run_ours(merged, workload, None, pool, d)
            if not args.skip_peft:
                peft_model = load_peft(model_dir, adapter_dirs, dtype=torch_dtype)
                systems[name, "b"] = lambda m=peft_model: run_peft_batched(m, workload)
                systems[name, "c"] = lambda m=peft_model: run_peft_sequential(m, workload)
        runs: dict[tuple[str, str], Run] = {}
        # Rounds run every system (in every dtype) in turn, and each keeps its fastest round: on a shared
        # machine noise only ever adds time, and interleaving spreads a slow spell over all systems alike.
        for round_ in range(args.repeats):
            for system, run in systems.items():
                result = run()
                say(f"round {round_ + 1}: {system[0]} ({system[1]}) {result.wall:.1f} s")
                if system not in runs or result.wall < runs[system].wall:
                    runs[system] = result
        for name in dtypes:
            say(f"--- {name}")
            of_dtype = {key: run for (d, key), run in runs.items() if d == name}
            report(of_dtype, wanted, prompt_tokens, spec, args.adapters, peaks[name])
        if len(dtypes) > 1:
            low = dtypes[1]
            say(f"--- {low} against fp32 (tok/s ratio; by CPU time in brackets), same run")
            line = []
            for key in sorted({key for _, key in runs}):
                fast, base = runs[low, key], runs["fp32", key]
                line.append(f"({key}) {base.wall / fast.wall:.2f} [{base.cpu / fast.cpu:.2f}]")
            say(" ".join(line))
            ratio = runs["fp32", "a"].wall / runs[low, "a"].wall
            say(f"RESULT {low}/fp32 ours with adapters (a)={ratio:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def say(line: str) -> None:
    print(line, flush=True)


def report(runs: dict[str, Run], wanted: int, prompt_tokens: int, spec: TinyModelSpec, adapters: int, peak: float):
    labels = {
        "a": "(a) ours, all adapters resident",
        "b": "(b) PEFT batched, adapter_names",
        "c": "(c) PEFT one request at a time",
        "d": "(d) ours, no adapters",
        "e": "(e) ours, one adapter merged",
    }
    say(f"load average={os.getloadavg()[0]:.2f}")
    say(f"{'system':36s} {'wall s':>8s} {'tok/s':>9s} {'cpu s':>8s} {'tok/cpu-s':>10s}")
    for key in sorted(runs):
        run = runs[key]
        assert run.produced == wanted, f"{labels[key]} produced {run.produced} useful tokens, expected {wanted}"
        say(f"{labels[key]:36s} {run.wall:8.2f} {wanted / run.wall:9.1f} {run.cpu:8.2f} {wanted / run.cpu:10.1f}")
    c = spec
    kv = c.kv_heads * (c.hidden // c.heads)
    base_flops = 2 * c.layers * (c.hidden * (2 * c.hidden + 2 * kv) + 3 * c.hidden * c.intermediate_size)
    lora = lora_flops_per_token([RANKS[i % len(RANKS)] for i in range(adapters)], c.hidden, c.intermediate_size, kv,
                                c.layers)  # fmt: skip
    achieved = (prompt_tokens + wanted) * (base_flops + lora) / runs["a"].wall / 1e9
    say(f"(a) achieved {achieved:.1f} GFLOP/s = {achieved / peak:.0%} of the measured matmul rate")

    def ratios(time_of) -> tuple[float, float, float]:
        def vs(key: str) -> float:
            return time_of(runs[key]) / time_of(runs["a"]) if key in runs else float("nan")

        return vs("b"), vs("c"), time_of(runs["a"]) / time_of(runs["d"]) - 1

    cpu_ab, cpu_ac, cpu_overhead = ratios(lambda r: r.cpu)
    say(f"by CPU time: a/b={cpu_ab:.2f} a/c={cpu_ac:.2f} overhead={cpu_overhead * 100:.1f}% "
        f"a/e={runs['e'].cpu / runs['a'].cpu:.2f}")  # fmt: skip
    a_b, a_c, overhead = ratios(lambda r: r.wall)
    say(f"RESULT a/b={a_b:.2f} a/c={a_c:.2f} overhead={overhead * 100:.1f}%")


def merge_one(model_dir: Path, adapter_dir: Path, out_dir: Path) -> Path:
    """The base with one adapter merged into its weights (PEFT merge_and_unload)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    main()
