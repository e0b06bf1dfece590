"""The counter rules: the energy between two cumulative readings of one device. Pure: no I/O, no clock.

Two places take deltas of the same raw counters: the engine's own ``GET /usage`` energy
(``services/engine/serve/energy.py``, ``EnergyTracker``) and the accounting ledger's intervals
(``services/accounting/intervals.py``). Two copies of these rules drift apart, and an operator then sees two
kWh figures for one counter (issue 22). Services never import each other; ``services/common/`` is the one
small runtime they share (docs/architecture.md, "Packages"), so the one copy lives here, as
``load_score.py`` does for the gateway and telemetry. What is *not* a counter rule stays with its owner:
which two readings are paired (the ledger: consecutive stored samples by ``seq``; the engine: consecutive
reads), gaps, and the first reading of a device.

Rules, in order, for readings ``before`` → ``after`` of one device taken ``dt_us`` microseconds apart
(docs/accounting.md, "Intervals"):

1. either counter unavailable (``energy_mj`` None) → energy None, method ``unavailable``;
2. ``kind``/``method`` changed (e.g. NVML counter → power integration): the counters are on different
   scales → None, ``is_reset`` (and ``is_method_change``);
3. counter went down: with a wrap range (RAPL's ``max_energy_range_uj``) one wrap is corrected
   (``delta + range``, ``is_wrap``); without one, or when it fell by more than the whole range, → None,
   ``is_reset``. Never negative, never guessed;
4. a counter with a wrap range over a span in which it could have run through the whole range at
   ``max_rapl_power_w`` → None, ``is_rapl_ambiguous``, **whether the counter rose or fell**: a rise may hide
   one unseen wrap, a fall a second one (``is_wrap`` stays set on a fall);
5. time going backwards, energy over zero time, or a mean power above the device's ceiling
   (``max_rapl_power_w`` with a wrap range, ``max_device_power_w`` without) → None, ``is_implausible``.

**Units.** A delta is taken in integer microjoules: from ``energy_uj`` when both readings carry it (RAPL's
native unit; appended to ``EnergyReading``), else from ``energy_mj`` x 1000 (NVML's native unit, and what
an older sender sends). Either way it is exact: no float enters before the final ``/ 1e6``. Time is integer
microseconds (:func:`epoch_us`), the resolution the ledger stores (DuckDB ``TIMESTAMPTZ``).
"""

from __future__ import annotations

from dataclasses import dataclass

# No device averages more. An H200 SXM is rated 700 W and a B200 1,000 W; 3,000 W leaves room for the
# next generations while still catching a counter that jumped (a driver bug, a wrong unit).
DEFAULT_MAX_DEVICE_POWER_W = 3000.0
# The most one RAPL zone can average. A zone is one CPU package (or a subzone inside it, which draws
# less), never the sum of a host's sockets. The largest server packages shipping (Intel Xeon 6980P,
# Granite Rapids, 2024; AMD EPYC 9965, Turin, 2024) are rated 500 W TDP; 600 W adds 20 % for the power
# above TDP that short turbo bursts (Intel PL2, AMD PPT) allow. An Intel package zone reports
# max_energy_range_uj = 262,143,328,850 (2^32 counts of 61 uJ): at 600 W it cannot wrap in less than
# 262,143 J / 600 W = 437 s, so a zone silent for longer may have wrapped unseen.
DEFAULT_MAX_RAPL_POWER_W = 600.0

UJ_PER_MJ = 1000
UJ_PER_J = 1_000_000
US_PER_S = 1_000_000


def epoch_us(ts_s: float) -> int:
    """A Unix timestamp in whole microseconds: the one conversion from the wire's float seconds, used by
    the ledger to store a sample's time and by the engine to time its own intervals, so both measure the
    same span."""
    return round(ts_s * US_PER_S)


@dataclass(frozen=True, kw_only=True)
class CounterLimits:
    """What a counter may plausibly do (docstring rules 4 and 5)."""

    max_device_power_w: float = DEFAULT_MAX_DEVICE_POWER_W
    max_rapl_power_w: float = DEFAULT_MAX_RAPL_POWER_W


@dataclass(frozen=True, kw_only=True)
class Counter:
    """One device's raw cumulative reading. ``energy_mj`` None: unavailable. ``energy_uj`` (RAPL) is the
    same counter in its native unit when the sender has it; ``max_range_uj``/``max_range_mj`` the wrap range
    (set only for counters that wrap: RAPL)."""

    kind: str
    method: str
    energy_mj: int | None
    energy_uj: int | None = None
    max_range_mj: int | None = None
    max_range_uj: int | None = None


@dataclass(frozen=True, kw_only=True)
class Delta:
    """The energy between two readings. ``energy_j`` None: not known (and never negative). ``method`` is
    the later reading's, or ``unavailable`` when either has no counter."""

    energy_j: float | None
    method: str
    is_reset: bool = False
    is_method_change: bool = False
    is_wrap: bool = False
    is_rapl_ambiguous: bool = False
    is_implausible: bool = False


def counter_delta(before: Counter, after: Counter, dt_us: int, limits: CounterLimits) -> Delta:
    """The energy from ``before`` to ``after``, ``dt_us`` microseconds later (rules in the module docstring)."""
    if before.energy_mj is None or after.energy_mj is None:
        return Delta(energy_j=None, method="unavailable")
    method = after.method
    if (before.kind, before.method) != (after.kind, after.method):
        return Delta(energy_j=None, method=method, is_reset=True, is_method_change=True)
    if before.energy_uj is not None and after.energy_uj is not None:
        delta_uj = after.energy_uj - before.energy_uj
        range_uj = after.max_range_uj or (after.max_range_mj or 0) * UJ_PER_MJ
    else:
        delta_uj = (after.energy_mj - before.energy_mj) * UJ_PER_MJ
        range_uj = (after.max_range_mj or 0) * UJ_PER_MJ
    is_wrap = False
    if delta_uj < 0:
        if not range_uj:
            return Delta(energy_j=None, method=method, is_reset=True)
        delta_uj += range_uj
        if delta_uj < 0:  # fell by more than the whole range: not a wrap
            return Delta(energy_j=None, method=method, is_reset=True)
        is_wrap = True
    # Power ceilings in uJ per us (= W): a zone with a wrap range is a RAPL package zone.
    max_power_w = limits.max_rapl_power_w if range_uj else limits.max_device_power_w
    if range_uj and dt_us >= 0 and dt_us * max_power_w >= range_uj:
        return Delta(energy_j=None, method=method, is_wrap=is_wrap, is_rapl_ambiguous=True)
    if dt_us < 0 or (dt_us == 0 and delta_uj > 0) or (dt_us > 0 and delta_uj > dt_us * max_power_w):
        return Delta(energy_j=None, method=method, is_wrap=is_wrap, is_implausible=True)
    return Delta(energy_j=delta_uj / UJ_PER_J, method=method, is_wrap=is_wrap)
