"""Multi-LoRA serving throughput on a GPU: our engine against transformers + PEFT, measured in the same run.

Workload: a random-init Llama with Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 / 8 heads of 64, MLP 8192,
vocabulary 128256, tied embeddings, rope theta 500000) in bf16, 64 adapters of rank 16 on all seven projections,
256 requests (prompts of 32-512 tokens, outputs of 16-128, seeded, EOS ignored so every system produces exactly
those tokens), one adapter per request in turn. Systems, on the same requests:

  graphs  our engine, adapters resident, decode replayed from CUDA graphs (the default on CUDA)
  eager   the same with ``enforce_eager=True``
  base    our engine with no adapters (graphs on): what LoRA costs us
  peft    transformers + PEFT, all adapters loaded, one left-padded ``generate(adapter_names=...)``

Each system runs a few short requests untimed, then ``--rounds`` interleaved rounds and keeps its fastest (PEFT
runs ``--peft-rounds`` of them: a round of it takes tens of seconds, and its noise cannot move a 10x verdict).
Decode at batch 8 is timed apart: 8 requests on 8 adapters generating D more tokens, minus the same requests
generating few, so prefill cancels. Prints ratios against the targets of ``bench/gpu/targets.py`` and writes
everything to ``--json``. ``--tiny``: tiny shapes in fp32, a few adapters and tokens: the CPU dry run of this
script (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.engine_cpu import warm_up
from bench.gpu.peft_baseline import Request, generate_mixed_batch, load_peft_on
from bench.gpu.random_model import LLAMA_3_2_1B, TINY, LlamaDims, describe, write_adapters, write_model
from bench.gpu.targets import target
from bench.kernels_gpu import copy_bandwidth
from server.engine import EngineConfig, SamplingParams
from server.offline import LLM


@dataclass(frozen=True)
class Setup:
    """Sizes of one run: the model, the adapters, the workload and the engine's limits."""

    dims: LlamaDims
    dtype: torch.dtype
    requests: int
    adapters: int
    rank: int
    prompt_lengths: tuple[int, int]
    output_lengths: tuple[int, ...]
    max_model_len: int
    pool_bytes: int
    decode_prompt: int
    decode_steps: int


GPU = Setup(LLAMA_3_2_1B, torch.bfloat16, 256, 64, 16, (32, 512), (16, 32, 64, 128), 1024, 8 << 30, 64, 128)
CPU_TINY = Setup(TINY, torch.float32, 12, 4, 8, (4, 24), (2, 4, 8), 128, 64 << 20, 8, 8)
DECODE_BATCH = 8
ENGINE_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def has_enforce_eager() -> bool:
    """Whether EngineConfig has ``enforce_eager`` (it came with the decode CUDA graphs); before, every run is eager."""
    return "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}


def make_workload(setup: Setup, seed: int) -> list[Request]:
    """``(prompt token ids, adapter name, output tokens)`` per request, adapters in turn."""
    rng = random.Random(seed)
    low, high = setup.prompt_lengths
    return [
        (
            [rng.randrange(3, setup.dims.vocab) for _ in range(rng.randint(low, high))],
            f"a{i % setup.adapters}",
            rng.choice(setup.output_lengths),
        )
        for i in range(setup.requests)
    ]


def without_adapters(workload: list[Request]) -> list[Request]:
    return [(prompt, None, n) for prompt, _, n in workload]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def make_engine(model_dir: Path, adapter_dirs: dict[str, Path], setup: Setup, eager: bool) -> LLM:
    """Our engine with ``adapter_dirs`` resident. Prefix caching is off: every round repeats the same prompts, and
    PEFT recomputes them each time."""
    kwargs: dict[str, Any] = {
        "dtype": ENGINE_DTYPES[setup.dtype],
        "pool_bytes": setup.pool_bytes,
        "max_lora_rank": setup.rank,
        "max_adapters": max(1, setup.adapters),
        "max_num_seqs": setup.requests,
        "max_model_len": setup.max_model_len,
        "enable_prefix_caching": False,
    }
    if has_enforce_eager():
        kwargs["enforce_eager"] = eager
    llm = LLM(model_dir, **kwargs)
    for name, path in adapter_dirs.items():
        llm.load_adapter(name, path)
    return llm


def graphs_captured(llm: LLM) -> bool:
    return getattr(llm.engine.runner, "graphs", None) is not None


def run_ours(llm: LLM, workload: list[Request], device: str) -> tuple[float, int]:
    """Wall seconds to finish ``workload`` and the output tokens produced (token ids out: no detokenization)."""
    requests = [
        (prompt, adapter, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False))
        for prompt, adapter, n in workload
    ]
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(requests)
    sync(device)
    return time.perf_counter() - start, sum(len(out.outputs[0].token_ids) for out in outputs)


