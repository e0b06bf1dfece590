"""Member health across scrapes, heartbeat and energy-sample building, discovery ranges and ids."""

from __future__ import annotations

import pytest

from services.common.runtime import ConfigError
from services.telemetry import discovery
from services.telemetry.normalize import Reading
from services.telemetry.probe import Health, Member, down_heartbeat, energy_sample, heartbeat

MEMBER = Member("m1", "http://127.0.0.1:8006")


def test_two_consecutive_failures_mark_down_and_the_first_success_after_recovers() -> None:
    h = Health()
    assert [h.observe(ok) for ok in (True, False, True, False, False, False, True, True)] == [
        None, None, None, None, "down", None, "recovered", None]


def test_a_heartbeat_carries_what_the_reading_filled_and_none_for_the_rest() -> None:
    reading = Reading(engine_kind="vllm", model_id="q", running=3, waiting=0, kv_usage=0.5)
    hb = heartbeat(MEMBER, reading, session_id="s", seq=7, ts_s=100.0, interval_s=1.0)
    assert (hb.worker_id, hb.backend, hb.engine_kind, hb.state, hb.ts_s, hb.seq) == (
        "m1", MEMBER.url, "vllm", "ready", 100.0, 7)
    assert (hb.running, hb.waiting, hb.kv_usage, hb.heartbeat_interval_s) == (3, 0, 0.5, 1.0)
    assert hb.lanes is None and hb.max_context is None and hb.energy_today_wh is None and hb.energy_30d_wh is None


def test_a_ninfer_heartbeat_carries_the_engine_s_today_and_30_day_energy() -> None:
    reading = Reading(engine_kind="ninfer", model_id="q", energy_today_wh=2.5, energy_30d_wh=95.25,
                      energy_wh_total=102.5)
    hb = heartbeat(MEMBER, reading, session_id="s", seq=1, ts_s=1.0, interval_s=1.0)
    assert (hb.energy_today_wh, hb.energy_30d_wh) == (2.5, 95.25)


def test_a_down_heartbeat_keeps_the_kind_and_model_but_no_load_figures() -> None:
    last = Reading(engine_kind="ninfer", model_id="q", lanes=8, running=8, energy_30d_wh=5.0)
    hb = down_heartbeat(MEMBER, last, session_id="s", seq=9, ts_s=5.0, interval_s=1.0)
    assert (hb.state, hb.engine_kind, hb.model_id, hb.lanes, hb.running) == ("down", "ninfer", "q", None, None)
    assert hb.energy_30d_wh is None
    assert down_heartbeat(MEMBER, None, session_id="s", seq=1, ts_s=5.0, interval_s=1.0).engine_kind == "stock"


def test_energy_is_the_daily_wh_sum_as_a_millijoule_counter_and_absent_when_unreported() -> None:
    sample = energy_sample(MEMBER, Reading(engine_kind="ninfer", model_id="q", energy_wh_total=1.5),
                           session_id="s", seq=3, ts_s=10.0)
    assert sample is not None
    (reading,) = sample.readings
    assert (reading.kind, reading.method, reading.energy_mj) == ("engine", "engine_reported", 1.5 * 3600 * 1000)
    assert energy_sample(MEMBER, Reading(engine_kind="ninfer"), session_id="s", seq=4, ts_s=11.0) is None


@pytest.mark.parametrize(("spec", "expected"), [
    ("localhost:8000-8003", ("localhost", 8000, 8003)),
    ("10.0.0.5:9000", ("10.0.0.5", 9000, 9000)),
    ("[::1]:80-81", ("::1", 80, 81)),
])
def test_discovery_ranges_parse(spec: str, expected: tuple[str, int, int]) -> None:
    r = discovery.parse_range(spec)
    assert (r.host, r.first_port, r.last_port) == expected


@pytest.mark.parametrize("spec", ["localhost", "localhost:b-c", ":80", "h:9-8", "h:0-3", "h:1-2000"])
def test_bad_discovery_ranges_name_the_key(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        discovery.parse_range(spec)
    assert err.value.key == "discover"


def test_discovered_ids_are_deterministic_and_subject_safe() -> None:
    assert discovery.discovered_id("10.0.0.5", 8000) == "disc-10-0-0-5-8000"
    assert discovery.discovered_id("::1", 80) == "disc--1-80"
    assert discovery.parse_range("[::1]:80").url(80) == "http://[::1]:80"
