"""A usage report as JSON or CSV; both carry the same rows and numbers."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict
from typing import Any

from api.usage.aggregate import METRIC_NAMES
from api.usage.report import UsageReport


def report_json(report: UsageReport) -> dict[str, Any]:
    """``{"object": "usage_report", "from", "to", "group_by", "data": [rows], "totals"}``."""
    return {
        "object": "usage_report",
        "from": report.period.start,
        "to": report.period.end,
        "group_by": report.group_by,
        "data": [{**row.labels, **asdict(row.metrics)} for row in report.rows],
        "totals": asdict(report.totals),
    }


def report_csv(report: UsageReport) -> str:
    """One header line, then one line per row (no totals line, so every line is a group)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*report.label_columns, *METRIC_NAMES])
    for row in report.rows:
        metrics = asdict(row.metrics)
        writer.writerow([*(row.labels[c] or "" for c in report.label_columns), *(metrics[m] for m in METRIC_NAMES)])
    return out.getvalue()
