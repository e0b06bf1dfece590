"""When a member's scrape loop fires: its phase, its grid, skipped ticks, and a changed interval."""

from __future__ import annotations

import zlib

import pytest

from services.telemetry import schedule


def test_the_phase_is_a_stable_fraction_of_the_interval_from_the_id_s_crc32() -> None:
    fraction = zlib.crc32(b"m1") % 1000 / 1000
    assert schedule.phase_s("m1", 2.0) == pytest.approx(2.0 * fraction)
    assert schedule.phase_s("m1", 2.0) == schedule.phase_s("m1", 2.0)
    assert all(0 <= schedule.phase_s(f"m{i}", 1.0) < 1.0 for i in range(200))
    assert len({schedule.phase_s(f"m{i}", 1.0) for i in range(200)}) > 150  # spread, not bunched


def test_the_next_tick_is_one_interval_after_the_last_when_the_scrape_was_quick() -> None:
    assert schedule.next_tick_s(tick_s=100.0, interval_s=1.0, now_s=100.3) == 100.0 + 1.0


def test_a_scrape_that_overran_skips_the_ticks_it_missed_instead_of_bursting() -> None:
    # last tick 100, interval 1, the scrape ended at 102.4: ticks 101 and 102 are gone, the next is 103
    assert schedule.next_tick_s(tick_s=100.0, interval_s=1.0, now_s=102.4) == 100.0 + 3 * 1.0
    # ended exactly on a tick: that tick is not in the past, so it is kept
    assert schedule.next_tick_s(tick_s=100.0, interval_s=1.0, now_s=101.0) == 101.0


def test_a_changed_interval_continues_the_grid_from_the_same_last_tick() -> None:
    # 5 s interval, last tick at 100, now 100.2; the interval becomes 0.1 s: next tick 100.3 (100 + 3·0.1,
    # the first not in the past), not the old 105
    assert schedule.next_tick_s(tick_s=100.0, interval_s=0.1, now_s=100.25) == pytest.approx(100.0 + 3 * 0.1)
    # 0.1 s → 2 s at 100.05: the next tick is 102, not 100.1
    assert schedule.next_tick_s(tick_s=100.0, interval_s=2.0, now_s=100.05) == 100.0 + 2.0


def test_the_floor_and_the_default_are_those_of_the_issue_and_the_pools_file() -> None:
    from proto.pools import MetricsConfig

    assert schedule.MIN_INTERVAL_S == 0.1
    assert schedule.DEFAULT_INTERVAL_S == MetricsConfig().poll_interval


@pytest.mark.parametrize(("timeout_s", "interval_s", "expected"), [
    (2.0, 1.0, 1.0),  # the default poll: a request gets at most one interval
    (2.0, 5.0, 2.0),  # a slow poll: --timeout
    (2.0, 0.1, schedule.MIN_REQUEST_TIMEOUT_S),  # a 100 ms poll: never under 250 ms
    (0.1, 0.1, 0.1),  # an operator's shorter --timeout is kept
])
def test_each_request_s_deadline_is_the_timeout_bounded_by_the_interval(timeout_s: float, interval_s: float,
                                                                        expected: float) -> None:
    assert schedule.request_timeout_s(timeout_s, interval_s) == expected
