"""An open-loop HTTP load generator cheap enough to offer 2x a gateway's capacity on the gateway's own host.

Request ``i`` is due at ``t0 + i / rate`` whether or not earlier ones finished. It goes out on an idle
keep-alive connection (``connections`` are opened before ``t0``); when none is idle it waits in a backlog
and goes out on the next connection that frees up. Its latency runs **from its due time** when it had to
wait for a connection (no coordinated omission: a stalled server is charged for every request it
delayed), otherwise from when it was written. The client's own lag (a write later than its due time: timer
granularity, or the client starved of CPU on a saturated host) is reported apart, as ``late_p99_ms`` and
``late_max_ms``, so a reader can tell the server's latency from the client's.

Why not aiohttp (the generator before, bench/gateway_overhead.py ``serve_rate``): its client costs about
150 µs of CPU per request, so on 2 cores it could not offer 2x the gateway's rate while the gateway held
the CPU, and the overload cells measured its own backlog (docs/benchmarks.md, issue #31). Here a request is
one prepared ``bytes`` written to a socket and a response is framed by ``httptools`` (C), under uvloop:
tens of µs per request. Why not wrk's Lua ``delay()``: wrk's callbacks do not say which connection a
response came on, so its latencies cannot be split into the served requests' and the 503s'.

Run as a process (``python bench/open_loop.py URL BODY RATE SECONDS HEADERS_JSON CONNECTIONS``); it prints
one ``RESULT {json}`` line: requests, duration_s, errors (every request not answered 200), shed (the 503s),
failures by kind, p50_us / p99_us of the 200s, late_p99_ms / late_max_ms.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
import urllib.parse
from typing import Any

TICK_S = 0.001  # requests due within one tick go out together (their lateness is reported)
DRAIN_TIMEOUT_S = 30.0  # after the last due time, what has not been answered by then counts as "no answer"


class _Conn(asyncio.Protocol):
    def __init__(self, gen: _Generator) -> None:
        import httptools

        self.gen = gen
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.started = 0.0  # perf_counter of the open request (0: none open)
        self.is_open = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.is_open = True
        self.gen.idle.append(self)

    def send(self, started: float) -> None:
        self.started = started
        assert self.transport is not None
        self.transport.write(self.gen.request)

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"bad response ({exc.__class__.__name__})")
            if self.transport is not None:
                self.transport.close()

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        started, self.started = self.started, 0.0
        if started:
            self.gen.answered(status, time.perf_counter() - started)
        if self.parser.should_keep_alive():
            self.gen.free(self)
        elif self.transport is not None:
            self.is_open = False
            self.transport.close()

    def _fail(self, kind: str) -> None:
        if self.started:
            self.started = 0.0
            self.gen.failed(kind)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_open = False
        self._fail(type(exc).__name__ if exc else "connection closed")
        self.gen.lost(self)


class _Generator:
    def __init__(self, url: str, body: bytes, headers: dict[str, str], rate: float, duration_s: float,
                 connections: int) -> None:
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {self.host}:{self.port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                *(f"{k}: {v}" for k, v in headers.items())]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        self.rate, self.duration_s, self.connections = rate, duration_s, connections
        self.idle: list[_Conn] = []
        self.backlog: collections.deque[float] = collections.deque()  # due times waiting for a connection
        self.latencies_us: list[float] = []
        self.late_s: list[float] = []  # per request: write time - due time (the client's lag), 0 when on time
        self.errors = self.shed = self.sent = self.done = 0
        self.failures: dict[str, int] = {}
        self.num_open = 0

    def answered(self, status: int, seconds: float) -> None:
        self.done += 1
        if status == 200:
            self.latencies_us.append(seconds * 1e6)
            return
        self.errors += 1
        self.shed += status == 503
        kind = f"HTTP {status}"
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def failed(self, kind: str) -> None:
        self.done += 1
        self.errors += 1
        self.failures[kind] = self.failures.get(kind, 0) + 1

    def free(self, conn: _Conn) -> None:
        if self.backlog:  # a request that found no idle connection: charged from its due time
            due = self.backlog.popleft()
            now = time.perf_counter()
            self.late_s.append(now - due)
            conn.send(due)
        else:
            self.idle.append(conn)

    def lost(self, conn: _Conn) -> None:
        self.num_open -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        asyncio.get_running_loop().create_task(self._reopen())

    async def _reopen(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            await loop.create_connection(lambda: _Conn(self), self.host, self.port)
            self.num_open += 1
        except OSError as exc:
            self.failures[f"reconnect {type(exc).__name__}"] = self.failures.get(f"reconnect {type(exc).__name__}",
                                                                                 0) + 1

    def dispatch(self, due: float, now: float) -> None:
        self.sent += 1
        if self.idle:
            self.late_s.append(max(0.0, now - due))
            self.idle.pop().send(now)
        else:
            self.backlog.append(due)

    async def run(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for _ in range(self.connections):
            await loop.create_connection(lambda: _Conn(self), self.host, self.port)
            self.num_open += 1
        total = int(self.rate * self.duration_s)
        t0 = time.perf_counter() + 0.05
        i = 0
        while i < total:
            now = time.perf_counter()
            due_now = min(total, int((now - t0) * self.rate) + 1)
            while i < due_now:
                self.dispatch(t0 + i / self.rate, now)
                i += 1
            if i < total:  # at least TICK_S: shorter sleeps spin the loop (uvloop's timers have 1 ms resolution)
                await asyncio.sleep(max(TICK_S, t0 + i / self.rate - time.perf_counter()))
        deadline = time.perf_counter() + DRAIN_TIMEOUT_S
        while self.done < total and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        elapsed = time.perf_counter() - t0
        unanswered = total - self.done
        if unanswered:
            self.errors += unanswered
            self.failures["no answer"] = self.failures.get("no answer", 0) + unanswered
        lat = sorted(self.latencies_us)
        late = sorted(self.late_s)

        def pct(values: list[float], q: float) -> float:
            return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")

        return {"requests": total, "duration_s": elapsed, "errors": self.errors, "shed": self.shed,
                "failures": self.failures, "p50_us": pct(lat, 50), "p99_us": pct(lat, 99),
                "late_p99_ms": pct(late, 99) * 1000, "late_max_ms": (late[-1] * 1000 if late else float("nan"))}


def run(url: str, body: str, rate: float, duration_s: float, headers_json: str, connections: int) -> None:
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    gen = _Generator(url, body.encode(), json.loads(headers_json), rate, duration_s, connections)
    print("RESULT " + json.dumps(asyncio.run(gen.run())), flush=True)


if __name__ == "__main__":
    url_, body_, rate_, dur_, hdrs_, conns_ = sys.argv[1:7]
    run(url_, body_, float(rate_), float(dur_), hdrs_, int(conns_))