def run_peft(model: Any, workload: list[Request], device: str) -> tuple[float, int]:
    sync(device)
    start = time.perf_counter()
    produced = generate_mixed_batch(model, workload)
    sync(device)
    return time.perf_counter() - start, produced


def decode_rate(llm: LLM, setup: Setup, adapters: list[str | None], device: str, repeats: int = 3) -> float:
    """Output tok/s of decode alone at batch 8: the same 8 requests run to ``decode_steps`` more tokens and to a few,
    the difference timed (prefill and the first tokens cancel); the fastest of ``repeats``."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, setup.dims.vocab) for _ in range(setup.decode_prompt)] for _ in range(DECODE_BATCH)]
    few = 2

    def timed(tokens: int) -> float:
        batch = [(p, adapters[i % len(adapters)], tokens) for i, p in enumerate(prompts)]
        return run_ours(llm, batch, device)[0]

    timed(few + setup.decode_steps)  # untimed: kernels of these shapes compile or get picked
    best = min(timed(few + setup.decode_steps) - timed(few) for _ in range(repeats))
    return DECODE_BATCH * setup.decode_steps / max(best, 1e-9)


def decode_figures(engines: dict[str, LLM], setup: Setup, adapters: list[str], device: str) -> dict:
    """Decode tok/s at batch 8 with graphs and eager (8 distinct adapters), their ratio, and the rate at which the
    graphs read the weights (every step reads all of them once) beside the copy bandwidth measured now."""
    names: list[str | None] = list(adapters[:DECODE_BATCH]) or [None]
    graphs, eager = (decode_rate(engines[mode], setup, names, device) for mode in ("graphs", "eager"))
    copy_bw = copy_bandwidth(device, 1 << 30 if device == "cuda" else 1 << 24)
    step_bytes = setup.dims.params() * torch.finfo(setup.dtype).bits // 8 + adapter_bytes(setup, len(names))
    fraction = graphs / DECODE_BATCH * step_bytes / copy_bw
    say(f"decode at batch {DECODE_BATCH}: graphs {graphs:.0f} tok/s, eager {eager:.0f} tok/s; graphs read the "
        f"weights at {fraction:.0%} of copy bandwidth ({copy_bw / 1e9:.0f} GB/s)")  # fmt: skip
    return {
        "graphs_tok_s": graphs,
        "eager_tok_s": eager,
        "bytes_per_step": step_bytes,
        "copy_bw_gbs": copy_bw / 1e9,
        "graphs_vs_eager": graphs / eager,
        "copy_fraction": fraction,
    }


def adapter_bytes(setup: Setup, count: int) -> int:
    """Bytes of ``count`` adapters' A and B over every layer, in the run's dtype."""
    widths = sum(i + o for i, o in setup.dims.projection_shapes().values())
    return count * setup.dims.layers * setup.rank * widths * torch.finfo(setup.dtype).bits // 8


def run_benchmark(setup: Setup, device: str, rounds: int, peft_rounds: int, seed: int, json_path: Path | None) -> dict:
    """Build the model and adapters, time every system, and return (and write to ``json_path`` after every round,
    so a run cut short still leaves its figures) the results with their ratios."""
    work = Path(tempfile.mkdtemp(prefix="loraplex-engine-gpu-"))
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "dtype": str(setup.dtype).removeprefix("torch."),
        "model": describe(setup.dims),
        "adapters": setup.adapters,
        "rank": setup.rank,
        "enforce_eager_field": has_enforce_eager(),
        "systems": {},
        "ratios": {},
    }

    def save() -> None:
        if json_path is not None:
            json_path.write_text(json.dumps(result, indent=2) + "\n")

    try:
        start = time.perf_counter()
        model_dir = write_model(work / "base", setup.dims, setup.dtype, device)
        paths = write_adapters(work / "adapters", setup.dims, setup.adapters, setup.rank, setup.dtype, device)
        adapter_dirs = {f"a{i}": path for i, path in enumerate(paths)}
        workload = make_workload(setup, seed)
        wanted = sum(n for _, _, n in workload)
        result.update(
            requests=len(workload),
            prompt_tokens=sum(len(p) for p, _, _ in workload),
            output_tokens=wanted,
            build_s=round(time.perf_counter() - start, 1),
        )
        say(f"model {setup.dims.params() / 1e9:.2f}B params, {setup.adapters} adapters of rank {setup.rank}, "
            f"{len(workload)} requests, {wanted} output tokens; written in {result['build_s']} s")  # fmt: skip

        start = time.perf_counter()
        engines = {
            "graphs": make_engine(model_dir, adapter_dirs, setup, eager=False),
            "eager": make_engine(model_dir, adapter_dirs, setup, eager=True),
            "base": make_engine(model_dir, {}, setup, eager=False),
        }
        result["graphs_captured"] = graphs_captured(engines["graphs"])
        result["engines_s"] = round(time.perf_counter() - start, 1)
        say(f"engines up in {result['engines_s']} s; graphs captured: {result['graphs_captured']}")

        # Decode at batch 8 first: the figure that needs the least time, kept even if a later stage runs out.
        result["decode_b8"] = decode_figures(engines, setup, list(adapter_dirs), device)
        result["ratios"]["graphs_vs_eager_decode_b8"] = result["decode_b8"].pop("graphs_vs_eager")
        result["ratios"]["decode_b8_copy_fraction"] = result["decode_b8"].pop("copy_fraction")
        save()

        systems: dict[str, Callable[[], tuple[float, int]]] = {
            "graphs": lambda: run_ours(engines["graphs"], workload, device),
            "eager": lambda: run_ours(engines["eager"], workload, device),
            "base": lambda: run_ours(engines["base"], without_adapters(workload), device),
        }
        for mode, llm in engines.items():
            run_ours(llm, warm_up(workload if mode != "base" else without_adapters(workload)), device)
        peft_model = None
        for round_ in range(rounds):
            for name, run in systems.items():
                record(result, name, *run(), wanted)
                save()  # after every system: a stage cut short by its time limit keeps what it measured
            if round_ < peft_rounds:
                if peft_model is None:  # loaded after our first round, so that round is saved however PEFT fares
                    start = time.perf_counter()
                    peft_model = load_peft_on(model_dir, adapter_dirs, setup.dtype, device)
                    run_peft(peft_model, warm_up(workload), device)
                    say(f"PEFT loaded and warmed up in {time.perf_counter() - start:.1f} s")
                record(result, "peft", *run_peft(peft_model, workload, device), wanted)
                save()
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def record(result: dict, system: str, wall: float, produced: int, wanted: int) -> None:
    """Add one round of ``system`` (it keeps its fastest) and update the ratios."""
    entry = result["systems"].setdefault(system, {"rounds_s": []})
    entry["rounds_s"].append(round(wall, 4))
    best = min(entry["rounds_s"])
    entry.update(wall_s=best, tok_s=wanted / best, produced=produced, complete=produced == wanted)
    say(f"{system:7s} {wall:7.2f} s {wanted / wall:9.0f} tok/s" + ("" if produced == wanted else
        f"  (produced {produced} useful tokens, expected {wanted})"))  # fmt: skip
    ratios(result)


def ratios(result: dict) -> None:
    """The workload's ratios from the systems' fastest rounds so far."""
    systems, out = result["systems"], result["ratios"]
    tok_s = {name: entry["tok_s"] for name, entry in systems.items()}
    if "graphs" in tok_s and "peft" in tok_s:
        out["ours_vs_peft"] = tok_s["graphs"] / tok_s["peft"]
    if "graphs" in tok_s and "base" in tok_s:
        out["lora_overhead"] = tok_s["base"] / tok_s["graphs"] - 1
    if "graphs" in tok_s and "eager" in tok_s:
        out["graphs_vs_eager_workload"] = tok_s["graphs"] / tok_s["eager"]


def say(line: str) -> None:
    print(line, flush=True)


def report(result: dict) -> None:
    say(f"--- {result['device']}, {result['dtype']}")
    for key, value in result["ratios"].items():
        try:
            t = target(key)
        except KeyError:
            say(f"{key} = {value:.3f}")
            continue
        verdict = "" if t.op is None else f"  target {t.bound_text}: {'met' if t.met(value) else 'NOT met'}"
        say(f"RESULT {key} = {value:.3f}{verdict}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code (0: it ran; the targets are judged by the summary)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 model, few adapters and tokens (CPU dry run)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of our systems; each keeps its fastest")
    parser.add_argument("--peft-rounds", type=int, default=1, help="rounds of PEFT among them (0: skip PEFT)")
    parser.add_argument("--requests", type=int, default=None, help="override the number of requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.tiny:
        print("bench/engine_gpu.py needs a CUDA GPU; on CPU run it with --tiny", file=sys.stderr)
        return 2
    setup = CPU_TINY if args.tiny else GPU
    if args.requests:
        setup = dataclasses.replace(setup, requests=args.requests)
    if not has_enforce_eager():
        say("EngineConfig has no enforce_eager yet: 'graphs' and 'eager' both run eagerly")
    result = run_benchmark(setup, device, args.rounds, min(args.peft_rounds, args.rounds), args.seed, args.json)
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
