"""services/gateway/limits.py: windows, reservation and settlement, replicas, headers (docs/admin.md, "Limits")."""

from __future__ import annotations

import datetime as dt

import pytest

from services.gateway.limits import (
    Cost,
    LimitBook,
    Limits,
    Principal,
    PromptEstimator,
    counter_key,
    duration_text,
    reset_s,
    window,
)

# 2026-03-31 23:59:30 UTC: 30 s before a minute, a day and a month end together
T0 = dt.datetime(2026, 3, 31, 23, 59, 30, tzinfo=dt.UTC).timestamp()
USER = Principal("user-u1", Limits(tokens_per_day=100, requests_per_minute=3, usd_per_month=0.01))
KEY = Principal("key-k1", Limits(tokens_per_minute=1000))


def test_windows_are_the_utc_minute_day_and_month_and_reset_when_they_end() -> None:
    assert window("requests_per_minute", T0) == f"m{int(T0 // 60)}"
    assert window("tokens_per_day", T0) == "2026-03-31"
    assert window("usd_per_month", T0) == window("kwh_per_month", T0) == "2026-03"
    assert reset_s("tokens_per_minute", T0) == pytest.approx(30.0)
    assert reset_s("tokens_per_day", T0) == pytest.approx(30.0)
    assert reset_s("usd_per_month", T0) == pytest.approx(30.0)
    assert window("tokens_per_day", T0 + 31) == "2026-04-01"
    assert reset_s("usd_per_month", T0 + 31) == pytest.approx(30 * 86400 - 1)  # April has 30 days


@pytest.mark.parametrize("at", [
    dt.datetime(2026, 3, 31, 23, 59, 59, 999_000, tzinfo=dt.UTC),  # the last millisecond of a day and a month
    dt.datetime(2026, 4, 1, 0, 0, 0, tzinfo=dt.UTC),  # the first instant of the next
    dt.datetime(2026, 12, 31, 23, 59, 59, tzinfo=dt.UTC),  # a year's end
    dt.datetime(2027, 1, 1, 0, 0, 0, tzinfo=dt.UTC),
    dt.datetime(2028, 2, 29, 12, 0, 0, tzinfo=dt.UTC),  # a leap day
])
def test_day_and_month_windows_match_the_calendar_at_their_edges(at: dt.datetime) -> None:
    now_s = at.timestamp()
    assert window("tokens_per_day", now_s) == at.strftime("%Y-%m-%d")
    assert window("usd_per_month", now_s) == at.strftime("%Y-%m")


