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
                failures={"HTTP 503": 120, "ServerDisconnectedError": 10})
    bench.report_rate([cell], "Overload")
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| gateway x2"))
    assert row == "| gateway x2 | json | 2,000 | 900 | 120 | 10 (10 ServerDisconnectedError) | 3.00 | 9.00 |"
