"""Lanes where the engine does not say (services/telemetry/lanes.py; docs/telemetry.md, "Lanes"):
engine's own > declared > learned > default, learned from saturation, forgotten at a restart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.heartbeat_load import VLLM_KV_WEIGHT, VLLM_RUNNING_WEIGHT, VLLM_WAITING_WEIGHT, heartbeat_load
from services.telemetry import lanes
from services.telemetry import normalize as n
from services.telemetry.probe import Member, heartbeat
from services.telemetry.promparse import parse
from tests.unit.telemetry import samples

DEFAULT = 3  # the pools file's metrics.default_max_seqs (upstream's default)


def _vllm(running: int, waiting: int, *, start_s: float = 1.7e9, prompt_tokens: float = 5000.0) -> n.Reading:
    text = samples.vllm_metrics(running=running, waiting=waiting, start_s=start_s, prompt_tokens=prompt_tokens)
    return n.vllm_reading(parse(text, n.wanted_family), n.ModelsInfo())


def _resolve(reading: n.Reading, memory: lanes.LaneMemory | None = None, declared: int | None = None
             ) -> tuple[n.Reading, lanes.LaneMemory]:
    return lanes.resolve(reading, memory or lanes.LaneMemory(), declared=declared, default=DEFAULT)


@pytest.mark.parametrize(("label", "declared", "saturated", "expected"), [
    (128, 64, True, (128, "cache_config_info")),  # the engine's own figure wins over everything
    (None, 64, True, (64, "declared")),  # then the operator's
    (None, None, True, (5, "learned")),  # then what saturation showed (5 running while 2 waited)
    (None, None, False, (DEFAULT, "default")),  # then upstream's default
])
def test_lanes_precedence_label_then_declared_then_learned_then_default(
        label: int | None, declared: int | None, saturated: bool, expected: tuple[int, str]) -> None:
    memory = _resolve(_vllm(5, 2))[1] if saturated else lanes.LaneMemory()
    reading = _vllm(1, 0)
    if label is not None:
        reading = replace(reading, lanes=label, signal_sources={**reading.signal_sources, "lanes": "cache_config_info"})
    resolved, _ = _resolve(reading, memory, declared)
    assert (resolved.lanes, resolved.signal_sources["lanes"]) == expected


def test_the_running_count_while_requests_wait_is_learned_as_the_lane_count_and_the_largest_is_kept() -> None:
    r, memory = _resolve(_vllm(running=4, waiting=2))
    assert (r.lanes, r.signal_sources["lanes"]) == (4, "learned")
    r, memory = _resolve(_vllm(running=6, waiting=1), memory)  # a larger saturated batch: a higher limit
    r, memory = _resolve(_vllm(running=3, waiting=3), memory)  # a smaller one (KV-bound) does not lower it
    assert memory.learned_lanes == 6
    r, memory = _resolve(_vllm(running=0, waiting=0), memory)  # idle: still the learned figure
    assert (r.lanes, r.running, r.signal_sources["lanes"]) == (6, 0, "learned")


def test_running_without_waiting_below_the_default_teaches_nothing() -> None:
    r, memory = _resolve(_vllm(running=2, waiting=0))
    assert (r.lanes, r.signal_sources["lanes"], memory.learned_lanes) == (DEFAULT, "default", None)


def test_a_running_count_above_the_assumed_lanes_raises_the_estimate_to_it_and_keeps_it() -> None:
    r, memory = _resolve(_vllm(running=7, waiting=0))
    assert (r.lanes, r.running, r.signal_sources["lanes"]) == (7, 7, "learned")  # never 7 running of 3 lanes
    r, _ = _resolve(_vllm(running=1, waiting=0), memory)
    assert (r.lanes, r.signal_sources["lanes"]) == (7, "learned")
    r, _ = _resolve(_vllm(running=9, waiting=0), declared=8)  # a declared figure below what runs is raised too
    assert (r.lanes, r.signal_sources["lanes"]) == (9, "learned")


@pytest.mark.parametrize("restarted", [
    {"start_s": 1.7e9 + 60},  # process_start_time_seconds changed: a new process
    {"prompt_tokens": 10.0},  # its token counter went backwards (multiprocess mode exports no process_*)
])
def test_what_was_learned_is_forgotten_when_the_engine_restarts(restarted: dict[str, float]) -> None:
    _, memory = _resolve(_vllm(running=6, waiting=2))
    r, memory = _resolve(_vllm(running=1, waiting=0), memory)
    assert (r.lanes, r.signal_sources["lanes"]) == (6, "learned")  # the same process: kept
    after = _vllm(running=1, waiting=0, **restarted)
    assert lanes.is_restart(memory, after)
    r, memory = _resolve(after, memory)
    assert (r.lanes, r.signal_sources["lanes"], memory.learned_lanes) == (DEFAULT, "default", None)


def test_a_reading_without_restart_markers_keeps_the_last_ones_seen() -> None:
    _, memory = _resolve(_vllm(running=6, waiting=2, prompt_tokens=5000.0))
    silent = replace(_vllm(running=1, waiting=0), process_start_s=None, tokens_processed_total=None)
    _, memory = _resolve(silent, memory)
    assert (memory.process_start_s, memory.tokens_processed_total, memory.learned_lanes) == (1.7e9, 5000 + 700, 6)
    assert lanes.is_restart(memory, _vllm(running=1, waiting=0, prompt_tokens=10.0))


def test_another_kind_answering_on_the_url_is_a_restart() -> None:
    _, memory = _resolve(_vllm(running=6, waiting=2))
    sglang = n.sglang_reading(parse(samples.SGLANG_METRICS, n.wanted_family), n.ModelsInfo())
    r, memory = _resolve(sglang, memory)
    assert (r.lanes, r.signal_sources["lanes"]) == (5, "learned")  # its own 5 running with 4 queued, not vLLM's 6


def test_engines_that_report_their_lanes_and_stock_servers_are_left_alone() -> None:
    ninfer = n.ninfer_reading(samples.ninfer_slots(running=2, lanes=8), None)
    assert _resolve(ninfer, declared=99)[0] == ninfer
    stock = n.stock_reading(n.ModelsInfo(("m",)))
    assert _resolve(stock)[0].lanes is None


def test_a_vllm_without_any_figure_gets_a_score_from_the_default_lanes_and_says_so_in_its_heartbeat() -> None:
    """Issue #24: with lanes null the score was null and ties went to the loaded member."""
    loaded, _ = _resolve(_vllm(running=3, waiting=2))  # 3 running while 2 wait: learned 3
    idle, _ = _resolve(_vllm(running=0, waiting=0))
    member = Member("v", "http://v")
    hb_loaded = heartbeat(member, loaded, session_id="s", seq=1, ts_s=0.0, interval_s=1.0)
    hb_idle = heartbeat(member, idle, session_id="s", seq=1, ts_s=0.0, interval_s=1.0)
    assert hb_loaded.signal_sources is not None and hb_loaded.signal_sources["lanes"] == "learned"
    assert hb_idle.signal_sources is not None and hb_idle.signal_sources["lanes"] == "default"
    # 0.6·3/3 + 0.3·0.4 + 0.1·min(2, 5)/5 against 0.6·0/3 + 0.3·0.4
    assert heartbeat_load("vllm", hb_loaded, None) == pytest.approx(
        VLLM_RUNNING_WEIGHT * 3 / 3 + VLLM_KV_WEIGHT * 0.4 + VLLM_WAITING_WEIGHT * 2 / 5)
    assert heartbeat_load("vllm", hb_idle, None) == pytest.approx(VLLM_KV_WEIGHT * 0.4)
