"""One energy stream per device across workers and sessions (services/accounting/device_stream.py;
docs/accounting.md, "Intervals" and "Attribution")."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from services.accounting.device_stream import StreamSample, split
from services.accounting.intervals import Limits, Reading, Sample, TokenCount

LIMITS = Limits(max_gap_s=60.0)


def at(worker: str, session: str, seq: int, ts_s: float, j: int | None, *, model: str = "m", device: str = "GPU-0",
       tokens: tuple[tuple[str, int], ...] = ()) -> StreamSample:
    reading = Reading(device_id=device, kind="nvml", method="counter" if j is not None else "unavailable",
                      energy_mj=None if j is None else j * 1000)
    return StreamSample(worker_id=worker, session_id=session, sample=Sample(
        seq=seq, ts_us=round(ts_s * 1e6), model_id=model, readings={device: reading},
        tokens=[TokenCount(request_id=r, output_tokens=n) for r, n in tokens]))


def rows(samples: list[StreamSample]) -> list[tuple[float, float, str, float | None, float, bool]]:
    return sorted((p.interval.start_s, p.interval.end_s, p.worker_id, p.interval.energy_j, p.weight, p.interval.is_busy)
                  for p in split(samples, LIMITS))


def test_a_gpu_read_by_two_workers_is_one_stream_and_its_idle_energy_is_split_by_overlap_time() -> None:
    # a reads at 0 and 10, b at 5 and 15: the stream 0 → 5 → 10 → 15, 100 J each, no tokens
    parts = rows([at("a", "sa", 1, 0, 0), at("a", "sa", 2, 10, 200, model="m1"),
                  at("b", "sb", 1, 5, 100, model="m2"), at("b", "sb", 2, 15, 300, model="m2")])
    # 0→5: a's window (0,10] overlaps 5 s, b's first sample has a window of no length: all a's.
    # 5→10: a (0,10] 5 s and b (5,15] 5 s: half each. 10→15: b alone.
    assert parts == [(0, 5, "a", 100.0, 1.0, False), (5, 10, "a", 50.0, 0.5, False),
                     (5, 10, "b", 50.0, 0.5, False), (10, 15, "b", 100.0, 1.0, False)]


def test_tokens_are_spread_over_the_intervals_their_window_overlaps() -> None:
    parts = split([at("a", "sa", 1, 0, 0), at("a", "sa", 2, 10, 200, tokens=(("ra", 10),)),
                   at("b", "sb", 1, 5, 100), at("b", "sb", 2, 15, 300, tokens=(("rb", 5),))], LIMITS)
    shares = sorted((p.interval.start_s, sh.request_id, sh.energy_j, sh.output_tokens) for p in parts
                    for sh in p.shares)
    # ra: 5 tokens in 0→5 and 5 in 5→10; rb: 2.5 in 5→10 and 2.5 in 10→15
    assert shares == [(0, "ra", 100.0, 5.0), (5, "ra", 100 * 5 / 7.5, 5.0), (5, "rb", 100 * 2.5 / 7.5, 2.5),
                      (10, "rb", 100.0, 2.5)]


def test_consecutive_sessions_bridge_a_rise_is_exact_idle_a_fall_a_reset_and_a_long_silence_a_gap() -> None:
    rise = rows([at("w", "s1", 1, 0, 0), at("w", "s1", 2, 5, 100), at("w", "s2", 1, 20, 130)])
    assert rise[-1] == (5, 20, "w", 30.0, 1.0, False)
    (_, reset) = split([at("w", "s1", 1, 0, 500), at("w", "s1", 2, 5, 600), at("w", "s2", 1, 10, 20)], LIMITS)
    assert reset.interval.is_reset and reset.interval.energy_j is None
    (_, off) = split([at("w", "s1", 1, 0, 500), at("w", "s1", 2, 5, 600), at("w", "s2", 1, 5 + 61, 700)], LIMITS)
    assert off.interval.is_gap and off.interval.energy_j is None and not off.interval.is_reset
    # within one session a long silence keeps its energy (the cumulative counter is trustworthy)
    (_, kept) = split([at("w", "s1", 1, 0, 500), at("w", "s1", 2, 5, 600), at("w", "s1", 3, 5 + 61, 700)], LIMITS)
    assert kept.interval.is_gap and kept.interval.energy_j == 100.0


def test_a_new_session_whose_seqs_collide_with_the_old_ones_is_ordered_by_time() -> None:
    parts = rows([at("w", "new", 1, 20, 130), at("w", "old", 2, 5, 100), at("w", "old", 1, 0, 0),
                  at("w", "new", 2, 25, 230)])
    assert [(p[0], p[1], p[3]) for p in parts] == [(0, 5, 100.0), (5, 20, 30.0), (20, 25, 100.0)]


def test_a_sessions_own_readings_stay_in_seq_order_when_its_clock_steps_back() -> None:
    (a, back, c) = split([at("w", "s", 1, 0, 0), at("w", "s", 2, 10, 100), at("w", "s", 3, 8, 150),
                          at("w", "s", 4, 13, 200)], LIMITS)
    assert (a.interval.energy_j, back.interval.is_implausible, c.interval.energy_j) == (100.0, True, 50.0)


workers = st.sampled_from(["a", "b", "c"])


@given(st.lists(st.tuples(workers, st.floats(0.0, 100.0), st.integers(0, 5000), st.integers(0, 9)),
                min_size=2, max_size=25))
def test_attributed_plus_idle_is_measured_for_every_interval_of_any_fleet(draws) -> None:  # type: ignore[no-untyped-def]
    seqs: dict[str, int] = {}
    samples = []
    counter = 0
    for worker, ts_s, step_j, num_tokens in draws:
        seqs[worker] = seqs.get(worker, 0) + 1
        counter = counter + step_j if step_j % 7 else 0  # now and then a reset
        samples.append(at(worker, "s", seqs[worker], ts_s, counter, model=worker,
                          tokens=((f"r-{worker}", num_tokens),) if num_tokens else ()))
    by_interval: dict[int, list[float]] = {}
    for p in split(samples, LIMITS):
        iv = p.device.interval
        assert p.weight > 0 and (p.interval.energy_j is None or p.interval.energy_j >= 0)
        acc = by_interval.setdefault(id(p.device), [0.0, 0.0, 0.0])
        acc[0] += p.weight
        acc[1] += p.interval.energy_j or 0.0
        acc[2] += math.fsum(sh.energy_j or 0.0 for sh in p.shares)
        if iv.energy_j is not None:
            assert math.isclose(math.fsum(sh.energy_j or 0.0 for sh in p.shares), p.interval.energy_j or 0.0,
                                rel_tol=1e-9, abs_tol=1e-9)
    for weight, parts_j, shares_j in by_interval.values():
        assert math.isclose(weight, 1.0, rel_tol=1e-9)  # the parts of an interval are all of it
        assert math.isclose(parts_j, shares_j, rel_tol=1e-9, abs_tol=1e-9)
