"""One energy stream per physical device, across workers and sessions (issue 22, parts 1 and 2). Pure.

``intervals.py`` pairs consecutive samples of one worker session. This module pairs consecutive
**readings of one device**, whatever worker or session sent them, and splits each such interval over the
workers and requests that made tokens in it (docs/accounting.md, "One stream per device"):

**Pairing.** The readings of a ``device_id`` (a GPU UUID — a MIG slice reports its parent GPU's — or a
host-qualified RAPL zone) are ordered by ``(ts, worker_id, session_id, seq)`` (``ts`` as far as the
session's clock had reached, so one session stays in ``seq`` order) and each consecutive pair
``p → c`` is one :class:`~services.accounting.intervals.Interval` with the counter rules of
``energy_counter.counter_delta``. Within one session a ``gap`` (``seq`` jumped, or more than
``max_gap_s``) keeps its energy, as before: the cumulative counter is trustworthy. Between two readings
from *different* sessions (or workers) the counter is compared like any other (down → ``reset``, NULL; up
→ exact energy), except that more than ``max_gap_s`` apart nobody watched the device: NULL, ``gap`` (and
``reset`` too when the counter also fell). Every span between two readings is an interval, so no time is
missing from coverage; a device reported by two workers is counted once.

**Token windows.** A sample's tokens were made in its *window*: from its session's previous sample to it
(a session's first sample: a window of no length at its time). Per device the sample lists, the window's
tokens are spread over the device's intervals in proportion to their overlap with the window, normalised
by the overlap the device's stream has with it (so the fractions sum to 1 wherever the stream covers any
of the window). A window of no length, or one that no interval of the device overlaps, puts its tokens on
the interval that *ends at* the sample's reading of the device (for a session's first sample: the span
since the device's previous reading, often the interval bridging the restart). Tokens count once: they go
to the sample's *token carrier* (its smallest ``device_id``); the other devices use the same fractions as
weights only. Fractions make token counts floats (``2.5`` tokens of a 5-token window half inside an
interval).

**Split.** An interval's energy goes to the requests with tokens in it, by (fractional) output tokens, or
prompt tokens when none were output; a worker x model's *part* is the sum of its requests' shares. With no
tokens at all the interval is idle, and its parts go to the worker x model of the windows that overlap it,
**by overlap time** (evenly when only windows of no length touch it; to the end reading's worker when no
window does). Each part carries that fraction of the interval's energy *and* of its device-time, so
per worker x model rollups keep attributed + idle = measured and coverage adds up to the device's.

**J/token.** A window is measured when every device it lists (in it or its session's previous sample) has
intervals covering the whole window, each measured; a part ``is_window_measured`` when its interval is
measured and every window of its worker on it is. Nothing here reads a clock.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.accounting.intervals import Interval, Limits, Reading, Sample, Share
from services.common.energy_counter import US_PER_S, counter_delta

Owner = tuple[str, str, str]  # (worker_id, session_id, model_id)


@dataclass(frozen=True, kw_only=True)
class StreamSample:
    """A stored sample with its identity: the unit a device stream and a token window are made of."""

    worker_id: str
    session_id: str
    sample: Sample

    @property
    def owner(self) -> Owner:
        return (self.worker_id, self.session_id, self.sample.model_id)


@dataclass(frozen=True, kw_only=True)
class DeviceInterval:
    """One device between two consecutive readings of its stream (any workers, any sessions)."""

    interval: Interval  # energy, flags, times; worker/model fields of the parts are set below
    start: StreamSample
    end: StreamSample


@dataclass(frozen=True, kw_only=True)
class Part:
    """The share of one device interval owned by one worker x model: ``weight`` of its energy and device-time.
    ``interval`` is the device interval with ``energy_j`` scaled by ``weight`` and the owner's carrier tokens;
    ``shares`` split that energy over the owner's requests (an idle part: one idle share, none when NULL)."""

    device: DeviceInterval
    worker_id: str
    session_id: str
    model_id: str
    weight: float
    interval: Interval
    shares: list[Share]

    @property
    def device_s(self) -> float:
        return self.interval.device_s * self.weight


