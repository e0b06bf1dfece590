"""Overload is answered, not timed out (issue #31): new inference requests get 503 with ``Retry-After`` at
once while this gateway process is past what it can serve, so served requests keep their latency.

Two signals, either one sheds:

- **in flight**: inference requests open in this process (``/v1/*`` POSTs, from arrival until the answer's
  last byte) at or above ``max_in_flight``;
- **event-loop lag**: a probe sleeps :data:`PROBE_INTERVAL_S` and measures how late it wakes. A loop whose
  last :data:`SUSTAINED_PROBES` probes all woke more than ``max_loop_lag_s`` late is saturated: every request
  it takes on makes every other one slower. One late probe is a stall (a page fault, a long synchronous
  call), not overload, and sheds nothing; one probe on time ends the shedding.

Health, metrics, pages and admin routes are never shed (an overloaded gateway must still say so). Counted in
``/metrics`` as ``llmgw_shed_requests_total{reason}``, with ``llmgw_gateway_in_flight`` and
``llmgw_event_loop_lag_seconds``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web

from services.common.http import HTTPError
from services.common.prom import PromText

PROBE_INTERVAL_S = 0.05
SUSTAINED_PROBES = 3
RETRY_AFTER_S = 1
ShedReason = Literal["in_flight", "loop_lag"]


class LoadShedder:
    def __init__(self, max_in_flight: int, max_loop_lag_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if not max_loop_lag_s > 0:
            raise ValueError("max_loop_lag_s must be positive")
        self.max_in_flight = max_in_flight
        self.max_loop_lag_s = max_loop_lag_s
        self.clock = clock
        self.in_flight = 0
        self.loop_lag_s = 0.0
        self.late_probes = 0  # consecutive probes later than max_loop_lag_s
        self.shed: collections.Counter[ShedReason] = collections.Counter()

    def verdict(self) -> ShedReason | None:
        """Why a new request would be shed now, or None to take it."""
        if self.in_flight >= self.max_in_flight:
            return "in_flight"
        if self.late_probes >= SUSTAINED_PROBES:
            return "loop_lag"
        return None

    def observe_lag(self, lag_s: float) -> None:
        self.loop_lag_s = max(0.0, lag_s)
        self.late_probes = self.late_probes + 1 if self.loop_lag_s > self.max_loop_lag_s else 0

    async def probe(self) -> None:
        """Measure the event loop's lag forever (a background task)."""
        while True:
            start = self.clock()
            await asyncio.sleep(PROBE_INTERVAL_S)
            self.observe_lag(self.clock() - start - PROBE_INTERVAL_S)

    def refusal(self, reason: ShedReason) -> HTTPError:
        self.shed[reason] += 1
        why = (f"{self.in_flight} requests are open (the limit is {self.max_in_flight})" if reason == "in_flight"
               else f"its event loop is {self.loop_lag_s * 1000:.0f} ms behind (the limit is "
                    f"{self.max_loop_lag_s * 1000:.0f} ms)")
        return HTTPError(503, f"the gateway is overloaded: {why}; retry after {RETRY_AFTER_S} s",
                         code="gateway_overloaded", retry_after_s=RETRY_AFTER_S)

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        reason = self.verdict()
        if reason is not None:
            raise self.refusal(reason)
        self.in_flight += 1
        try:
            return await handler(request)
        finally:
            self.in_flight -= 1

    def write(self, m: PromText) -> None:
        reasons: tuple[ShedReason, ...] = ("in_flight", "loop_lag")
        for reason in reasons:
            m.counter("llmgw_shed_requests_total", "Inference requests answered 503 gateway_overloaded at once, by "
                      "the signal that shed them.", self.shed[reason], {"reason": reason})
        m.gauge("llmgw_gateway_in_flight", "Inference requests open in this gateway process.", self.in_flight)
        m.gauge("llmgw_event_loop_lag_seconds", "How late the gateway's event loop woke for its newest probe.",
                round(self.loop_lag_s, 6))
