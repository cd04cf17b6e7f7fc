"""Greedy tokens of our engine against transformers + PEFT on the same random model and mixed adapters.

    python bench/gpu/parity.py --dtype fp32 [--tiny] [--json out.json]

One mixed batch of requests over adapters of ranks 4-64 on different projections (and the base model) runs
through our engine, with decode CUDA graphs and with ``enforce_eager`` on CUDA (one eager run on CPU), and each
request runs alone through PEFT (eager attention: the plain reference). fp32: every request's tokens must equal
PEFT's, and adapters must change most answers (else parity would hold trivially); exit 1 otherwise. bf16: the
fraction of requests that agree fully and the mean agreed prefix are reported, never judged: rounding differs
between any two bf16 implementations, and a greedy path that meets a near-tie once diverges from there on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `bench` importable

from bench.gpu.peft_baseline import generate_one, load_peft_on
from server.engine import EngineConfig, SamplingParams
from server.offline import LLM
from tests.integration.engine.models import ALL_PROJECTIONS, hf_config, save_adapter, save_model

DTYPES = {"fp32": (torch.float32, "float32"), "bf16": (torch.bfloat16, "bfloat16")}
ADAPTERS = {
    "attn-r8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "mlp-r16": {"r": 16, "lora_alpha": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "all-r32": {"r": 32, "lora_alpha": 32, "target_modules": ALL_PROJECTIONS},
    "qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all-r64": {"r": 64, "lora_alpha": 64, "target_modules": ALL_PROJECTIONS},
}


@dataclass(frozen=True)
class Size:
    """The model's transformers config overrides, the adapters' B scale and the workload."""

    model: dict
    b_std: float  # B's scale: updates a sizeable fraction of the base projection's output at this width
    requests: int
    max_tokens: int
    prompt_lengths: tuple[int, int]


GPU = Size(
    {"vocab_size": 2048, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
     "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024},
    b_std=0.02, requests=21, max_tokens=32, prompt_lengths=(3, 200),
)  # fmt: skip
TINY = Size({}, b_std=0.5, requests=12, max_tokens=6, prompt_lengths=(3, 40))


def has_enforce_eager() -> bool:
    return "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}


def engine_modes(device: str) -> dict[str, dict]:
    """Engine settings to compare: with graphs and eager on CUDA; on CPU graphs never run, so one eager run."""
    if device != "cuda" or not has_enforce_eager():
        return {"eager": {}}
    return {"graphs": {"enforce_eager": False}, "eager": {"enforce_eager": True}}


def agreed_prefix(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens the two sequences share."""
    count = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        count += 1
    return count


def compare(got: list[list[int]], expected: list[list[int]], max_tokens: int) -> dict:
    """Fraction of requests identical, mean agreed prefix as a fraction of ``max_tokens``, and the first mismatch."""
    prefixes = [agreed_prefix(g, e) for g, e in zip(got, expected, strict=True)]
    same = [g == e for g, e in zip(got, expected, strict=True)]
    first = next((i for i, ok in enumerate(same) if not ok), None)
    return {
        "identical_fraction": sum(same) / len(same),
        "mean_prefix_fraction": sum(prefixes) / len(prefixes) / max_tokens,
        "first_mismatch": None if first is None else {"request": first, "ours": got[first], "peft": expected[first]},
    }


def run_engine(base: Path, dirs: dict[str, Path], requests, size: Size, dtype: str, pool: int, **kw) -> list[list[int]]:
    # max_num_seqs 32: decode graphs up to batch 32, so 21 requests decode padded to the bucket of 24.
    llm = LLM(base, dtype=dtype, pool_bytes=pool, max_lora_rank=64, max_adapters=len(dirs) or 1, max_num_seqs=32, **kw)
    for name, path in dirs.items():
        llm.load_adapter(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=size.max_tokens, ignore_eos=True, detokenize=False)
    return [out.outputs[0].token_ids for out in llm.generate([(p, a, params) for p, a in requests])]


def run_parity(dtype_name: str, size: Size, device: str) -> dict:
    """Build the model and adapters, run both sides, and return the comparison."""
    torch_dtype, engine_dtype = DTYPES[dtype_name]
    work = Path(tempfile.mkdtemp(prefix="loraplex-parity-"))
    try:
        base = save_model(work / "base", hf_config("llama", **size.model))
        dirs = {
            name: save_adapter(work / name, base, seed=i + 1, b_std=size.b_std, **kw)
            for i, (name, kw) in enumerate(ADAPTERS.items())
        }
        gen = torch.Generator().manual_seed(0)
        vocab = size.model.get("vocab_size", 96)
        names: list[str | None] = [*ADAPTERS, None]
        requests = []
        for i in range(size.requests):
            length = int(torch.randint(*size.prompt_lengths, (1,), generator=gen))
            requests.append((torch.randint(3, vocab, (length,), generator=gen).tolist(), names[i % len(names)]))
        peft = load_peft_on(base, dirs, torch_dtype, device, attn="eager")
        expected = [generate_one(peft, prompt, adapter, size.max_tokens) for prompt, adapter in requests]
        del peft
        pool = (1 << 30) if device == "cuda" else (64 << 20)
        result: dict = {"dtype": dtype_name, "device": device, "requests": len(requests), "max_tokens": size.max_tokens}
        result["modes"] = {}
        for mode, kw in engine_modes(device).items():
            got = run_engine(base, dirs, requests, size, engine_dtype, pool, **kw)
            result["modes"][mode] = compare(got, expected, size.max_tokens)
        without = run_engine(base, {}, [(p, None) for p, _ in requests], size, engine_dtype, pool)
        adapted = [(e, w) for (_, a), e, w in zip(requests, expected, without, strict=True) if a is not None]
        result["adapters_matter"] = sum(e != w for e, w in adapted) / len(adapted)
        result["identical_fraction"] = min(m["identical_fraction"] for m in result["modes"].values())
        result["mean_prefix_fraction"] = min(m["mean_prefix_fraction"] for m in result["modes"].values())
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the comparison; exit 1 when fp32 tokens differ or adapters change too few answers."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--tiny", action="store_true", help="the tiny model of the engine tests (CPU dry run)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = run_parity(args.dtype, TINY if args.tiny else GPU, device)
    judged = args.dtype == "fp32"
    result["passed"] = not judged or (result["identical_fraction"] == 1.0 and result["adapters_matter"] >= 0.5)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for mode, m in result["modes"].items():
        print(
            f"{args.dtype} {mode}: identical {m['identical_fraction']:.0%} of {result['requests']} requests, mean "
            f"agreed prefix {m['mean_prefix_fraction']:.0%} of {result['max_tokens']} tokens; "
            f"first mismatch: {m['first_mismatch']}"
        )
    print(f"adapter requests whose tokens differ from the base model's: {result['adapters_matter']:.0%}")
    print(f"PARITY {args.dtype}: {'PASS' if result['passed'] else 'FAIL'}" + ("" if judged else " (reported only)"))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
