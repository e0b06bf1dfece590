"""bench/gateway_overhead.py's report (issue #31): a peer that served 0 req/s (LiteLLM stalled) gives "n/a"
ratios instead of a ZeroDivisionError, and the workers dimension gets its own scaling table."""

from __future__ import annotations

import pytest

from bench import gateway_overhead as bench
from bench.gateway_overhead import Cell


def _cell(target: str, stream: bool, rps: float, conc: int = 16) -> Cell:
    return Cell(target, stream, conc, rps, p50_ms=1.0, p99_ms=2.0, errors=0, requests=int(rps))


def test_a_litellm_that_served_nothing_gives_na_ratios_not_a_crash(capsys: pytest.CaptureFixture[str]) -> None:
    cells = [c for stream in (False, True) for c in (
        _cell("direct", stream, 3000.0), _cell("gateway x1", stream, 700.0), _cell("gateway x2", stream, 1330.0),
        _cell("litellm", stream, 0.0))]
    bench.report(cells, [], "aiohttp", 2, [16], [1, 2])
    out = capsys.readouterr().out
    assert "n/a (LiteLLM served 0 req/s)" in out
    assert "| json | 1.9x |" in out  # gateway x2 / gateway x1: 1330 / 700


def test_a_run_that_measured_no_time_is_0_per_second() -> None:
    assert bench.per_s(10, 0.0) == 0.0
    assert bench.per_s(10, 2.0) == 5.0


def test_the_overload_table_keeps_503s_apart_from_other_failures(capsys: pytest.CaptureFixture[str]) -> None:
    cell = Cell("gateway x2", False, 0, 900.0, 3.0, 9.0, errors=130, requests=4000, shed=120, offered_rps=2000.0,
                failures={"HTTP 503": 120, "connection closed": 10}, upstream="nginx", late_p99_ms=0.5,
                late_max_ms=1.25)
    bench.report_rate([cell], "Overload")
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| nginx"))
    assert row == ("| nginx | gateway x2 | json | 2,000 | 900 | 120 | 10 (10 connection closed) | 3.00 | 9.00 "
                   "| 0.50 / 1.25 |")


def test_the_workers_table_gives_each_upstream_its_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    cells = [Cell(t, s, 64, rps, 1.0, 2.0, 0, 1, upstream=u) for u, t, s, rps in (
        ("aiohttp", "gateway x1", False, 3000.0), ("aiohttp", "gateway x2", False, 3900.0),
        ("nginx", "direct", True, 40000.0), ("nginx", "gateway x1", True, 2500.0),
        ("nginx", "gateway x2", True, 4000.0))]
    bench.report_scaling(cells, [1, 2])
    out = capsys.readouterr().out
    assert "| aiohttp | json | 0 | 3,000 | 3,900 | 1.30x |" in out  # 3900 / 3000, two decimals: 1.55 is not 1.6
    assert "| nginx | stream | 40,000 | 2,500 | 4,000 | 1.60x |" in out  # 4000 / 2500


def test_with_rounds_each_round_has_its_ratio_and_the_median_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    cells = [Cell(t, False, 64, rps, 1.0, 2.0, 0, 1, upstream="nginx", round=r) for r, t, rps in (
        (1, "gateway x1", 2200.0), (1, "gateway x2", 3300.0),  # 1.50
        (2, "gateway x1", 1000.0), (2, "gateway x2", 1700.0),  # 1.70 (the host slowed: both sides alike)
        (3, "gateway x1", 2000.0), (3, "gateway x2", 3200.0))]  # 1.60
    bench.report_scaling(cells, [1, 2], rounds=3)
    out = capsys.readouterr().out
    assert "| 1 | nginx | json | 0 | 2,200 | 3,300 | 1.50x |" in out
    assert "| 2 | nginx | json | 0 | 1,000 | 1,700 | 1.70x |" in out
    assert "**1.60x** (rounds 1.50-1.70x)" in out  # the median of the rounds; the best of each side: 3300 / 2200
