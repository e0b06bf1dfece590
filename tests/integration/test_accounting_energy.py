"""Energy accounting replayed through a real nats-server: intervals, attribution, rollups, costs, SQL, auth.

Expected values are written as arithmetic from the counters published (docs/accounting.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import duckdb
import msgspec
import pytest

from proto import (
    AuthCheck,
    AuthReply,
    ConfigChanged,
    CostsQuery,
    EnergyReading,
    EnergySample,
    RequestTokens,
    SqlQuery,
    UsageRecord,
    decode_json,
    encode,
    encode_json,
    subjects,
)
from services.accounting.service import AccountingConfig, AccountingService

DAY_S = 86400
KEYS = {"sk-admin": AuthReply(ok=True, role="admin", key_id="k-admin", user="ops"),
        "sk-user": AuthReply(ok=True, role="user", key_id="k-user", user="alice")}


def energy(seq: int, ts_s: float, mj: int | None, *, worker: str = "w1", session: str = "s1", kind: str = "nvml",
           max_range_mj: int | None = None, tokens: tuple[tuple[str, int], ...] = (), device: str = "GPU-0"
           ) -> EnergySample:
    return EnergySample(worker_id=worker, session_id=session, seq=seq, ts_s=ts_s, model_id="m1",
                        readings=[EnergyReading(device_id=device, kind=kind,  # type: ignore[arg-type]
                                                method="counter" if mj is not None else "unavailable",
                                                energy_mj=mj, max_range_mj=max_range_mj)],
                        request_tokens=[RequestTokens(request_id=r, output_tokens=n) for r, n in tokens])


def usage(request_id: str, ts_s: float, output_tokens: int, api_key_id: str = "k1", model: str = "m1"
          ) -> UsageRecord:
    return UsageRecord(gateway_id="gw", session_id="g", seq=0, ts_s=ts_s, request_id=request_id, model=model,
                       pool=model, worker_id="w1", api_key_id=api_key_id, prompt_tokens=10, cached_tokens=4,
                       output_tokens=output_tokens, latency_ms=1000.0)


class Publisher:
    def __init__(self, nc: Any) -> None:
        self.js = nc.jetstream()
        self.num = 0

    async def __call__(self, msg: EnergySample | UsageRecord) -> None:
        # A fresh Nats-Msg-Id every time: the stream keeps a republished duplicate, so the ledger must drop it.
        self.num += 1
        subject = subjects.energy(msg.worker_id) if isinstance(msg, EnergySample) else subjects.usage("gw")
        await self.js.publish(subject, encode(msg), headers={"Nats-Msg-Id": f"m{self.num}"})


@contextlib.asynccontextmanager
async def running(nc: Any, db: Path, **kw: Any) -> AsyncIterator[AccountingService]:
    service = AccountingService(nc, AccountingConfig(db_path=db, fetch_timeout_s=0.1, port=0, **kw))
    task = asyncio.create_task(service.run())
    try:
        await asyncio.wait_for(service.ready.wait(), 10)
        yield service
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def ingested(service: AccountingService, predicate: Callable[[AccountingService], bool]) -> None:
    """Await the ingest event until ``predicate`` holds (no sleeps: each committed batch sets the event)."""
    async with asyncio.timeout(15):
        while not predicate(service):
            service.ingested.clear()
            if predicate(service):
                break
            await service.ingested.wait()


def energy_seen(n: int) -> Callable[[AccountingService], bool]:
    return lambda s: s.stats.energy_ingested + s.stats.energy_duplicates >= n


async def sql(service: AccountingService, query: str) -> list[list[Any]]:
    return (await service.run_sql(query))[1]


@pytest.fixture
async def auth(nc: Any) -> AsyncIterator[None]:
    """A stand-in for the gateways' key check on ``llm.v1.auth.check`` (a boundary we do not own here)."""
    table = {hashlib.sha256(k.encode()).hexdigest(): v for k, v in KEYS.items()}

    async def answer(msg: Any) -> None:
        digest = decode_json(msg.data, AuthCheck).key_sha256
        await msg.respond(encode_json(table.get(digest, AuthReply(ok=False))))

    sub = await nc.subscribe(subjects.AUTH_CHECK, cb=answer)
    yield
    await sub.unsubscribe()


