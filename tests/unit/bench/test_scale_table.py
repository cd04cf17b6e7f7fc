"""The adapter-scale benchmark's phase plan, its rule for which rows count, and the figures it reports."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors.torch import load_file

from bench.common import ADAPTER_CONFIG, ADAPTER_WEIGHTS, RANKS, adapter_dir_name, make_many_adapters
from bench.scale_table import BASE, UNIFORM, ZIPF, Phase, PhaseResult, phases, rotated, scale_retention, table
from bench.serve_stats import RunSummary
from core.tiny_model import TinyModelSpec, make_tiny_model


def run(system: str, tokens_per_s: float, errors: dict[str, int] | None = None) -> RunSummary:
    return RunSummary(system, wall_s=1.0, completed=10, output_tokens=int(tokens_per_s), errors=errors or {},
                      short_outputs=0, ttft_p50=0.02, ttft_p99=0.05, itl_p50=0.004, itl_p99=0.012, e2e_p50=0.3,
                      cold_start_requests=None)  # fmt: skip


def result(count: int, popularity: str, **tok_s: float) -> PhaseResult:
    r = PhaseResult(Phase(count, popularity))
    for system, value in tok_s.items():
        r.runs[system] = run(system, value)
        if system != "ours":
            r.same_as_ours[system] = (10, 10)
    return r


def test_phases_start_with_the_base_model_and_run_each_count_under_both_popularities() -> None:
    plan = phases([64, 1, 16, 16])
    assert plan[0] == Phase(BASE, ZIPF)
    assert [(p.count, p.popularity) for p in plan[1:]] == [
        (1, ZIPF), (16, ZIPF), (16, UNIFORM), (64, ZIPF), (64, UNIFORM)
    ]  # fmt: skip
    assert plan[3].zipf_exponent == 0.0 and plan[2].zipf_exponent > 0
    assert [p.label for p in plan[:3]] == ["base model", "1 adapter", "16 adapters, zipf"]
    with pytest.raises(ValueError, match=">= 1"):
        phases([0, 4])


def test_every_system_goes_first_in_turn() -> None:
    systems = ["ours", "vLLM", "PEFT"]
    firsts = [rotated(systems, turn)[0] for turn in range(6)]
    assert firsts == ["ours", "vLLM", "PEFT", "ours", "vLLM", "PEFT"]
    assert sorted(rotated(systems, 4)) == sorted(systems)


def test_a_peer_counts_only_without_errors_and_with_every_greedy_token_equal_to_ours() -> None:
    r = result(16, ZIPF, ours=1000.0, vLLM=250.0, PEFT=200.0)
    assert r.ratio("ours", "vLLM") == pytest.approx(4.0)
    r.same_as_ours["vLLM"] = (95, 96)  # one request's tokens differ: the row does not count
    assert not r.counts("vLLM") and math.isnan(r.ratio("ours", "vLLM"))
    r.runs["PEFT"] = run("PEFT", 200.0, errors={"timeout": 1})
    assert not r.counts("PEFT")
    r.same_as_ours["PEFT"] = (0, 0)  # nothing compared proves nothing
    r.runs["PEFT"] = run("PEFT", 200.0)
    assert not r.counts("PEFT")
    assert r.counts("ours")
    lines = table([r], ["ours", "vLLM", "PEFT"])
    assert "250.0*" in lines[1] and "95/96" in lines[1] and "1000.0" in lines[1]


def test_scale_retention_is_each_count_over_the_single_adapter_figure_of_the_same_system() -> None:
    results = [
        result(BASE, ZIPF, ours=1300.0, vLLM=600.0),
        result(1, ZIPF, ours=1200.0, vLLM=300.0),
        result(16, ZIPF, ours=960.0, vLLM=270.0),
        result(16, UNIFORM, ours=900.0, vLLM=240.0),
        result(64, ZIPF, ours=840.0, vLLM=150.0),
    ]
    assert scale_retention(results, "ours", ZIPF) == pytest.approx({16: 0.8, 64: 0.7})
    assert scale_retention(results, "ours", UNIFORM) == pytest.approx({16: 0.75})
    assert scale_retention(results, "vLLM", ZIPF) == pytest.approx({16: 0.9, 64: 0.5})
    assert scale_retention(results, "PEFT", ZIPF) == {}  # never ran


def test_many_adapters_are_distinct_and_shaped_like_their_rank_template(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "base", TinyModelSpec(hidden=64, layers=1, heads=2, kv_heads=1, seed=0))
    out = tmp_path / "adapters"
    out.mkdir()
    dirs = make_many_adapters(model, out, 5)
    assert [d.name for d in dirs] == [adapter_dir_name(i) for i in range(5)]
    weights = [load_file(d / ADAPTER_WEIGHTS) for d in dirs]
    for i in (3, 4):  # copies of the rank-8 and rank-16 templates with fresh weights
        template = i % len(RANKS)
        assert (dirs[i] / ADAPTER_CONFIG).read_text() == (dirs[template] / ADAPTER_CONFIG).read_text()
        assert {k: v.shape for k, v in weights[i].items()} == {k: v.shape for k, v in weights[template].items()}
        assert all(not v.equal(weights[template][k]) for k, v in weights[i].items())
        assert all(v.abs().sum() > 0 for v in weights[i].values())
