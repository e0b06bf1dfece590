"""The gateway's load shedder (issue #31): verdicts from in-flight and event-loop lag, the 503 it gives."""

from __future__ import annotations

import asyncio

import pytest

from services.common.prom import PromText
from services.gateway.shedding import PROBE_INTERVAL_S, SUSTAINED_PROBES, LoadShedder


def test_in_flight_at_the_limit_sheds_and_says_why() -> None:
    s = LoadShedder(max_in_flight=2, max_loop_lag_s=0.5)
    assert s.verdict() is None
    s.in_flight = 2
    assert s.verdict() == "in_flight"
    err = s.refusal("in_flight")
    assert err.status == 503 and err.code == "gateway_overloaded" and err.retry_after_s == 1
    assert err.type == "service_unavailable"
    assert "2 requests are open (the limit is 2)" in err.message
    assert s.shed["in_flight"] == 1


def test_loop_lag_sheds_only_while_it_is_sustained() -> None:
    s = LoadShedder(max_in_flight=100, max_loop_lag_s=0.25)
    s.observe_lag(10.0)  # one stall (a long synchronous call) is not overload
    assert s.verdict() is None
    s.observe_lag(0.01)
    for _ in range(SUSTAINED_PROBES - 1):
        s.observe_lag(0.6)
        assert s.verdict() is None
    s.observe_lag(0.6)
    assert s.verdict() == "loop_lag" and "600 ms behind" in s.refusal("loop_lag").message
    s.observe_lag(0.01)  # caught up: taking requests again at once
    assert s.verdict() is None
    s.observe_lag(-0.001)  # a clock that woke early is no lag
    assert s.loop_lag_s == 0.0


@pytest.mark.parametrize(("in_flight", "lag"), [(0, 0.5), (-1, 0.5), (1, 0.0), (1, float("nan"))])
def test_bad_limits_are_refused(in_flight: int, lag: float) -> None:
    with pytest.raises(ValueError):
        LoadShedder(in_flight, lag)


async def test_the_probe_measures_a_blocked_loop() -> None:
    import time
    s = LoadShedder(max_in_flight=100, max_loop_lag_s=0.1)
    task = asyncio.create_task(s.probe())
    for _ in range(SUSTAINED_PROBES + 1):  # a loop kept busy: every probe wakes late
        await asyncio.sleep(PROBE_INTERVAL_S / 2)
        time.sleep(0.3)
    await asyncio.sleep(PROBE_INTERVAL_S / 5)
    assert s.loop_lag_s > 0.2 and s.verdict() == "loop_lag"
    await asyncio.sleep(PROBE_INTERVAL_S * 3)
    assert s.verdict() is None
    task.cancel()


def test_metrics_carry_both_reasons_the_in_flight_and_the_lag() -> None:
    s = LoadShedder(max_in_flight=1, max_loop_lag_s=0.5)
    s.refusal("in_flight")
    m = PromText()
    s.write(m)
    text = m.render()
    assert 'llmgw_shed_requests_total{reason="in_flight"} 1' in text
    assert 'llmgw_shed_requests_total{reason="loop_lag"} 0' in text
    assert "llmgw_gateway_in_flight 0" in text and "llmgw_event_loop_lag_seconds 0" in text