def utc_midnight() -> float:
    return dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0).timestamp()


async def test_resets_wraps_gaps_duplicates_and_late_samples_are_counted_once(nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    # 200 s of samples, all in today's UTC day (the test asserts "today"): from 10 minutes ago, or from just
    # after midnight when the day is younger than that (no check refuses a sample a little in the future)
    t0 = max(time.time() - 600, utc_midnight() + 1)
    rng = 262_143_328
    nvml = [energy(1, t0, 1_000_000), energy(2, t0 + 5, 1_500_000, tokens=(("r1", 3), ("r2", 1))),
            energy(4, t0 + 15, 2_600_000, tokens=(("r1", 2),)),  # seq 3 arrives late, below
            energy(2, t0 + 5, 1_500_000, tokens=(("r1", 3), ("r2", 1))),  # duplicate
            energy(3, t0 + 10, 2_000_000, tokens=(("r2", 4),)),
            energy(5, t0 + 20, 300_000),  # counter went down: reset
            energy(6, t0 + 200, 700_000)]  # 180 s of silence: gap
    rapl = [energy(1, t0, rng - 100_000, worker="w2", kind="rapl", max_range_mj=rng, device="rapl:package-0"),
            energy(2, t0 + 5, 150_000, worker="w2", kind="rapl", max_range_mj=rng, device="rapl:package-0")]
    for msg in [*nvml, *rapl]:
        await publish(msg)
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, energy_seen(9))
        assert (service.stats.energy_ingested, service.stats.energy_duplicates) == (8, 1)
        rows = await sql(service, "SELECT worker_id, start_seq, end_seq, energy_j, is_reset, is_wrap, is_gap "
                                  "FROM energy_intervals ORDER BY worker_id, end_seq")
        assert rows == [
            ["w1", 1, 2, (1_500_000 - 1_000_000) / 1000, False, False, False],
            ["w1", 2, 3, (2_000_000 - 1_500_000) / 1000, False, False, False],
            ["w1", 3, 4, (2_600_000 - 2_000_000) / 1000, False, False, False],
            ["w1", 4, 5, None, True, False, False],
            ["w1", 5, 6, (700_000 - 300_000) / 1000, False, False, True],
            ["w2", 1, 2, (150_000 + rng - (rng - 100_000)) / 1000, False, True, False],
        ]
        # Conservation: for every interval, attributed + idle = measured.
        mismatches = await sql(service, """
            SELECT i.end_seq, i.energy_j, sum(a.energy_j) FROM energy_intervals i
            LEFT JOIN energy_attribution a USING (worker_id, session_id, device_id, end_seq)
            WHERE i.energy_j IS NOT NULL GROUP BY ALL HAVING abs(i.energy_j - coalesce(sum(a.energy_j), -1)) > 1e-9""")
        assert mismatches == []
        shares = await sql(service, "SELECT end_seq, request_id, energy_j FROM energy_attribution "
                                    "WHERE worker_id = 'w1' ORDER BY end_seq, request_id NULLS LAST")
        assert shares == [[2, "r1", 500.0 * 3 / 4], [2, "r2", 500.0 * 1 / 4], [3, "r2", 500.0], [4, "r1", 600.0],
                          [6, None, 400.0]]
        costs = await service.costs(30)
        measured_j = 500 + 500 + 600 + 400 + 250
        assert costs["today"]["kwh"] == pytest.approx(measured_j / 3.6e6)
        assert costs["today"]["energy_usd"] == pytest.approx(measured_j / 3.6e6 * 0.125)
        # Busy energy only: 1600 J over 3+1+4+2 output tokens.
        w1 = next(m for m in costs["by_member"] if m["member"] == "w1")
        assert w1["j_per_output_token"] == pytest.approx(1600 / 10)
        # Device-time: 5+5+5+5+180 s on w1, of which the 5 s reset is not backed by a valid reading.
        assert w1["coverage_pct"] == pytest.approx(100 * 195 / 200)


