"""Small SVG charts and the costs page's view model. Pure: data in, markup/dicts out.

The SVG is built from numbers only (no user text is interpolated except escaped day labels), so it is
safe to mark as trusted markup in the templates.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from proto import CostFigures, CostsReport

KWH_COLOUR = "#0b5cad"  # the stylesheet's --accent
USD_COLOUR = "#b54708"  # orange-brown: 5.4:1 on white (WCAG AA for small text), unlike the blue without red/green
MISSING_COLOUR = "#9aa4ae"


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


def _runs(points: Sequence[tuple[float, float] | None]) -> list[list[tuple[float, float]]]:
    """Consecutive known points, split wherever a day is unknown (a line never bridges a missing day)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for point in points:
        if point is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(point)
    return [run for run in runs if run]


def daily_chart_svg(days: Sequence[tuple[str, float | None, float | None]], width: int = 720, height: int = 250,
                    id_prefix: str = "daily-chart") -> str:
    """Daily kWh as bars (left axis) and the day's energy $ as a line with a point per day (right axis).

    ``days`` is ``(UTC day "YYYY-MM-DD", kWh, $)``, oldest first. Each axis runs from 0 to its own peak.
    A day without valid readings (kWh None) is drawn as a dashed outline titled "no data": unknown, not
    zero. A day with $ None gets no point, and the $ line breaks there instead of bridging it. The chart
    is an image to assistive technology, named by its ``<title>`` and described by its ``<desc>``; the
    costs page puts the same figures in a table next to it.
    """
    left, right, bottom, top = 52, 60, 28, 34
    plot_w, plot_h = width - left - right, height - top - bottom
    known_kwh = [kwh for _, kwh, _ in days if kwh is not None]
    known_usd = [usd for _, _, usd in days if usd is not None]
    peak_kwh = max(known_kwh, default=0.0) or 1.0
    peak_usd = max(known_usd, default=0.0) or 1.0
    slot = plot_w / max(len(days), 1)
    num_missing = len(days) - len(known_kwh)
    title = f"Daily energy (kWh) and energy cost ($), last {len(days)} days"
    desc = (f"Bars: kWh per UTC day on the left axis (peak {max(known_kwh, default=0.0):.4f} kWh). Line: energy $ "
            f"per day on the right axis (peak ${max(known_usd, default=0.0):.4f}). {num_missing} of {len(days)} "
            "days have no valid readings: dashed outlines, unknown rather than zero. The table after the chart "
            "lists every day.")
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" '
             f'aria-labelledby="{id_prefix}-title {id_prefix}-desc">'
             f'<title id="{id_prefix}-title">{title}</title><desc id="{id_prefix}-desc">{desc}</desc>']
    for frac in (0.0, 0.5, 1.0):
        y = top + plot_h * (1 - frac)
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#d8dee4"/>'
                     f'<text class="axis-kwh" x="{left - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end" '
                     f'fill="{KWH_COLOUR}">{peak_kwh * frac:.3g}</text>'
                     f'<text class="axis-usd" x="{width - right + 4}" y="{y + 4:.1f}" font-size="10" '
                     f'fill="{USD_COLOUR}">${peak_usd * frac:.3g}</text>')
    parts.append(f'<text x="{left - 4}" y="{top - 8}" font-size="10" text-anchor="end" fill="{KWH_COLOUR}">kWh</text>'
                 f'<text x="{width - right + 4}" y="{top - 8}" font-size="10" fill="{USD_COLOUR}">$</text>')
    # legend, above the plot
    lx = left + 24
    parts.append(f'<rect x="{lx}" y="6" width="10" height="10" fill="{KWH_COLOUR}"/>'
                 f'<text x="{lx + 14}" y="15" font-size="10">kWh per day (left)</text>'
                 f'<line x1="{lx + 130}" x2="{lx + 150}" y1="11" y2="11" stroke="{USD_COLOUR}" stroke-width="2"/>'
                 f'<circle cx="{lx + 140}" cy="11" r="2.5" fill="{USD_COLOUR}"/>'
                 f'<text x="{lx + 154}" y="15" font-size="10">energy $ per day (right)</text>'
                 f'<rect x="{lx + 290}" y="6" width="10" height="10" fill="none" stroke="{MISSING_COLOUR}" '
                 f'stroke-dasharray="2 2"/><text x="{lx + 304}" y="15" font-size="10">no data</text>')
    usd_points: list[tuple[float, float] | None] = []
    for i, (day, kwh, usd) in enumerate(days):
        x = left + i * slot + slot * 0.15
        w = slot * 0.7
        label = html.escape(day)
        if kwh is None:
            parts.append(f'<rect class="missing" x="{x:.1f}" y="{top + plot_h - 6}" width="{w:.1f}" height="6" '
                         f'fill="none" stroke="{MISSING_COLOUR}" stroke-dasharray="2 2">'
                         f'<title>{label}: no data</title></rect>')
        else:
            h = plot_h * kwh / peak_kwh
            cost = "$ unknown" if usd is None else f"${usd:.4f}"
            parts.append(f'<rect class="kwh" x="{x:.1f}" y="{top + plot_h - h:.1f}" width="{w:.1f}" '
                         f'height="{h:.1f}" fill="{KWH_COLOUR}"><title>{label}: {kwh:.4f} kWh, {cost}</title></rect>')
        usd_points.append(None if usd is None else (x + w / 2, top + plot_h * (1 - usd / peak_usd)))
        if i % 5 == 0 or i == len(days) - 1:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{height - 10}" font-size="9" text-anchor="middle">'
                         f'{label[5:]}</text>')
    for run in _runs(usd_points):
        if len(run) > 1:
            points = " ".join(f"{x:.1f},{y:.1f}" for x, y in run)
            parts.append(f'<polyline class="usd" fill="none" stroke="{USD_COLOUR}" stroke-width="2" '
                         f'points="{points}"/>')
    for (day, _, usd), point in zip(days, usd_points, strict=True):
        if point is not None:
            parts.append(f'<circle class="usd" cx="{point[0]:.1f}" cy="{point[1]:.1f}" r="2.5" fill="{USD_COLOUR}">'
                         f'<title>{html.escape(day)}: ${usd:.4f}</title></circle>')
    parts.append("</svg>")
    return "".join(parts)


