"""The adapter-scale benchmark's plan and figures: which phases run in which order, and what they add up to.

A phase is one workload: the base model alone, or ``count`` distinct adapters drawn with Zipf or uniform
popularity. Every system runs every phase it can on the same request sequence; the order of systems rotates
from phase to phase so that a slow patch of a shared machine does not always land on the same one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.model_profile import ProcessProfile
from bench.serve_stats import RunSummary

BASE = 0  # a phase's count for "no adapter: the base model"
ZIPF, UNIFORM = "zipf", "uniform"
ZIPF_EXPONENT = 1.0


@dataclass(frozen=True)
class Phase:
    count: int  # distinct adapters in the workload; BASE for none
    popularity: str  # ZIPF or UNIFORM; ZIPF for a single adapter or none, where it makes no difference

    @property
    def label(self) -> str:
        if self.count == BASE:
            return "base model"
        return f"{self.count} adapter" if self.count == 1 else f"{self.count} adapters, {self.popularity}"

    @property
    def zipf_exponent(self) -> float:
        return ZIPF_EXPONENT if self.popularity == ZIPF else 0.0


def phases(counts: Sequence[int]) -> list[Phase]:
    """The base model, then each count once (1 adapter) or twice (Zipf, then uniform popularity)."""
    if any(c < 1 for c in counts):
        raise ValueError("adapter counts must be >= 1")
    plan = [Phase(BASE, ZIPF)]
    for count in sorted(set(counts)):
        plan.append(Phase(count, ZIPF))
        if count > 1:
            plan.append(Phase(count, UNIFORM))
    return plan


def rotated(systems: Sequence[str], turn: int) -> list[str]:
    """``systems`` starting at position ``turn`` (mod their number): who goes first changes every phase."""
    k = turn % len(systems)
    return [*systems[k:], *systems[:k]]


@dataclass
class PhaseResult:
    """What each system measured in one phase, and whether its greedy tokens equal ours."""

    phase: Phase
    runs: dict[str, RunSummary] = field(default_factory=dict)
    same_as_ours: dict[str, tuple[int, int]] = field(default_factory=dict)  # system -> (identical, compared)
    profiles: dict[str, list[ProcessProfile]] = field(default_factory=dict)  # system -> py-spy, with --profile

    def counts(self, system: str) -> bool:
        """A peer's row counts only when every request both completed produced the same tokens as ours."""
        run = self.runs.get(system)
        if run is None or run.errors:
            return False
        same, compared = self.same_as_ours.get(system, (0, 0))
        return system == "ours" or (compared > 0 and same == compared)

    def ratio(self, system: str, peer: str) -> float:
        """``system``'s output tok/s over ``peer``'s in this phase (NaN when either row does not count)."""
        if not (self.counts(system) and self.counts(peer)):
            return math.nan
        return self.runs[system].tokens_per_s / self.runs[peer].tokens_per_s


def scale_retention(results: Sequence[PhaseResult], system: str, popularity: str) -> dict[int, float]:
    """Per adapter count: ``system``'s tok/s at that count and popularity over its tok/s with one adapter."""
    single = next((r for r in results if r.phase.count == 1 and r.counts(system)), None)
    if single is None:
        return {}
    base = single.runs[system].tokens_per_s
    out = {}
    for r in results:
        if r.phase.count > 1 and r.phase.popularity == popularity and r.counts(system):
            out[r.phase.count] = r.runs[system].tokens_per_s / base
    return out


def table(results: Sequence[PhaseResult], systems: Sequence[str]) -> list[str]:
    """One line per phase: each system's tok/s, TTFT p50 and ITL p50/p99, ours' ratio to each peer, and how
    many of each peer's requests matched ours token for token."""
    peers = [s for s in systems if s != "ours"]
    head = f"{'phase':<26}" + "".join(f"{s + ' tok/s':>13}" for s in systems)
    head += "".join(f"{'vs ' + p:>9}" for p in peers) + "".join(f"{p + ' same':>12}" for p in peers)
    head += f"{'ours TTFT p50':>15}{'ours ITL p50/p99':>18}{'ours loads':>26}"
    lines = [head]
    for r in results:
        line = f"{r.phase.label:<26}"
        for s in systems:
            run = r.runs.get(s)
            cell = "-" if run is None else (f"{run.tokens_per_s:.1f}" + ("" if r.counts(s) else "*"))
            line += f"{cell:>13}"
        for p in peers:
            ratio = r.ratio("ours", p)
            line += f"{'-' if math.isnan(ratio) else f'{ratio:.2f}x':>9}"
        for p in peers:
            same, compared = r.same_as_ours.get(p, (0, 0))
            line += f"{f'{same}/{compared}' if p in r.runs else '-':>12}"
        ours = r.runs.get("ours")
        loads = ""
        if ours is not None:
            line += f"{1e3 * ours.ttft_p50:>13.1f}ms{1e3 * ours.itl_p50:>10.1f}/{1e3 * ours.itl_p99:.1f}ms"
            loads = ", ".join(f"{k} {int(v)}" for k, v in sorted((ours.adapter_loads or {}).items()) if v)
        lines.append(line + f"{loads or '-':>26}")
    return lines


def plot(results: Sequence[PhaseResult], systems: Sequence[str], path: Path, title: str) -> None:
    """Output tok/s against the number of adapters (log scale), a line per system and popularity; the base
    model's figure as a dotted line per system. Needs matplotlib (``pip install -e '.[bench]'``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    for i, system in enumerate(systems):
        color = f"C{i}"
        for popularity, style in ((ZIPF, "-o"), (UNIFORM, "--s")):
            points = [(r.phase.count, r.runs[system].tokens_per_s) for r in results
                      if r.phase.count >= 1 and r.counts(system)
                      and (r.phase.popularity == popularity or r.phase.count == 1)]  # fmt: skip
            if len(points) > 1:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(xs, ys, style, color=color, label=f"{system}, {popularity}")
        base = next((r for r in results if r.phase.count == BASE and r.counts(system)), None)
        if base is not None:
            ax.axhline(base.runs[system].tokens_per_s, color=color, linestyle=":", linewidth=1,
                       label=f"{system}, base model")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("distinct adapters in the workload")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
