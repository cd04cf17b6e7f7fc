"""What a soak reports, and whether it passed: request counts, errors by kind, latency percentiles (with the
base model as the peer of adapters in the same run), and each process's memory at start and end against
a stated growth bound."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.load_clients import OK, RATE_LIMITED, Outcome
from core.local_services import ManagedProcess

MIB = 1 << 20


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
    """Resident memory of process ``pid`` (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


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

    @property
    def kinds(self) -> Counter[str]:
        return Counter(o.kind for o in [*self.warmup, *self.outcomes])

    @property
    def errors(self) -> Counter[str]:
        return Counter({k: n for k, n in self.kinds.items() if k not in (OK, RATE_LIMITED)})

    @property
    def memory_growth(self) -> dict[str, tuple[int, int, bool]]:
        """name -> (start, end, within the bound)."""
        return {n: (s, self.rss_end[n], self.bound.allows(s, self.rss_end[n])) for n, s in self.rss_start.items()}

    @property
    def ok(self) -> bool:
        """Every request succeeded or got a 429 with retry-after, and no process grew past the bound."""
        return not self.errors and all(within for *_, within in self.memory_growth.values())

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
        lines.append(f"memory (RSS, start after warm-up -> end; bound {self.bound}):")
        for name, (start, end, within) in self.memory_growth.items():
            verdict = "ok" if within else "GREW PAST THE BOUND"
            lines.append(
                f"  {name:16s} {start / MIB:8.1f} MiB -> {end / MIB:8.1f} MiB  ({(end - start) / MIB:+.1f})  {verdict}"
            )
        lines.append(
            "verdict: " + ("PASS: every request succeeded or got a 429 with retry-after" if self.ok else "FAIL")
        )
        return "\n".join(lines)