async def test_a_restart_mid_stream_loses_nothing_and_doubles_nothing(nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = time.time() - 3600
    first = [energy(i, t0 + 5 * i, 1_000 * i * i, tokens=((f"r{i}", 1),)) for i in range(1, 8)]
    for msg in first:
        await publish(msg)
    # A fetch cut short by the stop leaves its messages unacked: the server redelivers them after ack_wait.
    async with running(nc, tmp_path / "l.duckdb", batch_size=3, ack_wait_s=1.0) as service:
        await ingested(service, energy_seen(3))
        num_first = service.stats.energy_ingested
    assert 3 <= num_first < 7  # stopped mid-stream
    later = [energy(i, t0 + 5 * i, 1_000 * i * i, tokens=((f"r{i}", 1),)) for i in range(8, 13)]
    for msg in [*later, first[-1]]:  # the last one again, as a producer retry would
        await publish(msg)
    async with running(nc, tmp_path / "l.duckdb", batch_size=3, ack_wait_s=1.0) as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 12 - num_first and s.stats.energy_duplicates >= 1)
        assert (service.stats.energy_ingested, service.stats.energy_duplicates) == (12 - num_first, 1)
        rows = await sql(service, "SELECT count(*), sum(energy_j), min(start_seq), max(end_seq) FROM energy_intervals")
        assert rows == [[11, (1_000 * 12 * 12 - 1_000) / 1000, 1, 12]]
        assert await sql(service, "SELECT count(*) FROM sample_log") == [[12]]


async def test_intervals_across_midnight_are_split_by_time_and_the_30_day_window_skips_missing_days(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    midnight = today.timestamp()
    # 4 s across today's midnight: 1 s before (yesterday), 3 s after (today); 400 J in all.
    await publish(energy(1, midnight - 1, 0, tokens=()))
    await publish(energy(2, midnight + 3, 400_000, tokens=(("late", 4),)))
    # Separate sessions on days -29 (inside the 30-day window) and -31 (outside), 100 J each, on GPUs of
    # their own (the same GPU's readings would form one stream: a NULL gap interval across the days between).
    for day, session in ((29, "d29"), (31, "d31")):
        base = midnight - day * DAY_S + 3600
        await publish(energy(1, base, 0, session=session, device=f"GPU-{session}"))
        await publish(energy(2, base + 5, 100_000, session=session, device=f"GPU-{session}"))
    await publish(usage("late", midnight + 3, 4))
    await publish(usage("old", midnight - 31 * DAY_S + 3600, 7))
    async with running(nc, tmp_path / "l.duckdb", retention_days=40) as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 6 and s.stats.usage_ingested >= 2)
        costs = await service.costs(30)
        daily = {d["day"]: d for d in costs["daily"]}
        assert len(costs["daily"]) == 30
        day = lambda n: (today - dt.timedelta(days=n)).date().isoformat()  # noqa: E731
        assert daily[day(0)]["kwh"] == pytest.approx(300 / 3.6e6)
        assert daily[day(1)]["kwh"] == pytest.approx(100 / 3.6e6)
        assert daily[day(29)]["kwh"] == pytest.approx(100 / 3.6e6)
        assert daily[day(5)]["kwh"] is None and daily[day(5)]["requests"] is None  # no data: null, not 0
        assert day(31) not in daily
        assert costs["window"]["kwh"] == pytest.approx((300 + 100 + 100) / 3.6e6)
        assert costs["window"]["requests"] == 1 and costs["today"]["output_tokens"] == 4
        key = next(k for k in costs["by_api_key"] if k["api_key_id"] == "k1")
        assert key["kwh"] == pytest.approx(400 / 3.6e6) and key["j_per_output_token"] == pytest.approx(400 / 4)
        rolled = await sql(service, "SELECT day, round(kwh * 3.6e6, 6) FROM daily_energy ORDER BY day")
        assert [r[1] for r in rolled] == [100.0, 100.0, 100.0, 300.0]


