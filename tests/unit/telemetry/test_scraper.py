"""The scraper against loopback HTTP servers answering as the engines do: detection of llama.cpp without
``/slots`` and of SGLang's server info, and each request's deadline and single retry (docs/telemetry.md)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from services.common.http import serving
from services.telemetry.probe import Member
from services.telemetry.scraper import Knowledge, ScrapeError, Scraper
from tests.unit.telemetry import samples

TIMEOUT_S = 0.3
Answer = Callable[[web.Request], Any]  # an async handler


def text(body: str, status: int = 200) -> Answer:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=body, status=status, content_type="text/plain")
    return handler


def js(body: Any, status: int = 200) -> Answer:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)
    return handler


async def hang(request: web.Request) -> web.Response:
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


async def drop(request: web.Request) -> web.Response:
    assert request.transport is not None
    request.transport.close()  # the connection goes away mid-request: the client sees a disconnect
    await asyncio.sleep(3600)
    raise AssertionError("unreachable")


class Fake:
    """Answers each path with its list of handlers in turn (the last one repeats); 404 for the rest."""

    def __init__(self, routes: dict[str, list[Answer]]) -> None:
        self.routes = routes
        self.hits: collections.Counter[str] = collections.Counter()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        answers = self.routes.get(request.path)
        n = self.hits[request.path]
        self.hits[request.path] += 1
        if not answers:
            return web.json_response({"detail": "Not Found"}, status=404)
        return await answers[min(n, len(answers) - 1)](request)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self.handle)
        return app


@contextlib.asynccontextmanager
async def scraping(fake: Fake) -> AsyncIterator[tuple[Scraper, Member]]:
    async with serving(fake.app(), "127.0.0.1", 0) as url, aiohttp.ClientSession() as http:
        yield Scraper(http, TIMEOUT_S), Member("m", url)


VLLM = {"/metrics": [text(samples.VLLM_METRICS)], "/v1/models": [js(samples.VLLM_MODELS)]}


# aiohttp itself re-sends a GET once when the server drops the connection (RFC 9112 §9.3.1), so a
# connection error reaches the scraper only when the server drops it twice in a row.
@pytest.mark.parametrize("failures", [[js({"error": "busy"}, status=503)], [hang], [drop, drop]],
                         ids=["5xx", "timeout", "connection-dropped"])
async def test_a_request_that_fails_once_is_asked_again_within_the_scrape_and_the_scrape_succeeds(
        failures: list[Answer]) -> None:
    fake = Fake({**VLLM, "/metrics": [*failures, text(samples.VLLM_METRICS)]})
    async with scraping(fake) as (scraper, member):
        reading, known = await scraper.scrape(member, Knowledge())
    assert (known.kind, reading.running, reading.waiting) == ("vllm", 3, 2)
    assert fake.hits["/metrics"] == len(failures) + 1 and scraper.retries_total["m"] == 1


async def test_a_request_that_never_answers_fails_the_scrape_after_two_deadlines() -> None:
    fake = Fake({**VLLM, "/metrics": [hang]})
    async with scraping(fake) as (scraper, member):
        started = time.monotonic()
        with pytest.raises(ScrapeError) as err:
            await scraper.scrape(member, Knowledge("vllm"))
        elapsed = time.monotonic() - started
    assert err.value.is_transport and err.value.endpoint == "/metrics"
    assert fake.hits["/metrics"] == 2 and scraper.retries_total["m"] == 1
    assert 2 * TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + 1.0  # one deadline per attempt, not one per scrape


async def test_an_endpoint_that_hangs_at_detection_fails_the_scrape_instead_of_reading_as_absent() -> None:
    fake = Fake({**VLLM, "/slots": [hang]})
    async with scraping(fake) as (scraper, member):
        with pytest.raises(ScrapeError) as err:
            await scraper.scrape(member, Knowledge())
    assert err.value.endpoint == "/slots" and fake.hits["/metrics"] == 0


async def test_4xx_and_501_answers_are_not_retried() -> None:
    fake = Fake({**VLLM, "/slots": [js(samples.LLAMACPP_SLOTS_OFF, status=501)]})
    async with scraping(fake) as (scraper, member):
        _, known = await scraper.scrape(member, Knowledge())
    assert known.kind == "vllm"
    # 501 once; /props is not asked of a member whose /metrics says vLLM
    assert (fake.hits["/slots"], fake.hits["/props"], scraper.retries_total["m"]) == (1, 0, 0)


async def test_a_no_slots_llamacpp_with_metrics_is_detected_with_lanes_from_props() -> None:
    fake = Fake({"/slots": [js(samples.LLAMACPP_SLOTS_OFF, status=501)], "/metrics": [text(samples.LLAMACPP_METRICS)],
                 "/props": [js(samples.llamacpp_props(total_slots=4, n_ctx=8192))],
                 "/v1/models": [js(samples.LLAMACPP_MODELS)]})
    async with scraping(fake) as (scraper, member):
        reading, known = await scraper.scrape(member, Knowledge())
        assert (known.kind, known.has_slots, known.has_metrics) == ("llamacpp", False, True)
        assert (reading.lanes, reading.running, reading.waiting, reading.max_context) == (4, 1, 2, 8192)
        assert reading.signal_sources["lanes"] == "/props" and reading.signal_sources["running"] == "/metrics"
        before = dict(fake.hits)
        again, _ = await scraper.scrape(member, known)
    assert again.lanes == 4  # /props is read once, at detection
    assert {p: fake.hits[p] - before.get(p, 0) for p in fake.hits} == {"/slots": 0, "/metrics": 1, "/props": 0,
                                                                      "/v1/models": 0}


async def test_a_llamacpp_answering_neither_slots_nor_metrics_is_known_by_props_and_probed_by_it() -> None:
    fake = Fake({"/slots": [js(samples.LLAMACPP_SLOTS_OFF, status=501)],
                 "/metrics": [js(samples.LLAMACPP_METRICS_OFF, status=501)],
                 "/props": [js(samples.llamacpp_props(total_slots=2, n_ctx=4096)), js({}, status=500)],
                 "/v1/models": [js(samples.LLAMACPP_MODELS)], "/health": [js({"status": "ok"})]})
    async with scraping(fake) as (scraper, member):
        reading, known = await scraper.scrape(member, Knowledge())
        assert (known.kind, reading.lanes, reading.running, reading.max_context) == ("llamacpp", 2, None, 4096)
        with pytest.raises(ScrapeError) as err:  # afterwards /props is the probe: a failing one fails the scrape
            await scraper.scrape(member, known)
    assert err.value.endpoint == "/props" and fake.hits["/props"] == 1 + 2  # detection, then the try and its retry


@pytest.mark.parametrize(("routes", "source"), [
    ({"/server_info": [js(samples.sglang_server_info(max_running_per_dp=(48,)))]}, "/server_info"),
    ({"/get_server_info": [js(samples.sglang_server_info(max_running_per_dp=(48,)))]}, "/get_server_info"),
])
async def test_sglang_lanes_come_from_its_server_info_at_either_path(routes: dict[str, list[Answer]],
                                                                      source: str) -> None:
    fake = Fake({"/metrics": [text(samples.SGLANG_METRICS)], "/v1/models": [js({"object": "list", "data": [
        {"id": "meta-llama/Llama-3.1-8B-Instruct", "object": "model", "max_model_len": 131072}]})], **routes})
    async with scraping(fake) as (scraper, member):
        reading, known = await scraper.scrape(member, Knowledge())
        assert (known.kind, reading.lanes, reading.signal_sources["lanes"]) == ("sglang", 48, source)
        assert (reading.max_context, reading.signal_sources["max_context"]) == (131072, "/v1/models")
        again, _ = await scraper.scrape(member, known)
    assert again.lanes == 48 and fake.hits[source] == 1  # read at detection only


def test_the_fake_bodies_are_json_as_the_engines_send_them() -> None:
    for body in (samples.LLAMACPP_SLOTS_OFF, samples.llamacpp_props(), samples.sglang_server_info()):
        assert json.loads(json.dumps(body)) == body
