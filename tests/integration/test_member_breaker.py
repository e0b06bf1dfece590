"""A member that fails after the first byte is cooled down by its circuit breaker and recovers (issue #24):
real gateway, real nats-server, OpenAI-shaped members on loopback, the official client."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from proto import pools as pool_config
from services.gateway import breaker
from tests.integration.test_gateway_failover import gateway_over


async def _stream(api: openai.AsyncOpenAI) -> str:
    text = ""
    stream = await api.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    return text


async def _backend(url: str, key: str, member_id: str) -> dict:  # type: ignore[type-arg]
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json"}
    async with aiohttp.ClientSession() as http, http.get(url + "/backends", headers=headers) as resp:
        assert resp.status == 200
        rows = (await resp.json())["members"]
    return next(r for r in rows if r["member_id"] == member_id)


async def test_a_member_breaking_streams_after_the_first_byte_is_cooled_down_and_recovers(
        nats_server, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(breaker, "BASE_COOLDOWN_S", 1.0)
    async with gateway_over(nats_server, tmp_path, ["cut", "ok"]) as s:
        bad, good = s.members
        bad_id = pool_config.member_id_for(bad.url)
        assert s.gateway.bootstrap is not None
        key = s.gateway.bootstrap[1]
        with pytest.raises((openai.APIError, aiohttp.ClientError, Exception)):
            await _stream(s.api)  # the bigger member first; it cuts the stream mid-answer
        assert bad.hits == 1
        for _ in range(6):  # while its breaker is open, every request goes to the other
            assert await _stream(s.api) == "hello wörld"
        assert (bad.hits, good.hits) == (1, 6)
        row = await _backend(s.url, key, bad_id)
        assert row["breaker"]["state"] == "open" and row["breaker"]["last_failure"] == "after_first_byte"
        assert row["down"] is True
        async with aiohttp.ClientSession() as http, http.get(s.url + "/metrics") as resp:
            metrics = await resp.text()
        assert f'llmgw_member_breaker_state{{pool="m",member="{bad_id}"}} 2' in metrics

        await asyncio.sleep(1.1)  # half-open: one probe; it still cuts, so twice the cooldown
        with pytest.raises(Exception):
            await _stream(s.api)
        assert bad.hits == 2
        row = await _backend(s.url, key, bad_id)
        assert row["breaker"]["consecutive_failures"] == 2 and 1.0 < row["breaker"]["open_for_s"] <= 2.0
        await _stream(s.api)
        assert bad.hits == 2  # still cooling down

        bad.mode = "ok"  # fixed: the next probe succeeds and closes the breaker
        await asyncio.sleep(2.1)
        assert await _stream(s.api) == "hello wörld"
        assert bad.hits == 3
        row = await _backend(s.url, key, bad_id)
        assert row["breaker"]["state"] == "closed" and row["down"] is False
        for _ in range(8):
            await _stream(s.api)
        assert bad.hits > 3  # back in the rotation
