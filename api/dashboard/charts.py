"""Inline SVG charts, rendered on the server: readable at a glance, with a ``<title>`` tooltip on every mark.

Every chart is ``<svg class="chart" data-chart="...">`` so tests and people can find it; bars are
``<rect class="bar">``. Pure functions of their data.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
STATUS_COLORS = {
    "succeeded": "#59a14f",
    "failed": "#e15759",
    "cancelled": "#9c755f",
    "running": "#4e79a7",
    "queued": "#edc948",
    "validating_files": "#bab0ac",
}
POOL_COLORS = {"kv": "#4e79a7", "adapter": "#f28e2b", "free": "#d7dce2"}
WIDTH = 720
FONT = 'font-family="system-ui, sans-serif" font-size="12"'


def color_of(index: int) -> str:
    return PALETTE[index % len(PALETTE)]


def shortened(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters, cut in the middle: a model name keeps its base and tenant at
    the front and its job id at the end, the parts that tell two names apart."""
    if len(text) <= limit:
        return text
    tail = (limit - 1) // 2
    return text[: limit - 1 - tail] + "…" + text[-tail:]


def human(value: float) -> str:
    """1234567 → ``1.2M``: axis labels that fit."""
    for divisor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= divisor:
            return f"{value / divisor:.1f}{suffix}"
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def _svg(name: str, label: str, height: int, body: list[str]) -> str:
    return (
        f'<svg class="chart" data-chart="{escape(name)}" role="img" aria-label="{escape(label)}" '
        f'xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" {FONT}>'
        f"<title>{escape(label)}</title>{''.join(body)}</svg>"
    )


def _empty(name: str, label: str, message: str) -> str:
    text = f'<text x="{WIDTH // 2}" y="40" text-anchor="middle" fill="#666">{escape(message)}</text>'
    return _svg(name, label, 70, [text])


def stacked_columns(
    name: str, label: str, x_labels: Sequence[str], series: dict[str, Sequence[float]], unit: str
) -> str:
    """One column per x label, stacked by series (e.g. tokens per day, one colour per tenant), with a legend."""
    totals = [sum(values[i] for values in series.values()) for i in range(len(x_labels))]
    if not x_labels or not any(totals):
        return _empty(name, label, f"no {unit} in this period")
    height, top, bottom, left = 260, 16, 40, 56
    plot_h, plot_w = height - top - bottom, WIDTH - left - 16
    peak = max(totals)
    step = plot_w / len(x_labels)
    body = [
        f'<line x1="{left}" y1="{top + plot_h}" x2="{WIDTH - 16}" y2="{top + plot_h}" stroke="#999"/>',
        f'<text x="{left - 6}" y="{top + 4}" text-anchor="end">{human(peak)}</text>',
        f'<text x="{left - 6}" y="{top + plot_h}" text-anchor="end">0</text>',
        f'<text x="8" y="{top + plot_h // 2}" fill="#666">{escape(unit)}</text>',
    ]
    every = max(1, len(x_labels) // 10)  # at most ~10 axis labels
    for i, x_label in enumerate(x_labels):
        x, y = left + i * step, top + plot_h
        for s, (series_name, values) in enumerate(series.items()):
            if not values[i]:
                continue
            h = plot_h * values[i] / peak
            y -= h
            tip = f"{series_name} · {x_label}: {human(values[i])} {unit}"
            body.append(
                f'<rect class="bar" x="{x + step * 0.1:.1f}" y="{y:.1f}" width="{step * 0.8:.1f}" height="{h:.1f}" '
                f'fill="{color_of(s)}"><title>{escape(tip)}</title></rect>'
            )
        if i % every == 0:
            tick = f'<text x="{x + step / 2:.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
            body.append(f"{tick}{escape(x_label)}</text>")
    legend_x = left
    for s, series_name in enumerate(series):
        swatch = f'x="{legend_x}" y="{height - 14}" width="10" height="10" fill="{color_of(s)}"'
        body.append(f'<rect class="legend" {swatch}/>')
        body.append(f'<text x="{legend_x + 14}" y="{height - 5}">{escape(series_name)}</text>')
        legend_x += 24 + 7 * len(series_name)
    return _svg(name, label, height, body)


def horizontal_bars(
    name: str, label: str, items: Sequence[tuple[str, float]], unit: str, colors: dict[str, str] | None = None
) -> str:
    """One labelled bar per item, longest first as given (e.g. top adapters by tokens)."""
    if not items or not any(v for _, v in items):
        return _empty(name, label, f"no {unit} in this period")
    row_h, label_w = 24, 300
    label_chars = 40  # what fits left of the bars at 12 px (about 7 px a character)
    peak = max(v for _, v in items)
    height = row_h * len(items) + 8
    body = []
    for i, (item, value) in enumerate(items):
        y = 4 + i * row_h
        w = (WIDTH - label_w - 70) * value / peak if peak else 0
        fill = (colors or {}).get(item, color_of(0 if colors is None else i))
        shown = shortened(item, label_chars)
        hover = f"<title>{escape(item)}</title>"
        body.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end">{hover}{escape(shown)}</text>')
        body.append(
            f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{max(w, 1):.1f}" height="{row_h - 6}" fill="{fill}">'
            f"<title>{escape(item)}: {human(value)} {escape(unit)}</title></rect>"
        )
        body.append(f'<text x="{label_w + w + 6:.1f}" y="{y + 15}">{human(value)}</text>')
    return _svg(name, label, height, body)


def pool_bar(name: str, label: str, pages: dict[str, int]) -> str:
    """A replica's memory pool as one bar: KV-cache pages, adapter pages, free pages."""
    total = sum(pages.values())
    if not total:
        return _empty(name, label, "empty pool")
    height, bar_w = 46, WIDTH - 16
    body, x = [], 8.0
    for part in ("kv", "adapter", "free"):
        count = pages.get(part, 0)
        w = bar_w * count / total
        if count:
            tip = f"{part}: {count} pages ({100 * count / total:.0f}%)"
            body.append(
                f'<rect class="bar" data-part="{part}" x="{x:.1f}" y="4" width="{w:.1f}" height="20" '
                f'fill="{POOL_COLORS[part]}"><title>{escape(tip)}</title></rect>'
            )
        x += w
    legend = " · ".join(f"{part} {pages.get(part, 0)}" for part in ("kv", "adapter", "free"))
    body.append(f'<text x="8" y="40">{escape(legend)} pages</text>')
    return _svg(name, label, height, body)
