"""The costs page's daily kWh + $ chart, its table twin, and a user's own 30-day rows. Pure."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from proto import CostsReport, DayCosts, KeyCosts, WindowCosts
from services.gateway import charts

# daily_chart_svg's default geometry: 720 x 250, margins left 52, right 60, top 34, bottom 28
TOP, PLOT_H, LEFT, PLOT_W = 34, 250 - 34 - 28, 52, 720 - 52 - 60
DAYS = [("2026-11-01", 0.5, 0.0625), ("2026-11-02", None, None), ("2026-11-03", 1.0, 0.125),
        ("2026-11-04", 0.25, 0.03125)]


def _report(**fields: object) -> CostsReport:
    """A costs document with empty figures wherever ``fields`` gives none."""
    defaults: dict[str, object] = {
        "generated_at": "2026-11-02T12:00:00+00:00", "days": 30, "rate_usd_per_kwh": None,
        "today": DayCosts(day="2026-11-02"), "window": WindowCosts(from_day="2026-10-04", to_day="2026-11-02"),
        "daily": [], "by_model": [], "by_member": [], "by_api_key": []}
    return CostsReport(**{**defaults, **fields})  # type: ignore[arg-type]  # values typed by the caller


def _parse(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # also proves the markup is well-formed


def _of_class(root: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in root.iter(tag) if e.get("class") == cls]


def _centre(i: int, n: int) -> float:
    slot = PLOT_W / n
    return LEFT + i * slot + slot * 0.15 + slot * 0.7 / 2


def test_bars_are_kwh_on_the_left_axis_and_points_are_dollars_on_the_right() -> None:
    root = _parse(charts.daily_chart_svg(DAYS))
    bars = _of_class(root, "rect", "kwh")
    assert [b.findtext("title") for b in bars] == ["2026-11-01: 0.5000 kWh, $0.0625", "2026-11-03: 1.0000 kWh, $0.1250",
                                                   "2026-11-04: 0.2500 kWh, $0.0312"]
    # each axis runs from 0 to its own peak: 1.0 kWh and $0.125
    assert [float(b.get("height")) for b in bars] == pytest.approx([PLOT_H * 0.5 / 1.0, PLOT_H * 1.0 / 1.0,
                                                                   PLOT_H * 0.25 / 1.0], abs=0.05)
    points = _of_class(root, "circle", "usd")
    assert [p.findtext("title") for p in points] == ["2026-11-01: $0.0625", "2026-11-03: $0.1250",
                                                     "2026-11-04: $0.0312"]
    assert [float(p.get("cy")) for p in points] == pytest.approx(
        [TOP + PLOT_H * (1 - 0.0625 / 0.125), TOP + PLOT_H * (1 - 0.125 / 0.125), TOP + PLOT_H * (1 - 0.03125 / 0.125)],
        abs=0.05)
    assert [float(p.get("cx")) for p in points] == pytest.approx([_centre(0, 4), _centre(2, 4), _centre(3, 4)],
                                                                 abs=0.05)
    assert [t.text for t in _of_class(root, "text", "axis-kwh")] == ["0", "0.5", "1"]
    assert [t.text for t in _of_class(root, "text", "axis-usd")] == ["$0", "$0.0625", "$0.125"]


def test_a_day_without_readings_is_a_dashed_no_data_outline_and_the_dollar_line_breaks_there() -> None:
    root = _parse(charts.daily_chart_svg(DAYS))
    missing = _of_class(root, "rect", "missing")
    assert [m.findtext("title") for m in missing] == ["2026-11-02: no data"]
    assert missing[0].get("fill") == "none" and missing[0].get("stroke-dasharray")
    assert not any("2026-11-02" in (e.findtext("title") or "") for e in root.iter("circle"))
    # day 1 stands alone (a point, no segment); days 3-4 are joined; nothing bridges day 2 (unknown, not $0)
    lines = _of_class(root, "polyline", "usd")
    assert len(lines) == 1
    xs = [float(pair.split(",")[0]) for pair in lines[0].get("points").split()]
    assert xs == pytest.approx([_centre(2, 4), _centre(3, 4)], abs=0.05)


def test_the_chart_is_named_and_described_for_assistive_technology() -> None:
    root = _parse(charts.daily_chart_svg(DAYS))
    assert root.get("role") == "img"
    title_id, desc_id = root.get("aria-labelledby").split()
    assert root.find(f"title[@id='{title_id}']").text == "Daily energy (kWh) and energy cost ($), last 4 days"
    desc = root.find(f"desc[@id='{desc_id}']").text
    assert "peak 1.0000 kWh" in desc and "peak $0.1250" in desc and "1 of 4 days have no valid readings" in desc


def test_a_month_without_any_readings_draws_only_outlines() -> None:
    days = [(f"2026-11-{d:02d}", None, None) for d in range(1, 31)]
    root = _parse(charts.daily_chart_svg(days))
    assert len(_of_class(root, "rect", "missing")) == 30
    assert _of_class(root, "rect", "kwh") == [] and list(root.iter("polyline")) == []
    assert _of_class(root, "circle", "usd") == []


def test_the_costs_view_keeps_unknown_days_unknown_in_the_table() -> None:
    data = _report(days=2, rate_usd_per_kwh=0.125,
                   daily=[DayCosts(day="2026-11-01", kwh=None, energy_usd=None, output_tokens=7),
                          DayCosts(day="2026-11-02", kwh=0.5, energy_usd=0.5 * 0.125, output_tokens=3)])
    view = charts.costs_view(data)
    assert [(d["name"], d["kwh"], d["energy_usd"]) for d in view["daily"]] == [
        ("2026-11-01", None, None), ("2026-11-02", 0.5, 0.5 * 0.125)]
    assert 'class="missing"' in view["chart"] and 'class="kwh"' in view["chart"]


def test_a_users_own_figures_are_their_keys_rows_only() -> None:
    data = _report(by_api_key=[
        KeyCosts(api_key_id="key_a", prompt_tokens=10, output_tokens=5, list_value_usd=0.5, energy_usd=None),
        KeyCosts(api_key_id="key_b", prompt_tokens=7, output_tokens=1, list_value_usd=0.1, energy_usd=0.02),
        KeyCosts(api_key_id=None, prompt_tokens=99, output_tokens=99)])
    mine = charts.key_usage_view(data, ["key_a", "key_c"])
    assert list(mine) == ["key_a"]
    assert mine["key_a"]["tokens"] == 10 + 5 and mine["key_a"]["list_usd"] == 0.5
    assert mine["key_a"]["energy_usd"] is None  # no readings: unknown, not $0


def test_a_sparkline_needs_two_points() -> None:
    assert charts.sparkline_svg([0.1]) == "" and "polyline" in charts.sparkline_svg([0.1, 0.9])
