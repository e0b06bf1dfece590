"""Interval arithmetic and attribution over one worker session's stream (docs/accounting.md, "Intervals" and
"Attribution"): the ledger's own derivation (device_stream.py) fed one session, as an engine sends it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto import EnergyReading, EnergySample
from services.accounting.device_stream import Part, StreamSample, split
from services.accounting.intervals import Interval, Limits, Reading, Sample, Share, TokenCount, sample_of

LIMITS = Limits(max_gap_s=60.0, max_device_power_w=3000.0, max_rapl_power_w=600.0)


def parts_of(samples: list[Sample], limits: Limits = LIMITS) -> list[Part]:
    """One session's samples through the ledger's device streams, by end time and device."""
    parts = split([StreamSample(worker_id="w", session_id="s", sample=x) for x in samples], limits)
    return sorted(parts, key=lambda p: (p.interval.end_us, p.interval.device_id))


def derive_intervals(samples: list[Sample], limits: Limits) -> list[Interval]:
    return [p.interval for p in parts_of(samples, limits)]


def shares_of(samples: list[Sample]) -> list[Share]:
    return [sh for p in parts_of(samples) for sh in p.shares]


def sample(seq: int, ts_s: float, mj: int | None, *, kind: str = "nvml", method: str = "counter",
           max_range_mj: int | None = None, tokens: tuple[tuple[str, int], ...] = ()) -> Sample:
    reading = Reading(device_id="gpu0", kind=kind, method=method if mj is not None else "unavailable",
                      energy_mj=mj, max_range_mj=max_range_mj)
    return Sample(seq=seq, ts_us=round(ts_s * 1e6), model_id="m", readings={"gpu0": reading},
                  tokens=[TokenCount(request_id=r, output_tokens=n) for r, n in tokens])


def test_the_energy_of_an_interval_is_the_counter_delta_in_joules() -> None:
    (iv,) = derive_intervals([sample(1, 100.0, 50_000), sample(2, 105.0, 1_550_000)], LIMITS)
    assert iv.energy_j == (1_550_000 - 50_000) / 1000
    assert (iv.start_seq, iv.end_seq, iv.device_s) == (1, 2, 5.0)
    assert not (iv.is_reset or iv.is_wrap or iv.is_gap or iv.is_implausible)


def test_a_counter_that_goes_down_is_a_reset_with_no_energy_never_negative() -> None:
    (iv,) = derive_intervals([sample(1, 0.0, 9_000_000), sample(2, 5.0, 1_000)], LIMITS)
    assert iv.is_reset and iv.energy_j is None


def test_a_rapl_wrap_is_corrected_once_with_the_range() -> None:
    rng = 262_143_328  # mJ, a typical max_energy_range_uj / 1000
    (iv,) = derive_intervals([sample(1, 0.0, rng - 100_000, kind="rapl", max_range_mj=rng),
                              sample(2, 5.0, 400_000, kind="rapl", max_range_mj=rng)], LIMITS)
    assert iv.is_wrap and iv.energy_j == (400_000 + rng - (rng - 100_000)) / 1000


def test_a_wrap_across_a_span_that_could_hide_a_second_wrap_is_rapl_ambiguous_not_guessed() -> None:
    rng = 262_143_328
    # 600 W x 500 s = 300 kJ > the 262 kJ range: a second wrap is possible.
    (iv,) = derive_intervals([sample(1, 0.0, rng - 100_000, kind="rapl", max_range_mj=rng),
                              sample(2, 500.0, 400_000, kind="rapl", max_range_mj=rng)], LIMITS)
    assert iv.is_wrap and iv.is_rapl_ambiguous and not iv.is_implausible and iv.energy_j is None


def test_missing_seqs_and_long_silences_are_gaps_whose_energy_is_kept() -> None:
    a, b = derive_intervals([sample(1, 0.0, 0), sample(3, 10.0, 2_000_000), sample(4, 100.0, 3_000_000)], LIMITS)
    assert a.is_gap and a.energy_j == 2000.0  # seq 2 lost: the cumulative counter still has its energy
    assert b.is_gap and b.energy_j == 1000.0  # 90 s > max_gap_s


def test_unavailable_at_either_end_is_null_energy() -> None:
    a, b = derive_intervals([sample(1, 0.0, 0), sample(2, 5.0, None), sample(3, 10.0, 10_000)], LIMITS)
    assert (a.energy_j, a.method, b.energy_j, b.method) == (None, "unavailable", None, "unavailable")


def test_more_power_than_a_device_can_draw_or_time_going_backwards_is_implausible() -> None:
    (hot,) = derive_intervals([sample(1, 0.0, 0), sample(2, 1.0, 5_000_000)], LIMITS)  # 5000 W
    (back,) = derive_intervals([sample(1, 10.0, 0), sample(2, 5.0, 1_000)], LIMITS)
    assert hot.is_implausible and hot.energy_j is None
    assert back.is_implausible and back.energy_j is None and back.device_s == 0.0


def test_a_method_change_compares_no_counters() -> None:
    (iv,) = derive_intervals([sample(1, 0.0, 1_000), sample(2, 5.0, 2_000, method="power_integration")], LIMITS)
    assert iv.is_reset and iv.energy_j is None


def test_a_late_sample_splits_the_interval_that_spanned_it() -> None:
    late = derive_intervals([sample(3, 10.0, 3_000), sample(1, 0.0, 1_000), sample(2, 5.0, 2_500)], LIMITS)
    assert [(i.start_seq, i.end_seq, i.energy_j) for i in late] == [(1, 2, 1.5), (2, 3, 0.5)]


def test_energy_is_split_by_output_tokens_and_an_interval_without_tokens_is_idle() -> None:
    shares = shares_of([sample(1, 0.0, 0), sample(2, 5.0, 10_000, tokens=(("a", 3), ("b", 1)))])
    assert {s.request_id: s.energy_j for s in shares} == {"a": 10.0 * 3 / 4, "b": 10.0 * 1 / 4}
    idle = shares_of([sample(1, 0.0, 0), sample(2, 5.0, 10_000)])
    assert [(s.request_id, s.energy_j) for s in idle] == [(None, 10.0)]


def with_tokens(x: Sample, *tokens: TokenCount) -> Sample:
    return Sample(seq=x.seq, ts_us=x.ts_us, model_id=x.model_id, readings=x.readings, tokens=list(tokens))


def test_prefill_only_intervals_are_split_by_prompt_tokens() -> None:
    shares = shares_of([sample(1, 0.0, 0), with_tokens(sample(2, 5.0, 9_000),
                                                       TokenCount(request_id="a", prompt_tokens=2),
                                                       TokenCount(request_id="b", prompt_tokens=1))])
    assert {s.request_id: s.energy_j for s in shares} == pytest.approx({"a": 6.0, "b": 3.0})


def test_an_unknown_energy_gives_its_requests_shares_without_energy_and_no_idle_share() -> None:
    shares = shares_of([sample(1, 0.0, 9_000), with_tokens(sample(2, 5.0, 0),
                                                           TokenCount(request_id="a", output_tokens=5),
                                                           TokenCount(request_id="b", prompt_tokens=7))])
    # b only prefilled while a produced output: output tokens are the weights, so b has no share
    assert [(s.request_id, s.energy_j, s.output_tokens) for s in shares] == [("a", None, 5)]
    assert shares_of([sample(1, 0.0, 9_000), sample(2, 5.0, 0)]) == []


def test_durations_are_whole_microseconds_as_stored_not_differences_of_float_seconds() -> None:
    a, b = 1767225600.123457, 1767225605.123458
    assert b - a != 5_000_001 / 1e6  # 5.000000953674316: float epoch seconds lose ~2.4e-7 s here
    msgs = [EnergySample(worker_id="w", session_id="s", seq=k, ts_s=t, model_id="m",
                         readings=[EnergyReading(device_id="gpu0", kind="nvml", method="counter", energy_mj=mj)])
            for k, (t, mj) in enumerate([(a, 0), (b, 5_000)], start=1)]
    (iv,) = derive_intervals([sample_of(m) for m in msgs], LIMITS)
    assert (iv.start_us, iv.end_us, iv.device_s) == (1767225600_123457, 1767225605_123458, 5_000_001 / 1e6)


RAPL_RANGE_UJ = 262_143_328_850  # max_energy_range_uj of an Intel package zone


def rapl_sample(seq: int, ts_s: float, uj: int) -> Sample:
    reading = Reading(device_id="rapl:package-0", kind="rapl", method="counter", energy_mj=uj // 1000,
                      max_range_mj=RAPL_RANGE_UJ // 1000, energy_uj=uj, max_range_uj=RAPL_RANGE_UJ)
    return Sample(seq=seq, ts_us=round(ts_s * 1e6), model_id="m", readings={reading.device_id: reading})


def test_a_rapl_zone_silent_for_40_minutes_is_ambiguous_even_though_its_counter_rose() -> None:
    # 600 W x 2,400 s = 1,440,000 J: the 262,143 J range could have gone round unseen, up to five times
    (iv,) = derive_intervals([rapl_sample(1, 0.0, 10_000_000_000), rapl_sample(2, 2400.0, 60_000_000_000)], LIMITS)
    assert iv.is_rapl_ambiguous and iv.is_gap and iv.energy_j is None
    assert not (iv.is_wrap or iv.is_reset or iv.is_implausible or iv.is_window_measured)


def test_a_rapl_zone_silent_for_a_short_span_is_exact_in_microjoules() -> None:
    # 60 s: at most 600 W x 60 s = 36,000 J could pass, far less than the range: no wrap can hide
    (iv,) = derive_intervals([rapl_sample(1, 0.0, 10_000_000_123), rapl_sample(2, 60.0, 16_000_000_999)], LIMITS)
    assert not iv.is_rapl_ambiguous and iv.energy_j == (16_000_000_999 - 10_000_000_123) / 1e6


def tp_sample(seq: int, ts_s: float, mj: dict[str, int | None], tokens: tuple[tuple[str, int], ...] = ()) -> Sample:
    readings = {d: Reading(device_id=d, kind="nvml", method="counter" if v is not None else "unavailable",
                           energy_mj=v) for d, v in mj.items()}
    return Sample(seq=seq, ts_us=round(ts_s * 1e6), model_id="m", readings=readings,
                  tokens=[TokenCount(request_id=r, output_tokens=n) for r, n in tokens])


def test_a_tensor_parallel_window_counts_its_tokens_once_on_its_smallest_device() -> None:
    samples = [tp_sample(1, 0.0, {"GPU-1": 0, "GPU-0": 0}),
               tp_sample(2, 5.0, {"GPU-1": 900_000, "GPU-0": 1_000_000}, (("r", 7),))]
    a, b = derive_intervals(samples, LIMITS)
    assert [(i.device_id, i.energy_j, i.output_tokens) for i in (a, b)] == [("GPU-0", 1000.0, 7), ("GPU-1", 900.0, 0)]
    assert a.is_busy and b.is_busy and a.is_window_measured and b.is_window_measured
    shares = shares_of(samples)
    assert [(sh.request_id, sh.energy_j, sh.output_tokens) for sh in shares] == [("r", 1000.0, 7), ("r", 900.0, 0)]


def test_a_window_with_a_device_unavailable_is_not_measured_and_a_device_missing_from_one_sample_pairs_across_it(
        ) -> None:
    ivs = derive_intervals([tp_sample(1, 0.0, {"GPU-0": 0, "GPU-1": 0}),
                            tp_sample(2, 5.0, {"GPU-0": 1_000, "GPU-1": None}),
                            tp_sample(3, 10.0, {"GPU-0": 2_000, "GPU-1": 2_000}),
                            tp_sample(4, 15.0, {"GPU-0": 3_000}),  # GPU-1 not listed: its stream goes 3 → 5
                            tp_sample(5, 20.0, {"GPU-0": 4_000, "GPU-1": 4_000})], LIMITS)
    assert [(i.end_seq, i.device_id, i.energy_j, i.is_window_measured) for i in ivs] == [
        (2, "GPU-0", 1.0, False), (2, "GPU-1", None, False),
        (3, "GPU-0", 1.0, False), (3, "GPU-1", None, False),
        (4, "GPU-0", 1.0, True),  # GPU-1's 3 → 5 covers this window, measured
        (5, "GPU-0", 1.0, True), (5, "GPU-1", (4_000 - 2_000) / 1000, True)]
    # no device-time is missing: GPU-1's 20 s are all there
    assert sum(i.device_s for i in ivs if i.device_id == "GPU-1") == 20.0


counters = st.lists(st.one_of(st.none(), st.integers(0, 10**9)), min_size=2, max_size=30)
token_lists = st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 50), st.integers(0, 50)), max_size=6)


@given(counters, st.lists(st.floats(0.0, 120.0), min_size=30, max_size=30), st.integers(0, 2**31),
       st.data())
def test_conservation_and_non_negativity_for_any_counter_sequence(values, steps, max_range, data) -> None:  # type: ignore[no-untyped-def]
    ts = 0.0
    samples = []
    for seq, (mj, step) in enumerate(zip(values, steps, strict=False)):
        ts += step
        tokens = [TokenCount(request_id=r, prompt_tokens=p, output_tokens=o) for r, p, o in data.draw(token_lists)]
        samples.append(with_tokens(sample(seq, ts, mj, kind="rapl", max_range_mj=max_range or None), *tokens))
    for part in parts_of(samples):
        iv = part.interval
        assert part.weight == 1.0  # one worker: its part is the whole interval
        assert iv.energy_j is None or iv.energy_j >= 0
        if iv.energy_j is None:
            assert all(s.energy_j is None and s.request_id is not None for s in part.shares)
        else:
            assert all(s.energy_j is not None and s.energy_j >= 0 for s in part.shares)
            assert math.isclose(math.fsum(s.energy_j or 0.0 for s in part.shares), iv.energy_j, rel_tol=1e-12,
                                abs_tol=1e-9)
