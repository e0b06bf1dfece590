"""The Limits page's form and ``/admin/limits.json`` ↔ :class:`~services.gateway.limits.Limits`. Pure: no I/O,
the clock is passed.

A form or a JSON body changes only the kinds it names (a form field present but empty, or JSON ``null``,
clears that limit; a kind left out keeps its value). Values follow :func:`identity.parse_limit` (the form)
and :func:`identity.check_limits` (both): whole numbers for the token and request kinds, positive numbers
for USD and kWh. Errors are :class:`IdentityError` naming the kind (or the target field), so the page marks
that input and the JSON route names it as the error's ``param``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from services.gateway.identity import NO_LIMITS, IdentityError, Limits, check_limits, parse_limit
from services.gateway.limits import KINDS, UNITS

WHOLE_KINDS = ("tokens_per_day", "requests_per_minute", "tokens_per_minute")
LABELS = {"tokens_per_day": "Tokens / day", "requests_per_minute": "Requests / min",
          "tokens_per_minute": "Tokens / min", "usd_per_month": "USD / month", "kwh_per_month": "kWh / month"}
WINDOW_WORDS = {"tokens_per_day": "today", "requests_per_minute": "this minute", "tokens_per_minute": "this minute",
                "usd_per_month": "this month", "kwh_per_month": "this month"}
TARGET_FIELDS = ("user", "key_id")  # a JSON body names one of these: whose limits it sets


# ---- reading ------------------------------------------------------------------------------------------

def from_form(form: Mapping[str, str]) -> tuple[dict[str, int | float | None], dict[str, str]]:
    """The kinds the form carries, parsed; and the reason per kind that could not be (empty when none)."""
    values: dict[str, int | float | None] = {}
    errors: dict[str, str] = {}
    for kind in KINDS:
        if kind not in form:
            continue
        try:
            values[kind] = parse_limit(kind, form[kind])
        except IdentityError as exc:
            errors[kind] = exc.message
    return values, errors


def target_from_json(body: Mapping[str, Any]) -> tuple[str, str]:
    """``("user", name)`` or ``("key_id", key_id)``; exactly one of them must be given, as a string."""
    named = [f for f in TARGET_FIELDS if f in body]
    if len(named) != 1:
        raise IdentityError("user", 'name whose limits to set: "user" (a user name) or "key_id" (key_…), one of them')
    field = named[0]
    if not isinstance(body[field], str) or not body[field]:
        raise IdentityError(field, "must be a non-empty string")
    return field, body[field]


def changes_from_json(body: Mapping[str, Any]) -> dict[str, int | float | None]:
    """The kinds a JSON body sets (``null`` clears); any other field than the five and the target is refused."""
    changes: dict[str, int | float | None] = {}
    for name, value in body.items():
        if name in TARGET_FIELDS:
            continue
        if name not in KINDS:
            raise IdentityError(name, f"unknown field; the limits are {', '.join(KINDS)}")
        if value is None:
            changes[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise IdentityError(name, "must be a number, or null for no limit")
        if name in WHOLE_KINDS and isinstance(value, float) and math.isfinite(value) and value == int(value):
            value = int(value)  # 60.0 from a client that writes every number as a float
        check_limits(dataclasses.replace(NO_LIMITS, **{name: value}))
        changes[name] = value
    return changes


# ---- showing ------------------------------------------------------------------------------------------

def limit_text(value: float | None) -> str:
    """An input's value: empty for no limit, else the number as typed back (no separators)."""
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def _figure(kind: str, value: float) -> str:
    if kind in WHOLE_KINDS:
        return f"{round(value):,}"
    return f"{value:,.4f}"


def age_text(seconds: float) -> str:
    """``"12 s ago"``, ``"4 min ago"``, ``"3 h ago"``, ``"2 d ago"``."""
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} d ago"


def spend_text(kind: str, spent: float | None, limit: float | None, energy_age_s: float | None = None) -> str:
    """What counts against one limit now, e.g. ``"1,234 / 50,000 tokens today"``.

    ``spent`` None (kWh the ledger has not reported this month) reads "not reported yet"; ``energy_age_s``
    is how old the ledger's kWh figure is.
    """
    if spent is None:
        return "not reported yet"
    unit, when = UNITS[kind], WINDOW_WORDS[kind]
    shown = f"{_figure(kind, spent)} / {limit:,.12g} {unit} {when}" if limit is not None \
        else f"{_figure(kind, spent)} {unit} {when}, no limit"
    if kind == "kwh_per_month" and energy_age_s is not None:
        shown += f" (ledger: {age_text(energy_age_s)})"
    return shown


def as_json(limits: Limits) -> dict[str, int | float | None]:
    return {kind: getattr(limits, kind) for kind in KINDS}


def spend_json(spend: Mapping[str, float | None]) -> dict[str, int | float | None]:
    """Counts as whole numbers, USD and kWh as they are; None stays None (kWh not reported yet)."""
    out: dict[str, int | float | None] = {}
    for kind in KINDS:
        value = spend.get(kind)
        out[kind] = None if value is None else round(value) if kind in WHOLE_KINDS else value
    return out


def cells(limits: Limits, spend: Mapping[str, float | None], energy_age_s: float | None,
          texts: Mapping[str, str], errors: Mapping[str, str]) -> list[dict[str, str]]:
    """One row's five cells for limits.html: the input's text (``texts`` keeps what a refused form sent),
    its error, and the spend line."""
    return [{"kind": kind, "label": LABELS[kind],
             "text": texts.get(kind, limit_text(getattr(limits, kind))), "error": errors.get(kind, ""),
             "inputmode": "numeric" if kind in WHOLE_KINDS else "decimal",
             "spend": spend_text(kind, spend.get(kind), limits.get(kind), energy_age_s)} for kind in KINDS]
