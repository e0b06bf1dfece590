"""The gateway's load shedder (issue #31): the in-flight cap, the adaptive limit the loop's lag steers, the 503."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.http import error_middleware
from services.common.prom import PromText
from services.gateway.shedding import BUSY_SHARE, DECREASE, MIN_LIMIT, PROBE_INTERVAL_S, WINDOW_PROBES, LoadShedder


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


def test_a_standing_lag_cuts_the_limit_to_what_is_open_and_time_raises_it_back() -> None:
    s = LoadShedder(max_in_flight=1000, max_loop_lag_s=0.02)
    s.in_flight = 300
    s.observe_lag(5.0)  # one stall (a long synchronous call) is not overload: the median of the window is not late
    s.observe_lag(0.001)
    assert s.limit == 1000 and s.verdict() is None
    for _ in range(WINDOW_PROBES):
        s.observe_lag(0.06)
    assert s.limit < 300 * DECREASE + 1  # cut below what is open: new requests are shed until some finish
    assert s.verdict() == "loop_lag"
    msg = s.refusal("loop_lag").message
    assert "60 ms behind (the limit is 20 ms) with 300 requests open" in msg
    s.in_flight = 10
    for _ in range(200):
        s.observe_lag(0.06)
    assert s.limit == MIN_LIMIT  # never below the floor
    assert s.verdict() is None  # 10 open, under the floor
    for _ in range(WINDOW_PROBES):
        s.observe_lag(0.001)
    before = s.limit
    s.observe_lag(0.001)
    assert s.limit > before  # on time again: the limit grows back, one probe at a time
    s.in_flight = 200
    assert s.limit < 200 and s.verdict() is None  # and a loop on time takes a burst past it
    for _ in range(WINDOW_PROBES):
        s.observe_lag(0.03)  # over half the bound (20 ms): the limit binds again
    assert s.verdict() == "loop_lag"
    for _ in range(500):
        s.observe_lag(0.001)
    assert s.limit == 1000
    s.observe_lag(-0.001)  # a clock that woke early is no lag
    assert s.loop_lag_s == 0.0


def test_a_lag_while_this_process_was_not_busy_is_the_hosts_and_sheds_nothing() -> None:
    s = LoadShedder(max_in_flight=100, max_loop_lag_s=0.02)
    s.in_flight = 50
    for _ in range(3 * WINDOW_PROBES):
        s.observe_lag(0.2, cpu_share=BUSY_SHARE / 2)  # starved by other processes, not busy with requests
    assert s.limit == 100 and s.verdict() is None
    s.observe_lag(0.2, cpu_share=0.95)
    assert s.limit == 50 * DECREASE and s.verdict() == "loop_lag"


@pytest.mark.parametrize(("in_flight", "lag"), [(0, 0.5), (-1, 0.5), (1, 0.0), (1, float("nan"))])
def test_bad_limits_are_refused(in_flight: int, lag: float) -> None:
    with pytest.raises(ValueError):
        LoadShedder(in_flight, lag)


async def test_the_probe_measures_a_blocked_loop_and_its_own_cpu() -> None:
    s = LoadShedder(max_in_flight=100, max_loop_lag_s=0.05)
    s.in_flight = 40
    task = asyncio.create_task(s.probe())
    try:
        for _ in range(WINDOW_PROBES + 2):  # a loop kept busy (spinning: its own CPU): every probe wakes late
            await asyncio.sleep(PROBE_INTERVAL_S / 2)
            end = time.monotonic() + 0.1
            while time.monotonic() < end:
                pass
        await asyncio.sleep(PROBE_INTERVAL_S / 5)
        assert s.loop_lag_s > 0.05 and s.cpu_share > BUSY_SHARE
        assert s.limit < 40 and s.verdict() == "loop_lag"
        for _ in range(100):  # idle: on time again, the limit grows back
            await asyncio.sleep(PROBE_INTERVAL_S)
            if s.verdict() is None:
                break
        assert s.verdict() is None
    finally:
        task.cancel()


async def test_the_503_is_answered_before_any_other_middleware_and_only_for_inference() -> None:
    s = LoadShedder(max_in_flight=1, max_loop_lag_s=0.5)
    reached: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        reached.append(request.path)
        return web.json_response({"ok": True})

    app = web.Application(middlewares=[s.middleware, error_middleware])
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_get("/health", handler)
    s.in_flight = 1  # full
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", data=b"{not json")
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert resp.content_type == "application/json"
        body = json.loads(await resp.read())
        assert body["error"]["code"] == "gateway_overloaded" and body["error"]["type"] == "service_unavailable"
        assert "retry after 1 s" in body["error"]["message"] and body["error"]["param"] is None
        assert (await client.get("/health")).status == 200  # never shed
        assert reached == ["/health"]
        s.in_flight = 0
        assert (await client.post("/v1/chat/completions", data=b"{}")).status == 200
        assert s.in_flight == 0  # counted while open, released after
    assert s.shed["in_flight"] == 1


def test_metrics_carry_both_reasons_the_in_flight_the_lag_and_the_limit() -> None:
    s = LoadShedder(max_in_flight=7, max_loop_lag_s=0.5)
    s.refusal("in_flight")
    m = PromText()
    s.write(m)
    text = m.render()
    assert 'llmgw_shed_requests_total{reason="in_flight"} 1' in text
    assert 'llmgw_shed_requests_total{reason="loop_lag"} 0' in text
    assert "llmgw_gateway_in_flight 0" in text and "llmgw_event_loop_lag_seconds 0" in text
    assert "llmgw_gateway_in_flight_limit 7" in text
