"""``llmgw accounting`` configuration: dated rates (``--tariff``) and the errors that name the flag."""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import pytest

from services.accounting.__main__ import add_arguments, build_config
from services.accounting.service import DatedRate
from services.common.runtime import ConfigError


def config_of(tmp_path: Path, *argv: str):  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_config(parser.parse_args(["--config", "", *argv]), tmp_path)


def epoch(*args: int) -> float:
    return dt.datetime(*args, tzinfo=dt.UTC).timestamp()


def test_dated_rates_are_utc_oldest_first_and_a_repeated_identical_flag_is_one_rate(tmp_path: Path) -> None:
    config = config_of(tmp_path, "--tariff", "2026-03-01T06:30=0.2", "--tariff", "2026-01-15=0.15",
                       "--tariff", "2026-04-01T02:00+02:00=0.3", "--tariff", "2026-01-15=0.15")
    assert config.tariff == (DatedRate(effective_s=epoch(2026, 1, 15), usd_per_kwh=0.15),
                             DatedRate(effective_s=epoch(2026, 3, 1, 6, 30), usd_per_kwh=0.2),
                             DatedRate(effective_s=epoch(2026, 4, 1), usd_per_kwh=0.3))  # 02:00 at +02:00


def test_no_tariff_flag_means_no_dated_rates(tmp_path: Path) -> None:
    assert config_of(tmp_path).tariff == ()


@pytest.mark.parametrize(("value", "says"), [
    ("0.15", "no date"),
    ("=0.15", "no date"),
    ("2026-02-30=0.15", "'2026-02-30' is not a date or ISO datetime"),
    ("yesterday=0.15", "'yesterday' is not a date or ISO datetime"),
    ("2026-01-01=", "'' is not a rate in $ per kWh"),
    ("2026-01-01=cheap", "'cheap' is not a rate in $ per kWh"),
    ("2026-01-01=-0.1", "the rate must be a finite number >= 0, not '-0.1'"),
    ("2026-01-01=inf", "the rate must be a finite number >= 0, not 'inf'"),
])
def test_a_bad_tariff_stops_start_up_with_an_error_naming_the_flag(tmp_path: Path, value: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_of(tmp_path, "--tariff", value)
    assert caught.value.key == "tariff"
    assert f"--tariff {value!r}: {says}" in str(caught.value)


def test_two_different_rates_for_one_moment_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="two rates for one moment"):
        config_of(tmp_path, "--tariff", "2026-01-01=0.1", "--tariff", "2026-01-01T00:00:00+00:00=0.2")


def test_the_rapl_power_ceiling_defaults_to_the_counter_rules_figure_and_can_be_set(tmp_path: Path) -> None:
    from services.common.energy_counter import DEFAULT_MAX_RAPL_POWER_W

    assert config_of(tmp_path).limits.max_rapl_power_w == DEFAULT_MAX_RAPL_POWER_W == 600.0
    assert config_of(tmp_path, "--max-rapl-power-w", "250").limits.max_rapl_power_w == 250.0


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_a_bad_rapl_power_ceiling_stops_start_up_naming_the_flag(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config_of(tmp_path, "--max-rapl-power-w", value)
    assert caught.value.key == "max-rapl-power-w"
