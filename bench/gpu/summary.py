"""The GPU lease's verdict: stage exit codes and measured figures against the targets, as JSON and markdown.

    python bench/gpu/summary.py --out $OUT --stages stages.tsv [--env env.json] [--kernels-log log] [--dry-run]

Reads what ``bench/gpu/run.sh`` left in ``--out`` (engine.json, parity_fp32.json, parity_bf16.json,
kernel_tests.xml), writes ``summary.json`` and ``summary.md`` there, and exits 0 only when every stage
exited 0 and every judged target is met. A missing file (a stage that crashed or ran out of time) leaves
its figures missing, and a missing figure never meets its target.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make `bench` importable

from bench.gpu.targets import TARGETS

ENGINE_JSON = "engine.json"
PARITY_JSON = "parity_{dtype}.json"
KERNEL_TESTS_XML = "kernel_tests.xml"
# bench/kernels_gpu.py's SUMMARY line ends its LoRA verdict with "...x torch: met" or "...: NOT met".
KERNEL_BENCH_VERDICT = re.compile(r"x torch: (met|NOT met)")


@dataclass(frozen=True)
class Stage:
    """One stage of run.sh: its name, exit code (124: timed out) and seconds."""

    name: str
    rc: int
    seconds: float


def read_stages(path: Path) -> list[Stage]:
    """Stages from run.sh's tab-separated ``name rc seconds`` lines, in the order they ran."""
    stages = []
    for line in path.read_text().splitlines():
        if line.strip():
            name, rc, seconds = line.split("\t")
            stages.append(Stage(name, int(rc), float(seconds)))
    return stages


def junit_counts(path: Path) -> dict[str, int] | None:
    """passed / failed (failures + errors) / skipped of a pytest JUnit XML file; None when there is none."""
    if not path.is_file():
        return None
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = failed = skipped = 0
    for suite in suites:
        total += int(suite.get("tests", 0))
        failed += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped += int(suite.get("skipped", 0))
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def kernel_bench_met(log: str) -> float | None:
    """1.0 / 0.0 from the kernel sweep's SUMMARY verdict; None when its log has none."""
    found = KERNEL_BENCH_VERDICT.findall(log)
    return None if not found else float(found[-1] == "met")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect_metrics(out: Path, kernels_log: str = "") -> tuple[dict[str, float | None], dict[str, Any]]:
    """Every target's figure (None where its stage left nothing), and the raw results they came from."""
    metrics: dict[str, float | None] = {t.key: None for t in TARGETS}
    raw: dict[str, Any] = {}
    counts = junit_counts(out / KERNEL_TESTS_XML)
    if counts is not None:
        raw["kernel_tests"] = counts
        metrics["kernel_tests_passed"] = counts["passed"]
        metrics["kernel_tests_failed"] = counts["failed"]
        metrics["kernel_tests_skipped"] = counts["skipped"]
    for dtype in ("fp32", "bf16"):
        parity = _read_json(out / PARITY_JSON.format(dtype=dtype))
        if parity is None:
            continue
        raw[f"parity_{dtype}"] = parity
        metrics[f"parity_{dtype}_identical"] = parity.get("identical_fraction")
        if dtype == "fp32":
            metrics["parity_fp32_adapters_matter"] = parity.get("adapters_matter")
        else:
            metrics["parity_bf16_mean_prefix"] = parity.get("mean_prefix_fraction")
    metrics["kernel_bench_met"] = kernel_bench_met(kernels_log)
    engine = _read_json(out / ENGINE_JSON)
    if engine is not None:
        raw["engine"] = engine
        for key, value in engine.get("ratios", {}).items():
            if key in metrics:
                metrics[key] = value
    return metrics, raw


def build_summary(
    stages: list[Stage], metrics: dict[str, float | None], *, dry_run: bool, env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Rows for every stage and target, and ``passed``: all stages exited 0 and every judged target is met."""
    rows = []
    for t in TARGETS:
        value = metrics.get(t.key)
        judged = t.op is not None and not (dry_run and t.perf)
        met = t.met(value) if judged else None
        rows.append({"key": t.key, "what": t.what, "bound": t.bound_text, "value": value, "judged": judged, "met": met})
    stage_rows = [{**asdict(s), "ok": s.rc == 0} for s in stages]
    passed = bool(stages) and all(s["ok"] for s in stage_rows) and all(r["met"] is not False for r in rows)
    return {"dry_run": dry_run, "passed": passed, "env": env or {}, "stages": stage_rows, "targets": rows}


def _value_text(value: float | None) -> str:
    if value is None:
        return "missing"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _verdict(row: dict[str, Any]) -> str:
    if row["met"] is None:
        return "not judged (dry run)" if row["bound"] != "report" and not row["judged"] else "-"
    return "PASS" if row["met"] else "FAIL"


def render_markdown(summary: dict[str, Any]) -> str:
    """A markdown page: the verdict, the environment, a stage table and a target table."""
    mode = " (CPU dry run at tiny sizes: speed figures not judged)" if summary["dry_run"] else ""
    lines = [f"# GPU lease: {'PASS' if summary['passed'] else 'FAIL'}{mode}", ""]
    for key, value in summary["env"].items():
        lines.append(f"- {key}: {value}")
    if summary["env"]:
        lines.append("")
    lines += ["| stage | exit | seconds | |", "| --- | ---: | ---: | --- |"]
    for s in summary["stages"]:
        status = "ok" if s["ok"] else ("TIMED OUT" if s["rc"] in (124, 137) else "FAILED")
        lines.append(f"| {s['name']} | {s['rc']} | {s['seconds']:.0f} | {status} |")
    lines += ["", "| target | bound | measured | |", "| --- | --- | ---: | --- |"]
    for row in summary["targets"]:
        lines.append(f"| {row['what']} | {row['bound']} | {_value_text(row['value'])} | {_verdict(row)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write summary.json and summary.md into ``--out``; returns 0 when everything passed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", type=Path, required=True)
    parser.add_argument("--env", type=Path, default=None)
    parser.add_argument("--kernels-log", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    log = args.kernels_log.read_text(errors="replace") if args.kernels_log and args.kernels_log.is_file() else ""
    metrics, raw = collect_metrics(args.out, log)
    env = _read_json(args.env) if args.env else None
    summary = build_summary(read_stages(args.stages), metrics, dry_run=args.dry_run, env=env)
    summary["results"] = raw
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    markdown = render_markdown(summary)
    (args.out / "summary.md").write_text(markdown)
    print(markdown)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
