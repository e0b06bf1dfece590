"""Failover across HTTP members and usage that survives a bus outage (real nats-server, real aiohttp
members on loopback that answer like an OpenAI server, or fail the way real ones do)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from proto import UsageRecord, decode, subjects
from proto import pools as pool_config
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.conftest import wait_for


@dataclass
class Member:
    """An OpenAI-shaped fixture server whose chat answer is ``mode``: ok, 500, 429, 408, cut (the status
    line and part of the body, then the connection dropped) or hold (a stream that waits after its first
    events until ``release`` is set)."""

    mode: str = "ok"
    hits: int = 0
    url: str = ""
    seen_paths: list[str] = field(default_factory=list)
    bodies: list[dict] = field(default_factory=list)  # type: ignore[type-arg]
    release: asyncio.Event = field(default_factory=asyncio.Event)  # mode "hold": the stream's rest waits for it

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        body = await request.json()
        self.bodies.append(body)
        if body.get("stream"):
            return await self.stream(request, body)
        if self.mode == "cut":
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "400"})
            await resp.prepare(request)
            await resp.write(b'{"id": "c1", "object": "chat.completion", ')
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "408":
            return web.json_response({"error": {"message": "slow"}}, status=408)
        if self.mode == "429":
            return web.json_response({"error": {"message": "queue full", "code": "queue_full"}}, status=429,
                                     headers={"Retry-After": "7"})
        return web.json_response({
            "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})

    async def stream(self, request: web.Request, body: dict) -> web.StreamResponse:  # type: ignore[type-arg]
        """An SSE answer written in awkward pieces: lines split across writes, CRLF line ends, the usage
        chunk the gateway asked for."""
        assert body["stream_options"]["include_usage"] is True  # the gateway always asks for usage
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        events += [{"choices": [{"index": 0, "delta": {"content": word}}]} for word in ["hel", "lo ", "wörld"]]
        events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
        common = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        wire = b"".join(b"data: " + json.dumps({**common, **e}).encode() + b"\r\n\r\n" for e in events)
        wire += b"data: [DONE]\n\n"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "cut":  # two events and half of the third, then gone
            cut_at = wire.index(b"rld")  # inside the third word's event
            await resp.write(wire[:cut_at])
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()
            return resp
        if self.mode == "hold":  # the first two events, then the rest once the test releases it
            held_at = wire.index(b"data: ", wire.index(b"hel"))
            await resp.write(wire[:held_at])
            await self.release.wait()
            await resp.write(wire[held_at:])
            await resp.write_eof()
            return resp
        for start in range(0, len(wire), 37):  # 37 bytes at a time: most pieces end mid-line
            await resp.write(wire[start:start + 37])
            await asyncio.sleep(0.001)
        await resp.write_eof()
        return resp

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app


@dataclass
class Setup:
    url: str
    gateway: GatewayService
    members: list[Member]
    api: openai.AsyncOpenAI


@contextlib.asynccontextmanager
async def gateway_over(nats_server: EmbeddedNatsServer, tmp_path: Path, modes: list[str],
                       weights: list[float] | None = None, **settings: Any) -> AsyncIterator[Setup]:
    """One pool over members answering in ``modes``; capacity weights ``weights`` (default 8, 7, ...)."""
    async with contextlib.AsyncExitStack() as es:
        members = [Member(mode) for mode in modes]
        for m in members:
            m.url = await es.enter_async_context(serving(m.app(), "127.0.0.1", 0))
        nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(nc.close)
        await ensure_bus(nc)
        config = pool_config.parse({"model_pools": {"m": {"members": [
            {"model_id": "m", "backend": m.url, "capacity_weight": weights[i] if weights else 8 - i}
            for i, m in enumerate(members)]}}})
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gwf", port=0, data_dir=tmp_path, **settings), config)
        await es.enter_async_context(gateway.running())
        url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        assert gateway.bootstrap is not None
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key=gateway.bootstrap[1], max_retries=0)
        es.push_async_callback(api.close)
        yield Setup(url, gateway, members, api)


def _ask(api: openai.AsyncOpenAI):  # type: ignore[no-untyped-def]
    return api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("failure", ["500", "408"])
async def test_a_failing_http_member_fails_over_before_the_first_byte(nats_server, tmp_path, failure) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, [failure, "ok"]) as s:
        reply = await _ask(s.api)  # the first member ranks first (bigger capacity) and fails
        assert reply.choices[0].message.content == "hello"
        assert [m.hits for m in s.members] == [1, 1]
        assert s.gateway.metrics.failovers[pool_config.member_id_for(s.members[0].url)] == 1
        await _ask(s.api)  # the failed member sits out a while: no second try on it
        assert [m.hits for m in s.members] == [1, 2]


async def test_429_tries_the_next_member_and_is_returned_only_when_all_are_busy(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["429", "ok"]) as s:
        reply = await _ask(s.api)
        assert reply.choices[0].message.content == "hello" and [m.hits for m in s.members] == [1, 1]
        s.members[1].mode = "429"
        with pytest.raises(openai.RateLimitError) as info:
            await _ask(s.api)
        assert info.value.response.headers["Retry-After"] == "7"  # the member's own advice
        assert [m.hits for m in s.members] == [2, 2]  # each member once; busy is not down


async def test_all_members_down_is_a_503_with_retry_after(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["500", "500"]) as s:
        with pytest.raises(openai.InternalServerError) as info:
            await _ask(s.api)
        assert info.value.status_code == 503 and info.value.response.headers["Retry-After"] == "5"


@pytest.mark.slow
async def test_usage_made_while_the_bus_is_down_is_spooled_and_delivered_later(tmp_path: Path) -> None:
    server = EmbeddedNatsServer(tmp_path / "nats")
    await server.start()
    try:
        async with gateway_over(server, tmp_path, ["ok"]) as s:
            await _ask(s.api)
            await wait_for(lambda: s.gateway.usage.usage_published == 1)
            port = int(server.url.rsplit(":", 1)[1])
            await server.stop()
            await wait_for(lambda: not s.gateway.nc.is_connected)
            for _ in range(5):  # HTTP members need no bus: serving goes on
                await _ask(s.api)
            await wait_for(lambda: s.gateway.spool.has_pending(), timeout_s=15)
            assert s.gateway.usage.usage_published == 1
            server.port = port  # same address and JetStream store: the gateway reconnects by itself
            await server.start()
            await wait_for(lambda: s.gateway.usage.usage_published == 6 and not s.gateway.spool.has_pending(),
                           timeout_s=30)
            reader = await connect(server.url, "reader")
            try:
                sub = await reader.jetstream().pull_subscribe(subjects.USAGE_SUBJECTS, stream=subjects.STREAM_USAGE)
                msgs = await sub.fetch(10, timeout=2)
                records = [decode(m.data, UsageRecord) for m in msgs]
                assert len(records) == 6 and len({r.request_id for r in records}) == 6  # none lost, none twice
                assert all(r.status == "ok" and r.output_tokens == 1 for r in records)
            finally:
                await reader.close()
    finally:
        await server.stop()


async def test_http_member_is_not_tried_for_a_bad_request(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["ok"]) as s, aiohttp.ClientSession() as http:
        async with http.post(s.url + "/v1/chat/completions", json={"model": "m", "messages": "nope"},
                             headers={"Authorization": f"Bearer {s.gateway.bootstrap[1]}"}) as r:  # type: ignore[index]
            assert r.status == 400
        assert s.members[0].hits == 0


async def test_an_http_members_stream_passes_through_minus_the_injected_usage(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["ok"]) as s:
        stream = await s.api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     stream=True)
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello wörld"
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.usage is None for c in chunks)  # the client did not ask: the usage chunk was stripped
        stream = await s.api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                     stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        await wait_for(lambda: s.gateway.usage.usage_published == 2)  # usage recorded either way


async def test_parameters_our_engines_lack_still_reach_an_http_member_as_sent(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["ok"]) as s:
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        reply = await s.api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    tools=tools, tool_choice="auto")  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "hello"
        assert s.members[0].bodies[-1]["tools"] == tools and s.members[0].bodies[-1]["tool_choice"] == "auto"


async def test_a_member_that_drops_a_json_answer_halfway_fails_over(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["cut", "ok"]) as s:
        reply = await _ask(s.api)  # nothing had reached the client: the next member answers it whole
        assert reply.choices[0].message.content == "hello"
        assert [m.hits for m in s.members] == [1, 1]
        assert s.gateway.metrics.failovers[pool_config.member_id_for(s.members[0].url)] == 1


async def test_a_stream_the_member_drops_ends_with_an_error_event_and_is_recorded_as_an_error(  # type: ignore[no-untyped-def]
        nats_server, tmp_path) -> None:
    async with gateway_over(nats_server, tmp_path, ["cut"]) as s:
        reader = await connect(nats_server.url, "usage-reader")
        try:
            sub = await reader.subscribe(subjects.USAGE_SUBJECTS)
            stream = await s.api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                         stream=True)
            text = ""
            with pytest.raises(openai.APIError, match="broke off"):  # the SDK raises on the error event
                async for chunk in stream:
                    text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
            assert text == "hello "  # what had come through before the member went away
            record = decode((await sub.next_msg(timeout=5)).data, UsageRecord)
            assert (record.status, record.http_status, record.error_code) == ("error", 502, "upstream_error")
        finally:
            await reader.close()


async def test_the_session_pin_is_written_at_the_first_byte_not_after_the_answer(nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # issue #29: recorded only after the whole answer, a tenant's next requests did not know for the seconds a
    # long answer takes where its prefix was
    async with gateway_over(nats_server, tmp_path, ["hold", "ok"]) as s:
        held = s.members[0]
        stream = await s.api.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True,
            extra_headers={"X-Session-Id": "tenant-1"})
        chunks = aiter(stream)
        first = await anext(chunks)
        assert first.choices[0].delta.role == "assistant"
        member_id = pool_config.member_id_for(held.url)
        assert s.gateway.router.pins.get("tenant-1", time.time()) == member_id  # still streaming
        held.release.set()
        text = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        assert text == "hello wörld"


async def test_past_its_in_flight_limit_the_gateway_answers_503_at_once_and_serves_again_after(
        nats_server, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # issue #31: overload is answered, not timed out
    async with gateway_over(nats_server, tmp_path, ["hold"], max_in_flight=2) as s:
        held = [await s.api.chat.completions.create(model="m", messages=[{"role": "user", "content": f"h{i}"}],
                                                    stream=True) for i in range(2)]
        for stream in held:
            await anext(aiter(stream))  # both open, streaming
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            await _ask(s.api)
        assert time.monotonic() - started < 1.0
        err = info.value
        assert err.status_code == 503 and err.response.headers["Retry-After"] == "1"
        assert err.body["code"] == "gateway_overloaded"  # type: ignore[index]
        async with aiohttp.ClientSession() as http:
            async with http.get(s.url + "/health") as health:
                assert health.status == 200  # health and metrics are never shed
            async with http.get(s.url + "/metrics") as resp:
                metrics = await resp.text()
        assert 'llmgw_shed_requests_total{reason="in_flight"} 1' in metrics and "llmgw_gateway_in_flight 2" in metrics
        s.members[0].release.set()
        for stream in held:
            async for _ in stream:
                pass
        s.members[0].mode = "ok"
        assert (await _ask(s.api)).choices[0].message.content == "hello"