def bridge(prev: StreamSample, before: Reading, cur: StreamSample, after: Reading, limits: Limits) -> Interval:
    """One device's interval from ``prev``'s reading to ``cur``'s (docstring: "Pairing")."""
    dt_us = cur.sample.ts_us - prev.sample.ts_us
    delta = counter_delta(before.counter, after.counter, dt_us, limits)
    is_same_session = (prev.worker_id, prev.session_id) == (cur.worker_id, cur.session_id)
    is_long = dt_us > limits.max_gap_s * US_PER_S
    energy_j = delta.energy_j
    if is_same_session:
        is_gap = cur.sample.seq - prev.sample.seq > 1 or is_long
    else:
        is_gap = is_long
        if is_long:
            energy_j = None  # nobody watched the device: a counter that rose may have been reset meanwhile
    iv = Interval(device_id=after.device_id, kind=after.kind, method=delta.method, model_id=cur.sample.model_id,
                  start_seq=prev.sample.seq, end_seq=cur.sample.seq, start_us=prev.sample.ts_us,
                  end_us=cur.sample.ts_us, energy_j=energy_j, is_reset=delta.is_reset, is_wrap=delta.is_wrap,
                  is_gap=is_gap, is_implausible=delta.is_implausible, is_rapl_ambiguous=delta.is_rapl_ambiguous)
    return dataclasses.replace(iv, is_window_measured=iv.is_measured)


def stream_order(samples: Sequence[StreamSample]) -> dict[int, tuple[int, str, str, int]]:
    """Each sample's place in its devices' streams (by ``id``): ``(ts, worker, session, seq)``, where ``ts`` is
    the newest time its session had reached by that ``seq``. So a session's own readings stay in ``seq``
    order when its clock steps back (that interval is ``implausible``, as the engine's own tracker finds),
    and readings of different sessions interleave by time."""
    sessions: dict[tuple[str, str], list[StreamSample]] = defaultdict(list)
    for s in samples:
        sessions[(s.worker_id, s.session_id)].append(s)
    order = {}
    for group in sessions.values():
        reached = None
        for s in sorted(group, key=lambda s: s.sample.seq):
            reached = s.sample.ts_us if reached is None else max(reached, s.sample.ts_us)
            order[id(s)] = (reached, s.worker_id, s.session_id, s.sample.seq)
    return order


def device_intervals(samples: Sequence[StreamSample], limits: Limits) -> dict[str, list[DeviceInterval]]:
    """Per device, the intervals between consecutive readings in :func:`stream_order`."""
    streams: dict[str, list[StreamSample]] = defaultdict(list)
    for s in samples:
        for device_id in s.sample.readings:
            streams[device_id].append(s)
    order = stream_order(samples)
    out: dict[str, list[DeviceInterval]] = {}
    for device_id, stream in streams.items():
        stream.sort(key=lambda s: order[id(s)])
        out[device_id] = [DeviceInterval(interval=bridge(p, p.sample.readings[device_id], c,
                                                         c.sample.readings[device_id], limits), start=p, end=c)
                          for p, c in itertools.pairwise(stream)]
    return out


@dataclass(frozen=True, kw_only=True)
class Window:
    """A sample's tokens and the span they were made in: (``start_us``, ``end_us``]."""

    sample: StreamSample
    start_us: int
    devices: frozenset[str]  # listed in the sample or in its session's previous one

    @property
    def end_us(self) -> int:
        return self.sample.sample.ts_us

    @property
    def carrier(self) -> str | None:
        return min(self.sample.sample.readings, default=None)


