"""The costs document for the admin pages (``GET /costs``, ``llm.v1.accounting.costs``): pure shaping.

The ledger hands over per-group totals read from the rollups; this module merges usage and energy per
group and builds the :class:`proto.CostsReport` documented in docs/accounting.md ("Costs API"). Unknown stays unknown:
a group with no valid energy reading has ``kwh`` None (not 0), and its coverage says why.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from proto import CostFigures, CostsReport, DayCosts, KeyCosts, MemberCosts, ModelCosts, WindowCosts

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


F = TypeVar("F", bound=CostFigures)


def _float(value: Any) -> float | None:
    """A DuckDB sum as a float (a DECIMAL sum is a Decimal, which JSON would write as a string)."""
    return None if value is None else float(value)


def summary(usage: UsageTotals | None, energy: EnergyTotals | None, cls: type[F], **group: Any) -> F:
    """One group's figures as ``cls`` (``group``: its name field). Both None (no data at all) → every figure None."""
    if usage is None and energy is None:
        return cls(**group)
    u = usage or UsageTotals()
    e = energy or EnergyTotals()
    return cls(
        **group,
        requests=int(u.num_requests),
        prompt_tokens=int(u.prompt_tokens),
        cached_tokens=int(u.cached_tokens),
        output_tokens=int(u.output_tokens),
        kwh=None if e.measured_j is None else float(e.measured_j) / J_PER_KWH,
        energy_usd=_float(e.energy_usd),
        estimated_kwh=None if e.estimated_j is None else float(e.estimated_j) / J_PER_KWH,
        list_value_usd=_float(u.list_value_usd),
        j_per_output_token=(float(e.jpt_busy_j) / float(e.busy_output_tokens)
                            if e.jpt_busy_j is not None and e.busy_output_tokens > 0 else None),
        methods=sorted(e.methods),
        coverage_pct=_float(e.coverage_pct),
    )


def grouped(cls: type[F], name: str, usage: Mapping[str | None, UsageTotals],
            energy: Mapping[str | None, EnergyTotals]) -> list[F]:
    """One ``cls`` per group seen in either input (``name``: its group field), largest energy cost first, then
    most tokens."""
    keys = set(usage) | set(energy)
    rows = [summary(usage.get(k), energy.get(k), cls, **{name: k}) for k in keys]
    rows.sort(key=lambda r: (-(r.energy_usd or 0.0), -(r.output_tokens or 0), str(getattr(r, name))))
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
                ) -> CostsReport:
    """The costs document; the per-group maps cover the whole window."""
    days = day_keys(now.date(), num_days)
    window_usage = add_usage(daily_usage[d] for d in days if d in daily_usage)
    window_energy = add_energy(daily_energy[d] for d in days if d in daily_energy)
    return CostsReport(
        generated_at=now.isoformat(),
        days=num_days,
        rate_usd_per_kwh=_float(rate_usd_per_kwh),
        today=summary(daily_usage.get(days[-1]), daily_energy.get(days[-1]), DayCosts, day=days[-1].isoformat()),
        window=summary(window_usage, window_energy, WindowCosts, from_day=days[0].isoformat(),
                       to_day=days[-1].isoformat()),
        daily=[summary(daily_usage.get(d), daily_energy.get(d), DayCosts, day=d.isoformat()) for d in days],
        by_model=grouped(ModelCosts, "model", *by_model),
        by_member=grouped(MemberCosts, "member", *by_member),
        by_api_key=grouped(KeyCosts, "api_key_id", *by_api_key),
        note=("kwh is measured energy (counter, power integration or engine-reported) and is null when no "
              "valid reading exists; estimated_kwh is never added into it. coverage_pct is the share of "
              "device-time backed by valid readings. API keys carry busy energy only; idle energy "
              "stays with the member and model. For an API key, coverage_pct is the share of its output "
              "tokens produced while every device it ran on had a valid reading. j_per_output_token is "
              "over the windows in which every device of the worker was measured."),
    )