async def test_missing_readings_are_null_and_lower_coverage_never_zero_kwh(nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = time.time() - 60
    for i in range(1, 4):
        await publish(energy(i, t0 + 5 * i, None, tokens=(("r", 2),)))
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, energy_seen(3))
        costs = await service.costs(30)
        assert costs["today"]["kwh"] is None and costs["today"]["energy_usd"] is None
        assert costs["today"]["coverage_pct"] == 0.0 and costs["today"]["methods"] == ["unavailable"]
        over_bus = msgspec.json.decode((await nc.request(subjects.ACCOUNTING_COSTS, encode_json(CostsQuery()),
                                                         timeout=10)).data)
        assert over_bus["today"]["kwh"] is None and len(over_bus["daily"]) == 30


async def test_an_api_key_carries_the_methods_of_its_intervals_and_the_share_of_its_tokens_measured(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = max(time.time() - 600, utc_midnight() + 1)
    # 1 → 2: 1000 J by counter, r1 (k1) made 3 tokens; 2 → 3: no reading, r1 made 1 token and r2 (k2) 2.
    await publish(energy(1, t0, 0))
    await publish(energy(2, t0 + 5, 1_000_000, tokens=(("r1", 3),)))
    await publish(energy(3, t0 + 10, None, tokens=(("r1", 1), ("r2", 2))))
    await publish(usage("r1", t0 + 10, 4, api_key_id="k1"))
    await publish(usage("r2", t0 + 10, 2, api_key_id="k2"))
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 3 and s.stats.usage_ingested >= 2)
        keys = {k["api_key_id"]: k for k in (await service.costs(30))["by_api_key"]}
        k1, k2 = keys["k1"], keys["k2"]
        assert (k1["methods"], k2["methods"]) == (["counter", "unavailable"], ["unavailable"])
        assert k1["kwh"] == pytest.approx(1000 / 3.6e6) and k1["j_per_output_token"] == pytest.approx(1000 / 3)
        assert k1["coverage_pct"] == pytest.approx(100 * 3 / (3 + 1))
        # no valid reading while k2 ran: its energy is unknown (null, not 0) and its coverage 0
        assert (k2["kwh"], k2["energy_usd"], k2["j_per_output_token"], k2["coverage_pct"]) == (None, None, None, 0.0)
        assert await sql(service, "SELECT api_key_id, methods, round(coverage_pct, 9) FROM daily_key_energy "
                                  "ORDER BY api_key_id") == [["k1", ["counter", "unavailable"], 75.0],
                                                             ["k2", ["unavailable"], 0.0]]


REFUSED = [
    "INSERT INTO requests (request_id) VALUES ('x')",
    "ATTACH 'other.duckdb' AS o",
    "COPY requests TO 'out.csv'",
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM '/etc/passwd'",
    "SELECT * FROM glob('/etc/*')",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "PRAGMA database_list",
    "SELECT 1; SELECT 2",
    "WITH x AS (DELETE FROM requests RETURNING *) SELECT * FROM x",
]


async def test_operator_sql_over_http_and_the_bus_is_read_only(nc: Any, tmp_path: Path, auth: None) -> None:
    publish = Publisher(nc)
    await publish(usage("r1", time.time(), 5))
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, lambda s: s.stats.usage_ingested >= 1)
        admin = {"Authorization": "Bearer sk-admin"}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{service.url}/sql", json={"sql": "SELECT request_id, output_tokens FROM requests"},
                                 headers=admin) as resp:
                assert resp.status == 200
                assert await resp.json() == {"columns": ["request_id", "output_tokens"], "rows": [["r1", 5]]}
            for query in REFUSED:
                async with http.post(f"{service.url}/sql", json={"sql": query}, headers=admin) as resp:
                    body = await resp.json()
                    assert resp.status == 400, (query, body)
                    assert body["error"]["code"] in ("query_rejected", "query_failed"), body
            async with http.post(f"{service.url}/sql", json={"sql": "SELECT 1"}) as resp:
                assert resp.status == 401 and (await resp.json())["error"]["type"] == "authentication_error"
            async with http.post(f"{service.url}/sql", json={"sql": "SELECT 1"},
                                 headers={"Authorization": "Bearer sk-wrong"}) as resp:
                assert resp.status == 401
            async with http.post(f"{service.url}/sql", json={"sql": "SELECT 1"},
                                 headers={"Authorization": "Bearer sk-user"}) as resp:
                assert resp.status == 403 and (await resp.json())["error"]["code"] == "admin_required"
            async with http.get(f"{service.url}/costs", headers={"Authorization": "Bearer sk-user"}) as resp:
                assert resp.status == 403
            async with http.get(f"{service.url}/costs?days=7", headers=admin) as resp:
                body = await resp.json()
                assert resp.status == 200 and len(body["daily"]) == 7 and body["today"]["output_tokens"] == 5
        for query in REFUSED:
            reply = msgspec.json.decode((await nc.request(subjects.ACCOUNTING_SQL,
                                                          encode_json(SqlQuery(sql=query)), timeout=10)).data)
            assert "error" in reply, query
        count = encode_json(SqlQuery(sql="SELECT count(*) AS n FROM requests"))
        reply = msgspec.json.decode((await nc.request(subjects.ACCOUNTING_SQL, count, timeout=10)).data)
        assert reply == {"columns": ["n"], "rows": [[1]]}
        assert await sql(service, "SELECT count(*) FROM requests") == [[1]]


