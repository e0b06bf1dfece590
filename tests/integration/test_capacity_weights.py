"""Capacity weights mean what operators expect (issue #24): through a real gateway, 3:1 weights split 400
requests 75 ± 5 % while both members have free lanes, sequentially and concurrently."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.test_gateway_failover import gateway_over


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_weights_3_to_1_give_75_percent_of_400_requests(nats_server, tmp_path, concurrency: int) -> None:  # type: ignore[no-untyped-def]
    async with gateway_over(nats_server, tmp_path, ["ok", "ok"], weights=[1, 3]) as s:
        small, big = s.members
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await s.api.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q{i}"}])
        await asyncio.gather(*(one(i) for i in range(400)))
        assert big.hits + small.hits == 400
        assert 0.70 <= big.hits / 400 <= 0.80, (big.hits, small.hits)
