"""What a decoded message must satisfy before it is written (docs/accounting.md, "Ingest: exactly once")."""

from __future__ import annotations

import math

import pytest

from proto import EnergyReading, EnergySample, RequestTokens, UsageRecord
from services.accounting.validation import MAX_LATENCY_MS, MAX_TOKENS, MAX_TS_S, energy_problem, usage_problem

TOO_BIG = 2**63  # one past BIGINT: a uint64 that wrapped, as a buggy producer would send


def usage(**fields: object) -> UsageRecord:
    base: dict[str, object] = dict(gateway_id="gw", session_id="s", seq=1, ts_s=1.7e9, request_id="r", model="m",
                                   pool="m", prompt_tokens=10, cached_tokens=4, output_tokens=5, latency_ms=250.0)
    return UsageRecord(**(base | fields))  # type: ignore[arg-type]


def energy(*, seq: int = 1, ts_s: float = 1.7e9, reading: EnergyReading | None = None,
           tokens: RequestTokens | None = None) -> EnergySample:
    return EnergySample(worker_id="w", session_id="s", seq=seq, ts_s=ts_s, model_id="m",
                        readings=[reading or EnergyReading(device_id="gpu0", kind="nvml", method="counter",
                                                           energy_mj=1_000)],
                        request_tokens=[tokens] if tokens else [])


@pytest.mark.parametrize(("fields", "reason"), [
    ({"ts_s": math.inf}, "ts_s is inf, not a finite number"),
    ({"ts_s": math.nan}, "ts_s is nan, not a finite number"),
    ({"ts_s": -1.0}, "ts_s -1.0 is outside [0, 4.10244e+09]"),
    ({"ts_s": MAX_TS_S + 1}, "ts_s 4102444801.0 is outside [0, 4.10244e+09]"),
    ({"seq": TOO_BIG}, f"seq {TOO_BIG} is outside [0, {2**63 - 1}]"),
    ({"seq": -1}, f"seq -1 is outside [0, {2**63 - 1}]"),
    ({"http_status": 2**31}, f"http_status {2**31} is outside [0, 999]"),
    ({"prompt_tokens": MAX_TOKENS + 1}, f"prompt_tokens {MAX_TOKENS + 1} is outside [0, {MAX_TOKENS}]"),
    ({"cached_tokens": -1}, f"cached_tokens -1 is outside [0, {MAX_TOKENS}]"),
    ({"output_tokens": TOO_BIG}, f"output_tokens {TOO_BIG} is outside [0, {MAX_TOKENS}]"),
    ({"latency_ms": math.inf}, "latency_ms is inf, not a finite number"),
    ({"latency_ms": MAX_LATENCY_MS * 2}, "latency_ms 1209600000.0 is outside [-6.048e+08, 6.048e+08]"),
    ({"ttft_ms": math.nan}, "ttft_ms is nan, not a finite number"),
])
def test_a_usage_record_that_cannot_be_stored_is_named_with_its_field(fields: dict[str, object], reason: str) -> None:
    assert usage_problem(usage(**fields)) == reason


@pytest.mark.parametrize("fields", [
    {},
    {"seq": 0, "ts_s": 0.0, "http_status": 499, "ttft_ms": None},
    {"seq": 2**63 - 1, "ts_s": MAX_TS_S, "prompt_tokens": MAX_TOKENS, "output_tokens": MAX_TOKENS},
    {"latency_ms": -3.0},  # a negative duration is stored as it came (the dirty-hour marking clamps it to 0)
])
def test_a_usage_record_at_the_edges_of_the_ranges_is_accepted(fields: dict[str, object]) -> None:
    assert usage_problem(usage(**fields)) is None


@pytest.mark.parametrize(("sample", "reason"), [
    (energy(ts_s=math.inf), "ts_s is inf, not a finite number"),
    (energy(seq=TOO_BIG), f"seq {TOO_BIG} is outside [0, {2**63 - 1}]"),
    (energy(reading=EnergyReading(device_id="gpu0", kind="nvml", method="counter", energy_mj=TOO_BIG)),
     f"readings['gpu0'].energy_mj {TOO_BIG} is outside [0, {2**63 - 1}]"),
    (energy(reading=EnergyReading(device_id="cpu", kind="rapl", method="counter", energy_mj=5, max_range_mj=-1)),
     f"readings['cpu'].max_range_mj -1 is outside [0, {2**63 - 1}]"),
    (energy(reading=EnergyReading(device_id="gpu0", kind="nvml", method="counter", energy_mj=5, power_mw=TOO_BIG)),
     f"readings['gpu0'].power_mw {TOO_BIG} is outside [0, {2**63 - 1}]"),
    (energy(tokens=RequestTokens(request_id="r", output_tokens=MAX_TOKENS + 1)),
     f"request_tokens['r'].output_tokens {MAX_TOKENS + 1} is outside [0, {MAX_TOKENS}]"),
])
def test_an_energy_sample_that_cannot_be_stored_is_named_with_its_field(sample: EnergySample, reason: str) -> None:
    assert energy_problem(sample) == reason


def test_an_energy_sample_with_an_unavailable_reading_and_tokens_is_accepted() -> None:
    unavailable = EnergyReading(device_id="gpu0", kind="none", method="unavailable", energy_mj=None)
    assert energy_problem(energy(reading=unavailable, tokens=RequestTokens(request_id="r", prompt_tokens=3))) is None