async def test_a_query_past_the_time_limit_is_interrupted(nc: Any, tmp_path: Path) -> None:
    from services.accounting.service import QueryTimedOut

    async with running(nc, tmp_path / "l.duckdb", query_timeout_s=0.3) as service:
        with pytest.raises(QueryTimedOut):
            await service.run_sql("SELECT count(*) FROM range(100000000000) a, range(10) b")
        assert await sql(service, "SELECT 42") == [[42]]


async def test_retention_drops_old_raw_samples_but_keeps_rollups_and_export_writes_parquet(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    old = time.time() - 10 * DAY_S
    await publish(energy(1, old, 0))
    await publish(energy(2, old + 5, 50_000))
    async with running(nc, tmp_path / "l.duckdb", retention_days=20, export_dir=tmp_path / "exports") as service:
        await ingested(service, energy_seen(2))
        await service.refresh_rollups()
        object.__setattr__(service.config, "retention_days", 5.0)  # the operator shortened it; maintenance runs
        await service.maintain()
        assert await sql(service, "SELECT count(*) FROM energy_samples") == [[0]]
        assert await sql(service, "SELECT round(sum(measured_j), 6) FROM energy_daily") == [[50.0]]
        assert sorted(p.name for p in (tmp_path / "exports").iterdir()) == [
            "energy_daily.parquet", "energy_hourly.parquet", "key_energy_daily.parquet", "key_energy_hourly.parquet",
            "usage_daily.parquet", "usage_hourly.parquet"]
        # what an external tool reads back: the rollup's rows, joules and all
        with duckdb.connect() as con:
            exported = con.execute("SELECT count(*), sum(measured_j) FROM read_parquet(?)",
                                   [str(tmp_path / "exports" / "energy_daily.parquet")]).fetchall()
        assert await sql(service, "SELECT count(*) FROM energy_daily") == [[1]]  # one day, worker, model, method
        assert exported == [(1, pytest.approx(50_000 / 1000))]
    assert math.isfinite(old)


async def test_the_gateway_config_page_sets_the_rate_and_price_book(nc: Any, tmp_path: Path) -> None:
    async with running(nc, tmp_path / "l.duckdb") as service:
        raw = {"electricity_rate_usd_per_kwh": 0.31,
               "price_book": {"tiny": {"prompt_usd_per_m": 1.0, "cached_usd_per_m": 0.5, "output_usd_per_m": 2.0}}}
        await nc.publish(subjects.CONFIG_CHANGED, encode_json(ConfigChanged(gateway_id="gw", config=raw)))
        await asyncio.wait_for(service.config_applied.wait(), 10)
        assert await sql(service, "SELECT usd_per_kwh, source FROM tariff ORDER BY effective_from DESC LIMIT 1") \
            == [[0.31, "gateway config"]]
        assert await sql(service, "SELECT model_id, output_usd_per_m FROM price_book") == [["tiny", 2.0]]
