"""The GPU lease's verdict: which figures it reads, which targets it judges, and the table it writes."""

from __future__ import annotations

import json
from pathlib import Path

from bench.gpu.summary import (
    Stage,
    build_summary,
    collect_metrics,
    junit_counts,
    kernel_bench_met,
    main,
    read_stages,
    render_markdown,
)
from bench.gpu.targets import TARGETS, target

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2"
skipped="3" tests="20" time="1.0"></testsuite></testsuites>"""
KERNEL_SUMMARY = (
    "SUMMARY add_lora memory-bound (>=16 adapters, >=10 us at copy bw): 4 shapes, copy bw median 71% min 64%, "
    "speedup median 5.0x min 3.2x; all >=16 adapters: ...; target >=60% copy bw and >=3x torch: {}; attention ..."
)
GOOD = {
    "kernel_tests_passed": 200,
    "kernel_tests_failed": 0,
    "parity_fp32_identical": 1.0,
    "parity_fp32_adapters_matter": 1.0,
    "kernel_bench_met": 1.0,
    "ours_vs_peft": 25.0,
    "lora_overhead": 0.08,
    "graphs_vs_eager_decode_b8": 2.4,
}
STAGES = [Stage("kernel_tests", 0, 61.2), Stage("engine", 0, 150.0)]


def write_results(out: Path, *, fp32_identical: float = 1.0) -> None:
    (out / "kernel_tests.xml").write_text(JUNIT)
    (out / "parity_fp32.json").write_text(json.dumps({"identical_fraction": fp32_identical, "adapters_matter": 0.9}))
    (out / "parity_bf16.json").write_text(json.dumps({"identical_fraction": 0.7, "mean_prefix_fraction": 0.85}))
    ratios = {"ours_vs_peft": 12.5, "lora_overhead": 0.2, "graphs_vs_eager_decode_b8": 1.8, "unknown": 3.0}
    (out / "engine.json").write_text(json.dumps({"ratios": ratios}))


def row(summary: dict, key: str) -> dict:
    return next(r for r in summary["targets"] if r["key"] == key)


def test_figures_are_read_from_every_stage_file(tmp_path: Path) -> None:
    write_results(tmp_path)
    metrics, raw = collect_metrics(tmp_path, KERNEL_SUMMARY.format("met"))
    assert metrics["kernel_tests_passed"] == 14 and metrics["kernel_tests_failed"] == 3
    assert metrics["kernel_tests_skipped"] == 3
    assert metrics["parity_fp32_identical"] == 1.0 and metrics["parity_fp32_adapters_matter"] == 0.9
    assert metrics["parity_bf16_identical"] == 0.7 and metrics["parity_bf16_mean_prefix"] == 0.85
    assert metrics["kernel_bench_met"] == 1.0
    assert metrics["ours_vs_peft"] == 12.5 and metrics["lora_overhead"] == 0.2
    assert "unknown" not in metrics and set(raw) == {"kernel_tests", "parity_fp32", "parity_bf16", "engine"}


def test_a_stage_that_left_nothing_leaves_its_figures_missing(tmp_path: Path) -> None:
    (tmp_path / "kernel_tests.xml").write_text("<testsuites><testsuite")  # cut off mid-write
    (tmp_path / "engine.json").write_text("{")
    metrics, raw = collect_metrics(tmp_path)
    assert all(value is None for value in metrics.values()) and raw == {}
    assert junit_counts(tmp_path / "absent.xml") is None


def test_the_kernel_sweep_verdict_is_its_last_summary_line() -> None:
    assert kernel_bench_met(KERNEL_SUMMARY.format("NOT met")) == 0.0
    assert kernel_bench_met("x torch: NOT met\n" + KERNEL_SUMMARY.format("met")) == 1.0
    assert kernel_bench_met("Traceback (most recent call last):") is None


def test_all_met_passes_and_any_missed_target_or_failed_stage_fails() -> None:
    assert build_summary(STAGES, GOOD, dry_run=False)["passed"]
    assert not build_summary(STAGES, {**GOOD, "lora_overhead": 0.16}, dry_run=False)["passed"]
    assert not build_summary(STAGES, {**GOOD, "parity_fp32_identical": 23 / 24}, dry_run=False)["passed"]
    assert not build_summary([*STAGES, Stage("parity_bf16", 124, 60.0)], GOOD, dry_run=False)["passed"]
    assert not build_summary([], GOOD, dry_run=False)["passed"]  # nothing ran: nothing is proven


def test_a_missing_figure_fails_its_target() -> None:
    summary = build_summary(STAGES, {**GOOD, "ours_vs_peft": None}, dry_run=False)
    assert not summary["passed"] and row(summary, "ours_vs_peft")["met"] is False


def test_a_dry_run_judges_correctness_but_not_speed() -> None:
    slow = {**GOOD, "ours_vs_peft": 1.1, "graphs_vs_eager_decode_b8": None, "kernel_bench_met": 0.0}
    summary = build_summary(STAGES, slow, dry_run=True)
    assert summary["passed"]
    assert row(summary, "ours_vs_peft")["met"] is None and not row(summary, "ours_vs_peft")["judged"]
    assert not build_summary(STAGES, {**slow, "kernel_tests_failed": 1}, dry_run=True)["passed"]


def test_report_only_figures_never_fail() -> None:
    assert target("parity_bf16_identical").met(0.0) is None
    assert build_summary(STAGES, {**GOOD, "parity_bf16_identical": 0.0}, dry_run=False)["passed"]
    assert {t.key for t in TARGETS} >= set(GOOD)


def test_the_markdown_gives_the_verdict_the_stages_and_each_target() -> None:
    stages = [*STAGES, Stage("parity_fp32", 124, 60.0)]
    summary = build_summary(stages, {**GOOD, "ours_vs_peft": None}, dry_run=False, env={"device": "NVIDIA H200"})
    text = render_markdown(summary)
    assert text.startswith("# GPU lease: FAIL\n")
    assert "- device: NVIDIA H200" in text
    assert "| parity_fp32 | 124 | 60 | TIMED OUT |" in text and "| engine | 0 | 150 | ok |" in text
    assert f"| {target('ours_vs_peft').what} | >= 10 | missing | FAIL |" in text
    assert f"| {target('lora_overhead').what} | <= 0.15 | 0.08 | PASS |" in text
    dry = render_markdown(build_summary(STAGES, GOOD, dry_run=True))
    assert "PASS (CPU dry run" in dry and "not judged (dry run)" in dry


def test_main_writes_both_files_and_exits_by_the_verdict(tmp_path: Path, capsys) -> None:
    write_results(tmp_path, fp32_identical=0.5)
    stages = tmp_path / "stages.tsv"
    stages.write_text("kernel_tests\t0\t61.2\nengine\t0\t150.0\n")
    assert read_stages(stages) == STAGES
    assert main(["--out", str(tmp_path), "--stages", str(stages), "--dry-run"]) == 1  # fp32 parity is judged
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["dry_run"] and not saved["passed"] and saved["results"]["engine"]["ratios"]["ours_vs_peft"] == 12.5
    assert (tmp_path / "summary.md").read_text() == capsys.readouterr().out.rstrip("\n") + "\n"
    write_results(tmp_path)
    (tmp_path / "kernel_tests.xml").write_text(JUNIT.replace('errors="1" failures="2"', 'errors="0" failures="0"'))
    assert main(["--out", str(tmp_path), "--stages", str(stages), "--dry-run"]) == 0
