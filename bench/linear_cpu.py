"""Dense projections on CPU: our panel GEMM (``loraplex_kernels/cpu_gemm.c``) against oneDNN's packed matmul.

Both run every projection of the engine benchmark's model (hidden 512, intermediate 1408, 8 layers: q/k/v,
o, gate/up and down, 94 MB of fp32 weights, more than the last-level cache, as in a real decode step) at the
row counts engine steps have: decode batches of 1-64 tokens and prefill chunks. Rounds alternate between the
two and each keeps its fastest. Prints ms per pass over all layers, GFLOP/s and weight GB/s per row count,
and ends with ``RESULT panels/onednn min=<x> geomean=<y>`` (speed ratio: above 1 means the panels are faster).
Run: ``python bench/linear_cpu.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: make `bench` importable

import server.model.linear as linear_module
from loraplex_kernels.cpu_linear import PanelWeight, panel_gemm_suits, panel_linear
from server.model.linear import Linear

HIDDEN, INTERMEDIATE, LAYERS, KV = 512, 1408, 8, 256
SHAPES = {  # projection group: (in_features, out_features)
    "qkv": (HIDDEN, HIDDEN + 2 * KV),
    "o": (HIDDEN, HIDDEN),
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),
    "down": (INTERMEDIATE, HIDDEN),
}
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 256, 1024)


def onednn_linear(weight_t: torch.Tensor) -> Linear:
    """A ``Linear`` packed for oneDNN, as the engine packs weights where the panel GEMM is not used."""
    suits, linear_module.panel_gemm_suits = linear_module.panel_gemm_suits, lambda weight_t: False
    try:
        return Linear(weight_t)
    finally:
        linear_module.panel_gemm_suits = suits


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = {
        name: [torch.randn(i, o, generator=gen) * 0.02 for _ in range(LAYERS)] for name, (i, o) in SHAPES.items()
    }
    if not panel_gemm_suits(weights["o"][0]):
        sys.exit("the panel GEMM is not used on this machine (no C compiler, or no AVX-512): nothing to compare")
    panels = {name: [PanelWeight.pack(w) for w in ws] for name, ws in weights.items()}
    onednn = {name: [onednn_linear(w) for w in ws] for name, ws in weights.items()}
    params = sum(i * o for i, o in SHAPES.values()) * LAYERS
    print(f"threads={torch.get_num_threads()} weights={params * 4 / 1e6:.0f} MB over {LAYERS} layers", flush=True)
    print(f"{'rows':>5s} {'oneDNN ms':>10s} {'panels ms':>10s} {'panels GFLOP/s':>15s} {'GB/s':>6s} {'ratio':>6s}")
    ratios = []
    for rows in ROWS:
        xs = {name: torch.randn(rows, i, generator=gen) for name, (i, _) in SHAPES.items()}

        def run_panels(xs: dict[str, torch.Tensor] = xs) -> None:
            for n in range(LAYERS):
                for name in SHAPES:
                    panel_linear(xs[name], panels[name][n])

        def run_onednn(xs: dict[str, torch.Tensor] = xs) -> None:
            for n in range(LAYERS):
                for name in SHAPES:
                    onednn[name][n](xs[name])

        run_panels(), run_onednn()  # warm: oneDNN builds its kernels for this row count
        times = {"panels": math.inf, "onednn": math.inf}
        for _ in range(args.rounds):  # alternate, so a slow spell on a shared machine hits both
            times["panels"] = min(times["panels"], best_seconds(run_panels, 2))
            times["onednn"] = min(times["onednn"], best_seconds(run_onednn, 2))
        ratio = times["onednn"] / times["panels"]
        ratios.append(ratio)
        print(f"{rows:5d} {times['onednn'] * 1e3:10.2f} {times['panels'] * 1e3:10.2f} "
              f"{2 * rows * params / times['panels'] / 1e9:15.1f} {4 * params / times['panels'] / 1e9:6.1f} "
              f"{ratio:6.2f}", flush=True)  # fmt: skip
    geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"RESULT panels/onednn min={min(ratios):.2f} geomean={geomean:.2f}")


if __name__ == "__main__":
    main()
