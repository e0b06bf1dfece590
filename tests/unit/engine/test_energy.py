"""Energy meters (NVML fake, RAPL fake sysfs tree) and the interval tracker over replayed counters.

The rules under test are DESIGN.md "Energy accounting": cumulative counters, a reset is flagged and not
guessed, one RAPL wrap is corrected, gaps are flagged but keep their energy, unavailable is None."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pynvml
import pytest

from services.engine.serve.energy import (
    DeviceReading,
    EnergyTracker,
    NvmlMeter,
    RaplMeter,
    ReplayMeter,
    UnavailableMeter,
    detect_meter,
    find_rapl_zones,
    host_id,
    total_energy_j,
)


class FakeNvml:
    """The slice of ``pynvml`` the meter uses, raising pynvml's own exception classes.

    ``devices``: one dict per GPU with ``uuid``, ``energy_mj`` (int, or an exception to raise) and
    ``power_mw`` (int, or an exception). Tests mutate the dicts between reads."""

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[dict[str, Any]], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.num_energy_calls = [0] * len(devices)
        self.is_initialised = False

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.is_initialised = True

    def nvmlShutdown(self) -> None:
        self.is_initialised = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < len(self.devices):
            raise pynvml.NVMLError_InvalidArgument()
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return str(self.devices[handle]["uuid"])

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        self.num_energy_calls[handle] += 1
        return int(_value_or_raise(self.devices[handle]["energy_mj"]))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return int(_value_or_raise(self.devices[handle]["power_mw"]))


def _value_or_raise(value: Any) -> Any:
    if isinstance(value, Exception):
        raise value
    return value


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            {"uuid": "GPU-aaaa", "energy_mj": 1_000_000, "power_mw": 300_000},
            {"uuid": "GPU-bbbb", "energy_mj": pynvml.NVMLError_NotSupported(), "power_mw": 200_000},
        ]
    )


# ------------------------------------------------------------------------------------------------ NVML


def test_nvml_meter_reads_each_gpus_cumulative_counter_keyed_by_uuid() -> None:
    nvml = FakeNvml([
        {"uuid": "GPU-aaaa", "energy_mj": 5_000, "power_mw": 1},
        {"uuid": "GPU-bbbb", "energy_mj": 7_000, "power_mw": 2},
    ])
    readings = NvmlMeter(nvml).read(10.0)
    assert [(r.device_id, r.kind, r.method, r.energy_mj, r.power_mw, r.ts_s) for r in readings] == [
        ("GPU-aaaa", "nvml", "counter", 5_000, 1, 10.0),
        ("GPU-bbbb", "nvml", "counter", 7_000, 2, 10.0),
    ]


def test_a_gpu_without_the_energy_counter_integrates_power_instead_200_w_for_2_s_is_400_j() -> None:
    nvml = two_gpus()
    meter = NvmlMeter(nvml)
    first = {r.device_id: r for r in meter.read(100.0)}
    nvml.devices[0]["energy_mj"] = 1_000_000 + 600_000
    second = {r.device_id: r for r in meter.read(102.0)}

    assert first["GPU-aaaa"].method == "counter"
    assert first["GPU-bbbb"].method == "power_integration"
    assert first["GPU-bbbb"].energy_mj == 0  # the synthetic counter starts at the first read
    assert second["GPU-bbbb"].energy_mj == 200_000 * 2  # mW x s = mJ: 200 W for 2 s = 400 J
    assert second["GPU-aaaa"].energy_mj == 1_000_000 + 600_000
    assert "power integration" in meter.describe() and "GPU-bbbb" in meter.describe()


def test_power_integration_uses_the_trapezoid_between_two_power_samples() -> None:
    nvml = FakeNvml([{"uuid": "GPU-c", "energy_mj": pynvml.NVMLError_NotSupported(), "power_mw": 100_000}])
    meter = NvmlMeter(nvml)
    meter.read(0.0)
    nvml.devices[0]["power_mw"] = 300_000
    (reading,) = meter.read(4.0)
    assert reading.energy_mj == (100_000 + 300_000) // 2 * 4  # mean of 100 W and 300 W for 4 s = 800 J


def test_a_gpu_whose_counter_fails_is_not_asked_for_the_counter_again() -> None:
    nvml = two_gpus()
    meter = NvmlMeter(nvml)
    for t in (0.0, 1.0, 2.0):
        meter.read(t)
    assert nvml.num_energy_calls == [3, 1]


def test_power_integration_with_no_power_reading_is_unavailable_not_zero() -> None:
    nvml = FakeNvml([{"uuid": "GPU-c", "energy_mj": pynvml.NVMLError_NotSupported(), "power_mw": 50_000}])
    meter = NvmlMeter(nvml)
    meter.read(0.0)
    nvml.devices[0]["power_mw"] = pynvml.NVMLError_Unknown()
    (reading,) = meter.read(1.0)
    assert (reading.method, reading.energy_mj) == ("unavailable", None)


def test_nvml_meter_can_be_restricted_to_one_device_index_or_uuid() -> None:
    assert [r.device_id for r in NvmlMeter(two_gpus(), device_indices=[1]).read(0.0)] == ["GPU-bbbb"]
    assert [r.device_id for r in NvmlMeter(two_gpus(), device_uuids=["aaaa"]).read(0.0)] == ["GPU-aaaa"]


class FakeMigNvml(FakeNvml):
    """NVML with MIG: GPU handle ``g`` holds the instances ``mig`` lists (handles ``(g, slot)``)."""

    def __init__(self, devices: list[dict[str, Any]], mig: dict[int, list[str | None]]) -> None:
        super().__init__(devices)
        self.mig = mig

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: int) -> int:
        return len(self.mig.get(handle, []))

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: int, index: int) -> tuple[int, int]:
        if self.mig[handle][index] is None:
            raise pynvml.NVMLError_NotFound()
        return (handle, index)

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        if isinstance(handle, tuple):
            return str(self.mig[handle[0]][handle[1]])
        return super().nvmlDeviceGetUUID(handle)


def test_a_mig_instance_reads_its_parent_gpus_counter_under_the_parents_uuid() -> None:
    # A MIG slice has no counter of its own; every worker on any slice of one GPU reports that GPU's
    # stream, which the ledger counts once (docs/accounting.md, "Intervals").
    nvml = FakeMigNvml([{"uuid": "GPU-aaaa", "energy_mj": 1_000, "power_mw": 0},
                        {"uuid": "GPU-bbbb", "energy_mj": 2_000, "power_mw": 0}],
                       mig={1: ["MIG-b-one", None, "MIG-b-two"]})
    for wanted in (["MIG-b-two"], ["b-one"], ["MIG-b-one", "MIG-b-two"]):
        assert [(r.device_id, r.energy_mj) for r in NvmlMeter(nvml, device_uuids=wanted).read(0.0)] == [
            ("GPU-bbbb", 2_000)]


def test_detect_meter_for_cuda_n_reads_only_gpu_n() -> None:
    meter = detect_meter("cuda:1", nvml=two_gpus())
    assert [r.device_id for r in meter.read(0.0)] == ["GPU-bbbb"]


def test_detect_meter_for_cuda_is_unavailable_when_nvml_does_not_initialise() -> None:
    meter = detect_meter("cuda", nvml=FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound()))
    assert isinstance(meter, UnavailableMeter)
    (reading,) = meter.read(3.0)
    assert (reading.kind, reading.method, reading.energy_mj) == ("none", "unavailable", None)
    assert "nvmlInit" in meter.describe()


def test_detect_meter_for_a_gpu_index_that_does_not_exist_is_unavailable() -> None:
    assert isinstance(detect_meter("cuda:5", nvml=two_gpus()), UnavailableMeter)


# ------------------------------------------------------------------------------------------------ RAPL


def write_zone(root: Path, name: str, zone_name: str, energy_uj: int, max_range_uj: int = 262_143_000_000) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "name").write_text(zone_name + "\n")
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_range_uj}\n")
    return zone


def test_rapl_meter_reads_package_zones_and_skips_nested_zones(tmp_path: Path) -> None:
    write_zone(tmp_path, "intel-rapl:0", "package-0", 5_000_000)
    write_zone(tmp_path, "intel-rapl:0:0", "core", 3_000_000)  # inside package-0: summing it would double count
    write_zone(tmp_path, "intel-rapl:1", "package-1", 7_000_000)
    write_zone(tmp_path, "intel-rapl-mmio:0", "package-0", 5_000_000)  # the same package counter again

    readings = RaplMeter(tmp_path, host="h1").read(1.0)

    assert [(r.device_id, r.kind, r.method, r.energy_mj, r.max_range_mj) for r in readings] == [
        ("rapl:h1:package-0", "rapl", "counter", 5_000_000 // 1000, 262_143_000_000 // 1000),
        ("rapl:h1:package-1", "rapl", "counter", 7_000_000 // 1000, 262_143_000_000 // 1000),
    ]


def test_a_rapl_zone_id_names_its_host_so_two_hosts_package_0_are_two_devices(tmp_path: Path) -> None:
    # The ledger keeps one stream per device id (docs/accounting.md, "Intervals"): every host has a package-0.
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000)
    (tmp_path / "machine-id").write_text("0123abcd\n")
    assert host_id(tmp_path / "machine-id") == "0123abcd"
    assert host_id(tmp_path / "no-machine-id") == socket.gethostname()
    ids = {RaplMeter(tmp_path, host=h).read(0.0)[0].device_id for h in ("h1", "h2")}
    assert ids == {"rapl:h1:package-0", "rapl:h2:package-0"}
    assert RaplMeter(tmp_path).read(0.0)[0].device_id == f"rapl:{host_id()}:package-0"


def test_rapl_psys_is_used_only_when_there_is_no_package_zone(tmp_path: Path) -> None:
    write_zone(tmp_path / "a", "intel-rapl:0", "package-0", 1_000)
    write_zone(tmp_path / "a", "intel-rapl:1", "psys", 9_000)  # the platform zone contains the package
    write_zone(tmp_path / "b", "intel-rapl:0", "psys", 9_000)
    assert [z.name for z in find_rapl_zones(tmp_path / "a")] == ["package-0"]
    assert [z.name for z in find_rapl_zones(tmp_path / "b")] == ["psys"]


def test_a_rapl_wrap_is_corrected_with_the_max_range(tmp_path: Path) -> None:
    max_range_uj = 262_143_000_000
    zone = write_zone(tmp_path, "intel-rapl:0", "package-0", max_range_uj - 1_000_000, max_range_uj)
    meter = RaplMeter(tmp_path)
    tracker = EnergyTracker(expected_interval_s=1.0)
    tracker.update(meter.read(0.0), 0.0)
    (zone / "energy_uj").write_text("500000\n")
    (interval,) = tracker.update(meter.read(1.0), 1.0)
    assert interval.flags == {"wrap"}
    assert interval.energy_j == (1_000_000 + 500_000) / 1e6  # 1_500_000 uJ = 1.5 J


def test_rapl_that_only_root_can_read_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    zone = write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000)
    original = Path.read_text

    def read_text(self: Path, *args: Any, **kwargs: Any) -> str:
        if self == zone / "energy_uj":
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    # chmod cannot stand in for this: the tests may run as root, which reads mode-000 files anyway.
    monkeypatch.setattr(Path, "read_text", read_text)
    assert find_rapl_zones(tmp_path) == []
    meter = detect_meter("cpu", rapl_root=tmp_path)
    assert isinstance(meter, UnavailableMeter)
    assert meter.read(0.0)[0].energy_mj is None


def test_detect_meter_for_cpu_without_rapl_is_unavailable(tmp_path: Path) -> None:
    meter = detect_meter("cpu", rapl_root=tmp_path / "no-powercap-here")
    assert isinstance(meter, UnavailableMeter)
    assert [(r.device_id, r.method, r.energy_mj) for r in meter.read(0.0)] == [("cpu", "unavailable", None)]


def test_detect_meter_for_cpu_with_readable_rapl_is_a_rapl_meter(tmp_path: Path) -> None:
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000)
    assert isinstance(detect_meter("cpu", rapl_root=tmp_path), RaplMeter)


# --------------------------------------------------------------------------------------------- tracker


def run_tracker(meter: ReplayMeter, times: list[float], expected_interval_s: float = 1.0) -> list[Any]:
    tracker = EnergyTracker(expected_interval_s=expected_interval_s)
    return [tracker.update(meter.read(t), t) for t in times]


def test_tracker_turns_a_normal_counter_sequence_into_interval_joules() -> None:
    meter = ReplayMeter([{"GPU-a": 10_000}, {"GPU-a": 12_500}, {"GPU-a": 20_000}])
    steps = run_tracker(meter, [0.0, 1.0, 2.0])
    assert [(i.energy_j, i.flags, i.start_s, i.end_s) for (i,) in steps] == [
        (None, {"baseline"}, None, 0.0),
        ((12_500 - 10_000) / 1000, frozenset(), 0.0, 1.0),
        ((20_000 - 12_500) / 1000, frozenset(), 1.0, 2.0),
    ]


def test_a_counter_that_goes_down_is_a_reset_flagged_and_never_negative() -> None:
    meter = ReplayMeter([{"GPU-a": 50_000}, {"GPU-a": 3_000}, {"GPU-a": 4_000}])
    steps = run_tracker(meter, [0.0, 1.0, 2.0])
    (reset,), (after,) = steps[1], steps[2]
    assert (reset.energy_j, reset.flags) == (None, {"reset"})
    assert after.energy_j == (4_000 - 3_000) / 1000  # the reset value is the new baseline


def test_a_rapl_wrap_in_replay_adds_the_max_range_once() -> None:
    max_range_mj = 262_143_000
    meter = ReplayMeter([{"rapl:package-0": max_range_mj - 1_000}, {"rapl:package-0": 500}], kind="rapl",
                        max_range_mj=max_range_mj)
    (_, (wrapped,)) = run_tracker(meter, [0.0, 1.0])
    assert wrapped.flags == {"wrap"}
    assert wrapped.energy_j == (500 - (max_range_mj - 1_000) + max_range_mj) / 1000  # 1_500 mJ = 1.5 J


def test_a_gap_is_flagged_but_its_energy_is_kept() -> None:
    meter = ReplayMeter([{"GPU-a": 0}, {"GPU-a": 1_000}, {"GPU-a": 61_000}])
    steps = run_tracker(meter, [0.0, 1.0, 1.0 + 60.0])  # 60 s > 3 x the 1 s expected interval
    (gap,) = steps[2]
    assert gap.flags == {"gap"}
    assert gap.energy_j == (61_000 - 1_000) / 1000


def test_a_gap_of_exactly_three_intervals_is_not_flagged() -> None:
    steps = run_tracker(ReplayMeter([{"GPU-a": 0}, {"GPU-a": 3_000}]), [0.0, 3.0])
    assert steps[1][0].flags == frozenset()


def test_a_duplicate_sample_adds_zero_not_double() -> None:
    meter = ReplayMeter([{"GPU-a": 0}, {"GPU-a": 2_000}, {"GPU-a": 2_000}])
    steps = run_tracker(meter, [0.0, 1.0, 1.0])
    (dup,) = steps[2]
    assert (dup.energy_j, dup.flags) == (0.0, {"duplicate"})
    assert total_energy_j([i for step in steps for i in step]) == 2_000 / 1000


def test_time_going_backwards_is_implausible_and_the_next_interval_starts_from_that_reading() -> None:
    # The ledger pairs consecutive samples the same way, so both lose the backwards span and no more.
    meter = ReplayMeter([{"GPU-a": 0}, {"GPU-a": 2_000}, {"GPU-a": 2_500}, {"GPU-a": 3_000}])
    steps = run_tracker(meter, [0.0, 2.0, 1.0, 3.0])
    assert (steps[2][0].energy_j, steps[2][0].flags) == (None, {"implausible"})
    assert (steps[3][0].energy_j, steps[3][0].start_s) == ((3_000 - 2_500) / 1000, 1.0)


def test_a_missing_or_unavailable_reading_breaks_the_chain_as_in_the_ledger() -> None:
    # The ledger forms no interval for a device absent from one of two consecutive samples, and a NULL
    # one on either side of an unavailable reading; /usage counts the same joules (none are bridged).
    meter = ReplayMeter([{"GPU-a": 0, "GPU-b": 0}, {"GPU-a": 1_000}, {"GPU-a": 2_000, "GPU-b": None},
                         {"GPU-a": 3_000, "GPU-b": 9_000}, {"GPU-a": 4_000, "GPU-b": 10_000}])
    steps = run_tracker(meter, [0.0, 1.0, 2.0, 3.0, 4.0])
    by_step = [{i.device_id: i for i in step} for step in steps]
    assert (by_step[1]["GPU-b"].energy_j, by_step[1]["GPU-b"].flags) == (None, {"missing"})
    assert (by_step[2]["GPU-b"].energy_j, by_step[2]["GPU-b"].flags) == (None, {"unavailable"})
    assert (by_step[3]["GPU-b"].energy_j, by_step[3]["GPU-b"].flags) == (None, {"unavailable"})
    assert by_step[4]["GPU-b"].energy_j == (10_000 - 9_000) / 1000
    assert total_energy_j([i for step in steps for i in step]) == (4_000 + 10_000 - 9_000) / 1000


def test_a_change_of_method_restarts_the_baseline_instead_of_mixing_scales() -> None:
    tracker = EnergyTracker(expected_interval_s=1.0)

    def reading(method: Any, energy_mj: int, ts_s: float) -> DeviceReading:
        return DeviceReading(device_id="GPU-a", kind="nvml", method=method, ts_s=ts_s, energy_mj=energy_mj)

    tracker.update([reading("counter", 9_000_000, 0.0)], 0.0)
    (changed,) = tracker.update([reading("power_integration", 0, 1.0)], 1.0)
    (after,) = tracker.update([reading("power_integration", 500, 2.0)], 2.0)
    assert (changed.energy_j, changed.flags) == (None, {"method_change"})
    assert after.energy_j == 500 / 1000


def test_total_energy_is_none_when_nothing_was_measured_not_zero() -> None:
    steps = run_tracker(ReplayMeter([{"cpu": None}, {"cpu": None}]), [0.0, 1.0])
    assert total_energy_j([i for step in steps for i in step]) is None


def test_total_energy_sums_devices_that_have_a_measurement() -> None:
    meter = ReplayMeter([{"GPU-a": 0, "GPU-b": 0}, {"GPU-a": 1_000, "GPU-b": 600_000}])  # 1 W and 600 W
    (_, second) = run_tracker(meter, [0.0, 1.0])
    assert total_energy_j(second) == (1_000 + 600_000) / 1000


def test_a_reading_converts_to_the_bus_message_unchanged() -> None:
    r = DeviceReading(device_id="rapl:package-0", kind="rapl", method="counter", ts_s=5.0, energy_mj=7,
                      max_range_mj=262_143_000, power_mw=None)
    msg = r.to_message()
    assert (msg.device_id, msg.kind, msg.method, msg.energy_mj, msg.max_range_mj, msg.power_mw) == (
        "rapl:package-0", "rapl", "counter", 7, 262_143_000, None,
    )
