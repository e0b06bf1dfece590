"""Energy intervals and their attribution to requests: pure arithmetic over stored samples.

An engine sends raw **cumulative** counters (``EnergySample``); this module turns two consecutive
stored samples of one worker session into one :class:`Interval` per device present in both, and splits
each interval's energy over the requests that produced tokens in it (docs/accounting.md, "Intervals" and
"Attribution"; DESIGN.md, "Energy accounting").

The energy of one device between samples ``p`` and ``c`` (``c`` the next stored sample of the same
session, by ``seq``) follows the counter rules of ``services/common/energy_counter.py``, the one copy the
engine's own ``/usage`` uses too: unavailable → NULL; kind/method changed → ``reset``; counter down →
``reset``, or one corrected RAPL ``wrap``; a RAPL span long enough to hide a wrap → ``rapl_ambiguous``
(NULL even when the counter rose); zero or negative time, or more than the device's power ceiling →
``implausible``. On top of them, this module flags a ``gap``: samples missing in between (``seq``
jumped) or more than ``max_gap_s`` between the two. The energy of a gap is kept: the counter is
cumulative, so a lost sample loses no energy.

**A window** is the span between ``p`` and ``c`` for all the worker's devices together (a tensor-parallel
worker lists several GPUs in every sample). Its tokens (the end sample's) are counted **once**: they sit
on one of its intervals, the *token carrier* (the smallest ``device_id``), and are 0 on the others, while
every interval keeps ``is_busy`` (the window made tokens) for the busy/idle split. The window
``is_window_measured`` when every device listed in either sample has a measured interval (energy known,
not ``estimated``): J per output token is computed over such windows only (docs/accounting.md, "Rollups").

Time is integer microseconds as the ledger stores it (``ts_us``), so a duration is exact.

The intervals are derived from what is *stored*, ordered by ``seq``, so a sample that arrives late
replaces the interval that spanned it by two (the shell recomputes that neighbourhood), and a duplicate
changes nothing. Nothing here reads a clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from proto import EnergySample
from services.common.energy_counter import US_PER_S, Counter, CounterLimits, counter_delta, epoch_us


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One device's raw cumulative counter in one sample (``EnergyReading`` as stored)."""

    device_id: str
    kind: str
    method: str
    energy_mj: int | None
    max_range_mj: int | None = None
    energy_uj: int | None = None  # RAPL's native unit, when the sender has it (appended to EnergyReading)
    max_range_uj: int | None = None

    @property
    def counter(self) -> Counter:
        return Counter(kind=self.kind, method=self.method, energy_mj=self.energy_mj, energy_uj=self.energy_uj,
                       max_range_mj=self.max_range_mj, max_range_uj=self.max_range_uj)


