"""The engine's own daily energy and token buckets: what ``GET /usage`` shows under ``"energy"`` and what
``--metrics-state`` persists (shared/reference/interop.md: "GET /usage", "--metrics-state file").

**Units and formulas** (interop.md, DESIGN.md "Energy accounting"): energy is kept in watt-seconds
(= joules) per UTC day; Wh = Ws / 3600; kWh = Ws / 3.6e6; cost = kWh x rate; cost per 1M tokens =
cost / tokens x 1e6, ``None`` when a bucket has no tokens (never a division by zero).

**Unavailable is None, never 0.** A day counts as *measured* once any energy was added to it (even 0 J
from an idle but metered interval). A bucket with no measured day reports ``wh``, ``kwh``, ``cost_usd``
and ``cost_per_m_tokens_usd`` as ``None``.

**Tokens.** ``daily_tokens`` counts the tokens each day's energy served; :meth:`UsageLedger.record_tokens`
defines that as prompt + output tokens (cached prompt tokens included, since they are part of the
prompt). Lifetime totals of prompt / cached / output tokens survive restarts: the values read from the
state file are the *persisted baselines*, this process's counts are added to them, and the sum is what
is written back.

**Retention.** 31 days (the rolling 30 days plus the day before them), pruned relative to
the newest day the ledger has seen, on every add and on load; the ledger never reads the clock.

**The state file** is the interop ``--metrics-state`` schema 2 plus ``daily_measured`` (the days with a
real measurement); readers ignore unknown keys, and a file written by a reader that lacks
``daily_measured`` is taken as measured on every day present in ``daily_ws``. :func:`save_state` writes
atomically; :func:`load_state` never stops the engine: a corrupt file is renamed aside and an empty ledger
returned.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from services.common.runtime import atomic_write_text

log = logging.getLogger(__name__)

STATE_SCHEMA = 2
RETENTION_DAYS = 31
ROLLING_DAYS = 30
WS_PER_KWH = 3.6e6
WS_PER_WH = 3600.0


class InvalidMetricsStateError(ValueError):
    """A ``--metrics-state`` document that does not follow the schema; ``reason`` names the key."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid metrics state: {reason}")
        self.reason = reason


def _parse_day(day: str) -> dt.date:
    try:
        parsed = dt.date.fromisoformat(day)
    except (TypeError, ValueError) as e:
        raise ValueError(f"day must be UTC YYYY-MM-DD, got {day!r}") from e
    if parsed.isoformat() != day:  # fromisoformat also accepts 20260102 and 2026-W01-5
        raise ValueError(f"day must be UTC YYYY-MM-DD, got {day!r}")
    return parsed


def utc_day(ts_s: float) -> str:
    """The UTC day key (YYYY-MM-DD) of a Unix timestamp."""
    return dt.datetime.fromtimestamp(ts_s, tz=dt.UTC).date().isoformat()


