"""Limits that bind a principal: a user, and optionally each key under it. Pure: no I/O; the clock is passed.

A request made with an API key is checked against two principals, ``user-<user_id>`` and
``key-<lineage>`` (a key's lineage is the first key of its rotation chain, so a rotated key carries its
counters on: see identity.py). Every limit of both must have room.

Kinds and windows (UTC):

| kind | counts | window |
|---|---|---|
| ``tokens_per_day`` | prompt + output tokens | the UTC day |
| ``requests_per_minute`` | requests admitted | the epoch minute |
| ``tokens_per_minute`` | prompt + output tokens | the epoch minute |
| ``usd_per_month`` | list-price value from the price book | the UTC calendar month |
| ``kwh_per_month`` | energy the ledger attributed to the principal's requests | the UTC calendar month |

Admission **reserves** what the request may use (its prompt estimate plus ``max_tokens``, or a configured
default; one request; that much at list price) and completion **settles**: the reservation is released and
what the request really used is counted. A request is admitted while *settled + reserved* (here and, as
they last said, at the other gateways) is still below the limit, so N parallel requests overshoot a limit
by at most the last admitted request's reservation, not N requests. Energy cannot be reserved (it is
measured after the fact, minutes later): ``kwh_per_month`` refuses once the ledger's figure has reached
the limit, so it may overshoot by what ran since the ledger last measured.

Across gateway replicas each gateway publishes its own counters (settled + reserved, current windows) as
:class:`proto.LimitCounters` every ``share`` period; a receiver keeps each sender's newest message whole.
Between two messages a replica does not see the other's newest requests: across N gateways a limit can be
overshot by what the others admitted in one share period (docs/admin.md, "Limits").
"""

from __future__ import annotations

import collections
import datetime as dt
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

LimitKind = Literal["tokens_per_day", "requests_per_minute", "tokens_per_minute", "usd_per_month",
                    "kwh_per_month"]
KINDS: tuple[LimitKind, ...] = ("tokens_per_day", "requests_per_minute", "tokens_per_minute", "usd_per_month",
                                "kwh_per_month")
# The HTTP error code a refusal carries, per kind (OpenAI's own codes where it has one).
ERROR_CODES: dict[str, str] = {
    "tokens_per_day": "quota_exceeded",
    "requests_per_minute": "rate_limit_exceeded",
    "tokens_per_minute": "rate_limit_exceeded",
    "usd_per_month": "budget_exceeded",
    "kwh_per_month": "energy_budget_exceeded",
}
UNITS: dict[str, str] = {"tokens_per_day": "tokens", "requests_per_minute": "requests",
                         "tokens_per_minute": "tokens", "usd_per_month": "USD", "kwh_per_month": "kWh"}
_TIDY = 1e-9  # float sums of prices: below this a reservation's leftover is zero


@dataclass(frozen=True)
class Limits:
    """One principal's limits; None = no limit of that kind."""

    tokens_per_day: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    usd_per_month: float | None = None
    kwh_per_month: float | None = None

    def get(self, kind: str) -> float | None:
        value = getattr(self, kind)
        return None if value is None else float(value)


@dataclass(frozen=True)
class Principal:
    principal_id: str  # "user-<user_id>" or "key-<lineage>"
    limits: Limits


def user_principal(user_id: str) -> str:
    return f"user-{user_id}"


def key_principal(lineage: str) -> str:
    return f"key-{lineage}"


@dataclass(frozen=True)
class Cost:
    """What a request reserves at admission, or used in the end."""

    tokens: int = 0
    requests: int = 1
    usd: float = 0.0

    def amount(self, kind: str) -> float:
        if kind == "requests_per_minute":
            return float(self.requests)
        if kind == "usd_per_month":
            return self.usd
        if kind == "kwh_per_month":
            return 0.0  # measured by the ledger, never reserved
        return float(self.tokens)


