"""What one GPU lease must show (issue 22): each target's metric, bound, and whether a CPU dry run judges it.

The one owner of these numbers: ``bench/engine_gpu.py`` prints its ratios against them and
``bench/gpu/summary.py`` writes the pass/fail table from them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """A bound on one metric. ``op`` None: reported, never judged. ``perf``: a speed figure, which a CPU dry run
    at tiny sizes cannot meet or miss meaningfully, so there it is shown and not judged."""

    key: str
    what: str
    op: str | None = None  # ">=" | "<=" | None
    bound: float = 0.0
    perf: bool = False

    def met(self, value: float | None) -> bool | None:
        """True/False against the bound; None when the target is report-only. A missing value never meets it."""
        if self.op is None:
            return None
        if value is None:
            return False
        return value >= self.bound if self.op == ">=" else value <= self.bound

    @property
    def bound_text(self) -> str:
        return "report" if self.op is None else f"{self.op} {self.bound:g}"


TARGETS: tuple[Target, ...] = (
    Target("kernel_tests_passed", "kernel tests passed (pytest tests/unit/kernels)", ">=", 1),
    Target("kernel_tests_failed", "kernel tests failed or errored", "<=", 0),
    Target("kernel_tests_skipped", "kernel tests skipped"),
    Target("parity_fp32_identical", "fp32 greedy tokens identical to PEFT (fraction of requests)", ">=", 1.0),
    Target("parity_fp32_adapters_matter", "fp32 adapter requests whose tokens differ from the base's", ">=", 0.5),
    Target("parity_bf16_identical", "bf16 requests whose tokens all agree with PEFT (fraction)"),
    Target("parity_bf16_mean_prefix", "bf16 mean agreed prefix / max_tokens"),
    Target("kernel_bench_met", "kernels_gpu: add_lora >= 60% copy bw and >= 3x torch (1 = met)", ">=", 1, perf=True),
    Target("ours_vs_peft", "output tok/s: ours (graphs, adapters) / PEFT mixed batch", ">=", 10.0, perf=True),
    Target("lora_overhead", "LoRA overhead: ours base-only tok/s / ours with adapters - 1", "<=", 0.15, perf=True),
    Target("graphs_vs_eager_decode_b8", "decode tok/s at batch 8: graphs / enforce_eager", ">=", 1.5, perf=True),
    Target("decode_b8_copy_fraction", "decode at batch 8 (graphs): weight bytes read / copy bandwidth"),
)


def target(key: str) -> Target:
    """The target of ``key`` (KeyError if none)."""
    for t in TARGETS:
        if t.key == key:
            return t
    raise KeyError(key)