def test_a_days_window_ids_are_formatted_once_not_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request asks for the day and month ids several times (check, reserve, headers); they change
    once a day, so the calendar is consulted once per new day, not per call (issue #31: 3 % of a worker)."""
    from services.gateway import limits

    calls = []
    real = limits.dt.datetime

    class Counting(real):  # type: ignore[misc,valid-type]
        @classmethod
        def fromtimestamp(cls, t, tz=None):  # type: ignore[no-untyped-def,override]
            calls.append(t)
            return real.fromtimestamp(t, tz)

    monkeypatch.setattr(limits.dt, "datetime", Counting)
    day = dt.datetime(2031, 5, 6, tzinfo=dt.UTC).timestamp()  # a day no other test asks for
    for i in range(1000):
        window("tokens_per_day", day + i * 60)
        window("usd_per_month", day + i * 60)
    assert len(calls) == 2  # one day id and one month id, where formatting per call made 2 x 1000


def test_openais_reset_durations() -> None:
    assert [duration_text(s) for s in (0.02, 1.0, 59.2, 360.0, 3723.0)] == ["20ms", "1s", "1m0s", "6m0s",
                                                                               "1h2m3s"]


def test_parallel_admissions_overshoot_by_at_most_the_last_reservation() -> None:
    book = LimitBook()
    user = Principal("user-u1", Limits(tokens_per_day=100))
    admitted = []
    for _ in range(32):  # all arrive before any settles
        if book.check([user], T0) is None:
            admitted.append(book.reserve([user], Cost(tokens=30), T0))
    # admitted while settled + reserved < 100: 0, 30, 60, 90 → four; the fifth sees 120
    assert len(admitted) == 4
    refusal = book.check([user], T0)
    assert refusal is not None and refusal.kind == "tokens_per_day" and refusal.counted == 4 * 30
    assert refusal.retry_after_s == pytest.approx(30.0)
    for r in admitted:
        book.settle(r, Cost(tokens=25))
    key = counter_key("user-u1", "tokens_per_day", "2026-03-31")
    assert book.counted(key) == 4 * 25 and key not in book.reserved  # reservations gone, usage settled
    assert book.check([user], T0) is not None  # 100 of 100


def test_every_principal_needs_room_and_the_first_without_names_itself() -> None:
    book = LimitBook()
    for _ in range(3):
        book.settle(book.reserve([USER, KEY], Cost(tokens=10), T0), Cost(tokens=10))
    refusal = book.check([USER, KEY], T0)
    assert refusal is not None and (refusal.principal_id, refusal.kind) == ("user-u1", "requests_per_minute")
    assert "your user" in refusal.message() and refusal.code == "rate_limit_exceeded"
    assert book.check([USER, KEY], T0 + 31) is None  # a new minute (and a new day)


def test_dollars_per_month_count_list_price_and_kwh_comes_from_the_ledger() -> None:
    book = LimitBook()
    book.settle(book.reserve([USER], Cost(tokens=10, usd=0.004), T0), Cost(tokens=10, usd=0.006))
    assert book.used("user-u1", "usd_per_month", T0) == pytest.approx(0.006)
    book.settle(book.reserve([USER], Cost(tokens=10, usd=0.004), T0), Cost(tokens=10, usd=0.006))
    refusal = book.check([USER], T0)
    assert refusal is not None and refusal.kind == "usd_per_month" and refusal.code == "budget_exceeded"
    budget = Principal("user-u2", Limits(kwh_per_month=0.5))
    assert book.used("user-u2", "kwh_per_month", T0) is None and book.check([budget], T0) is None  # not reported
    book.set_energy("2026-03", {"user-u2": 0.5}, T0 - 60)
    refusal = book.check([budget], T0)
    assert refusal is not None and refusal.code == "energy_budget_exceeded"
    assert book.check([budget], T0 + 31) is None  # April: March's figure no longer counts


def test_other_gateways_counters_count_and_their_newest_message_replaces_the_last() -> None:
    book = LimitBook()
    key = counter_key("user-u1", "tokens_per_day", "2026-03-31")
    book.merge_remote("gw2", {key: 60.0})
    book.merge_remote("gw3", {key: 30.0, "junk": float("nan")})
    assert book.counted(key) == 90
    book.merge_remote("gw2", {key: 80.0})
    assert book.counted(key) == 110 and book.check([USER], T0) is not None
    mine = book.reserve([USER], Cost(tokens=5), T0 + 31)  # a new day: gw2's yesterday does not count
    assert book.check([USER], T0 + 31) is None
    assert book.own_counters(T0 + 31)[counter_key("user-u1", "tokens_per_day", "2026-04-01")] == 5
    book.settle(mine, Cost(tokens=7))
    # what a restart keeps: the day's (and month's) settled amounts, not the minute's; $0 is not a counter
    assert book.persistent() == {counter_key("user-u1", "tokens_per_day", "2026-04-01"): 7}


def test_rate_headers_name_the_tightest_principal_and_only_minute_limits() -> None:
    book = LimitBook()
    tight = Principal("key-k2", Limits(requests_per_minute=2, tokens_per_minute=50))
    book.reserve([USER, tight], Cost(tokens=20), T0)
    h = book.rate_headers([USER, tight], T0)
    assert h == {"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1",
                 "x-ratelimit-reset-requests": "30s", "x-ratelimit-limit-tokens": "50",
                 "x-ratelimit-remaining-tokens": "30", "x-ratelimit-reset-tokens": "30s"}
    assert book.rate_headers([Principal("user-x", Limits(tokens_per_day=5))], T0) == {}


def test_the_prompt_estimate_learns_each_models_tokens_per_character() -> None:
    est = PromptEstimator()
    assert est.estimate("m", 13) == 4  # ceil(13 / 4) before any answer
    est.observe("m", 13, 26)  # the engine counted 26: 2 tokens a character (small vocabulary, template)
    assert est.estimate("m", 13) == 26 and est.estimate("other", 13) == 4
    est.observe("m", 13, 13)  # a running average: 2 + 0.2 * (1 - 2) = 1.8
    assert est.estimate("m", 10) == 18
    est.observe("m", 1000, 1)  # one odd answer moves it by a fifth of the way to the floor of 1/8
    assert est.estimate("m", 10) == 15  # ceil(10 * (1.8 + 0.2 * (0.125 - 1.8))) = ceil(14.65)
