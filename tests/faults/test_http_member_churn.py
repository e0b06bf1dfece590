"""Churn on HTTP members: json and streams at once through the gateway, a third of the streams dropped by
their clients halfway. Every answer that completes must be the member's, whole (the upstream connections
are reused: one handed back with an answer half read would give the next request someone else's bytes),
nothing may be logged as an error, and no connection may be left busy."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import aiohttp
import pytest

from tests.integration.conftest import wait_for
from tests.integration.test_gateway_failover import gateway_over

DURATION_S = 3.0
CLIENTS = 24


async def test_dropped_streams_never_leak_into_other_answers(nats_server, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING)
    counts = {"json": 0, "stream": 0, "dropped": 0}
    bad: list[str] = []
    async with gateway_over(nats_server, tmp_path, ["ok"]) as s, aiohttp.ClientSession() as http:
        auth = {"Authorization": f"Bearer {s.gateway.bootstrap[1]}"}  # type: ignore[index]
        deadline = time.monotonic() + DURATION_S

        async def client(i: int) -> None:
            rng = random.Random(i)
            while time.monotonic() < deadline:
                stream = rng.random() < 0.6
                body = {"model": "m", "messages": [{"role": "user", "content": f"client {i}"}], "stream": stream}
                async with http.post(s.url + "/v1/chat/completions", json=body, headers=auth) as resp:
                    if not stream:
                        answer = await resp.json()
                        if resp.status != 200 or answer["choices"][0]["message"]["content"] != "hello":
                            bad.append(f"json {resp.status}: {answer}")
                        counts["json"] += 1
                    elif rng.random() < 0.35:
                        await resp.content.read(60)  # part of the first event, then gone
                        resp.close()
                        counts["dropped"] += 1
                    else:
                        raw = (await resp.read()).decode()
                        events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
                        text = "".join((json.loads(e)["choices"] or [{}])[0].get("delta", {}).get("content") or ""
                                       for e in events if e != "[DONE]")
                        if resp.status != 200 or text != "hello wörld" or events[-1] != "[DONE]":
                            bad.append(f"stream {resp.status}: {raw[:200]!r}")
                        counts["stream"] += 1

        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
        assert not bad, bad[:3]
        assert counts["json"] > 50 and counts["stream"] > 50 and counts["dropped"] > 20, counts
        # every connection handed back or closed, once the dropped ones' handlers have finished
        await wait_for(lambda: not s.gateway.http.client._busy, timeout_s=10)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[:3]


pytestmark = pytest.mark.slow