def window(kind: str, now_s: float) -> str:
    """The id of the window ``now_s`` falls in for ``kind`` (the same at every gateway)."""
    if kind.endswith("_per_minute"):
        return f"m{int(now_s // 60)}"
    if kind.endswith("_per_day"):
        return _day_id(int(now_s // 86400))
    return month_of(now_s)


def month_of(now_s: float) -> str:
    return _month_id(int(now_s // 86400))


# A UTC day is 86,400 s of Unix time (no leap seconds), so a day's window ids depend on its number only.
# Memoised: every request asks for them 6-10 times (check, reserve and the x-ratelimit headers, for the
# user's and the key's limits), and a datetime + strftime is ~2-4 µs each: 3 % of a gateway worker's
# samples under load (py-spy, bench/gateway_overhead.py, issue #31). Pure functions of their argument.
@functools.lru_cache(maxsize=4)
def _day_id(day: int) -> str:
    return dt.datetime.fromtimestamp(day * 86400, dt.UTC).strftime("%Y-%m-%d")


@functools.lru_cache(maxsize=4)
def _month_id(day: int) -> str:
    return dt.datetime.fromtimestamp(day * 86400, dt.UTC).strftime("%Y-%m")


def reset_s(kind: str, now_s: float) -> float:
    """Seconds until the window of ``kind`` that holds ``now_s`` ends."""
    if kind.endswith("_per_minute"):
        return 60.0 - now_s % 60.0
    if kind.endswith("_per_day"):
        return 86400.0 - now_s % 86400.0
    t = dt.datetime.fromtimestamp(now_s, dt.UTC)
    nxt = dt.datetime(t.year + (t.month == 12), t.month % 12 + 1, 1, tzinfo=dt.UTC)
    return nxt.timestamp() - now_s


def counter_key(principal_id: str, kind: str, window_id: str) -> str:
    return f"{principal_id}|{kind}|{window_id}"


def duration_text(seconds: float) -> str:
    """OpenAI's ``x-ratelimit-reset-*`` format: ``"20ms"``, ``"1s"``, ``"6m0s"``, ``"1h2m3s"``."""
    if seconds < 1.0:
        return f"{max(1, math.ceil(seconds * 1000))}ms"
    total = math.ceil(seconds)
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: which principal's which limit, and when to retry."""

    principal_id: str
    kind: str
    limit: float
    counted: float
    retry_after_s: float

    @property
    def code(self) -> str:
        return ERROR_CODES[self.kind]

    def message(self) -> str:
        who = "your user" if self.principal_id.startswith("user-") else "this API key"
        shown = f"{self.limit:g}" if self.kind in ("usd_per_month", "kwh_per_month") else f"{int(self.limit):,}"
        return (f"{self.kind.replace('_', ' ')} limit of {shown} {UNITS[self.kind]} reached for {who} "
                f"({self.counted:.6g} counted); retry in {math.ceil(self.retry_after_s)} s")


@dataclass(frozen=True)
class Reservation:
    """What admission counted for a request; give it back to :meth:`LimitBook.settle`."""

    principal_ids: tuple[str, ...]
    cost: Cost
    keys: tuple[tuple[str, str], ...]  # (counter key, kind) the reservation went to


@dataclass
class LimitBook:
    """Counters for every principal this gateway has seen, per window; see the module doc.

    ``settled``: what finished requests used here; ``reserved``: open requests' reservations here;
    ``remote``: each other gateway's last :class:`proto.LimitCounters` (settled + reserved there);
    ``energy_kwh``: the ledger's month-to-date attributed kWh per principal (``energy_month``).
    """

    settled: dict[str, float] = field(default_factory=dict)
    reserved: dict[str, float] = field(default_factory=dict)
    remote: dict[str, dict[str, float]] = field(default_factory=dict)
    remote_total: collections.Counter[str] = field(default_factory=collections.Counter)
    energy_kwh: dict[str, float] = field(default_factory=dict)
    energy_month: str = ""
    energy_as_of_s: float | None = None

    # ---- counting -----------------------------------------------------------------------------

    def counted(self, key: str) -> float:
        return self.settled.get(key, 0.0) + self.reserved.get(key, 0.0) + self.remote_total.get(key, 0.0)

    def used(self, principal_id: str, kind: str, now_s: float) -> float | None:
        """What counts against the principal's ``kind`` now (None: kWh not known yet)."""
        if kind == "kwh_per_month":
            if self.energy_month != month_of(now_s):
                return None
            return self.energy_kwh.get(principal_id, 0.0)
        return self.counted(counter_key(principal_id, kind, window(kind, now_s)))

    def check(self, principals: Iterable[Principal], now_s: float) -> Refusal | None:
        """The first limit with no room left, or None (see the module doc for "room")."""
        for p in principals:
            for kind in KINDS:
                limit = p.limits.get(kind)
                if limit is None:
                    continue
                used = self.used(p.principal_id, kind, now_s)
                if used is None:  # the ledger has not said yet: admit (state it on the limits page)
                    continue
                if used >= limit:
                    return Refusal(p.principal_id, kind, limit, used, reset_s(kind, now_s))
        return None

    def reserve(self, principals: Iterable[Principal], cost: Cost, now_s: float) -> Reservation:
        """Count ``cost`` as reserved for every principal and every kind (spend is shown for all kinds,
        limited or not)."""
        ids = tuple(p.principal_id for p in principals)
        keys = []
        for pid in ids:
            for kind in KINDS:
                if kind == "kwh_per_month":
                    continue
                key = counter_key(pid, kind, window(kind, now_s))
                self.reserved[key] = self.reserved.get(key, 0.0) + cost.amount(kind)
                keys.append((key, kind))
        return Reservation(ids, cost, tuple(keys))

    def settle(self, reservation: Reservation, used: Cost) -> None:
        """Release the reservation and count what the request used, in the windows it was admitted in."""
        for key, kind in reservation.keys:
            left = self.reserved.get(key, 0.0) - reservation.cost.amount(kind)
            if left > _TIDY:
                self.reserved[key] = left
            else:
                self.reserved.pop(key, None)
            amount = used.amount(kind)
            if amount:
                self.settled[key] = self.settled.get(key, 0.0) + amount

    # ---- replicas -------------------------------------------------------------------------------

    def own_counters(self, now_s: float) -> dict[str, float]:
        """This gateway's settled + reserved amounts in the current windows (what it tells the others)."""
        self.prune(now_s)
        out: dict[str, float] = dict(self.settled)
        for key, value in self.reserved.items():
            out[key] = out.get(key, 0.0) + value
        return {k: v for k, v in out.items() if v}

    def merge_remote(self, gateway_id: str, counters: Mapping[str, float]) -> None:
        """Another gateway's newest counters replace its previous ones."""
        self.remote[gateway_id] = {k: float(v) for k, v in counters.items()
                                   if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}
        total: collections.Counter[str] = collections.Counter()
        for counts in self.remote.values():
            total.update(counts)
        self.remote_total = total

    def set_energy(self, month: str, kwh_by_principal: Mapping[str, float], as_of_s: float | None) -> None:
        self.energy_month, self.energy_kwh, self.energy_as_of_s = month, dict(kwh_by_principal), as_of_s

    def prune(self, now_s: float) -> None:
        """Forget counters of windows that have ended (a minute, a day or a month ago)."""
        current: dict[str, str] = {kind: window(kind, now_s) for kind in KINDS}
        for table in (self.settled, self.reserved):
            for key in [k for k in table if not _is_current(k, current)]:
                del table[key]

    # ---- what clients and admins see ---------------------------------------------------------------

    def rate_headers(self, principals: Iterable[Principal], now_s: float) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers for the requests and tokens per minute limits that apply
        (each from the principal with the least room left); none when no such limit applies."""
        headers: dict[str, str] = {}
        for kind, name in (("requests_per_minute", "requests"), ("tokens_per_minute", "tokens")):
            tightest: tuple[float, float] | None = None  # (remaining, limit)
            for p in principals:
                limit = p.limits.get(kind)
                if limit is None:
                    continue
                remaining = max(0.0, limit - (self.used(p.principal_id, kind, now_s) or 0.0))
                if tightest is None or remaining < tightest[0]:
                    tightest = (remaining, limit)
            if tightest is not None:
                headers[f"x-ratelimit-limit-{name}"] = str(int(tightest[1]))
                headers[f"x-ratelimit-remaining-{name}"] = str(int(tightest[0]))
                headers[f"x-ratelimit-reset-{name}"] = duration_text(reset_s(kind, now_s))
        return headers

    def spend(self, principal_id: str, now_s: float) -> dict[str, float | None]:
        return {kind: self.used(principal_id, kind, now_s) for kind in KINDS}

    def persistent(self) -> dict[str, float]:
        """Settled day and month counters (what a restart must not forget; minutes pass anyway)."""
        return {k: v for k, v in self.settled.items() if "_per_minute|" not in k}

    def restore(self, counters: Mapping[str, float]) -> None:
        """Counters saved by :meth:`persistent` (ended windows are pruned at the next share)."""
        for key, value in counters.items():
            self.settled[key] = max(self.settled.get(key, 0.0), float(value))


@dataclass
class PromptEstimator:
    """How many tokens a prompt of so many characters will be, per model, learnt from what the engines
    counted (their prompt tokens, chat template included, over the characters the client sent).

    Reservations need a prompt length before any engine tokenized the request; a fixed 4 characters per
    token is right for English prose under a large vocabulary and far off for code, other scripts, small
    vocabularies or templates that add tokens, and an underestimate lets parallel requests overshoot a
    limit by the error times their number. The ratio is a running average (weight ``alpha`` per request)
    starting at 1/4; it never goes below 1/8 (so one odd request cannot make reservations free)."""

    alpha: float = 0.2
    default_tokens_per_char: float = 0.25
    ratios: dict[str, float] = field(default_factory=dict)

    def estimate(self, model: str, chars: int) -> int:
        return math.ceil(max(chars, 1) * self.ratios.get(model, self.default_tokens_per_char))

    def observe(self, model: str, chars: int, prompt_tokens: int) -> None:
        if chars <= 0 or prompt_tokens <= 0:
            return
        ratio = max(prompt_tokens / chars, 0.125)
        old = self.ratios.get(model)
        self.ratios[model] = ratio if old is None else old + self.alpha * (ratio - old)
        if len(self.ratios) > 10_000:  # bounded: model names come from clients
            self.ratios.pop(next(iter(self.ratios)))


def _is_current(key: str, current: Mapping[str, str]) -> bool:
    _, kind, win = key.rsplit("|", 2) if key.count("|") >= 2 else ("", "", "")
    return current.get(kind) == win
