"""Server-rendered charts: well-formed SVG whose bars are proportional to the data, with tooltips."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from api.dashboard.charts import horizontal_bars, human, pool_bar, shortened, stacked_columns

SVG = "{http://www.w3.org/2000/svg}"


def bars(svg: str) -> list[ET.Element]:
    root = ET.fromstring(svg)
    assert root.get("class") == "chart"
    return [el for el in root.iter(f"{SVG}rect") if el.get("class") == "bar"]


def test_stacked_columns_stack_series_per_day_and_the_tallest_fills_the_plot() -> None:
    svg = stacked_columns("usage", "Tokens", ["05-01", "05-02"], {"acme": [10, 30], "bolt": [10, 0]}, "tokens")
    heights = [float(b.get("height") or 0) for b in bars(svg)]
    assert len(heights) == 3  # bolt has nothing on day two
    day_one, day_two = heights[0] + heights[1], heights[2]
    assert abs(day_one / day_two - 20 / 30) < 1e-3
    assert "acme · 05-02: 30 tokens" in svg  # the tooltip says what a bar is


def test_labels_are_escaped() -> None:
    svg = horizontal_bars("top", "Top", [("<script>alert(1)</script>", 3.0)], "tokens")
    ET.fromstring(svg)
    assert "<script>" not in svg


def test_long_model_names_are_shortened_in_the_middle_and_shown_whole_on_hover() -> None:
    name = "ft:tiny-llama:acme-corporation:support-bot:ftjob-01m96fx31e4k83rcmwkjkfywcc"
    svg = horizontal_bars("top", "Top", [(name, 3.0)], "tokens")
    [label] = [el for el in ET.fromstring(svg).iter(f"{SVG}text") if el.find(f"{SVG}title") is not None]

    shown = "".join(label.itertext()).removeprefix(name)  # the hover title comes first, then what is drawn
    assert shown == shortened(name, 40) and len(shown) == 40
    assert shown.startswith("ft:tiny-llama:acme") and shown.endswith("kjkfywcc") and "…" in shown
    assert label.findtext(f"{SVG}title") == name
    assert shortened("ft:short", 40) == "ft:short"


def test_horizontal_bars_are_proportional() -> None:
    widths = [float(b.get("width") or 0) for b in bars(horizontal_bars("top", "Top", [("a", 4.0), ("b", 1.0)], "t"))]
    assert abs(widths[0] / widths[1] - 4.0) < 1e-3


def test_the_pool_bar_shows_kv_adapter_and_free_pages_in_proportion() -> None:
    parts = {
        b.get("data-part"): float(b.get("width") or 0)
        for b in bars(pool_bar("pool", "r1", {"kv": 30, "adapter": 10, "free": 60}))
    }
    assert set(parts) == {"kv", "adapter", "free"}
    assert abs(parts["kv"] / parts["adapter"] - 3.0) < 1e-3


def test_empty_data_says_so_instead_of_drawing_nothing() -> None:
    svg = stacked_columns("usage", "Tokens", ["05-01"], {}, "tokens")
    assert bars(svg) == [] and "no tokens in this period" in svg


def test_human_numbers() -> None:
    assert [human(v) for v in (0, 12, 1500, 2_500_000, 0.25)] == ["0", "12", "1.5k", "2.5M", "0.25"]