class UsageLedger:
    """Daily energy (Ws) and token buckets, and lifetime token totals. Not thread-safe: one owner."""

    def __init__(self, rate_usd_per_kwh: float, *, note: str = "") -> None:
        if not math.isfinite(rate_usd_per_kwh) or rate_usd_per_kwh < 0:
            raise ValueError(f"rate_usd_per_kwh must be a finite number >= 0, got {rate_usd_per_kwh!r}")
        self.rate_usd_per_kwh = rate_usd_per_kwh
        self.note = note
        self.daily_ws: dict[str, float] = {}
        self.daily_tokens: dict[str, int] = {}
        self.daily_measured: set[str] = set()
        self.persisted_prompt_tokens = 0
        self.persisted_cached_tokens = 0
        self.persisted_output_tokens = 0
        self.session_prompt_tokens = 0
        self.session_cached_tokens = 0
        self.session_output_tokens = 0

    # ------------------------------------------------------------------------------------------ writes

    def add_energy(self, day: str, joules: float) -> None:
        """Add measured energy to ``day``'s bucket and mark the day measured (0 J is a measurement)."""
        _parse_day(day)
        if not math.isfinite(joules) or joules < 0:
            raise ValueError(f"joules must be a finite number >= 0, got {joules!r}")
        self.daily_ws[day] = self.daily_ws.get(day, 0.0) + joules
        self.daily_measured.add(day)
        self.prune(day)

    def add_tokens(self, day: str, n: int) -> None:
        """Add ``n`` tokens to ``day``'s bucket (the denominator of cost per 1M tokens)."""
        _parse_day(day)
        if n < 0:
            raise ValueError(f"token count must be >= 0, got {n}")
        self.daily_tokens[day] = self.daily_tokens.get(day, 0) + n
        self.prune(day)

    def record_tokens(self, day: str, *, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> None:
        """Count one request's (or one interval's) tokens: lifetime totals, and prompt + output into the
        day's bucket. ``cached_tokens`` is the part of ``prompt_tokens`` served from the prefix cache."""
        if min(prompt_tokens, cached_tokens, output_tokens) < 0:
            raise ValueError("token counts must be >= 0")
        self.session_prompt_tokens += prompt_tokens
        self.session_cached_tokens += cached_tokens
        self.session_output_tokens += output_tokens
        self.add_tokens(day, prompt_tokens + output_tokens)

    def prune(self, newest_day: str) -> None:
        """Drop buckets older than the 31 days ending at the newest of ``newest_day`` and the kept days."""
        days = set(self.daily_ws) | set(self.daily_tokens) | {newest_day}
        cutoff = (_parse_day(max(days)) - dt.timedelta(days=RETENTION_DAYS - 1)).isoformat()
        for bucket in (self.daily_ws, self.daily_tokens):
            for day in [d for d in bucket if d < cutoff]:
                del bucket[day]
        self.daily_measured = {d for d in self.daily_measured if d >= cutoff}

    # ------------------------------------------------------------------------------------------- reads

    @property
    def prompt_tokens_total(self) -> int:
        return self.persisted_prompt_tokens + self.session_prompt_tokens

    @property
    def cached_tokens_total(self) -> int:
        return self.persisted_cached_tokens + self.session_cached_tokens

    @property
    def output_tokens_total(self) -> int:
        return self.persisted_output_tokens + self.session_output_tokens

    def bucket(self, days: Iterable[str]) -> dict[str, Any]:
        """The interop bucket ``{"wh","kwh","cost_usd","tokens","cost_per_m_tokens_usd"}`` over ``days``;
        energy fields are ``None`` when none of the days was measured."""
        days = list(days)
        tokens = sum(self.daily_tokens.get(d, 0) for d in days)
        measured = [d for d in days if d in self.daily_measured]
        if not measured:
            return {"wh": None, "kwh": None, "cost_usd": None, "tokens": tokens, "cost_per_m_tokens_usd": None}
        ws = math.fsum(self.daily_ws.get(d, 0.0) for d in measured)
        kwh = ws / WS_PER_KWH
        cost_usd = kwh * self.rate_usd_per_kwh
        return {
            "wh": ws / WS_PER_WH,
            "kwh": kwh,
            "cost_usd": cost_usd,
            "tokens": tokens,
            "cost_per_m_tokens_usd": cost_usd / tokens * 1e6 if tokens else None,
        }

    def today(self, day: str) -> dict[str, Any]:
        _parse_day(day)
        return self.bucket([day])

    def rolling_30d(self, day: str) -> dict[str, Any]:
        """The 30 UTC days ending at ``day`` inclusive (``day - 29`` … ``day``)."""
        end = _parse_day(day)
        return self.bucket((end - dt.timedelta(days=k)).isoformat() for k in range(ROLLING_DAYS))

    def daily(self) -> dict[str, dict[str, Any]]:
        """One bucket per kept day (any day with energy or tokens), oldest first."""
        return {d: self.bucket([d]) for d in sorted(set(self.daily_ws) | set(self.daily_tokens))}

    def energy_view(self, day: str) -> dict[str, Any]:
        """The whole ``"energy"`` object of ``GET /usage`` for UTC ``day``."""
        return {
            "rate_usd_per_kwh": self.rate_usd_per_kwh,
            "today": self.today(day),
            "rolling_30d": self.rolling_30d(day),
            "daily": self.daily(),
            "note": self.note,
        }

    # ------------------------------------------------------------------------------------------- state

    def to_state(self) -> dict[str, Any]:
        """The ``--metrics-state`` document; the persisted totals are baselines + this session."""
        return {
            "schema": STATE_SCHEMA,
            "daily_ws": dict(sorted(self.daily_ws.items())),
            "daily_tokens": dict(sorted(self.daily_tokens.items())),
            "daily_measured": sorted(self.daily_measured),
            "persisted_prompt_tokens": self.prompt_tokens_total,
            "persisted_cached_tokens": self.cached_tokens_total,
            "persisted_output_tokens": self.output_tokens_total,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any], rate_usd_per_kwh: float, *, note: str = "") -> UsageLedger:
        """Rebuild a ledger from a ``--metrics-state`` document; raises :class:`InvalidMetricsStateError`."""
        if not isinstance(state, Mapping):
            raise InvalidMetricsStateError("document is not a JSON object")
        if state.get("schema") != STATE_SCHEMA or isinstance(state.get("schema"), bool):
            raise InvalidMetricsStateError(f"schema must be {STATE_SCHEMA}, got {state.get('schema')!r}")
        ledger = cls(rate_usd_per_kwh, note=note)
        ledger.daily_ws = {d: float(v) for d, v in _day_map(state, "daily_ws", float).items()}
        ledger.daily_tokens = {d: int(v) for d, v in _day_map(state, "daily_tokens", int).items()}
        measured = state.get("daily_measured")
        if measured is None:
            ledger.daily_measured = set(ledger.daily_ws)
        elif isinstance(measured, list) and all(isinstance(d, str) and _is_day(d) for d in measured):
            ledger.daily_measured = set(measured) & set(ledger.daily_ws)
        else:
            raise InvalidMetricsStateError("daily_measured must be a list of YYYY-MM-DD days")
        for key in ("persisted_prompt_tokens", "persisted_cached_tokens", "persisted_output_tokens"):
            value = state.get(key, 0)
            if not _is_count(value):
                raise InvalidMetricsStateError(f"{key} must be an integer >= 0, got {value!r}")
            setattr(ledger, key, value)
        days = set(ledger.daily_ws) | set(ledger.daily_tokens)
        if days:
            ledger.prune(max(days))
        return ledger


