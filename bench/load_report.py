"""What a soak reports, and whether it passed: request counts, errors by kind, latency percentiles (with the
base model as the peer of adapters in the same run), and each process's memory at start and end against
a stated growth bound."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.load_clients import OK, RATE_LIMITED, Outcome
from bench.load_crash import Crash
from bench.load_training import TrainingLoad
from core.local_services import ManagedProcess

MIB = 1 << 20
BROKEN_BY_CRASH = "broken by the replica crash"
UPSTREAM_FAILED = "stream error (upstream_failed)"  # what a client reads when its replica dies mid-answer


@dataclass(frozen=True)
class RssBound:
    """Growth allowed between the start (after warm-up) and the end: ``absolute`` bytes or ``fraction`` of
    the start, whichever is larger. Warm-up takes the one-time growth (imports, caches, allocator arenas,
    every adapter placed once); what still grows steadily after it is a leak."""

    absolute: int = 64 * MIB
    fraction: float = 0.25

    def allows(self, start: int, end: int) -> bool:
        return end - start <= max(self.absolute, self.fraction * start)

    def __str__(self) -> str:
        return f"max({self.absolute // MIB} MiB, {self.fraction:.0%} of start)"


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its descendants (Linux /proc): a server's engine process and a
    worker's training child count with their parent."""
    total = 0
    for member in _tree(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:  # it ended meanwhile
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return total


def _tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # the field after the parenthesised command name is the state, then the parent's pid
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def rss_snapshot(processes: dict[str, ManagedProcess]) -> dict[str, int]:
    return {name: rss_bytes(p.pid) for name, p in processes.items() if p.pid is not None}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


@dataclass
class SoakReport:
    duration_s: float
    clients: int
    warmup: list[Outcome]
    outcomes: list[Outcome]
    rss_start: dict[str, int]
    rss_end: dict[str, int]
    bound: RssBound = field(default_factory=RssBound)
    crash: Crash | None = None
    training: TrainingLoad | None = None
    stores: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (start, end): reported, not bounded

    def kind(self, outcome: Outcome) -> str:
        """The outcome's kind, with streams the crash broke told apart from errors."""
        if self.crash is not None and outcome.kind == UPSTREAM_FAILED and self.crash.broke(outcome.ended_at):
            return BROKEN_BY_CRASH
        return outcome.kind

    @property
    def kinds(self) -> Counter[str]:
        return Counter(self.kind(o) for o in [*self.warmup, *self.outcomes])

    @property
    def errors(self) -> Counter[str]:
        expected = (OK, RATE_LIMITED, BROKEN_BY_CRASH)
        return Counter({k: n for k, n in self.kinds.items() if k not in expected})

    @property
    def memory_growth(self) -> dict[str, tuple[int, int, bool]]:
        """name -> (start, end, within the bound)."""
        return {n: (s, self.rss_end[n], self.bound.allows(s, self.rss_end[n])) for n, s in self.rss_start.items()}

    @property
    def ok(self) -> bool:
        """Every request succeeded, got a 429 with retry-after, or was a stream the crash broke; every training
        job succeeded; no process grew past the bound."""
        trained = self.training is None or not self.training.errors
        return not self.errors and trained and all(within for *_, within in self.memory_growth.values())

    def latencies(self, on_adapter: bool | None = None) -> list[float]:
        return [o.latency_s for o in self.outcomes if o.kind == OK and on_adapter in (None, o.on_adapter)]

    def render(self) -> str:
        done = [o for o in self.outcomes if o.kind == OK]
        lines = [
            f"soak: {self.duration_s:.0f} s measured, {self.clients} concurrent clients",
            f"requests: {len(self.outcomes)} measured ({len(done)} completed, {len(done) / self.duration_s:.1f}/s), "
            f"{len(self.warmup)} in warm-up",
            "outcomes (warm-up included): " + ", ".join(f"{k} {n}" for k, n in self.kinds.most_common()),
            f"errors: {dict(self.errors) or 'none'}",
            f"adapters served: {len({o.model for o in done if o.on_adapter})}",
        ]
        for label, which in (("all", None), ("adapter", True), ("base", False)):
            values = self.latencies(which)
            p50, p99 = percentile(values, 50) * 1000, percentile(values, 99) * 1000
            lines.append(f"latency {label:7s}: p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  (n={len(values)})")
        adapter, base = percentile(self.latencies(True), 50), percentile(self.latencies(False), 50)
        lines.append(f"adapter/base p50 latency ratio (peer: the base model, same run): {adapter / base:.2f}")
        structured = [o for o in self.outcomes if o.structured]
        lines.append(
            f"structured (JSON schema) requests: {sum(o.kind == OK for o in structured)} ok of {len(structured)}"
        )
        prompt, cached = sum(o.prompt_tokens for o in done), sum(o.cached_tokens for o in done)
        lines.append(
            f"prefix cache: {cached} of {prompt} prompt tokens read from cache ({cached / max(prompt, 1):.0%})"
        )
        if self.crash is not None:
            lines.append(f"{self.crash.render()}; streams broken mid-answer: {self.kinds[BROKEN_BY_CRASH]}")
        if self.training is not None:
            lines.append(self.training.render())
        lines.append(f"memory (RSS, start after warm-up -> end; bound {self.bound}):")
        for name, (start, end, within) in self.memory_growth.items():
            verdict = "ok" if within else "GREW PAST THE BOUND"
            lines.append(
                f"  {name:16s} {start / MIB:8.1f} MiB -> {end / MIB:8.1f} MiB  ({(end - start) / MIB:+.1f})  {verdict}"
            )
        for name, (start, end) in self.stores.items():
            lines.append(
                f"  {name:16s} {start / MIB:8.1f} MiB -> {end / MIB:8.1f} MiB  ({(end - start) / MIB:+.1f})  "
                "a data store: holds what was written, not bounded"
            )
        lines.append(
            "verdict: "
            + ("PASS: every request succeeded or got a 429 with retry-after" if self.ok else "FAIL")
            + (" (or was a stream the crash broke)" if self.ok and self.crash is not None else "")
        )
        return "\n".join(lines)
