"""Percentiles, per-request latencies, run summaries and the ratio table of the serving benchmark."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from bench.serve_stats import RequestRecord, percentile, ratio, same_tokens, summarize, table
from bench.serve_systems import counter_by_label, delta, process_cpu_seconds


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 99, 3.97),
        ([1, 2, 3, 4], 0, 1),
        ([1, 2, 3, 4], 100, 4),
        ([4, 1, 3, 2], 25, 1.75),  # order of the input does not matter
        ([7.0], 99, 7.0),
    ],
)
def test_percentile_interpolates_between_closest_ranks(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_nan_and_out_of_range_is_refused() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def record(index: int, arrivals: list[tuple[float, int]], wanted: int = 3, error: str | None = None,
           ids: list[int] | None = None) -> RequestRecord:  # fmt: skip
    r = RequestRecord(index, adapter=0, wanted_tokens=wanted, sent_at=10.0, arrivals=arrivals, error=error)
    r.output_tokens = sum(n for _, n in arrivals)
    r.finished_at = arrivals[-1][0] if arrivals else None
    r.token_ids = ids or []
    return r


def test_ttft_and_inter_token_gaps_per_token() -> None:
    r = record(0, [(10.5, 1), (10.6, 1), (10.9, 3)], wanted=5)
    assert r.ttft() == pytest.approx(0.5)
    # a chunk of 3 tokens after 0.3 s counts as three gaps of 0.1 s
    assert r.token_gaps() == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_summary_counts_only_completed_requests_and_groups_errors() -> None:
    records = [
        record(0, [(10.1, 1), (10.2, 1), (10.3, 1)]),
        record(1, [(10.3, 1), (10.4, 1)]),  # two of three tokens: short
        record(2, [], error="http 429"),
        record(3, [], error="http 429"),
        record(4, [], error="timeout"),
    ]
    s = summarize("ours", records, wall_s=2.0)
    assert (s.completed, s.output_tokens, s.short_outputs) == (2, 5, 1)
    assert s.errors == {"http 429": 2, "timeout": 1}
    assert s.requests_per_s == pytest.approx(1.0) and s.tokens_per_s == pytest.approx(2.5)
    assert s.ttft_p50 == pytest.approx(0.2)
    assert s.cold_start_requests is None  # no server stats field seen


def test_ratio_column_is_above_one_when_ours_is_better() -> None:
    fast = summarize("ours", [record(0, [(10.1, 1), (10.2, 1), (10.3, 1)])], wall_s=1.0)
    slow = summarize("PEFT", [record(0, [(10.4, 1), (10.6, 1), (10.8, 1)])], wall_s=2.0)
    rows = {line[:22].strip(): line.split()[-1] for line in table(fast, slow)[1:]}
    assert rows["output tokens/s"] == "2.00"  # 3/1 vs 3/2 tokens per second
    assert rows["TTFT p50 ms"] == "4.00"  # 400 ms vs 100 ms
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))


def test_same_tokens_compares_requests_both_completed() -> None:
    ours = [record(0, [(10.1, 2)], ids=[5, 6]), record(1, [(10.1, 2)], ids=[7, 8]), record(2, [], error="timeout")]
    peer = [record(0, [(10.1, 2)], ids=[5, 6]), record(1, [(10.1, 2)], ids=[7, 9]), record(2, [(10.1, 1)], ids=[1])]
    assert same_tokens(ours, peer) == (1, 2)


@pytest.mark.parametrize("declared", ["loraplex_adapter_loads", "loraplex_adapter_loads_total"])
def test_adapter_load_counters_are_read_from_the_exposition(declared: str) -> None:
    exposition = (
        f"# HELP {declared} Adapters placed in the pool.\n"
        f"# TYPE {declared} counter\n"
        'loraplex_adapter_loads_total{tier="local"} 3.0\n'
        'loraplex_adapter_loads_total{tier="host"} 5.0\n'
        "# TYPE loraplex_prompt_tokens counter\n"
        "loraplex_prompt_tokens_total 99.0\n"
    )
    before = counter_by_label(exposition, "loraplex_adapter_loads", "tier")
    assert before == {"local": 3.0, "host": 5.0}
    assert delta({"local": 4.0, "host": 5.0, "store": 1.0}, before) == {"local": 1.0, "host": 0.0, "store": 1.0}


SPIN = "import sys, time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nsys.stdin.read()"
WAIT_FOR_CHILD = (
    "import subprocess, sys\n"
    f"child = subprocess.Popen([sys.executable, '-c', {SPIN!r}], stdin=subprocess.PIPE)\n"
    "print(child.pid, flush=True)\n"
    "sys.stdin.read()\n"
    "child.kill()\n"
)


def test_a_servers_cpu_seconds_include_its_child_processes() -> None:
    """vLLM runs its engine in a child process: the server's CPU time must count it."""
    parent = subprocess.Popen([sys.executable, "-c", WAIT_FOR_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while process_cpu_seconds(child) < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_cpu_seconds(child) >= 0.45
        assert process_cpu_seconds(parent.pid) >= 0.45  # the parent itself only waits: most of this is its child's
    finally:
        parent.kill()
        parent.wait()
