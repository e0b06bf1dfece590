"""What the ledger accepts from the bus: checks on a decoded message before it is written.

A message that decodes can still be unstorable (``ts_s`` = inf, a ``seq`` past BIGINT) or poison the
rollups later (a token count whose sums overflow). Such a message is parked with the reason this module
returns (docs/accounting.md, "Ingest"), instead of failing its whole batch again on every redelivery.
Pure: no clock, no I/O.
"""

from __future__ import annotations

import datetime as dt
import math
import re

from proto import EnergySample, UsageRecord

MAX_INT64 = 2**63 - 1
# 1970-01-01 .. 2100-01-01 UTC: a timestamp outside is a broken clock, and one past year 9999 cannot
# become a TIMESTAMPTZ at all (Python's datetime raises).
MIN_TS_S = 0.0
MAX_TS_S = 4_102_444_800.0
# No request lasts a week; the bound also caps the hours a record marks for the rollup refresh (one per
# hour it spans: an infinite latency failed its batch, a huge finite one would list millions of hours).
MAX_LATENCY_MS = 7 * 86_400 * 1000.0
# No request has 2^31 tokens (the largest context windows are ~1e7). The bound keeps every sum the
# ledger takes (an interval's tokens, an hour's tokens) far inside BIGINT, so a rollup cannot overflow.
MAX_TOKENS = 2**31 - 1
# ``usage_source`` and ``limit_kind`` are labels from a short list, ``user_id`` an id: bounded so a broken
# producer cannot add megabytes to every row of ``requests``, which is kept forever.
MAX_LABEL_CHARS = 64
MAX_ID_CHARS = 256
_MONTH = re.compile(r"([0-9]{4})-([0-9]{2})")


def usage_problem(r: UsageRecord) -> str | None:
    """Why ``r`` cannot go into the ledger, or None when it can."""
    return _first(
        _timestamp("ts_s", r.ts_s),
        _integer("seq", r.seq, 0, MAX_INT64),
        _integer("http_status", r.http_status, 0, 999),
        *(_integer(name, value, 0, MAX_TOKENS) for name, value in (
            ("prompt_tokens", r.prompt_tokens), ("cached_tokens", r.cached_tokens),
            ("output_tokens", r.output_tokens))),
        _finite("latency_ms", r.latency_ms, -MAX_LATENCY_MS, MAX_LATENCY_MS),
        None if r.ttft_ms is None else _finite("ttft_ms", r.ttft_ms, -MAX_LATENCY_MS, MAX_LATENCY_MS),
        # Only their length is checked, not that they are in today's lists (usage_source: member, engine,
        # counted_by_gateway, none; limit_kind: tokens_per_day, requests_per_minute, tokens_per_minute,
        # usd_per_month, kwh_per_month, concurrent_requests). A newer gateway may add a value (fields and
        # values are appended; an old reader tolerates a new writer), and parking its records would drop
        # their tokens from the ledger; an unfamiliar label is stored as it came and harms no sum.
        _length("usage_source", r.usage_source, MAX_LABEL_CHARS),
        None if r.limit_kind is None else _length("limit_kind", r.limit_kind, MAX_LABEL_CHARS),
        None if r.user_id is None else _length("user_id", r.user_id, MAX_ID_CHARS),
    )


def energy_problem(s: EnergySample) -> str | None:
    """Why ``s`` cannot go into the ledger, or None when it can."""
    return _first(
        _timestamp("ts_s", s.ts_s),
        _integer("seq", s.seq, 0, MAX_INT64),
        # One count per running request, on the ingest path: a field's label is formatted only when it fails.
        *(_outside(f"readings[{r.device_id!r}].{name}", value, 0, MAX_INT64)
          for r in s.readings for name, value in (
              ("energy_mj", r.energy_mj), ("max_range_mj", r.max_range_mj), ("power_mw", r.power_mw),
              ("energy_uj", r.energy_uj), ("max_range_uj", r.max_range_uj))
          if value is not None and not 0 <= value <= MAX_INT64),
        *(_outside(f"request_tokens[{t.request_id!r}].{name}", value, 0, MAX_TOKENS)
          for t in s.request_tokens for name, value in (
              ("prompt_tokens", t.prompt_tokens), ("output_tokens", t.output_tokens))
          if not 0 <= value <= MAX_TOKENS),
    )


def month_bounds(month: str) -> tuple[float, float] | None:
    """A ``KeyEnergyQuery.month``, ``"YYYY-MM"`` in UTC, as its [start, end) in epoch seconds; None when it is
    not one, or lies outside the ledger's 1970 to 2100."""
    match = _MONTH.fullmatch(month)
    if match is None:
        return None
    year, num = int(match[1]), int(match[2])
    if not (1970 <= year < 2100 and 1 <= num <= 12):
        return None
    start = dt.datetime(year, num, 1, tzinfo=dt.UTC)
    end = dt.datetime(year + num // 12, num % 12 + 1, 1, tzinfo=dt.UTC)
    return start.timestamp(), end.timestamp()


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


def _timestamp(name: str, value: float) -> str | None:
    return _finite(name, value, MIN_TS_S, MAX_TS_S)


def _finite(name: str, value: float, lo: float, hi: float) -> str | None:
    if not math.isfinite(value):
        return f"{name} is {value!r}, not a finite number"
    if not lo <= value <= hi:
        return f"{name} {value!r} is outside [{lo:g}, {hi:g}]"
    return None


def _length(name: str, value: str, max_chars: int) -> str | None:
    return None if len(value) <= max_chars else f"{name} is {len(value)} characters; the limit is {max_chars}"


def _integer(name: str, value: int, lo: int, hi: int) -> str | None:
    return None if lo <= value <= hi else _outside(name, value, lo, hi)


def _outside(name: str, value: int, lo: int, hi: int) -> str:
    return f"{name} {value} is outside [{lo}, {hi}]"