def _row(name: str, entry: CostFigures) -> dict[str, Any]:
    """One summary of the accounting costs document (docs/accounting.md, "Costs API")."""
    return {"name": name, "prompt_tokens": entry.prompt_tokens, "cached_tokens": entry.cached_tokens,
            "output_tokens": entry.output_tokens, "kwh": entry.kwh,
            "energy_usd": entry.energy_usd, "list_usd": entry.list_value_usd,
            "j_per_token": entry.j_per_output_token, "coverage_pct": entry.coverage_pct}


def costs_view(data: CostsReport) -> dict[str, Any]:
    """The accounting service's costs document → what costs.html renders."""
    periods = []
    for pid, title, entry in (("today", "Today (UTC)", data.today), ("window", f"Last {data.days} days", data.window)):
        periods.append({"id": pid, "title": title, **_row(title, entry)})
    daily = [(d.day, d.kwh, d.energy_usd) for d in data.daily]
    methods = sorted({m for entry in (data.window, data.today) for m in entry.methods})

    def rows(entries: Sequence[CostFigures], names: Sequence[str | None]) -> list[dict[str, Any]]:
        return [_row(str(name or "-"), r) for r, name in zip(entries, names, strict=True)]

    return {
        "periods": periods, "chart": daily_chart_svg(daily), "rate": data.rate_usd_per_kwh,
        "daily": [_row(d.day, d) for d in data.daily],
        "methods": ", ".join(methods), "by_model": rows(data.by_model, [r.model for r in data.by_model]),
        "by_member": rows(data.by_member, [r.member for r in data.by_member]),
        "by_key": rows(data.by_api_key, [r.api_key_id for r in data.by_api_key]),
    }


def key_usage_view(data: CostsReport, key_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The costs document's 30-day ``by_api_key`` rows for ``key_ids`` only (a user's own page), by key id.

    ``tokens`` is prompt + output tokens (cached prompt tokens are part of the prompt); keys without
    traffic in the window are absent.
    """
    wanted = set(key_ids)
    out = {}
    for entry in data.by_api_key:
        key_id = entry.api_key_id
        if key_id in wanted:
            row = _row(str(key_id), entry)
            known = [n for n in (row["prompt_tokens"], row["output_tokens"]) if n is not None]
            out[str(key_id)] = {**row, "tokens": sum(known) if known else None}
    return out
