"""Capacity weights mean what operators expect (issue #24): through a real gateway, 3:1 weights split 400
requests 75 ± 5 % while both members have free lanes, sequentially and concurrently."""

from __future__ import annotations

import asyncio
import contextlib

import openai
import pytest

from proto import pools as pool_config
from services.common.bus import connect, ensure_bus
from services.common.http import serving
from services.gateway.service import GatewayConfig, GatewayService
from tests.integration.test_gateway_failover import Member


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_weights_3_to_1_give_75_percent_of_400_requests(nats_server, tmp_path, concurrency: int) -> None:  # type: ignore[no-untyped-def]
    async with contextlib.AsyncExitStack() as es:
        big, small = Member(), Member()
        for m in (big, small):
            m.url = await es.enter_async_context(serving(m.app(), "127.0.0.1", 0))
        nc = await connect(nats_server.url, "gateway")
        es.push_async_callback(nc.close)
        await ensure_bus(nc)
        config = pool_config.parse({"model_pools": {"m": {"members": [
            {"model_id": "m", "backend": small.url, "capacity_weight": 1},
            {"model_id": "m", "backend": big.url, "capacity_weight": 3}]}}})
        gateway = GatewayService(nc, GatewayConfig(gateway_id="gww", port=0, data_dir=tmp_path), config)
        await es.enter_async_context(gateway.running())
        url = await es.enter_async_context(serving(gateway.app(), "127.0.0.1", 0))
        assert gateway.bootstrap is not None
        api = openai.AsyncOpenAI(base_url=url + "/v1", api_key=gateway.bootstrap[1], max_retries=0)
        es.push_async_callback(api.close)
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await api.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
        await asyncio.gather(*(one(i) for i in range(400)))
        assert big.hits + small.hits == 400
        assert 0.70 <= big.hits / 400 <= 0.80, (big.hits, small.hits)
