"""Interval arithmetic and attribution (docs/accounting.md, "Intervals" and "Attribution")."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.accounting.intervals import Limits, Reading, Sample, TokenCount, attribute, derive_intervals

LIMITS = Limits(max_gap_s=60.0, max_device_power_w=3000.0)


def sample(seq: int, ts_s: float, mj: int | None, *, kind: str = "nvml", method: str = "counter",
           max_range_mj: int | None = None, tokens: tuple[tuple[str, int], ...] = ()) -> Sample:
    reading = Reading(device_id="gpu0", kind=kind, method=method if mj is not None else "unavailable",
                      energy_mj=mj, max_range_mj=max_range_mj)
    return Sample(seq=seq, ts_s=ts_s, model_id="m", readings={"gpu0": reading},
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


def test_a_wrap_across_a_span_that_could_hide_a_second_wrap_is_not_guessed() -> None:
    rng = 262_143_328
    # 3000 W x 100 s = 300 kJ > the 262 kJ range: a second wrap is possible.
    (iv,) = derive_intervals([sample(1, 0.0, rng - 100_000, kind="rapl", max_range_mj=rng),
                              sample(2, 100.0, 400_000, kind="rapl", max_range_mj=rng)], LIMITS)
    assert iv.is_wrap and iv.is_implausible and iv.energy_j is None


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
    (busy,) = derive_intervals([sample(1, 0.0, 0), sample(2, 5.0, 10_000, tokens=(("a", 3), ("b", 1)))], LIMITS)
    shares = attribute(busy, [TokenCount(request_id="a", output_tokens=3), TokenCount(request_id="b", output_tokens=1)])
    assert {s.request_id: s.energy_j for s in shares} == {"a": 10.0 * 3 / 4, "b": 10.0 * 1 / 4}
    (idle,) = derive_intervals([sample(1, 0.0, 0), sample(2, 5.0, 10_000)], LIMITS)
    assert [(s.request_id, s.energy_j) for s in attribute(idle, [])] == [(None, 10.0)]


def test_prefill_only_intervals_are_split_by_prompt_tokens() -> None:
    (iv,) = derive_intervals([sample(1, 0.0, 0), sample(2, 5.0, 9_000)], LIMITS)
    shares = attribute(iv, [TokenCount(request_id="a", prompt_tokens=2), TokenCount(request_id="b", prompt_tokens=1)])
    assert {s.request_id: s.energy_j for s in shares} == pytest.approx({"a": 6.0, "b": 3.0})


def test_an_unknown_energy_gives_its_requests_shares_without_energy_and_no_idle_share() -> None:
    (iv,) = derive_intervals([sample(1, 0.0, 9_000), sample(2, 5.0, 0)], LIMITS)
    shares = attribute(iv, [TokenCount(request_id="a", output_tokens=5), TokenCount(request_id="b", prompt_tokens=7)])
    # b only prefilled while a produced output: output tokens are the weights, so b has no share
    assert [(s.request_id, s.energy_j, s.output_tokens) for s in shares] == [("a", None, 5)]
    assert attribute(iv, []) == []


counters = st.lists(st.one_of(st.none(), st.integers(0, 10**9)), min_size=2, max_size=30)
token_lists = st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 50), st.integers(0, 50)), max_size=6)


@given(counters, st.lists(st.floats(0.0, 120.0), min_size=30, max_size=30), st.integers(0, 2**31),
       st.data())
def test_conservation_and_non_negativity_for_any_counter_sequence(values, steps, max_range, data) -> None:  # type: ignore[no-untyped-def]
    ts = 0.0
    samples = []
    for seq, (mj, step) in enumerate(zip(values, steps, strict=False)):
        ts += step
        samples.append(sample(seq, ts, mj, kind="rapl", max_range_mj=max_range or None))
    for iv in derive_intervals(samples, LIMITS):
        assert iv.energy_j is None or iv.energy_j >= 0
        tokens = [TokenCount(request_id=r, prompt_tokens=p, output_tokens=o) for r, p, o in data.draw(token_lists)]
        shares = attribute(iv, tokens)
        if iv.energy_j is None:
            assert all(s.energy_j is None and s.request_id is not None for s in shares)
        else:
            assert all(s.energy_j is not None and s.energy_j >= 0 for s in shares)
            assert math.isclose(math.fsum(s.energy_j or 0.0 for s in shares), iv.energy_j, rel_tol=1e-12,
                                abs_tol=1e-9)