def windows_of(samples: Sequence[StreamSample],
               previous: Mapping[tuple[str, str], StreamSample] | None = None) -> list[Window]:
    """Each sample's window: since its session's previous sample (by ``seq``; ``previous`` names the one
    before a session's first in ``samples``, when stored), or of no length."""
    sessions: dict[tuple[str, str], list[StreamSample]] = defaultdict(list)
    for s in samples:
        sessions[(s.worker_id, s.session_id)].append(s)
    out = []
    for group in sessions.values():
        group.sort(key=lambda s: s.sample.seq)
        prev: StreamSample | None = (previous or {}).get((group[0].worker_id, group[0].session_id))
        for s in group:
            devices = frozenset(s.sample.readings) | (frozenset(prev.sample.readings) if prev else frozenset())
            out.append(Window(sample=s, start_us=prev.sample.ts_us if prev else s.sample.ts_us, devices=devices))
            prev = s
    return out


def _overlap_us(a0: int, a1: int, b0: int, b1: int) -> int:
    return max(0, min(a1, b1) - max(a0, b0))


@dataclass(frozen=True)
class _Index:
    """One device's intervals, searchable by time: the windows of a month's migration are found in
    O(log n) each, not by a scan per window. ``reach_us[k]``: the latest end among intervals 0..k;
    ``floor_us[k]``: the earliest start among k..n-1 (a session's clock step back can leave the times of
    consecutive intervals out of order, so plain bisection on them would not do)."""

    ivs: Sequence[DeviceInterval]
    reach_us: list[int]
    floor_us: list[int]
    ending: dict[int, int]  # id(end sample) → index of the interval ending at its reading

    @classmethod
    def of(cls, ivs: Sequence[DeviceInterval]) -> _Index:
        reach = list(itertools.accumulate((iv.interval.end_us for iv in ivs), max))
        floor = list(itertools.accumulate((iv.interval.start_us for iv in reversed(ivs)), min))[::-1]
        return cls(ivs=ivs, reach_us=reach, floor_us=floor, ending={id(iv.end): k for k, iv in enumerate(ivs)})

    def overlapping(self, start_us: int, end_us: int) -> dict[int, int]:
        """Index → overlap (µs, > 0) of every interval overlapping (start_us, end_us]."""
        out = {}
        for k in range(bisect.bisect_right(self.reach_us, start_us), len(self.ivs)):
            if self.floor_us[k] >= end_us:
                break
            iv = self.ivs[k].interval
            if o := _overlap_us(start_us, end_us, iv.start_us, iv.end_us):
                out[k] = o
        return out


def fractions(window: Window, index: _Index) -> tuple[dict[int, float], bool]:
    """Which of one device's intervals hold what fraction of ``window``'s tokens, and whether the device's
    stream covers the whole window (docstring: "Token windows")."""
    length = window.end_us - window.start_us
    if length > 0:
        overlaps = index.overlapping(window.start_us, window.end_us)
        total = sum(overlaps.values())
        if total:
            return {k: o / total for k, o in overlaps.items()}, total == length
    k = index.ending.get(id(window.sample))
    return ({k: 1.0}, True) if k is not None else ({}, False)


