"""What one request measured, what a whole run amounts to, and the side-by-side table with ratios."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks (numpy's default);
    NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


@dataclass
class RequestRecord:
    """One request as the client saw it; times are ``time.perf_counter()`` seconds."""

    index: int
    adapter: int
    wanted_tokens: int
    sent_at: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per chunk with tokens
    token_ids: list[int] = field(default_factory=list)  # what was generated, when the server sends ids
    finished_at: float | None = None
    output_tokens: int = 0
    error: str | None = None  # kind of failure; None when the stream completed
    cold_start: bool | None = None  # the server's own stats field, when it sends one

    def ttft(self) -> float | None:
        return self.arrivals[0][0] - self.sent_at if self.arrivals else None

    def token_gaps(self) -> list[float]:
        """Inter-token latencies: a chunk carrying k tokens after a gap g counts as k gaps of g/k."""
        gaps = []
        for (before, _), (at, tokens) in zip(self.arrivals, self.arrivals[1:], strict=False):
            gaps.extend([(at - before) / tokens] * tokens)
        return gaps


@dataclass
class RunSummary:
    """One system's run under the load."""

    system: str
    wall_s: float
    completed: int
    output_tokens: int
    errors: dict[str, int]
    short_outputs: int  # completed with fewer tokens than asked for (EOS when ignore_eos is not honoured)
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    e2e_p50: float
    cold_start_requests: int | None
    adapter_loads: dict[str, float] | None = None  # our server's load counter deltas, by source tier
    server_cpu_s: float | None = None

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.output_tokens / self.server_cpu_s if self.server_cpu_s else math.nan


def summarize(system: str, records: Sequence[RequestRecord], wall_s: float) -> RunSummary:
    """Throughput over ``wall_s`` and latency percentiles over the requests that completed."""
    done = [r for r in records if r.error is None]
    ttfts = [t for r in done if (t := r.ttft()) is not None]
    gaps = [g for r in done for g in r.token_gaps()]
    e2e = [r.finished_at - r.sent_at for r in done if r.finished_at is not None]
    reported = [r.cold_start for r in done if r.cold_start is not None]
    return RunSummary(
        system=system,
        wall_s=wall_s,
        completed=len(done),
        output_tokens=sum(r.output_tokens for r in done),
        errors=dict(Counter(r.error for r in records if r.error is not None)),
        short_outputs=sum(r.output_tokens < r.wanted_tokens for r in done),
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        itl_p50=percentile(gaps, 50),
        itl_p99=percentile(gaps, 99),
        e2e_p50=percentile(e2e, 50),
        cold_start_requests=sum(reported) if reported else None,
    )


def ratio(ours: float, peer: float) -> float:
    """``ours / peer``, NaN when either is missing or the peer is zero."""
    if peer is None or ours is None or math.isnan(peer) or math.isnan(ours) or peer == 0:
        return math.nan
    return ours / peer


@dataclass(frozen=True)
class Row:
    """A table row: how to read the value, and which way is better (None: no ratio)."""

    label: str
    value: Callable[[RunSummary], float | int | str | None]
    better: str | None = None  # "higher" or "lower"
    fmt: str = "{:.1f}"


ROWS: tuple[Row, ...] = (
    Row("requests/s", lambda s: s.requests_per_s, "higher", "{:.2f}"),
    Row("output tokens/s", lambda s: s.tokens_per_s, "higher"),
    Row("TTFT p50 ms", lambda s: s.ttft_p50 * 1e3, "lower"),
    Row("TTFT p99 ms", lambda s: s.ttft_p99 * 1e3, "lower"),
    Row("ITL p50 ms", lambda s: s.itl_p50 * 1e3, "lower"),
    Row("ITL p99 ms", lambda s: s.itl_p99 * 1e3, "lower"),
    Row("E2E latency p50 ms", lambda s: s.e2e_p50 * 1e3, "lower"),
    Row("wall s", lambda s: s.wall_s, None, "{:.1f}"),
    Row("completed requests", lambda s: s.completed, None, "{}"),
    Row("output tokens", lambda s: s.output_tokens, None, "{}"),
    Row("short outputs", lambda s: s.short_outputs, None, "{}"),
    Row("errors", lambda s: ", ".join(f"{k}={v}" for k, v in sorted(s.errors.items())) or "0", None, "{}"),
    Row("cold-start requests", lambda s: s.cold_start_requests, None, "{}"),
    Row("adapter loads", lambda s: _loads(s.adapter_loads), None, "{}"),
    Row("server CPU s", lambda s: s.server_cpu_s, None, "{:.1f}"),
    Row("output tokens/CPU-s", lambda s: s.tokens_per_cpu_s, "higher"),
)


def _loads(loads: dict[str, float] | None) -> str | None:
    if loads is None:
        return None
    total = int(sum(loads.values()))
    detail = ", ".join(f"{tier} {int(n)}" for tier, n in sorted(loads.items()) if n)
    return f"{total} ({detail})" if detail else str(total)


def _cell(value: float | int | str | None, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def table(ours: RunSummary, peer: RunSummary) -> list[str]:
    """Lines of the side-by-side table; the ratio column is >1 when ours is better (ours/peer for rates,
    peer/ours for latencies)."""
    width = max(len(_cell(row.value(s), row.fmt)) for row in ROWS for s in (ours, peer))
    width = max(width, len(ours.system), len(peer.system), 8)
    lines = [f"{'':22s} {ours.system:>{width}s} {peer.system:>{width}s} {'ratio':>7s}"]
    for row in ROWS:
        a, b = row.value(ours), row.value(peer)
        shown = "" if row.better is None else _cell(_row_ratio(row, a, b), "{:.2f}")
        lines.append(f"{row.label:22s} {_cell(a, row.fmt):>{width}s} {_cell(b, row.fmt):>{width}s} {shown:>7s}")
    return lines


def _row_ratio(row: Row, ours: object, peer: object) -> float:
    if not isinstance(ours, int | float) or not isinstance(peer, int | float):
        return math.nan
    return ratio(ours, peer) if row.better == "higher" else ratio(peer, ours)


def same_tokens(ours: Sequence[RequestRecord], peer: Sequence[RequestRecord]) -> tuple[int, int]:
    """Of the requests both systems completed with token ids, how many got identical tokens (same greedy work)."""
    theirs = {r.index: r.token_ids for r in peer if r.error is None and r.token_ids}
    both = [(r.token_ids, theirs[r.index]) for r in ours if r.error is None and r.token_ids and r.index in theirs]
    return sum(a == b for a, b in both), len(both)
