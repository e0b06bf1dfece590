"""Member credentials (issue #24, deliverable 3): a member started with ``--api-key`` serves through the gateway.

Real processes on loopback: our engine's HTTP service with ``api_key`` set (it answers a bad key 401, as
vLLM's ``--api-key`` middleware does), a keyless second engine to fail over to, the gateway with the
official ``openai`` client, and telemetry scraping a vLLM-shaped server that records what it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from proto import pools as pool_config
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.common.nats_server import EmbeddedNatsServer
from services.engine.config import EngineConfig
from services.engine.engine_core import EngineCore
from services.engine.serve.async_engine import AsyncEngine
from services.engine.serve.energy import UnavailableMeter
from services.engine.serve.http import EngineService, ServeConfig, http_site
from services.gateway.service import GatewayConfig, GatewayService
from services.telemetry.probe import Member
from services.telemetry.service import TelemetryConfig, TelemetryService
from tests.integration.conftest import wait_for

SECRET = "sk-member-secret-4f1c9a"  # the key the keyed engine wants
ENV = "LLMGW_TEST_MEMBER_KEY"


@dataclass
class Gateway:
    api: openai.AsyncOpenAI
    session: aiohttp.ClientSession
    base_url: str
    service: GatewayService
    keyed_id: str


@contextlib.asynccontextmanager
async def _gateway(nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path, key: str | None,
                   with_spare: bool) -> AsyncIterator[Gateway]:
    """The keyed engine first in the pool (its id sorts first), a keyless spare second when ``with_spare``."""
    async with contextlib.AsyncExitStack() as es:
        nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(nc.drain)
        await ensure_bus(nc)
        urls = []
        for api_key in (SECRET, None)[: 2 if with_spare else 1]:
            core = EngineCore(EngineConfig(model_path=tiny_model, model_id="tiny", kv_capacity_tokens=4096,
                                           max_concurrency=2, max_pending_requests=8))
            engine = await es.enter_async_context(AsyncEngine(core))
            service = EngineService(engine, UnavailableMeter("cpu", "test"), ServeConfig(port=0, api_key=api_key))
            urls.append(await es.enter_async_context(http_site(service)))
        members: list[dict[str, Any]] = [{"id": "a-keyed", "model_id": "tiny", "backend": urls[0]}]
        if key is not None:
            members[0]["api_key_env"] = ENV
        if with_spare:
            members.append({"id": "b-spare", "model_id": "tiny", "backend": urls[1]})
        config_path = tmp_path / "pools.json"
        config_path.write_text(json.dumps({"model_pools": {"tiny": {"members": members, "cache_affinity": False}}}))
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gw1", port=0, data_dir=tmp_path,
                                                   config_path=config_path, first_chunk_timeout_s=5.0),
                                 pool_config.load(config_path))
        await es.enter_async_context(gateway.running())
        base_url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        assert gateway.bootstrap is not None
        admin_key = gateway.bootstrap[1]
        api = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=admin_key, max_retries=0)
        es.push_async_callback(api.close)
        session = await es.enter_async_context(aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin_key}"}))
        yield Gateway(api, session, base_url, gateway, "a-keyed")


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_a_member_with_api_key_serves_json_and_streams_and_the_key_shows_nowhere(
        nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(ENV, SECRET)
    caplog.set_level(logging.DEBUG)
    async with _gateway(nats_server, tiny_model, tmp_path, SECRET, with_spare=False) as gw:
        answer = await gw.api.chat.completions.with_raw_response.create(
            model="tiny", messages=_user("hello"), max_tokens=4)
        assert answer.status_code == 200
        assert answer.parse().choices[0].message.content is not None
        stream = await gw.api.chat.completions.create(model="tiny", messages=_user("hi"), max_tokens=4, stream=True)
        chunks = [c async for c in stream]
        assert chunks and any(c.choices and c.choices[0].finish_reason for c in chunks)
        bodies = []
        for path in ("/backends", "/admin/config/page", "/metrics"):
            async with gw.session.get(gw.base_url + path) as resp:
                assert resp.status == 200, path
                bodies.append(await resp.text())
        bodies.append(json.dumps(gw.service.backends_view(), default=str))
        bodies.append(repr(gw.service.pools_file.file_config))
        assert all(SECRET not in body for body in bodies)
        assert ENV in gw.service.pools_file.config_dict()["model_pools"]["tiny"]["members"][0]["api_key_env"]
    records = [r.getMessage() for r in caplog.records]
    assert records and all(SECRET not in line for line in records)


async def test_a_wrong_member_key_fails_over_to_the_next_member(
        nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "sk-wrong")
    async with _gateway(nats_server, tiny_model, tmp_path, "sk-wrong", with_spare=True) as gw:
        for _ in range(2):  # the first try hits the keyed member (ranked first), the second finds it down
            answer = await gw.api.chat.completions.with_raw_response.create(
                model="tiny", messages=_user("hello"), max_tokens=4)
            assert answer.status_code == 200
        assert gw.service.metrics.failovers["a-keyed"] >= 1
        assert gw.service.fleet.is_down("a-keyed", time.time())


@pytest.mark.parametrize("key", ["sk-wrong", None], ids=["wrong key", "no key"])
async def test_a_member_alone_that_rejects_the_gateways_key_is_a_502_naming_the_member_not_a_401(
        nats_server: EmbeddedNatsServer, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        key: str | None) -> None:
    if key is not None:
        monkeypatch.setenv(ENV, key)
    async with _gateway(nats_server, tiny_model, tmp_path, key, with_spare=False) as gw:
        with pytest.raises(openai.InternalServerError) as caught:
            await gw.api.chat.completions.create(model="tiny", messages=_user("hello"), max_tokens=4)
        assert caught.value.status_code == 502
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["code"] == "member_credentials_rejected"
        assert "'a-keyed' rejected the gateway's credentials (HTTP 401)" in error["message"]
        assert ("api_key_env" in error["message"]) and (ENV in error["message"]) == (key is not None)
        assert SECRET not in error["message"] and "sk-wrong" not in error["message"]


async def test_telemetry_sends_the_members_key_on_every_scrape_request(nats_server: EmbeddedNatsServer) -> None:
    seen: list[tuple[str, str | None]] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization")))
        if request.path == "/metrics":  # vLLM-shaped
            return web.Response(text="# TYPE vllm:num_requests_running gauge\n"
                                     'vllm:num_requests_running{model_name="tiny"} 0\n'
                                     "# TYPE vllm:num_requests_waiting gauge\n"
                                     'vllm:num_requests_waiting{model_name="tiny"} 0\n')
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    async with contextlib.AsyncExitStack() as es:
        url = await es.enter_async_context(serving(app, "127.0.0.1", 0))
        nc = await connect(nats_server.url, "telemetry")
        es.push_async_callback(nc.drain)
        await ensure_bus(nc)
        telemetry = TelemetryService(nc, TelemetryConfig(members=(Member("v1", url, api_key=SECRET),),
                                                         interval_s=0.1))
        assert SECRET not in repr(Member("v1", url, api_key=SECRET))
        task = asyncio.create_task(telemetry.run())
        try:
            await wait_for(lambda: {p for p, _ in seen} >= {"/slots", "/metrics"})
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    assert seen and all(auth == f"Bearer {SECRET}" for _, auth in seen)


async def test_telemetry_scrapes_with_a_new_key_once_the_pools_change_it(nats_server: EmbeddedNatsServer) -> None:
    seen: list[str | None] = []

    async def anything(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", anything)
    async with contextlib.AsyncExitStack() as es:
        url = await es.enter_async_context(serving(app, "127.0.0.1", 0))
        nc = await connect(nats_server.url, "telemetry")
        es.push_async_callback(nc.drain)
        await ensure_bus(nc)
        telemetry = TelemetryService(nc, TelemetryConfig(members=(), interval_s=0.1))
        task = asyncio.create_task(telemetry.run())
        try:
            await wait_for(lambda: telemetry._group is not None)
            telemetry.follow_pools([Member("p1", url, api_key="sk-old")])
            await wait_for(lambda: "Bearer sk-old" in seen)
            telemetry.follow_pools([Member("p1", url, api_key="sk-new")])
            await wait_for(lambda: "Bearer sk-new" in seen)
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    assert set(seen) == {"Bearer sk-old", "Bearer sk-new"}
