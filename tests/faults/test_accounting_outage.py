"""Issue #12 (3): the accounting service is killed (-9, mid-batch or not) while traffic flows, and restarted.

Real processes for the engine (it publishes energy samples every 0.5 s) and accounting, the gateway in
process. After the restart every usage and energy record the stream holds is in the ledger exactly once.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from proto import subjects
from tests.faults.client import Result, chat_body, post
from tests.faults.conftest import accounting_proc, engine_proc, gateway_in_process, procs, sql, stream_count, wait_until

OUTAGE_S = 3.0


@pytest.mark.slow
async def test_accounting_killed_under_traffic_ingests_every_record_exactly_once_after_restart(
        nats_server, tiny_model, tmp_path) -> None:  # type: ignore[no-untyped-def]
    db = tmp_path / "ledger.duckdb"
    with procs() as started:
        engine = engine_proc(tiny_model, nats_server.url, "e1", tmp_path / "e1", "--energy-interval", "0.5")
        accounting = accounting_proc(nats_server.url, db, tmp_path / "acct")
        started += [engine, accounting]
        await asyncio.gather(engine.start(), accounting.start())
        async with gateway_in_process(nats_server.url, tmp_path / "gw") as g, aiohttp.ClientSession() as http:
            await wait_until(lambda: "e1" in g.gateway.fleet.bus_workers("tiny"), 20)
            url = g.url + "/v1/chat/completions"
            results: list[Result] = []
            stop = asyncio.Event()

            async def client(i: int) -> None:
                n = 0
                while not stop.is_set():
                    n += 1
                    results.append(await post(http, url, chat_body(4, False, f"c{i} {n}"), g.auth))
                    await asyncio.sleep(0.02)

            clients = [asyncio.create_task(client(i)) for i in range(2)]
            await wait_until(lambda: len(results) >= 20, 20)
            accounting.kill()
            killed_at, sent_before = time.monotonic(), len(results)
            await asyncio.sleep(OUTAGE_S)
            sent_during = len(results) - sent_before
            await accounting.start()
            restarted_at = time.monotonic()
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*clients)
            engine.stop()  # no more energy samples: the stream's count is final

            n = len(results)
            assert all(r.status == 200 for r in results)  # accounting is not on the request path
            await wait_until(lambda: g.gateway.usage_published >= n, 20, what="usage published")
            num_energy = await stream_count(nats_server.url, subjects.STREAM_ENERGY)
            num_usage = await stream_count(nats_server.url, subjects.STREAM_USAGE)
            assert num_usage == n  # the gateway sent one record per request

            counts: list[int] = []

            async def ingested() -> bool:
                nonlocal counts
                reply = await sql(nats_server.url, "SELECT (SELECT count(*) FROM requests), "
                                  "(SELECT count(DISTINCT request_id) FROM requests), "
                                  "(SELECT count(*) FROM sample_log)")
                counts = list(reply["rows"][0])
                return counts[0] >= n and counts[2] >= num_energy

            # a batch the killed process fetched but never acked comes back after the consumer's ack wait (60 s)
            async with asyncio.timeout(90):
                while not await ingested():
                    await asyncio.sleep(0.2)
            caught_up_s = time.monotonic() - restarted_at
            assert counts == [n, n, num_energy]  # exactly once: none lost, none twice
            print(f"\nFIGURES accounting-outage: requests={n} ok={n} sent_while_down={sent_during}"
                  f" outage_s={restarted_at - killed_at:.2f} usage_in_ledger={counts[0]} distinct={counts[1]}"
                  f" energy_samples_sent={num_energy} energy_in_ledger={counts[2]}"
                  f" caught_up_after_restart_s={caught_up_s:.2f} lost=0 duplicates=0")
