"""Overload is answered, not timed out (issue #31): new inference requests get 503 with ``Retry-After`` at
once while this gateway process is past what it can serve, so served requests keep their latency.

Two signals:

- **in flight**: inference requests open in this process (``/v1/*`` POSTs, from arrival until the answer's
  last byte) at or above ``max_in_flight``: every new one is shed;
- **event-loop lag**: a probe sleeps :data:`PROBE_INTERVAL_S` and measures how late it wakes. The *standing*
  lag is the median of the last :data:`WINDOW_PROBES` probes, so one stall (a page fault, a long synchronous
  call) is not overload; nor is a lag while this process used less than :data:`BUSY_SHARE` of a core over
  the window (a host busy with other work starves the loop, and turning requests away would not help it).
  The lag steers an **adaptive in-flight limit** (additive increase, multiplicative
  decrease, as TCP and Envoy's adaptive concurrency do, with the loop's lag as the congestion signal):
  each probe that finds the standing lag above ``max_loop_lag_s`` cuts the limit to :data:`DECREASE` of what
  is open now; each probe under it raises the limit by :data:`INCREASE` of itself (at least 1), up to
  ``max_in_flight``. Requests past the limit are shed while the standing lag is above half the bound; once
  the loop is back under it the limit does not bind (it only grows back), so a burst that meets a loop on
  time is taken even if an earlier overload left the limit low. Waiting on engines costs the loop nothing, so
  long LLM requests never lower it; requests that keep the CPU busy do, and then the limit settles where
  the loop keeps up. Shedding new requests alone (a fraction, or all while late) does not: the requests
  already taken are the queue, and each one taken while the loop is late lengthens it.

The refusal is built here, before any other middleware runs (no body read, no JSON parsing, no auth): a 503
must cost far less than an answer, or shedding would itself fill the loop.

Health, metrics, pages and admin routes are never shed (an overloaded gateway must still say so). Counted in
``/metrics`` as ``llmgw_shed_requests_total{reason}``, with ``llmgw_gateway_in_flight``,
``llmgw_event_loop_lag_seconds`` and ``llmgw_gateway_in_flight_limit``.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web

from services.common.http import HTTPError, error_response
from services.common.prom import PromText

PROBE_INTERVAL_S = 0.01
WINDOW_PROBES = 3  # the standing lag: the median of this many probes (30 ms when the loop keeps time)
DECREASE = 0.9  # a late probe cuts the limit to this share of the requests open now
INCREASE = 0.05  # a probe on time raises the limit by this share of itself (at least one request)
BUSY_SHARE = 0.5  # a lag is this process's overload only while it used at least this much of a core
MIN_LIMIT = 16  # never fewer: the floor a lag from elsewhere (a stall, a busy host) can push it to
RETRY_AFTER_S = 1
ShedReason = Literal["in_flight", "loop_lag"]


class LoadShedder:
    def __init__(self, max_in_flight: int, max_loop_lag_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if not max_loop_lag_s > 0:
            raise ValueError("max_loop_lag_s must be positive")
        self.max_in_flight = max_in_flight
        self.max_loop_lag_s = max_loop_lag_s
        self.clock = clock
        self.cpu_clock = cpu_clock
        self.cpu_share = 0.0  # of one core this process used over the window (all its threads)
        self.in_flight = 0
        self.loop_lag_s = 0.0  # the newest probe's
        self.recent: collections.deque[float] = collections.deque([0.0] * WINDOW_PROBES, maxlen=WINDOW_PROBES)
        self.standing_lag_s = 0.0
        self.limit = float(max_in_flight)  # the adaptive in-flight limit the loop's lag steers
        self.shed: collections.Counter[ShedReason] = collections.Counter()

    def verdict(self) -> ShedReason | None:
        """Why a new request would be shed now, or None to take it."""
        if self.in_flight >= self.max_in_flight:
            return "in_flight"
        if self.in_flight >= self.limit and self.standing_lag_s > self.max_loop_lag_s / 2:
            return "loop_lag"
        return None

    def observe_lag(self, lag_s: float, cpu_share: float = 1.0) -> None:
        """One probe: how late it woke, and the share of a core this process used over the window."""
        self.loop_lag_s = lag = max(0.0, lag_s) if lag_s == lag_s else 0.0  # NaN: no reading
        self.cpu_share = cpu_share
        self.recent.append(lag)
        self.standing_lag_s = statistics.median(self.recent)
        if self.standing_lag_s > self.max_loop_lag_s and cpu_share >= BUSY_SHARE:
            self.limit = max(MIN_LIMIT, min(self.limit, self.in_flight) * DECREASE)
        elif self.limit < self.max_in_flight:
            self.limit = min(self.max_in_flight, self.limit + max(1.0, self.limit * INCREASE))

    async def probe(self) -> None:
        """Measure the event loop's lag forever (a background task)."""
        marks: collections.deque[tuple[float, float]] = collections.deque(maxlen=WINDOW_PROBES + 1)
        marks.append((self.clock(), self.cpu_clock()))
        while True:
            start = self.clock()
            await asyncio.sleep(PROBE_INTERVAL_S)
            now, cpu = self.clock(), self.cpu_clock()
            (then, cpu_then) = marks[0]
            marks.append((now, cpu))
            self.observe_lag(now - start - PROBE_INTERVAL_S, (cpu - cpu_then) / max(now - then, 1e-6))

    def message(self, reason: ShedReason) -> str:
        why = (f"{self.in_flight} requests are open (the limit is {self.max_in_flight})" if reason == "in_flight"
               else f"its event loop is {self.standing_lag_s * 1000:.0f} ms behind (the limit is "
                    f"{self.max_loop_lag_s * 1000:.0f} ms) with {self.in_flight} requests open, so it takes "
                    f"no more than {int(self.limit)} for now")
        return f"the gateway is overloaded: {why}; retry after {RETRY_AFTER_S} s"

    def refusal(self, reason: ShedReason) -> HTTPError:
        self.shed[reason] += 1
        return HTTPError(503, self.message(reason), code="gateway_overloaded", retry_after_s=RETRY_AFTER_S)

    def refusal_response(self, reason: ShedReason) -> web.Response:
        """The 503 itself, returned rather than raised through the middleware chain (this middleware runs
        first, before :func:`~services.common.http.error_middleware` could catch it)."""
        return error_response(self.refusal(reason))

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        if request.method != "POST" or not request.path.startswith("/v1/"):
            return await handler(request)
        reason = self.verdict()
        if reason is not None:
            return self.refusal_response(reason)
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
        m.gauge("llmgw_gateway_in_flight_limit", "The in-flight limit the event loop's lag has set (up to "
                "--max-in-flight): past it, new inference requests are shed.", int(self.limit))
