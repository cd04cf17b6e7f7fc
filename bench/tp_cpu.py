"""Tensor parallelism on CPU (gloo): what crosses between the ranks per decode step, and tok/s at 1 and 2 ranks.

    python bench/tp_cpu.py                        # hidden 512, 8 layers, 8 adapters of ranks 8/16/32
    python bench/tp_cpu.py --hidden 256 --layers 4 --requests 8 --rounds 1

Prints, measured on rank 0 over one decode-only step of the workload:
* all-reduces per step and their bytes, with every row using an adapter and with none: the same count and bytes
  (two per layer and one for the embedding), because each row-parallel LoRA delta is summed inside its
  projection's all-reduce; and the logits gather;
* the adapter bytes each rank holds, against a whole copy on one rank (column-parallel B and row-parallel A
  are split, the other factor is kept whole);
* output tok/s of one rank (both cores) and of two ranks (one core each) on the same requests, greedy tokens
  checked equal first. No target: two cores cannot go faster split in two; the point is the pattern above.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

from bench.common import bench_model, make_adapters
from core.tiny_model import make_tiny_model
from server.engine import SamplingParams
from server.offline import LLM

POOL_BYTES = 64 << 20


def engine(model_dir: Path, adapters: list[Path], world: int) -> LLM:
    """An engine over ``world`` ranks sharing the two cores between them, with every adapter resident."""
    llm = LLM(model_dir, pool_bytes=POOL_BYTES, max_lora_rank=32, tensor_parallel_size=world, num_threads=2 // world)
    for i, path in enumerate(adapters):
        llm.load_adapter(f"a{i}", path)
    return llm


def workload(
    num_requests: int, num_adapters: int, max_tokens: int
) -> list[tuple[list[int], str | None, SamplingParams]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    return [
        ([4 + (7 * i + j) % 250 for j in range(24 + i % 17)], f"a{i % num_adapters}", params)
        for i in range(num_requests)
    ]


def collectives_per_decode_step(llm: LLM, requests) -> dict[str, float]:
    """Rank 0's collective counts and bytes over one step in which every request decodes."""
    engine_ = llm.engine
    for i, (prompt, adapter, params) in enumerate(requests):
        engine_.add_request(f"probe-{adapter}-{i}", prompt, params, adapter)
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine_.scheduler.running) or (
        engine_.scheduler.waiting
    ):
        engine_.step()
    tp = engine_.runner.model.tp
    before = (tp.all_reduces, tp.all_reduce_bytes, tp.gathers, tp.gather_bytes)
    engine_.step()
    after = (tp.all_reduces, tp.all_reduce_bytes, tp.gathers, tp.gather_bytes)
    while engine_.has_unfinished_requests():
        engine_.step()
    reduces, reduce_bytes, gathers, gather_bytes = (b - a for a, b in zip(before, after, strict=True))
    return {"all_reduces": reduces, "all_reduce_bytes": reduce_bytes, "gathers": gathers, "gather_bytes": gather_bytes}


def adapter_bytes(llm: LLM, names: list[str]) -> int:
    stats = llm.engine.pool_stats()
    return sum(llm.engine.adapters.resident[name].num_pages for name in names) * stats.page_bytes


def timed(llm: LLM, requests) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outputs = llm.generate(requests)
    seconds = time.perf_counter() - start
    return seconds, [out.outputs[0].token_ids for out in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="loraplex-tp-") as tmp:
        spec = bench_model(args.hidden, args.layers)
        model_dir = make_tiny_model(Path(tmp) / "model", spec)
        adapters = make_adapters(model_dir, Path(tmp), args.adapters)
        requests = workload(args.requests, args.adapters, args.max_tokens)
        names = [f"a{i}" for i in range(args.adapters)]
        one, two = engine(model_dir, adapters, 1), engine(model_dir, adapters, 2)
        try:
            print(f"model: hidden {spec.hidden}, {spec.layers} layers, {spec.heads}/{spec.kv_heads} heads; "
                  f"{args.adapters} adapters of ranks 8/16/32 on all seven projections")  # fmt: skip
            base = [(prompt, None, params) for prompt, _, params in requests]
            for label, batch in (("with adapters", requests), ("base only", base)):
                c = collectives_per_decode_step(two, batch)
                print(f"decode step of {len(batch)} rows, {label}: {c['all_reduces']} all-reduces "
                      f"({c['all_reduce_bytes'] / 1024:.1f} KiB), {c['gathers']} logits gather "
                      f"({c['gather_bytes'] / 1024:.1f} KiB)")  # fmt: skip
            whole, per_rank = adapter_bytes(one, names), adapter_bytes(two, names)
            print(f"adapter bytes: {whole / 2**20:.2f} MiB on one rank; {per_rank / 2**20:.2f} MiB on each of two "
                  f"({per_rank / whole:.2f}x)")  # fmt: skip
            rates: dict[int, list[float]] = {1: [], 2: []}
            tokens: dict[int, list[list[int]]] = {}
            for round_ in range(args.rounds):
                for world, llm in ((1, one), (2, two)) if round_ % 2 == 0 else ((2, two), (1, one)):
                    seconds, tokens[world] = timed(llm, requests)
                    rates[world].append(sum(map(len, tokens[world])) / seconds)
            if tokens[1] != tokens[2]:
                raise SystemExit("the two-rank engine's greedy tokens differ from one rank's: no timing counts")
            one_rate, two_rate = statistics.median(rates[1]), statistics.median(rates[2])
            print(f"output tok/s: one rank {one_rate:.1f}, two ranks {two_rate:.1f} ({two_rate / one_rate:.2f}x; "
                  f"{args.rounds} interleaved rounds, medians; greedy tokens equal)")  # fmt: skip
        finally:
            one.close()
            two.close()


if __name__ == "__main__":
    main()
