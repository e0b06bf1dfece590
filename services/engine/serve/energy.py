"""Energy meters and the interval arithmetic over their cumulative counters.

**What is measured.** A meter returns one :class:`DeviceReading` per physical device: the raw
*cumulative* energy counter in millijoules (and in µJ where that is the native unit: RAPL), never a
per-interval figure. Deltas are taken afterwards (:class:`EnergyTracker` here, the accounting service on
the bus), both by the one copy of the counter rules in ``services/common/energy_counter.py``, so a lost
sample loses no energy, a duplicate adds none, and ``/usage`` and the ledger agree (DESIGN.md, "Energy
accounting"; docs/accounting.md, "Intervals").

- :class:`NvmlMeter` — ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver was loaded, Volta and
  newer) per GPU, keyed by UUID; method ``counter``. A GPU whose counter call raises an ``NVMLError`` is
  switched, for the life of the meter, to a synthetic counter: the trapezoid integral of
  ``nvmlDeviceGetPowerUsage`` (mW) between reads, method ``power_integration``. Switching once (rather than
  per read) keeps one device's counter on one scale, so the tracker never compares a real counter with a
  synthetic one.
- :class:`RaplMeter` — ``/sys/class/powercap/intel-rapl:N/energy_uj`` for the top-level zones only (nested
  zones such as ``intel-rapl:0:0`` are *inside* their package and would be counted twice; ``psys`` covers
  the packages too and is used only when there is no package zone). The counter wraps at
  ``max_energy_range_uj``. Values are sent in their native µJ (``energy_uj``, ``max_range_uj``) and, for
  readers that know only mJ, as ``uj // 1000`` too; deltas are taken in µJ when both readings have them.
- :class:`UnavailableMeter` — no meter: one reading with ``energy_mj=None``. "Unavailable" is ``None``,
  never 0 J.
- :class:`ReplayMeter` — replays scripted counter values (tests and simulations).

**Time.** No class here reads the clock: every ``read`` takes ``now_s`` (UTC seconds) from the caller,
and that is the reading's timestamp. Meters do I/O (NVML, sysfs) and keep per-device state (the power
integral); :class:`EnergyTracker` is pure.

:func:`detect_meter` picks a meter for an engine ``--device`` and never raises.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from proto.fleet import EnergyReading
from services.common.energy_counter import US_PER_S, Counter, CounterLimits, counter_delta, epoch_us

log = logging.getLogger(__name__)

MeterKind = Literal["nvml", "rapl", "estimate", "none"]
EnergyMethod = Literal["counter", "power_integration", "estimated", "unavailable"]
IntervalFlag = Literal[
    "baseline",  # first reading of a device: nothing to subtract from yet
    "unavailable",  # the device gave no counter this time or the previous time
    "missing",  # a device seen before is absent from this batch: its next reading is a new baseline
    "reset",  # the counter went down with no wrap range: energy not guessed
    "wrap",  # RAPL counter wrapped once and was corrected with its range
    "rapl_ambiguous",  # RAPL: long enough to run through the whole range at the max package power: not guessed
    "implausible",  # time went backwards, energy in zero time, or more than the device's power ceiling
    "gap",  # longer than gap_factor x the expected interval since the previous reading
    "duplicate",  # same timestamp and same counter as the previous reading
    "method_change",  # the device's kind/method changed (e.g. counter -> power_integration)
]

DEFAULT_RAPL_ROOT = Path("/sys/class/powercap")
DEFAULT_COUNTER_LIMITS = CounterLimits()
_RAPL_TOP_ZONE = re.compile(r"^intel-rapl:(\d+)$")


class EnergyMeterUnavailableError(Exception):
    """A meter could not be opened on this host; ``reason`` says why in one line."""

    def __init__(self, meter: str, reason: str) -> None:
        super().__init__(f"{meter} energy meter unavailable: {reason}")
        self.meter = meter
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class DeviceReading:
    """One device's cumulative energy counter at ``ts_s``.

    ``device_id`` is a GPU UUID, ``rapl:<zone name>`` or ``cpu``. ``energy_mj`` is cumulative (it only
    grows, except for a driver reset or a RAPL wrap) and ``None`` when unavailable. ``max_range_mj`` is
    the wrap range (RAPL only). ``energy_uj``/``max_range_uj``: the same counter and range in µJ, RAPL's
    native unit (``energy_mj`` is then ``energy_uj // 1000``, for readers that know only mJ). ``power_mw``
    is the instantaneous power when known, for display.
    """

    device_id: str
    kind: MeterKind
    method: EnergyMethod
    ts_s: float
    energy_mj: int | None
    max_range_mj: int | None = None
    power_mw: int | None = None
    energy_uj: int | None = None
    max_range_uj: int | None = None

    @property
    def counter(self) -> Counter:
        """The reading as the shared counter rules take it."""
        return Counter(kind=self.kind, method=self.method, energy_mj=self.energy_mj, energy_uj=self.energy_uj,
                       max_range_mj=self.max_range_mj, max_range_uj=self.max_range_uj)

    def to_message(self) -> EnergyReading:
        """The bus form (``proto.EnergyReading``), which carries no timestamp of its own."""
        return EnergyReading(
            device_id=self.device_id,
            kind=self.kind,
            method=self.method,
            energy_mj=self.energy_mj,
            max_range_mj=self.max_range_mj,
            power_mw=self.power_mw,
            energy_uj=self.energy_uj,
            max_range_uj=self.max_range_uj,
        )


class EnergyMeter(Protocol):
    def read(self, now_s: float) -> list[DeviceReading]:
        """One reading per device, stamped ``now_s``. Must not raise for a device that fails: that
        device's reading has ``energy_mj=None``."""
        ...

    def describe(self) -> str:
        """One line: what is measured and how (shown as the ``/usage`` energy note)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------- NVML


@dataclass
class _NvmlDevice:
    index: int
    handle: Any
    uuid: str
    has_counter: bool = True
    integrated_mj: float = 0.0
    last_power: tuple[float, int] | None = None  # (ts_s, power_mw) of the previous integration point


class NvmlMeter:
    """NVML energy per GPU. ``nvml`` is the ``pynvml`` module (or a fake with the same functions and
    ``NVMLError`` classes). ``device_indices`` / ``device_uuids`` restrict the GPUs read; NVML indices
    follow PCI order, which need not match CUDA's numbering under ``CUDA_VISIBLE_DEVICES``, so a caller
    that knows the torch device's UUID should pass ``device_uuids`` (with or without the ``GPU-`` prefix;
    a MIG instance's ``MIG-`` UUID selects its parent GPU, whose UUID the readings carry).

    Raises :class:`EnergyMeterUnavailableError` when NVML does not initialise or no GPU matches.
    """

    def __init__(
        self,
        nvml: Any = None,
        *,
        device_indices: Sequence[int] | None = None,
        device_uuids: Sequence[str] | None = None,
    ) -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as e:
                raise EnergyMeterUnavailableError("nvml", f"pynvml is not installed ({e})") from e
        self._nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise EnergyMeterUnavailableError("nvml", f"nvmlInit failed: {e}") from e
        try:
            self._devices = self._open_devices(device_indices, device_uuids)
        except BaseException:
            self._shutdown()
            raise

    def _open_devices(
        self, device_indices: Sequence[int] | None, device_uuids: Sequence[str] | None
    ) -> list[_NvmlDevice]:
        nvml = self._nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
            indices = range(count) if device_indices is None else [i for i in device_indices if 0 <= i < count]
            devices = []
            for i in indices:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                devices.append(_NvmlDevice(index=i, handle=handle, uuid=_as_str(nvml.nvmlDeviceGetUUID(handle))))
        except nvml.NVMLError as e:
            raise EnergyMeterUnavailableError("nvml", f"cannot enumerate GPUs: {e}") from e
        if device_uuids is not None:
            wanted = {_strip_gpu_prefix(u) for u in device_uuids}
            devices = [d for d in devices if _strip_gpu_prefix(d.uuid) in wanted
                       or not wanted.isdisjoint(self._mig_uuids(d.handle))]
        if not devices:
            raise EnergyMeterUnavailableError(
                "nvml", f"no GPU matches (count={count}, indices={device_indices}, uuids={device_uuids})"
            )
        return devices

    def _mig_uuids(self, handle: Any) -> set[str]:
        """The UUIDs (``MIG-`` prefix stripped, lower case) of the MIG instances on a physical GPU. A MIG
        instance has no energy counter of its own: the parent GPU's counter is read and reported under the
        parent's UUID, so every worker on any slice of one GPU feeds the ledger one stream for it."""
        nvml = self._nvml
        try:
            max_count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        except (nvml.NVMLError, AttributeError):
            return set()  # not MIG-capable, or an NVML without MIG calls
        uuids = set()
        for i in range(max_count):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nvml.NVMLError:
                continue  # an empty slot
            uuids.add(_as_str(nvml.nvmlDeviceGetUUID(mig)).removeprefix("MIG-").lower())
        return uuids

    @property
    def device_uuids(self) -> list[str]:
        return [d.uuid for d in self._devices]

    def read(self, now_s: float) -> list[DeviceReading]:
        return [self._read_device(d, now_s) for d in self._devices]

    def _read_device(self, dev: _NvmlDevice, now_s: float) -> DeviceReading:
        nvml = self._nvml
        try:
            power_mw: int | None = int(nvml.nvmlDeviceGetPowerUsage(dev.handle))
        except nvml.NVMLError:
            power_mw = None
        if dev.has_counter:
            try:
                energy_mj = int(nvml.nvmlDeviceGetTotalEnergyConsumption(dev.handle))
                return DeviceReading(
                    device_id=dev.uuid,
                    kind="nvml",
                    method="counter",
                    ts_s=now_s,
                    energy_mj=energy_mj,
                    power_mw=power_mw,
                )
            except nvml.NVMLError as e:
                dev.has_counter = False
                log.warning(
                    "gpu=%s index=%s energy counter failed (%s); integrating power from now on", dev.uuid, dev.index, e
                )
        return self._integrate_power(dev, now_s, power_mw)

    @staticmethod
    def _integrate_power(dev: _NvmlDevice, now_s: float, power_mw: int | None) -> DeviceReading:
        if power_mw is None:
            # No bridging across a span whose power we never saw: the next good read restarts the trapezoid.
            dev.last_power = None
            return DeviceReading(device_id=dev.uuid, kind="nvml", method="unavailable", ts_s=now_s, energy_mj=None)
        if dev.last_power is not None:
            last_s, last_mw = dev.last_power
            dt_s = now_s - last_s
            if dt_s > 0:
                dev.integrated_mj += (last_mw + power_mw) / 2 * dt_s  # mW x s = mJ
        dev.last_power = (now_s, power_mw)
        return DeviceReading(
            device_id=dev.uuid,
            kind="nvml",
            method="power_integration",
            ts_s=now_s,
            energy_mj=int(dev.integrated_mj),
            power_mw=power_mw,
        )

    def describe(self) -> str:
        how = {True: "energy counter", False: "power integration, trapezoid of nvmlDeviceGetPowerUsage"}
        parts = [f"{d.uuid} ({how[d.has_counter]})" for d in self._devices]
        return f"NVML per GPU, cumulative mJ: {', '.join(parts)}"

    def close(self) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as e:
            log.debug("nvmlShutdown failed: %s", e)


def _as_str(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _strip_gpu_prefix(uuid: str) -> str:
    return uuid.removeprefix("GPU-").removeprefix("MIG-").lower()


# ---------------------------------------------------------------------------------------------- RAPL


@dataclass(frozen=True)
class RaplZone:
    path: Path
    name: str
    max_range_uj: int
    host_id: str = ""

    @property
    def device_id(self) -> str:
        """``rapl:<host>:<zone name>``: the ledger keeps one energy stream per device id, whatever worker
        reports it, so a zone id must name its host (every host has a ``package-0``)."""
        return f"rapl:{self.host_id}:{self.name}" if self.host_id else f"rapl:{self.name}"


def host_id(machine_id_path: Path = Path("/etc/machine-id")) -> str:
    """This host's stable id for RAPL device ids: ``/etc/machine-id`` (systemd, stable across reboots and
    hostname changes), else the hostname."""
    try:
        machine_id = machine_id_path.read_text().strip()
    except OSError:
        machine_id = ""
    return machine_id or socket.gethostname()


def find_rapl_zones(root: Path = DEFAULT_RAPL_ROOT, host: str = "") -> list[RaplZone]:
    """The readable top-level RAPL zones under ``root``, to be summed without double counting.

    Nested zones (``intel-rapl:0:0`` core, ``:0:1`` dram…) are parts of their package and are skipped;
    ``intel-rapl-mmio:*`` repeats the package counter and does not match. ``psys`` (platform) contains
    the packages, so it is used only when no other top-level zone is readable. Zones whose ``energy_uj``
    cannot be read (often root-only since CVE-2020-8694) are left out.
    """
    zones: list[RaplZone] = []
    try:
        entries = sorted(root.iterdir(), key=lambda p: p.name)
    except OSError:
        return []
    for entry in entries:
        m = _RAPL_TOP_ZONE.match(entry.name)
        if m is None:
            continue
        try:
            int((entry / "energy_uj").read_text().strip())
            max_range_uj = int((entry / "max_energy_range_uj").read_text().strip())
        except (OSError, ValueError) as e:
            log.info("rapl zone %s not readable: %s", entry.name, e)
            continue
        try:
            name = (entry / "name").read_text().strip() or entry.name
        except OSError:
            name = entry.name
        zones.append(RaplZone(path=entry, name=name, max_range_uj=max_range_uj, host_id=host))
    non_psys = [z for z in zones if z.name != "psys"]
    return non_psys or zones


class RaplMeter:
    """RAPL ``energy_uj`` per top-level zone (see :func:`find_rapl_zones`); method ``counter`` with the
    wrap range so the tracker can correct a wrap. Raises :class:`EnergyMeterUnavailableError`
    when no zone is readable."""

    def __init__(self, root: Path = DEFAULT_RAPL_ROOT, host: str | None = None) -> None:
        self._zones = find_rapl_zones(root, host_id() if host is None else host)
        if not self._zones:
            raise EnergyMeterUnavailableError("rapl", f"no readable intel-rapl:N/energy_uj under {root}")

    @property
    def zones(self) -> list[RaplZone]:
        return list(self._zones)

    def read(self, now_s: float) -> list[DeviceReading]:
        readings = []
        for zone in self._zones:
            try:
                energy_uj: int | None = int((zone.path / "energy_uj").read_text().strip())
            except (OSError, ValueError):
                energy_uj = None
            readings.append(
                DeviceReading(
                    device_id=zone.device_id,
                    kind="rapl",
                    method="counter" if energy_uj is not None else "unavailable",
                    ts_s=now_s,
                    energy_mj=None if energy_uj is None else energy_uj // 1000,
                    max_range_mj=zone.max_range_uj // 1000,
                    energy_uj=energy_uj,
                    max_range_uj=zone.max_range_uj,
                )
            )
        return readings

    def describe(self) -> str:
        names = ", ".join(z.name for z in self._zones)
        return f"RAPL energy_uj counters (top-level zones: {names}); CPU package energy, not the whole host"

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------ no meter / replay


class UnavailableMeter:
    """No energy meter on this host: every read is one reading with ``energy_mj=None``."""

    def __init__(self, device_id: str, reason: str) -> None:
        self.device_id = device_id
        self.reason = reason

    def read(self, now_s: float) -> list[DeviceReading]:
        return [DeviceReading(device_id=self.device_id, kind="none", method="unavailable", ts_s=now_s, energy_mj=None)]

    def describe(self) -> str:
        return f"energy unavailable on {self.device_id}: {self.reason}"

    def close(self) -> None:
        pass


class ReplayMeter:
    """Replays scripted counters: ``steps[k]`` maps device id → cumulative mJ (``None`` = unavailable)
    for the k-th read; a device absent from a step is missing from that batch. After the last step the
    last one repeats (an idle device). ``method`` and ``max_range_mj`` apply to every reading."""

    def __init__(
        self,
        steps: Sequence[Mapping[str, int | None]],
        *,
        kind: MeterKind = "nvml",
        method: EnergyMethod = "counter",
        max_range_mj: int | None = None,
        note: str = "replayed counters",
    ) -> None:
        if not steps:
            raise ValueError("ReplayMeter needs at least one step")
        self._steps = [dict(s) for s in steps]
        self._kind: MeterKind = kind
        self._method: EnergyMethod = method
        self._max_range_mj = max_range_mj
        self._note = note
        self.num_reads = 0

    def read(self, now_s: float) -> list[DeviceReading]:
        step = self._steps[min(self.num_reads, len(self._steps) - 1)]
        self.num_reads += 1
        return [
            DeviceReading(
                device_id=device_id,
                kind=self._kind,
                method=self._method if energy_mj is not None else "unavailable",
                ts_s=now_s,
                energy_mj=energy_mj,
                max_range_mj=self._max_range_mj,
            )
            for device_id, energy_mj in step.items()
        ]

    def describe(self) -> str:
        return self._note

    def close(self) -> None:
        pass


def detect_meter(
    device: str, *, nvml: Any = None, rapl_root: Path = DEFAULT_RAPL_ROOT, device_uuids: Sequence[str] | None = None,
    rapl_host: str | None = None,
) -> EnergyMeter:
    """The best meter for an engine ``--device`` (``cuda``, ``cuda:N``, ``cpu``); never raises.

    cuda → NVML (restricted to index N, or to ``device_uuids`` when given), else unavailable;
    cpu → RAPL if readable, else unavailable; anything else → unavailable.
    """
    kind, _, index = device.partition(":")
    try:
        if kind == "cuda":
            if device_uuids is not None:
                return NvmlMeter(nvml, device_uuids=device_uuids)
            return NvmlMeter(nvml, device_indices=[int(index)] if index else None)
        if kind == "cpu":
            return RaplMeter(rapl_root, rapl_host)
        return UnavailableMeter(device, f"no energy meter for device kind {kind!r}")
    except EnergyMeterUnavailableError as e:
        log.warning("%s; energy will be reported as unavailable", e)
        return UnavailableMeter(device, e.reason)
    except Exception as e:  # a broken driver binding must not stop the engine from serving
        log.warning("energy meter detection failed for %s", device, exc_info=True)
        return UnavailableMeter(device, f"meter detection failed: {type(e).__name__}: {e}")


# ------------------------------------------------------------------------------------------- tracker


@dataclass(frozen=True, kw_only=True)
class IntervalEnergy:
    """Energy of one device between two readings. ``energy_j`` is ``None`` when it cannot be known
    (first reading, reset, unavailable, missing) and never negative. ``start_s`` is ``None`` when there
    was no previous reading."""

    device_id: str
    method: EnergyMethod
    start_s: float | None
    end_s: float
    energy_j: float | None
    flags: frozenset[IntervalFlag] = field(default_factory=frozenset)


class EnergyTracker:
    """Turns successive cumulative readings into per-interval joules, per device (pure; no clock).

    Each reading is paired with the device's previous reading and the pair goes through the counter rules
    of ``services/common/energy_counter.py`` (unavailable, kind/method change, reset or one corrected RAPL
    wrap, a RAPL span that may hide a wrap, implausible power or time), the one copy the accounting
    ledger's intervals use too. The pairing is the ledger's as well: consecutive readings, whatever they
    were (an unavailable reading or an implausible interval is still the next baseline), and a device
    absent from a batch has no interval (``missing``) and starts again from a baseline, as the ledger forms
    no interval for a device missing from one of two consecutive samples. So ``/usage`` and the ledger
    count the same joules for the samples this engine publishes
    (``tests/unit/test_energy_counter.py``). A *gap* (more than ``gap_factor`` x ``expected_interval_s``
    since the previous reading) is flagged but its energy kept: the counter is cumulative.
    """

    def __init__(self, expected_interval_s: float, gap_factor: float = 3.0,
                 limits: CounterLimits = DEFAULT_COUNTER_LIMITS) -> None:
        if not expected_interval_s > 0 or not gap_factor > 0:
            raise ValueError("expected_interval_s and gap_factor must be > 0")
        self.max_gap_s = gap_factor * expected_interval_s
        self.limits = limits
        self._last: dict[str, DeviceReading] = {}

    def update(self, readings: Sequence[DeviceReading], now_s: float) -> list[IntervalEnergy]:
        """Feed one batch of readings; one result per device in the batch plus one ``missing`` result for
        each device seen before but absent now (stamped ``now_s``)."""
        out = [self._update_one(r) for r in readings]
        present = {r.device_id for r in readings}
        for device_id in [d for d in self._last if d not in present]:
            prev = self._last.pop(device_id)
            out.append(_interval(prev.device_id, prev.method, prev.ts_s, now_s, None, "missing"))
        return out

    def _update_one(self, r: DeviceReading) -> IntervalEnergy:
        prev = self._last.get(r.device_id)
        self._last[r.device_id] = r
        if prev is None:
            return _interval(r.device_id, r.method, None, r.ts_s, None,
                             "baseline" if r.energy_mj is not None else "unavailable")
        dt_us = epoch_us(r.ts_s) - epoch_us(prev.ts_s)
        delta = counter_delta(prev.counter, r.counter, dt_us, self.limits)
        flags: set[IntervalFlag] = set()
        if delta.method == "unavailable":
            flags.add("unavailable")
        if delta.is_method_change:
            flags.add("method_change")
        elif delta.is_reset:
            flags.add("reset")
        if delta.is_wrap:
            flags.add("wrap")
        if delta.is_rapl_ambiguous:
            flags.add("rapl_ambiguous")
        if delta.is_implausible:
            flags.add("implausible")
        if dt_us == 0 and delta.energy_j == 0:
            flags.add("duplicate")
        if dt_us > self.max_gap_s * US_PER_S:
            flags.add("gap")
        method: EnergyMethod = "unavailable" if delta.method == "unavailable" else r.method
        return _interval(r.device_id, method, prev.ts_s, r.ts_s, delta.energy_j, *flags)


def _interval(
    device_id: str,
    method: EnergyMethod,
    start_s: float | None,
    end_s: float,
    energy_j: float | None,
    *flags: IntervalFlag,
) -> IntervalEnergy:
    return IntervalEnergy(
        device_id=device_id, method=method, start_s=start_s, end_s=end_s, energy_j=energy_j, flags=frozenset(flags)
    )


def total_energy_j(intervals: Sequence[IntervalEnergy]) -> float | None:
    """Sum of the known interval energies; ``None`` when no interval has a measurement (not 0)."""
    known = [i.energy_j for i in intervals if i.energy_j is not None]
    if not known:
        return None
    return math.fsum(known)
