"""The costs document for the admin pages (``GET /costs``, ``llm.v1.accounting.costs``): pure shaping.

The ledger hands over per-group totals read from the rollups; this module merges usage and energy per
group and writes the JSON shape documented in docs/accounting.md ("Costs API"). Unknown stays unknown:
a group with no valid energy reading has ``kwh`` None (not 0), and its coverage says why.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

J_PER_KWH = 3.6e6


@dataclass(frozen=True, kw_only=True)
class UsageTotals:
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    list_value_usd: float | None = None


@dataclass(frozen=True, kw_only=True)
class EnergyTotals:
    """Sums over rollup rows. ``measured_j``/``energy_usd``/``jpt_busy_j`` are None when nothing was measured.
    J per output token is ``jpt_busy_j`` / ``busy_output_tokens``: the busy energy and the output tokens
    (each counted once) of the windows in which every device of the worker was measured.

    Coverage has one basis per kind of group: device-seconds (``covered_s`` of ``device_s``) for days,
    models and members; output tokens (``busy_output_tokens`` of ``attributed_output_tokens``, the tokens
    produced in any interval, measured or not) for API keys, whose device-time is shared with other keys
    and split between them by tokens."""

    measured_j: float | None = None
    energy_usd: float | None = None
    estimated_j: float | None = None
    jpt_busy_j: float | None = None
    busy_output_tokens: float = 0.0
    covered_s: float = 0.0
    device_s: float = 0.0
    attributed_output_tokens: float = 0.0
    methods: tuple[str, ...] = field(default_factory=tuple)

    @property
    def coverage_pct(self) -> float | None:
        if self.device_s > 0:
            return 100.0 * self.covered_s / self.device_s
        if self.attributed_output_tokens > 0:
            return 100.0 * self.busy_output_tokens / self.attributed_output_tokens
        return None


def summary(usage: UsageTotals | None, energy: EnergyTotals | None) -> dict[str, Any]:
    """One group's figures. Both None (no data at all) → every figure None."""
    if usage is None and energy is None:
        return {k: None for k in ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "kwh",
                                  "energy_usd", "estimated_kwh", "list_value_usd", "j_per_output_token",
                                  "coverage_pct")} | {"methods": []}
    u = usage or UsageTotals()
    e = energy or EnergyTotals()
    return {
        "requests": u.num_requests,
        "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.cached_tokens,
        "output_tokens": u.output_tokens,
        "kwh": None if e.measured_j is None else e.measured_j / J_PER_KWH,
        "energy_usd": e.energy_usd,
        "estimated_kwh": None if e.estimated_j is None else e.estimated_j / J_PER_KWH,
        "list_value_usd": u.list_value_usd,
        "j_per_output_token": (e.jpt_busy_j / e.busy_output_tokens
                               if e.jpt_busy_j is not None and e.busy_output_tokens > 0 else None),
        "methods": sorted(e.methods),
        "coverage_pct": e.coverage_pct,
    }


def grouped(name: str, usage: Mapping[str | None, UsageTotals], energy: Mapping[str | None, EnergyTotals]
            ) -> list[dict[str, Any]]:
    """One entry per group seen in either input, largest energy cost first, then most tokens."""
    keys = set(usage) | set(energy)
    rows = [{name: k, **summary(usage.get(k), energy.get(k))} for k in keys]
    rows.sort(key=lambda r: (-(r["energy_usd"] or 0.0), -(r["output_tokens"] or 0), str(r[name])))
    return rows


def day_keys(today: dt.date, num_days: int) -> list[dt.date]:
    """The window: ``num_days`` UTC days ending with ``today``, oldest first."""
    return [today - dt.timedelta(days=num_days - 1 - i) for i in range(num_days)]


def add_usage(parts: Iterable[UsageTotals]) -> UsageTotals | None:
    items = list(parts)
    if not items:
        return None
    values = [p.list_value_usd for p in items if p.list_value_usd is not None]
    return UsageTotals(num_requests=sum(p.num_requests for p in items),
                       prompt_tokens=sum(p.prompt_tokens for p in items),
                       cached_tokens=sum(p.cached_tokens for p in items),
                       output_tokens=sum(p.output_tokens for p in items),
                       list_value_usd=sum(values) if values else None)


def add_energy(parts: Iterable[EnergyTotals]) -> EnergyTotals | None:
    items = list(parts)
    if not items:
        return None

    def known_sum(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    return EnergyTotals(measured_j=known_sum([p.measured_j for p in items]),
                        energy_usd=known_sum([p.energy_usd for p in items]),
                        estimated_j=known_sum([p.estimated_j for p in items]),
                        jpt_busy_j=known_sum([p.jpt_busy_j for p in items]),
                        busy_output_tokens=sum(p.busy_output_tokens for p in items),
                        covered_s=sum(p.covered_s for p in items), device_s=sum(p.device_s for p in items),
                        attributed_output_tokens=sum(p.attributed_output_tokens for p in items),
                        methods=tuple(sorted({m for p in items for m in p.methods})))


def build_costs(*, now: dt.datetime, num_days: int, rate_usd_per_kwh: float | None,
                daily_usage: Mapping[dt.date, UsageTotals], daily_energy: Mapping[dt.date, EnergyTotals],
                by_model: tuple[Mapping[str | None, UsageTotals], Mapping[str | None, EnergyTotals]],
                by_member: tuple[Mapping[str | None, UsageTotals], Mapping[str | None, EnergyTotals]],
                by_api_key: tuple[Mapping[str | None, UsageTotals], Mapping[str | None, EnergyTotals]],
                ) -> dict[str, Any]:
    """The costs document; the per-group maps cover the whole window."""
    days = day_keys(now.date(), num_days)
    window_usage = add_usage(daily_usage[d] for d in days if d in daily_usage)
    window_energy = add_energy(daily_energy[d] for d in days if d in daily_energy)
    return {
        "generated_at": now.isoformat(),
        "days": num_days,
        "rate_usd_per_kwh": rate_usd_per_kwh,
        "today": {"day": days[-1].isoformat(), **summary(daily_usage.get(days[-1]), daily_energy.get(days[-1]))},
        "window": {"from": days[0].isoformat(), "to": days[-1].isoformat(), **summary(window_usage, window_energy)},
        "daily": [{"day": d.isoformat(), **summary(daily_usage.get(d), daily_energy.get(d))} for d in days],
        "by_model": grouped("model", *by_model),
        "by_member": grouped("member", *by_member),
        "by_api_key": grouped("api_key_id", *by_api_key),
        "note": ("kwh is measured energy (counter, power integration or engine-reported) and is null when no "
                 "valid reading exists; estimated_kwh is never added into it. coverage_pct is the share of "
                 "device-time backed by valid readings. API keys carry busy energy only; idle energy "
                 "stays with the member and model. For an API key, coverage_pct is the share of its output "
                 "tokens produced while every device it ran on had a valid reading. j_per_output_token is "
                 "over the windows in which every device of the worker was measured."),
    }
