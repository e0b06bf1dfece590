"""Issue #12 (2): the nats-server restarts while traffic flows.

A real engine process and the gateway (in process) on a real nats-server that is stopped for a while and
started again on the same port with the same JetStream store. Nothing reconnects by hand.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from services.common.nats_server import EmbeddedNatsServer
from tests.conftest import LONG_GENERATION_TOKENS
from tests.faults.client import Result, chat_body, keep_posting, post
from tests.faults.conftest import engine_proc, gateway_in_process, procs, read_usage, wait_until

HEARTBEAT_S = 0.25
OUTAGE_S = 2.0
CLIENT_TIMEOUT_S = 10.0


@pytest.mark.slow
async def test_a_nats_restart_costs_fast_503s_only_and_loses_no_usage_record(long_model, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="services.gateway.service")
    server = EmbeddedNatsServer(tmp_path / "nats")
    await server.start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with procs() as started:
            engine = engine_proc(long_model, server.url, "e1", tmp_path / "e1",
                                 "--heartbeat-interval", str(HEARTBEAT_S))
            started.append(engine)
            await engine.start()
            async with gateway_in_process(server.url, tmp_path / "gw", stale_after_s=2 * HEARTBEAT_S) as g, \
                    aiohttp.ClientSession() as http:
                gw = g.gateway
                await wait_until(lambda: "e1" in gw.fleet.bus_workers("tiny"), 20)
                url = g.url + "/v1/chat/completions"
                sent: list[tuple[float, Result]] = []
                stop = asyncio.Event()
                clients = [asyncio.create_task(keep_posting(http, url, g.auth, f"c{i}", sent, stop, 0.05,
                                                            timeout_s=CLIENT_TIMEOUT_S)) for i in range(3)]
                long_body = chat_body(LONG_GENERATION_TOKENS, True, "long")
                long_stream = asyncio.create_task(post(http, url, long_body, g.auth))
                await wait_until(lambda: sum(r.status == 200 for _, r in sent) >= 10, 20)
                await asyncio.sleep(0.5)  # the long stream is streaming now

                await server.stop()
                down_at = time.monotonic()
                streamed = await long_stream
                stream_end_s = time.monotonic() - down_at
                await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
                server.port = port
                await server.start()
                up_at = time.monotonic()
                await wait_until(lambda: gw.nc.is_connected, 15, what="gateway reconnected")
                reconnect_s = time.monotonic() - up_at
                await wait_until(lambda: any(t0 > up_at and r.status == 200 for t0, r in sent), 15,
                                 what="first success after the restart")
                recovered_s = min(t0 + r.elapsed_s for t0, r in sent if t0 > up_at and r.status == 200) - up_at
                await asyncio.sleep(0.5)
                stop.set()
                await asyncio.gather(*clients)

                during = [r for t0, r in sent if down_at <= t0 < up_at]
                assert during, "requests were sent during the outage"
                # during the outage: 503 + Retry-After at once, never a hang up to the client's timeout
                assert all(r.status == 503 and r.retry_after for r in during), {r.status for r in during}
                refused = [r for _, r in sent if r.status != 200]
                assert all(r.status == 503 and r.retry_after for r in refused), [(r.status, r.body) for r in refused]
                # a request the engine was answering when the bus went away is "upstream_lost"; every other
                # one found no engine to take it
                in_flight = [r for t0, r in sent if t0 < down_at < t0 + r.elapsed_s and r.status != 200]
                codes = [r.body["error"]["code"] for r in refused]
                assert codes.count("upstream_lost") <= len(in_flight), [(r.status, r.body) for r in refused]
                assert set(codes) <= {"no_backend_available", "upstream_lost"}, codes
                slowest_503_s = max(r.elapsed_s for r in refused)
                assert slowest_503_s < 1.0
                # the stream that was running ends with a clean error event within the staleness threshold
                assert streamed.status == 200 and streamed.done and streamed.texts > 0
                assert streamed.error_event is not None and stream_end_s < 2 * HEARTBEAT_S + 1.0
                # recovery is measured and printed (about 0.8 s on a quiet machine); the bound only catches a
                # stack that does not come back: a reconnect attempt may wait out nats-py's 2 s connect
                # timeout while the restarted server is still starting on a loaded CI machine (seen: 3.0 s)
                assert recovered_s < 10.0
                # every request made one usage record, and every one reached the stream exactly once
                total = len(sent) + 1
                await wait_until(lambda: gw.usage.usage_published >= total and not gw.spool.has_pending(), 30,
                                 what="usage delivered")
                records = await read_usage(server.url)
                assert len(records) == total and len({r.request_id for r in records}) == total
                assert sum(r.http_status == 503 for r in records) == len(refused) + 1
                # no log storm: per-request lines about the outage are throttled, not one per request
                gateway_lines = [r for r in caplog.records if r.name == "services.gateway.service"]
                assert len(gateway_lines) < 20, len(gateway_lines)
                # the engine rejoined by itself: fresh heartbeats again
                row = next(r for r in gw.backends_view() if r["member_id"] == "e1")
                assert not row["stale"]
                print(f"\nFIGURES nats-restart: requests={total} ok={sum(r.status == 200 for _, r in sent)}"
                      f" refused_503={len(refused)} during_outage={len(during)}"
                      f" slowest_503_ms={slowest_503_s * 1000:.0f}"
                      f" outage_s={up_at - down_at:.2f} gateway_reconnect_s={reconnect_s:.2f}"
                      f" first_200_after_restart_s={recovered_s:.2f} stream_cut_after_s={stream_end_s:.2f}"
                      f" usage_records={len(records)} lost=0 duplicates=0")
    finally:
        await server.stop()