def _is_day(value: str) -> bool:
    try:
        _parse_day(value)
    except ValueError:
        return False
    return True


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _day_map(state: Mapping[str, Any], key: str, kind: type) -> dict[str, float | int]:
    raw = state.get(key, {})
    if not isinstance(raw, dict):
        raise InvalidMetricsStateError(f"{key} must be an object of day -> number")
    for day, value in raw.items():
        if not isinstance(day, str) or not _is_day(day):
            raise InvalidMetricsStateError(f"{key} has a key that is not a YYYY-MM-DD day: {day!r}")
        ok = _is_count(value) if kind is int else (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        )
        if not ok:
            raise InvalidMetricsStateError(f"{key}[{day}] must be a finite number >= 0, got {value!r}")
    return raw


def save_state(path: Path, ledger: UsageLedger) -> None:
    """Write the ledger's state atomically (temp file in the same directory, fsync, rename)."""
    atomic_write_text(path, json.dumps(ledger.to_state(), indent=1) + "\n")


def load_state(path: Path, *, rate_usd_per_kwh: float, now_s: float, note: str = "") -> UsageLedger:
    """The ledger stored at ``path``; never raises for a bad file, so the engine always starts.

    Missing file → empty ledger. A file that cannot be read, parsed or validated is renamed aside to
    ``<name>.corrupt-<UTC YYYYmmddTHHMMSSZ of now_s>`` (kept for inspection, never overwritten by the next
    save), a warning is logged, and an empty ledger is returned.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return UsageLedger(rate_usd_per_kwh, note=note)
    except (OSError, UnicodeDecodeError) as e:
        _set_aside(path, now_s, f"unreadable: {e}")
        return UsageLedger(rate_usd_per_kwh, note=note)
    try:
        return UsageLedger.from_state(json.loads(text), rate_usd_per_kwh, note=note)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and InvalidMetricsStateError are ValueErrors
        _set_aside(path, now_s, str(e))
        return UsageLedger(rate_usd_per_kwh, note=note)


def _set_aside(path: Path, now_s: float, reason: str) -> None:
    stamp = dt.datetime.fromtimestamp(now_s, tz=dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    suffix = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{suffix}")
        suffix += 1
    try:
        path.rename(target)
    except OSError as e:
        log.warning("metrics state %s is unusable (%s) and could not be moved aside (%s); starting empty",
                    path, reason, e)
        return
    log.warning("metrics state %s is unusable (%s); moved to %s, starting with an empty ledger", path, reason, target)
