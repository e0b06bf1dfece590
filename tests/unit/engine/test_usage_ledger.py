"""The engine's daily energy/token ledger: /usage arithmetic (interop.md "GET /usage": kWh = Ws / 3.6e6,
cost = kWh x rate, cost per 1M tokens = cost / tokens x 1e6), retention, unavailable-as-None, and the
--metrics-state file (schema 2, atomic writes, corrupt files set aside)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from services.engine.serve.usage_ledger import (
    InvalidMetricsStateError,
    UsageLedger,
    load_state,
    save_state,
    utc_day,
)

RATE = 0.125
NOW_S = 1_767_323_045.0  # 2026-01-02T03:04:05Z


def test_seven_million_two_hundred_thousand_ws_is_two_kwh_and_a_quarter_dollar_at_0_125() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2026-01-02", 7_200_000)
    ledger.add_tokens("2026-01-02", 500_000)
    assert ledger.today("2026-01-02") == {
        "wh": 7_200_000 / 3600,  # 2000 Wh
        "kwh": 7_200_000 / 3.6e6,  # 2 kWh
        "cost_usd": 2 * 0.125,  # $0.25
        "tokens": 500_000,
        "cost_per_m_tokens_usd": 0.25 / 500_000 * 1e6,  # $0.50 per 1M tokens
    }


def test_energy_added_in_several_intervals_sums_in_the_day_bucket() -> None:
    ledger = UsageLedger(RATE)
    for joules in (1_800_000, 1_800_000, 3_600_000):
        ledger.add_energy("2026-01-02", joules)
    assert ledger.today("2026-01-02")["kwh"] == (1_800_000 + 1_800_000 + 3_600_000) / 3.6e6


def test_a_day_with_no_energy_measured_reports_none_not_zero() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_tokens("2026-01-02", 1_000)
    assert ledger.today("2026-01-02") == {
        "wh": None, "kwh": None, "cost_usd": None, "tokens": 1_000, "cost_per_m_tokens_usd": None,
    }
    assert ledger.rolling_30d("2026-01-02")["kwh"] is None


def test_a_measured_idle_day_reports_zero_energy_not_none() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2026-01-02", 0.0)
    assert (ledger.today("2026-01-02")["wh"], ledger.today("2026-01-02")["cost_usd"]) == (0.0, 0.0)


def test_cost_per_million_tokens_is_none_when_no_tokens_were_served() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2026-01-02", 3_600_000)
    bucket = ledger.today("2026-01-02")
    assert (bucket["cost_usd"], bucket["tokens"], bucket["cost_per_m_tokens_usd"]) == (1 * 0.125, 0, None)


def test_rolling_30_days_covers_day_minus_29_to_day_and_excludes_day_minus_30() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2025-12-03", 3_600_000)  # 2026-01-01 minus 29 days: inside
    ledger.add_energy("2025-12-02", 7_200_000)  # minus 30 days: the 31st day, outside
    ledger.add_energy("2026-01-01", 3_600_000)
    ledger.add_tokens("2025-12-02", 99)
    ledger.add_tokens("2026-01-01", 10)
    rolling = ledger.rolling_30d("2026-01-01")
    assert rolling["kwh"] == (3_600_000 + 3_600_000) / 3.6e6
    assert rolling["tokens"] == 10


def test_days_older_than_31_days_are_dropped_on_add() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2025-12-01", 1.0)  # 2025-12-31 minus 30 days: the oldest kept
    ledger.add_tokens("2025-11-30", 5)  # minus 31 days: dropped
    ledger.add_energy("2025-12-31", 1.0)
    assert list(ledger.daily()) == ["2025-12-01", "2025-12-31"]


def test_daily_lists_every_kept_day_in_the_usage_shape() -> None:
    ledger = UsageLedger(RATE, note="replayed counters")
    ledger.add_energy("2026-01-01", 3_600)
    ledger.add_tokens("2026-01-02", 7)
    view = ledger.energy_view("2026-01-02")
    assert view["rate_usd_per_kwh"] == RATE
    assert view["note"] == "replayed counters"
    assert view["daily"] == {
        "2026-01-01": {"wh": 3_600 / 3600, "kwh": 3_600 / 3.6e6, "cost_usd": 3_600 / 3.6e6 * RATE, "tokens": 0,
                       "cost_per_m_tokens_usd": None},
        "2026-01-02": {"wh": None, "kwh": None, "cost_usd": None, "tokens": 7, "cost_per_m_tokens_usd": None},
    }
    assert view["rolling_30d"]["wh"] == 3_600 / 3600 and view["rolling_30d"]["tokens"] == 7


def test_record_tokens_counts_prompt_plus_output_per_day_and_keeps_lifetime_totals() -> None:
    ledger = UsageLedger(RATE)
    ledger.persisted_prompt_tokens, ledger.persisted_cached_tokens, ledger.persisted_output_tokens = 100, 40, 30
    ledger.record_tokens("2026-01-02", prompt_tokens=12, cached_tokens=8, output_tokens=5)
    assert ledger.daily_tokens == {"2026-01-02": 12 + 5}
    assert (ledger.prompt_tokens_total, ledger.cached_tokens_total, ledger.output_tokens_total) == (
        100 + 12, 40 + 8, 30 + 5,
    )


def test_negative_or_non_finite_energy_is_refused() -> None:
    ledger = UsageLedger(RATE)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            ledger.add_energy("2026-01-02", bad)
    with pytest.raises(ValueError):
        ledger.add_energy("2026-1-2", 1.0)


def test_utc_day_uses_utc_not_local_time() -> None:
    assert utc_day(NOW_S) == "2026-01-02"
    assert utc_day(1_767_225_599.0) == "2025-12-31"  # 2026-01-01T00:00:00Z minus one second


# ---------------------------------------------------------------------------------------------- state


def test_state_round_trip_keeps_buckets_measured_days_and_token_totals() -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2026-01-01", 123_456.7)
    ledger.add_tokens("2026-01-02", 98_765)
    ledger.record_tokens("2026-01-02", prompt_tokens=10, cached_tokens=4, output_tokens=3)

    state = json.loads(json.dumps(ledger.to_state()))
    restored = UsageLedger.from_state(state, RATE)

    assert state["schema"] == 2
    assert state["daily_ws"] == {"2026-01-01": 123_456.7}
    assert state["daily_tokens"] == {"2026-01-02": 98_765 + 10 + 3}
    assert (state["persisted_prompt_tokens"], state["persisted_cached_tokens"], state["persisted_output_tokens"]) == (
        10, 4, 3,
    )
    assert restored.daily() == ledger.daily()
    assert (restored.prompt_tokens_total, restored.cached_tokens_total, restored.output_tokens_total) == (10, 4, 3)


def test_token_totals_survive_two_restarts() -> None:
    first = UsageLedger(RATE)
    first.record_tokens("2026-01-02", prompt_tokens=10, cached_tokens=0, output_tokens=1)
    second = UsageLedger.from_state(first.to_state(), RATE)
    second.record_tokens("2026-01-03", prompt_tokens=20, cached_tokens=5, output_tokens=2)
    third = UsageLedger.from_state(second.to_state(), RATE)
    assert (third.prompt_tokens_total, third.cached_tokens_total, third.output_tokens_total) == (10 + 20, 5, 1 + 2)


def test_a_ninfer_state_file_without_measured_days_counts_its_energy_days_as_measured() -> None:
    state = {"schema": 2, "daily_ws": {"2026-01-02": 123456.7}, "daily_tokens": {"2026-01-02": 98765},
             "persisted_prompt_tokens": 0, "persisted_cached_tokens": 0, "persisted_output_tokens": 0}
    ledger = UsageLedger.from_state(state, RATE)
    assert ledger.today("2026-01-02")["wh"] == 123456.7 / 3600


def test_loading_drops_days_older_than_31_days_before_the_newest() -> None:
    state = {"schema": 2, "daily_ws": {"2025-11-30": 1.0, "2025-12-01": 2.0, "2025-12-31": 3.0}, "daily_tokens": {}}
    assert list(UsageLedger.from_state(state, RATE).daily_ws) == ["2025-12-01", "2025-12-31"]


@pytest.mark.parametrize(
    "state",
    [
        {"schema": 1, "daily_ws": {}},
        {"daily_ws": {}},
        {"schema": 2, "daily_ws": {"2026-01-02": -5}},
        {"schema": 2, "daily_ws": {"yesterday": 5}},
        {"schema": 2, "daily_ws": [], "daily_tokens": {}},
        {"schema": 2, "daily_tokens": {"2026-01-02": 1.5}},
        {"schema": 2, "persisted_prompt_tokens": -1},
        {"schema": 2, "persisted_output_tokens": True},
        {"schema": 2, "daily_measured": "2026-01-02"},
    ],
)
def test_an_invalid_state_document_is_refused_with_its_reason(state: dict[str, object]) -> None:
    with pytest.raises(InvalidMetricsStateError):
        UsageLedger.from_state(state, RATE)


def test_save_then_load_reads_back_the_same_ledger(tmp_path: Path) -> None:
    ledger = UsageLedger(RATE)
    ledger.add_energy("2026-01-02", 7_200_000)
    ledger.record_tokens("2026-01-02", prompt_tokens=3, cached_tokens=1, output_tokens=2)
    path = tmp_path / "metrics-state.json"
    save_state(path, ledger)
    loaded = load_state(path, rate_usd_per_kwh=RATE, now_s=NOW_S, note="n")
    assert loaded.to_state() == ledger.to_state()
    assert loaded.note == "n"


def test_atomic_save_leaves_only_the_state_file_behind(tmp_path: Path) -> None:
    path = tmp_path / "state" / "metrics-state.json"
    ledger = UsageLedger(RATE)
    for joules in (1.0, 2.0, 3.0):
        ledger.add_energy("2026-01-02", joules)
        save_state(path, ledger)
    assert [p.name for p in path.parent.iterdir()] == ["metrics-state.json"]
    assert json.loads(path.read_text())["daily_ws"] == {"2026-01-02": 1.0 + 2.0 + 3.0}


def test_a_missing_state_file_gives_an_empty_ledger(tmp_path: Path) -> None:
    ledger = load_state(tmp_path / "absent.json", rate_usd_per_kwh=RATE, now_s=NOW_S)
    assert (ledger.daily(), ledger.prompt_tokens_total) == ({}, 0)
    assert not (tmp_path / "absent.json").exists()


@pytest.mark.parametrize("content", ["{not json", '{"schema": 7}', "[1, 2]", ""])
def test_a_corrupt_state_file_is_renamed_aside_and_an_empty_ledger_returned(
    tmp_path: Path, content: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics-state.json"
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="services.engine.serve.usage_ledger"):
        ledger = load_state(path, rate_usd_per_kwh=RATE, now_s=NOW_S)
    assert ledger.daily() == {}
    assert not path.exists()
    aside = tmp_path / "metrics-state.json.corrupt-20260102T030405Z"
    assert aside.read_text() == content
    assert "metrics-state.json" in caplog.text


def test_a_second_corrupt_file_in_the_same_second_does_not_overwrite_the_first(tmp_path: Path) -> None:
    path = tmp_path / "metrics-state.json"
    for content in ("first", "second"):
        path.write_text(content)
        load_state(path, rate_usd_per_kwh=RATE, now_s=NOW_S)
    assert (tmp_path / "metrics-state.json.corrupt-20260102T030405Z").read_text() == "first"
    assert (tmp_path / "metrics-state.json.corrupt-20260102T030405Z-1").read_text() == "second"


def test_a_state_path_that_is_a_directory_is_set_aside_too(tmp_path: Path) -> None:
    path = tmp_path / "metrics-state.json"
    path.mkdir()
    ledger = load_state(path, rate_usd_per_kwh=RATE, now_s=NOW_S)
    assert ledger.daily() == {}
    assert (tmp_path / "metrics-state.json.corrupt-20260102T030405Z").is_dir()