def split(samples: Sequence[StreamSample], limits: Limits,
          previous: Mapping[tuple[str, str], StreamSample] | None = None) -> list[Part]:
    """Every device interval over ``samples``, split into parts per worker x model (module docstring).
    ``previous``: per session, its stored sample before its first in ``samples`` (only its time and devices
    are used: it starts that session's first window; it is not part of the device streams)."""
    streams = device_intervals(samples, limits)
    indexes = {d: _Index.of(ivs) for d, ivs in streams.items()}
    no_intervals = _Index.of([])
    windows = windows_of(samples, previous)
    # per device, per interval index: per owner the request weights [prompt, output], carrier tokens,
    # overlap time, and whether all its windows there are measured
    weights: dict[tuple[str, int], dict[Owner, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    carried: dict[tuple[str, int], dict[Owner, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(dict))
    overlap: dict[tuple[str, int], dict[Owner, int]] = defaultdict(lambda: defaultdict(int))
    unmeasured: dict[tuple[str, int], set[Owner]] = defaultdict(set)
    for w in windows:
        owner = w.sample.owner
        per_device = {d: fractions(w, indexes.get(d, no_intervals)) for d in w.devices}
        is_measured = all(full and fr and all(streams[d][k].interval.is_measured for k in fr)
                          for d, (fr, full) in per_device.items())
        for d, (fr, _) in per_device.items():
            if d not in w.sample.sample.readings:
                continue  # listed only in the previous sample: its tokens are not this device's any more
            for k, f in fr.items():
                key = (d, k)
                iv = streams[d][k].interval
                overlap[key][owner] += _overlap_us(w.start_us, w.end_us, iv.start_us, iv.end_us)
                if not is_measured:
                    unmeasured[key].add(owner)
                for t in w.sample.sample.tokens:
                    c = weights[key][owner].setdefault(t.request_id, [0.0, 0.0])
                    c[0] += max(t.prompt_tokens, 0) * f
                    c[1] += max(t.output_tokens, 0) * f
                    if d == w.carrier:
                        c = carried[key][owner].setdefault(t.request_id, [0.0, 0.0])
                        c[0] += max(t.prompt_tokens, 0) * f
                        c[1] += max(t.output_tokens, 0) * f
    parts: list[Part] = []
    for d, ivs in streams.items():
        for k, div in enumerate(ivs):
            parts.extend(_parts(div, weights.get((d, k), {}), carried.get((d, k), {}), overlap.get((d, k), {}),
                                unmeasured.get((d, k), set())))
    return parts


def _parts(div: DeviceInterval, weights: dict[Owner, dict[str, list[float]]],
           carried: dict[Owner, dict[str, list[float]]],
           overlap: dict[Owner, int], unmeasured: set[Owner]) -> list[Part]:
    iv = div.interval
    index = 1 if any(c[1] for reqs in weights.values() for c in reqs.values()) else 0
    total = sum(c[index] for reqs in weights.values() for c in reqs.values())
    energy_j = iv.energy_j
    out: list[Part] = []
    if total > 0:
        for owner, reqs in weights.items():
            owner_w = sum(c[index] for c in reqs.values())
            if owner_w <= 0:
                continue
            mine = carried.get(owner, {})
            shares = [Share(request_id=rid, energy_j=None if energy_j is None else energy_j * c[index] / total,
                            prompt_tokens=mine.get(rid, [0.0, 0.0])[0],
                            output_tokens=mine.get(rid, [0.0, 0.0])[1])
                      for rid, c in reqs.items() if c[index] > 0]
            out.append(_part(div, owner, owner_w / total, mine, True, owner not in unmeasured, shares))
        return out
    by_time = {o: t for o, t in overlap.items() if t > 0}
    owners = by_time or dict.fromkeys(overlap, 1) or {div.end.owner: 1}
    span = sum(owners.values())
    for owner, t in owners.items():
        weight = t / span
        shares = [] if energy_j is None else [Share(request_id=None, energy_j=energy_j * weight)]
        out.append(_part(div, owner, weight, carried.get(owner, {}), False, owner not in unmeasured, shares))
    return out


def _part(div: DeviceInterval, owner: Owner, weight: float, carried: dict[str, list[float]], is_busy: bool,
          is_owner_measured: bool, shares: list[Share]) -> Part:
    iv = div.interval
    worker_id, session_id, model_id = owner
    part_iv = dataclasses.replace(
        iv, model_id=model_id, energy_j=None if iv.energy_j is None else iv.energy_j * weight,
        prompt_tokens=sum(c[0] for c in carried.values()),
        output_tokens=sum(c[1] for c in carried.values()),
        is_busy=is_busy, is_window_measured=iv.is_measured and is_owner_measured)
    return Part(device=div, worker_id=worker_id, session_id=session_id, model_id=model_id, weight=weight,
                interval=part_iv, shares=shares)