@dataclass(frozen=True, kw_only=True)
class TokenCount:
    """Tokens one request produced since the previous sample of its worker session."""

    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One stored ``EnergySample`` of a worker session. ``ts_us``: its time in whole microseconds, exactly
    as stored (``energy_counter.epoch_us`` of the wire's ``ts_s``; DuckDB ``TIMESTAMPTZ`` resolution)."""

    seq: int
    ts_us: int
    model_id: str
    readings: Mapping[str, Reading] = field(default_factory=dict)  # device_id → reading
    tokens: Sequence[TokenCount] = ()

    @property
    def ts_s(self) -> float:
        return self.ts_us / US_PER_S


def sample_of(msg: EnergySample) -> Sample:
    """A bus sample as the ledger stores it."""
    return Sample(seq=msg.seq, ts_us=epoch_us(msg.ts_s), model_id=msg.model_id,
                  readings={r.device_id: Reading(device_id=r.device_id, kind=r.kind, method=r.method,
                                                 energy_mj=r.energy_mj, max_range_mj=r.max_range_mj,
                                                 energy_uj=r.energy_uj, max_range_uj=r.max_range_uj)
                            for r in msg.readings},
                  tokens=[TokenCount(request_id=t.request_id, prompt_tokens=t.prompt_tokens,
                                     output_tokens=t.output_tokens) for t in msg.request_tokens])


@dataclass(frozen=True, kw_only=True)
class Limits(CounterLimits):
    """What counts as plausible: the counter limits (``max_device_power_w``, ``max_rapl_power_w``; defaults
    and their evidence in ``energy_counter``) and ``max_gap_s``: longer than this between samples is a
    ``gap`` (the engine samples every 5 s by default)."""

    max_gap_s: float = 60.0


@dataclass(frozen=True, kw_only=True)
class Interval:
    """Energy of one device between two consecutive stored samples of one worker session.

    ``energy_j`` is None when it cannot be known, and never negative. ``device_s`` is the device-time the
    interval covers (0 when time went backwards); it counts towards coverage only when ``energy_j`` is
    known. ``prompt_tokens``/``output_tokens`` are the end sample's tokens (produced during the window) on
    the window's token carrier and 0 on its other devices' intervals, so a sum over intervals counts each
    token once; ``is_busy`` says whether the window made any. ``is_window_measured``: every device of the
    window has a measured energy (the windows J per output token is computed over).
    """

    device_id: str
    kind: str
    method: str
    model_id: str
    start_seq: int
    end_seq: int
    start_us: int
    end_us: int
    energy_j: float | None
    is_reset: bool = False
    is_wrap: bool = False
    is_gap: bool = False
    is_implausible: bool = False
    is_rapl_ambiguous: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    is_busy: bool = False
    is_window_measured: bool = False
    is_token_carrier: bool = True

    @property
    def start_s(self) -> float:
        return self.start_us / US_PER_S

    @property
    def end_s(self) -> float:
        return self.end_us / US_PER_S

    @property
    def device_s(self) -> float:
        return max(self.end_us - self.start_us, 0) / US_PER_S

    @property
    def is_measured(self) -> bool:
        """A valid reading by a measuring method (``estimated`` energy is never a measurement)."""
        return self.energy_j is not None and self.method != "estimated"


@dataclass(frozen=True, kw_only=True)
class Share:
    """Part of one interval's energy. ``request_id`` None is the idle share (belongs to the engine/model).
    ``energy_j`` None: the interval's energy is unknown; the share still says whose tokens were made in it
    (an API key's coverage). Its tokens are the request's on the window's token carrier, 0 on the other
    devices' shares of the same window."""

    request_id: str | None
    energy_j: float | None
    prompt_tokens: int = 0
    output_tokens: int = 0


def derive_intervals(samples: Sequence[Sample], limits: Limits) -> list[Interval]:
    """Intervals between each pair of consecutive samples (sorted by ``seq`` here), per device in both.

    Each window's tokens go on its token carrier only (the interval with the smallest ``device_id``) and
    ``is_window_measured`` is set when every device listed in either sample has a measured interval."""
    ordered = sorted(samples, key=lambda s: s.seq)
    out: list[Interval] = []
    for prev, cur in itertools.pairwise(ordered):
        window = [interval_between(prev, before, cur, reading, limits)
                  for device_id, reading in sorted(cur.readings.items())
                  if (before := prev.readings.get(device_id)) is not None]
        devices = prev.readings.keys() | cur.readings.keys()
        is_window_measured = len(window) == len(devices) and all(iv.is_measured for iv in window)
        out.extend(dataclasses.replace(iv, is_window_measured=is_window_measured) if k == 0 else
                   dataclasses.replace(iv, is_window_measured=is_window_measured, prompt_tokens=0, output_tokens=0,
                                       is_token_carrier=False)
                   for k, iv in enumerate(window))
    return out


def interval_between(prev: Sample, before: Reading, cur: Sample, after: Reading, limits: Limits) -> Interval:
    """One device's interval from ``prev`` to ``cur``, as the window's only device (its token carrier):
    the counter rules of ``energy_counter.counter_delta``, plus the ``gap`` flag."""
    prompt = sum(t.prompt_tokens for t in cur.tokens)
    output = sum(t.output_tokens for t in cur.tokens)
    dt_us = cur.ts_us - prev.ts_us
    delta = counter_delta(before.counter, after.counter, dt_us, limits)
    iv = Interval(device_id=after.device_id, kind=after.kind, method=delta.method, model_id=cur.model_id,
                  start_seq=prev.seq, end_seq=cur.seq, start_us=prev.ts_us, end_us=cur.ts_us,
                  energy_j=delta.energy_j, is_reset=delta.is_reset, is_wrap=delta.is_wrap,
                  is_gap=cur.seq - prev.seq > 1 or dt_us > limits.max_gap_s * US_PER_S,
                  is_implausible=delta.is_implausible, is_rapl_ambiguous=delta.is_rapl_ambiguous,
                  prompt_tokens=prompt, output_tokens=output, is_busy=prompt + output > 0)
    return dataclasses.replace(iv, is_window_measured=iv.is_measured)


def attribute(interval: Interval, tokens: Sequence[TokenCount]) -> list[Share]:
    """Split an interval's energy over ``tokens`` (the end sample's) by output tokens.

    When no request produced an output token but some were prefilled, prompt tokens are the weights
    (a prefill-only interval is busy, not idle). With no tokens at all the whole interval is one idle
    share. Shares are non-negative and sum to ``interval.energy_j`` (up to float rounding): attributed +
    idle = measured. An interval without a known energy gives the same requests shares with ``energy_j``
    None (their tokens were made without a valid reading), and no idle share. Every device of a window is
    split by the same weights; the shares' token counts are set on the token carrier's only, so a key's
    tokens are counted once however many devices served them.
    """
    energy_j = interval.energy_j
    per_request: dict[str, list[int]] = {}
    for t in tokens:
        counts = per_request.setdefault(t.request_id, [0, 0])
        counts[0] += max(t.prompt_tokens, 0)
        counts[1] += max(t.output_tokens, 0)
    weight_index = 1 if any(c[1] for c in per_request.values()) else 0
    total = math.fsum(c[weight_index] for c in per_request.values())
    if total <= 0:
        return [] if energy_j is None else [Share(request_id=None, energy_j=energy_j)]
    carries = interval.is_token_carrier
    return [Share(request_id=rid, energy_j=None if energy_j is None else energy_j * c[weight_index] / total,
                  prompt_tokens=c[0] if carries else 0, output_tokens=c[1] if carries else 0)
            for rid, c in per_request.items() if c[weight_index] > 0]

