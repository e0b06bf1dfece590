"""The ledger's energy values: samples and readings as stored, intervals and their shares. Pure.

An engine sends raw **cumulative** counters (``EnergySample``); ``device_stream.py`` pairs consecutive
readings of one device (from any worker and session) into :class:`Interval` s by the counter rules of
``services/common/energy_counter.py`` and splits each over the requests that made tokens in it into
:class:`Share` s (docs/accounting.md, "Intervals" and "Attribution"; DESIGN.md, "Energy accounting").

Time is integer microseconds as the ledger stores it (``ts_us``), so a duration is exact. Nothing here
reads a clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from proto import EnergySample
from services.common.energy_counter import US_PER_S, Counter, CounterLimits, epoch_us


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
    """Energy of one device between two consecutive readings of its stream (any workers and sessions;
    ``device_stream.py``), or of one worker x model's part of it (``energy_j`` scaled by the part's weight).

    ``energy_j`` is None when it cannot be known, and never negative. ``device_s`` is the device-time the
    interval covers (0 when time went backwards); it counts towards coverage only when ``energy_j`` is
    known. ``prompt_tokens``/``output_tokens`` (a part's) are the fractions of its owner's windows' tokens
    made in the interval, on the windows' token carrier and 0 on other devices' intervals, so a sum over
    intervals counts each token once; ``is_busy`` says whether any were made. ``is_window_measured``:
    the interval is measured and so is every window of its owner on it (J per output token's windows).
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
    prompt_tokens: float = 0
    output_tokens: float = 0
    is_busy: bool = False
    is_window_measured: bool = False

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
    prompt_tokens: float = 0
    output_tokens: float = 0
