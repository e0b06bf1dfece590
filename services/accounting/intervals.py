"""Energy intervals and their attribution to requests: pure arithmetic over stored samples.

An engine sends raw **cumulative** counters (``EnergySample``); this module turns two consecutive
stored samples of one worker session into one :class:`Interval` per device present in both, and splits
each interval's energy over the requests that produced tokens in it (docs/accounting.md, "Intervals" and
"Attribution"; DESIGN.md, "Energy accounting").

Rules, in the order they are applied to one device between samples ``p`` and ``c`` (``c`` the next
stored sample of the same session, by ``seq``):

- either reading unavailable (``energy_mj`` None) → energy NULL, method ``unavailable``;
- the device's ``kind``/``method`` changed (e.g. NVML counter → power integration) → the two counters are
  on different scales: energy NULL, flagged ``reset``;
- counter went down: with ``max_range_mj`` (RAPL) one wrap is corrected (``delta + max_range``) and
  flagged ``wrap``; without it the interval is a ``reset`` and its energy NULL — never negative, never
  guessed;
- a wrap over a span long enough to hold a second wrap at ``max_device_power_w`` is ambiguous: NULL,
  flagged ``implausible`` as well as ``wrap``;
- time going backwards, energy over zero time, or more than ``max_device_power_w`` on average →
  NULL, flagged ``implausible``;
- ``gap``: samples missing in between (``seq`` jumped) or more than ``max_gap_s`` between the two. The
  energy of a gap is kept: the counter is cumulative, so a lost sample loses no energy.

The intervals are derived from what is *stored*, ordered by ``seq``, so a sample that arrives late
replaces the interval that spanned it by two (the shell recomputes that neighbourhood), and a duplicate
changes nothing. Nothing here reads a clock.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Reading:
    """One device's raw cumulative counter in one sample (``EnergyReading`` as stored)."""

    device_id: str
    kind: str
    method: str
    energy_mj: int | None
    max_range_mj: int | None = None


@dataclass(frozen=True, kw_only=True)
class TokenCount:
    """Tokens one request produced since the previous sample of its worker session."""

    request_id: str
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One stored ``EnergySample`` of a worker session."""

    seq: int
    ts_s: float
    model_id: str
    readings: Mapping[str, Reading] = field(default_factory=dict)  # device_id → reading
    tokens: Sequence[TokenCount] = ()


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What counts as plausible. ``max_gap_s``: longer than this between samples is a ``gap`` (the engine
    samples every 5 s by default). ``max_device_power_w``: no device averages more (an H200 is 700 W)."""

    max_gap_s: float = 60.0
    max_device_power_w: float = 3000.0


@dataclass(frozen=True, kw_only=True)
class Interval:
    """Energy of one device between two consecutive stored samples of one worker session.

    ``energy_j`` is None when it cannot be known, and never negative. ``device_s`` is the device-time the
    interval covers (0 when time went backwards); it counts towards coverage only when ``energy_j`` is
    known. ``prompt_tokens``/``output_tokens`` are the end sample's tokens (produced during the interval).
    """

    device_id: str
    kind: str
    method: str
    model_id: str
    start_seq: int
    end_seq: int
    start_s: float
    end_s: float
    energy_j: float | None
    is_reset: bool = False
    is_wrap: bool = False
    is_gap: bool = False
    is_implausible: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def device_s(self) -> float:
        return max(self.end_s - self.start_s, 0.0)


@dataclass(frozen=True, kw_only=True)
class Share:
    """Part of one interval's energy. ``request_id`` None is the idle share (belongs to the engine/model).
    ``energy_j`` None: the interval's energy is unknown; the share still says whose tokens were made in it
    (an API key's coverage)."""

    request_id: str | None
    energy_j: float | None
    prompt_tokens: int = 0
    output_tokens: int = 0


def derive_intervals(samples: Sequence[Sample], limits: Limits) -> list[Interval]:
    """Intervals between each pair of consecutive samples (sorted by ``seq`` here), per device in both."""
    ordered = sorted(samples, key=lambda s: s.seq)
    out: list[Interval] = []
    for prev, cur in itertools.pairwise(ordered):
        for device_id, reading in cur.readings.items():
            before = prev.readings.get(device_id)
            if before is not None:
                out.append(interval_between(prev, before, cur, reading, limits))
    return out


def interval_between(prev: Sample, before: Reading, cur: Sample, after: Reading, limits: Limits) -> Interval:
    """One device's interval from ``prev`` to ``cur`` (see the module docstring for the rules)."""
    prompt = sum(t.prompt_tokens for t in cur.tokens)
    output = sum(t.output_tokens for t in cur.tokens)
    dt_s = cur.ts_s - prev.ts_s
    is_gap = cur.seq - prev.seq > 1 or dt_s > limits.max_gap_s

    def make(energy_j: float | None, method: str, **flags: bool) -> Interval:
        return Interval(device_id=after.device_id, kind=after.kind, method=method, model_id=cur.model_id,
                        start_seq=prev.seq, end_seq=cur.seq, start_s=prev.ts_s, end_s=cur.ts_s, energy_j=energy_j,
                        is_gap=is_gap, prompt_tokens=prompt, output_tokens=output, **flags)

    if before.energy_mj is None or after.energy_mj is None:
        return make(None, "unavailable")
    if (before.kind, before.method) != (after.kind, after.method):
        return make(None, after.method, is_reset=True)
    delta_mj = after.energy_mj - before.energy_mj
    is_wrap = False
    if delta_mj < 0:
        if not after.max_range_mj:
            return make(None, after.method, is_reset=True)
        delta_mj += after.max_range_mj
        is_wrap = True
        if delta_mj < 0:  # fell by more than the whole range: not a wrap
            return make(None, after.method, is_reset=True)
        if dt_s * limits.max_device_power_w * 1000 >= after.max_range_mj:  # room for a second, unseen wrap
            return make(None, after.method, is_wrap=True, is_implausible=True)
    energy_j = delta_mj / 1000
    if dt_s < 0 or (dt_s == 0 and delta_mj > 0) or (dt_s > 0 and energy_j / dt_s > limits.max_device_power_w):
        return make(None, after.method, is_wrap=is_wrap, is_implausible=True)
    return make(energy_j, after.method, is_wrap=is_wrap)


def attribute(interval: Interval, tokens: Sequence[TokenCount]) -> list[Share]:
    """Split an interval's energy over ``tokens`` (the end sample's) by output tokens.

    When no request produced an output token but some were prefilled, prompt tokens are the weights
    (a prefill-only interval is busy, not idle). With no tokens at all the whole interval is one idle
    share. Shares are non-negative and sum to ``interval.energy_j`` (up to float rounding): attributed +
    idle = measured. An interval without a known energy gives the same requests shares with ``energy_j``
    None (their tokens were made without a valid reading), and no idle share.
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
    return [Share(request_id=rid, energy_j=None if energy_j is None else energy_j * c[weight_index] / total,
                  prompt_tokens=c[0], output_tokens=c[1])
            for rid, c in per_request.items() if c[weight_index] > 0]

