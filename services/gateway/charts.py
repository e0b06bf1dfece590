"""Small SVG charts and the costs page's view model. Pure: data in, markup/dicts out.

The SVG is built from numbers only (no user text is interpolated except escaped day labels), so it is
safe to mark as trusted markup in the templates.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any


def sparkline_svg(history: Sequence[float], width: int = 80, height: int = 20) -> str:
    """A load history (values in [0, 1]) as a polyline; empty for fewer than two points."""
    if len(history) < 2:
        return ""
    n = len(history)
    points = " ".join(f"{i * width / (n - 1):.1f},{height - min(max(v, 0.0), 1.0) * height:.1f}"
                      for i, v in enumerate(history))
    return (f'<svg class="spark" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img" '
            f'aria-label="recent load"><polyline fill="none" stroke="#0b5cad" stroke-width="1.5" '
            f'points="{points}"/></svg>')


def daily_chart_svg(days: Sequence[tuple[str, float | None, float | None]], width: int = 720,
                    height: int = 220) -> str:
    """Bars of daily kWh with the day's $ in the tooltip; a day without valid readings is drawn as a
    dashed outline labelled "no data" (unknown, not zero)."""
    left, bottom, top = 48, 28, 12
    plot_w, plot_h = width - left - 8, height - top - bottom
    known = [kwh for _, kwh, _ in days if kwh is not None]
    peak = max(known, default=0.0) or 1.0
    n = max(len(days), 1)
    slot = plot_w / n
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-label="Daily energy in kWh over the last {len(days)} days">']
    for frac in (0.0, 0.5, 1.0):
        y = top + plot_h * (1 - frac)
        parts.append(f'<line x1="{left}" x2="{width - 8}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d8dee4"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">'
                     f'{peak * frac:.3g}</text>')
    parts.append(f'<text x="4" y="{top + 10}" font-size="10">kWh</text>')
    for i, (day, kwh, usd) in enumerate(days):
        x = left + i * slot + slot * 0.15
        w = slot * 0.7
        label = html.escape(day)
        if kwh is None:
            parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - 6}" width="{w:.1f}" height="6" fill="none" '
                         f'stroke="#9aa4ae" stroke-dasharray="2 2"><title>{label}: no data</title></rect>')
        else:
            h = plot_h * kwh / peak
            cost = "unknown" if usd is None else f"${usd:.4f}"
            parts.append(f'<rect x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{w:.1f}" height="{h:.1f}" '
                         f'fill="#0b5cad"><title>{label}: {kwh:.4f} kWh, {cost}</title></rect>')
        if i % 5 == 0 or i == len(days) - 1:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{height - 10}" font-size="9" text-anchor="middle">'
                         f'{label[5:]}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _row(name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """One summary of the accounting costs document (docs/accounting.md, "Costs API")."""
    return {"name": name, "prompt_tokens": entry.get("prompt_tokens"), "cached_tokens": entry.get("cached_tokens"),
            "output_tokens": entry.get("output_tokens"), "kwh": entry.get("kwh"),
            "energy_usd": entry.get("energy_usd"), "list_usd": entry.get("list_value_usd"),
            "j_per_token": entry.get("j_per_output_token"), "coverage_pct": entry.get("coverage_pct")}


def costs_view(data: dict[str, Any]) -> dict[str, Any]:
    """The accounting service's costs document → what costs.html renders."""
    periods = []
    for pid, title in (("today", "Today (UTC)"), ("window", f"Last {data.get('days', 30)} days")):
        periods.append({"id": pid, "title": title, **_row(title, data.get(pid) or {})})
    daily = [(d.get("day", ""), d.get("kwh"), d.get("energy_usd")) for d in data.get("daily", [])]
    methods = sorted({m for entry in (data.get("window") or {}, data.get("today") or {})
                      for m in entry.get("methods") or []})

    def rows(key: str, name_key: str) -> list[dict[str, Any]]:
        return [_row(str(r.get(name_key) or "-"), r) for r in data.get(key, [])]

    return {
        "periods": periods, "chart": daily_chart_svg(daily), "rate": data.get("rate_usd_per_kwh"),
        "methods": ", ".join(methods), "by_model": rows("by_model", "model"),
        "by_member": rows("by_member", "member"), "by_key": rows("by_api_key", "api_key_id"),
    }
