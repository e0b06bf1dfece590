"""Issue #30 (1): a burst fills every lane and every queue slot before anything is refused.

A real engine process with 2 lanes and a queue of 2 (so 4 open requests), hit with 12 long streams at once:
over its own HTTP API, and over the bus through an in-process gateway whose booking must agree with the
engine's count. Exactly 4 are taken and 8 answered 429 queue_full with Retry-After; `/slots` never shows a
free lane while a request of the burst was refused. Then a burst at a full engine, and one interleaved with
finishing requests.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from tests.conftest import LONG_GENERATION_TOKENS
from tests.faults.client import Result, chat_body, post
from tests.faults.conftest import engine_proc, gateway_in_process, procs, wait_until

LANES, PENDING = 2, 2
BURST = 12


async def _slots(http: aiohttp.ClientSession, engine_url: str) -> dict:  # type: ignore[type-arg]
    async with http.get(engine_url + "/slots") as resp:
        assert resp.status == 200
        return await resp.json()  # type: ignore[no-any-return]


async def _burst(http: aiohttp.ClientSession, engine_url: str, url: str, auth: dict[str, str], n: int, tag: str,
                 max_tokens: int = LONG_GENERATION_TOKENS) -> tuple[list[asyncio.Task[Result]], list[Result]]:
    """``n`` streams at once: (the tasks still open, the refusals), once every request is accounted for:
    refused, streaming its answer, or waiting in the engine's queue (``/slots``)."""
    started: asyncio.Queue[int] = asyncio.Queue()

    def first_text(result: Result) -> None:
        if result.texts == 1:
            started.put_nowait(1)

    already_waiting = (await _slots(http, engine_url))["requests_waiting"]  # from before this burst
    tasks = [asyncio.create_task(post(http, url, chat_body(max_tokens, True, f"{tag} {i}"), auth,
                                      on_text=first_text, timeout_s=300)) for i in range(n)]
    refused: list[Result] = []
    async with asyncio.timeout(120):
        while True:
            await asyncio.sleep(0.05)
            refused = [t.result() for t in tasks if t.done() and t.result().status == 429]
            waiting = (await _slots(http, engine_url))["requests_waiting"] - already_waiting
            if len(refused) + started.qsize() + waiting >= n:
                break
    return [t for t in tasks if not (t.done() and t.result().status == 429)], refused


async def _cancel(tasks: list[asyncio.Task[Result]]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


def _check_refusals(refused: list[Result]) -> None:
    assert all(r.body["error"]["code"] == "queue_full" and r.body["error"]["type"] == "rate_limit_error"
               and r.retry_after for r in refused), [r.body for r in refused]


async def test_a_burst_takes_every_lane_and_queue_slot_over_http_and_through_the_gateway(
        nats_server, long_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with procs() as started:
        engine = engine_proc(long_model, nats_server.url, "e1", tmp_path / "e1", "--max-concurrency", str(LANES),
                             "--max-pending-requests", str(PENDING))
        started.append(engine)
        await engine.start()
        engine_url = engine.url
        async with gateway_in_process(nats_server.url, tmp_path / "gw") as g, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            await wait_until(lambda: "e1" in g.gateway.fleet.bus_workers("tiny"), 20)

            # 1. at an idle engine, over its own HTTP API: 4 taken (2 running, 2 waiting), 8 refused
            streaming, refused = await _burst(http, engine_url, engine_url + "/v1/chat/completions", {}, BURST,
                                              "http")
            assert (len(streaming), len(refused)) == (LANES + PENDING, BURST - LANES - PENDING)
            _check_refusals(refused)
            slots = await _slots(http, engine_url)
            assert all(s["busy"] for s in slots["slots"]), slots  # no free lane while the burst was refused
            assert (slots["requests_processing"], slots["requests_waiting"]) == (LANES, PENDING)

            # 2. at a full engine: everything is refused at once, nothing is lost from the running ones
            more, refused_full = await _burst(http, engine_url, engine_url + "/v1/chat/completions", {}, 4,
                                                "full")
            assert (len(more), len(refused_full)) == (0, 4)
            _check_refusals(refused_full)
            await _cancel(streaming)

            async def idle() -> bool:
                s = await _slots(http, engine_url)
                return s["requests_processing"] == 0 and s["requests_waiting"] == 0
            async with asyncio.timeout(60):
                while not await idle():
                    await asyncio.sleep(0.1)

            # 3. through the gateway, over the bus: the same arithmetic, and the gateway's booking agrees
            url = g.url + "/v1/chat/completions"
            streaming, refused = await _burst(http, engine_url, url, g.auth, BURST, "bus")
            assert (len(streaming), len(refused)) == (LANES + PENDING, BURST - LANES - PENDING)
            _check_refusals(refused)
            assert all(s["busy"] for s in (await _slots(http, engine_url))["slots"])
            rec = g.gateway.fleet.record("e1")

            def booked_matches() -> bool:  # every refusal un-booked, every admission counted by the engine
                admitted = g.gateway.fleet.admitted("e1")
                return admitted is not None and rec.routed_total - admitted == 0
            await wait_until(booked_matches, 10)
            assert rec.in_flight == LANES + PENDING

            # 4. interleaved with finishing requests: short ones finish and free their places for the next
            await _cancel(streaming)
            async with asyncio.timeout(60):
                while not await idle():
                    await asyncio.sleep(0.1)
            shorts = [asyncio.create_task(post(http, url, chat_body(4, False, f"short {i}"), g.auth, timeout_s=120))
                      for i in range(LANES + PENDING)]
            results = await asyncio.gather(*shorts)
            assert all(r.status == 200 for r in results), [r.body for r in results]
            await wait_until(booked_matches, 10)
            assert rec.in_flight == 0
