"""What the gateway's usage limits need from accounting, through a real nats-server and a real DuckDB file:
the usage record's appended fields in ``requests``, and the month-to-date joules per API key that the
kWh-per-month limit asks for on ``llm.v1.accounting.key_energy`` (docs/accounting.md, "Tables").

Expected joules are written as arithmetic from the counters published: an interval's energy is split over
its requests by output tokens (docs/accounting.md, "Attribution"), and an interval across the month's start
is split in proportion to time ("Rollups").
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

import duckdb
import msgspec
import pytest

from proto import (
    EnergyReading,
    EnergySample,
    KeyEnergyQuery,
    KeyEnergyReply,
    RequestTokens,
    UsageRecord,
    decode,
    encode,
    subjects,
)
from services.accounting import schema
from services.accounting.store import Ledger
from tests.integration.test_accounting_energy import Publisher, energy, ingested, running, sql

HOUR_S = 3600


def usage(request_id: str, ts_s: float, output_tokens: int, api_key_id: str | None = "k1", **fields: Any
          ) -> UsageRecord:
    return UsageRecord(gateway_id="gw", session_id="g", seq=0, ts_s=ts_s, request_id=request_id, model="m1",
                       pool="m1", worker_id="w1", api_key_id=api_key_id, output_tokens=output_tokens,
                       latency_ms=1000.0, **fields)


def month_of(t: dt.datetime) -> str:
    return f"{t.year:04d}-{t.month:02d}"


async def key_energy(nc: Any, payload: bytes) -> KeyEnergyReply:
    return decode((await nc.request(subjects.ACCOUNTING_KEY_ENERGY, payload, timeout=10)).data, KeyEnergyReply)


async def test_the_appended_usage_fields_are_stored_and_an_older_gateways_record_gets_the_defaults(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    now = time.time()
    await publish(usage("r-limited", now, 0, status="error", http_status=429, usage_source="counted_by_gateway",
                        limit_kind="tokens_per_minute", user_id="u_1"))
    await publish(usage("r-counted", now, 7, usage_source="engine", user_id="u_1"))
    # A value today's list does not have (a newer gateway's) is stored as it came, not parked.
    await publish(usage("r-newer", now, 2, usage_source="replayed_from_spool", user_id="u_2"))
    # An older gateway: the record as it encoded it, without the three fields.
    old = {"gateway_id": "gw-old", "session_id": "g", "seq": 0, "ts_s": now, "request_id": "r-old", "model": "m1",
           "pool": "m1", "api_key_id": "k9", "output_tokens": 5}
    await nc.jetstream().publish(subjects.usage("gw-old"), msgspec.msgpack.encode(old))
    await publish(usage("r-oversized", now, 1, usage_source="x" * 65))
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, lambda s: s.stats.usage_ingested >= 4 and s.stats.poison_messages >= 1)
        assert await sql(service, "SELECT request_id, usage_source, limit_kind, user_id, http_status FROM requests "
                                  "ORDER BY request_id") == [
            ["r-counted", "engine", None, "u_1", 200],
            ["r-limited", "counted_by_gateway", "tokens_per_minute", "u_1", 429],
            ["r-newer", "replayed_from_spool", None, "u_2", 200],
            ["r-old", "member", None, None, 200]]
        assert await sql(service, "SELECT reason FROM parked") == [
            ["invalid: usage_source is 65 characters; the limit is 64"]]
        # what `llmgw sql` answers per user
        assert await sql(service, "SELECT user_id, sum(output_tokens) FROM requests GROUP BY 1 ORDER BY 1 NULLS LAST"
                         ) == [["u_1", 0 + 7], ["u_2", 2], [None, 5]]


async def test_a_ledger_from_before_the_new_columns_gains_them_when_opened_and_its_rows_keep_null(
        nc: Any, tmp_path: Path) -> None:
    db = tmp_path / "l.duckdb"
    with duckdb.connect(str(db)) as con:  # the ledger as the previous version left it, with one request
        con.execute(schema.TABLES)
        for column in ("usage_source", "limit_kind", "user_id"):
            con.execute(f"ALTER TABLE requests DROP COLUMN {column}")
        con.execute("INSERT INTO requests (request_id, ts, gateway_id, gateway_session, gateway_seq, model, pool, "
                    "status, prompt_tokens, cached_tokens, output_tokens) "
                    "VALUES ('r-before', now(), 'gw', 'g', 0, 'm1', 'm1', 'ok', 1, 0, 3)")
    await Publisher(nc)(usage("r-after", time.time(), 4, usage_source="none", limit_kind="kwh_per_month",
                              user_id="u_1"))
    async with running(nc, db) as service:
        await ingested(service, lambda s: s.stats.usage_ingested >= 1)
        assert await sql(service, "SELECT request_id, usage_source, limit_kind, user_id, output_tokens FROM requests "
                                  "ORDER BY request_id") == [["r-after", "none", "kwh_per_month", "u_1", 4],
                                                             ["r-before", None, None, None, 3]]
        # the same column order as a new ledger's
        assert [c[0] for c in await sql(service, "SELECT column_name FROM information_schema.columns WHERE "
                                                 "table_name = 'requests' ORDER BY ordinal_position")][-4:] == [
            "ingested_at", "usage_source", "limit_kind", "user_id"]


def estimated(seq: int, ts_s: float, mj: int, tokens: tuple[tuple[str, int], ...] = ()) -> EnergySample:
    return EnergySample(worker_id="w2", session_id="e", seq=seq, ts_s=ts_s, model_id="m1",
                        readings=[EnergyReading(device_id="est", kind="estimate", method="estimated", energy_mj=mj)],
                        request_tokens=[RequestTokens(request_id=r, output_tokens=n) for r, n in tokens])


async def publish_month(publish: Publisher) -> tuple[float, float, float]:
    """Energy and usage in this month and the one before; returns (month start, t0, newest sample time).

    w1 session s1 from t0 (in this month): 1 → 2: 1200 J, r1 (k1) 3 tokens, r2 (k2) 1, rX 2 (its usage record
    comes later); 2 → 3: 800 J, r2 4 tokens; 3 → 4: 500 J, no tokens (idle); 4 → 5: no reading, r1 2 tokens.
    w2: 1000 J estimated (not measured), r1 4 tokens. Session edge: 400 J over the 40 s from 10 s before this
    month's start, r-edge (k1) 1 token. Session old: 1000 J an hour before this month, r-old (k1) 5 tokens.
    """
    now = dt.datetime.now(dt.UTC)
    ms = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
    # ten minutes ago, or just after the month began when it is younger (no check refuses a sample a
    # little in the future)
    t0 = max(now.timestamp() - 600, ms + 1)
    for msg in (energy(1, t0, 0), energy(2, t0 + 5, 1_200_000, tokens=(("r1", 3), ("r2", 1), ("rX", 2))),
                energy(3, t0 + 10, 2_000_000, tokens=(("r2", 4),)), energy(4, t0 + 15, 2_500_000),
                energy(5, t0 + 20, None, tokens=(("r1", 2),)),
                estimated(1, t0, 0), estimated(2, t0 + 5, 1_000_000, tokens=(("r1", 4),)),
                energy(1, ms - 10, 0, session="edge"), energy(2, ms + 30, 400_000, session="edge",
                                                              tokens=(("r-edge", 1),)),
                energy(1, ms - HOUR_S, 0, session="old"), energy(2, ms - HOUR_S + 5, 1_000_000, session="old",
                                                                 tokens=(("r-old", 5),)),
                usage("r1", t0 + 20, 3 + 2 + 4, api_key_id="k1"), usage("r2", t0 + 10, 1 + 4, api_key_id="k2"),
                usage("r-edge", ms + 30, 1, api_key_id="k1"), usage("r-old", ms - HOUR_S + 5, 5, api_key_id="k1")):
        await publish(msg)
    return ms, t0, max(t0 + 20, ms + 30)


def previous_month(ms: float) -> str:
    return month_of(dt.datetime.fromtimestamp(ms - 1, dt.UTC))


async def test_key_energy_is_each_keys_measured_share_of_the_month_and_leaves_out_the_month_before(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    ms, t0, newest_s = await publish_month(publish)
    month = month_of(dt.datetime.fromtimestamp(ms, dt.UTC))
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 11 and s.stats.usage_ingested >= 4)
        reply = await key_energy(nc, encode(KeyEnergyQuery(month=month)))
        # k1: r1's 3 of 6 tokens of 1200 J, and r-edge's 30 of its 40 s; nothing from the estimated interval,
        # the one without a reading, or r-old's month. k2: r2's 1 of 6 tokens of 1200 J, and all 800 J of 2 → 3.
        # rX's 2 of 6 belong to no key yet: its usage record has not arrived.
        assert reply.month == month and reply.as_of_s == pytest.approx(newest_s)
        assert reply.joules_by_key == {"k1": pytest.approx(1200 * 3 / 6 + 400 * 30 / 40),
                                       "k2": pytest.approx(1200 * 1 / 6 + 800)}
        before = await key_energy(nc, encode(KeyEnergyQuery(month=previous_month(ms))))
        assert before.joules_by_key == {"k1": pytest.approx(1000 + 400 * 10 / 40)}
        assert before.as_of_s == pytest.approx(ms)  # the edge interval runs on into this month

        await publish(usage("rX", t0 + 5, 2, api_key_id="k2"))  # it ended with sample 2
        await ingested(service, lambda s: s.stats.usage_ingested >= 5)
        reply = await key_energy(nc, encode(KeyEnergyQuery(month=month)))
        assert reply.joules_by_key == {"k1": pytest.approx(1200 * 3 / 6 + 400 * 30 / 40),
                                       "k2": pytest.approx(1200 * 1 / 6 + 800 + 1200 * 2 / 6)}
        # the figure is what the daily rollup sums to once refreshed
        await service.refresh_rollups()
        assert dict(await sql(service, f"SELECT api_key_id, sum(busy_j) FROM key_energy_daily WHERE day >= DATE "
                                       f"'{month}-01' GROUP BY 1")) == pytest.approx(reply.joules_by_key)

        for bad in (b"\x93garbage", encode(KeyEnergyQuery(month="2026-13")), encode(KeyEnergyQuery(month="26-1"))):
            assert await key_energy(nc, bad) == KeyEnergyReply(month="", joules_by_key={}, as_of_s=None)
        assert await key_energy(nc, encode(KeyEnergyQuery(month="1999-01"))) == KeyEnergyReply(month="1999-01")


async def test_key_energy_is_the_same_from_daily_and_hourly_rollups_dirty_hours_and_past_the_raw_retention(
        nc: Any, tmp_path: Path) -> None:
    db = tmp_path / "l.duckdb"
    ms = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
    pm = dt.datetime.fromtimestamp(ms - 1, dt.UTC).replace(day=1, hour=0, minute=0, second=0).timestamp()
    day2_01, day2_03, day3_01 = pm + 86400 + HOUR_S, pm + 86400 + 3 * HOUR_S, pm + 2 * 86400 + HOUR_S
    # Last month, where every hour is in the past: two hours of day 2 and one of day 3, a session each.
    # day 2 01:00: 600 J, rA (k1) 2 tokens, rB (k2) 1; 03:00: 300 J, rB 3; day 3 01:00: 900 J, rC (k1) 2.
    publish = Publisher(nc)
    # one GPU per session: on one GPU the hours between would be a NULL gap interval (docs/accounting.md)
    for msg in (energy(1, day2_01, 0, session="a", device="GPU-a"),
                energy(2, day2_01 + 5, 600_000, session="a", device="GPU-a", tokens=(("rA", 2), ("rB", 1))),
                energy(1, day2_03, 0, session="b", device="GPU-b"),
                energy(2, day2_03 + 5, 300_000, session="b", device="GPU-b", tokens=(("rB", 3),)),
                energy(1, day3_01, 0, session="c", device="GPU-c"),
                energy(2, day3_01 + 5, 900_000, session="c", device="GPU-c", tokens=(("rC", 2),)),
                usage("rA", day2_01 + 5, 2, api_key_id="k1"), usage("rB", day2_03 + 5, 1 + 3, api_key_id="k2"),
                usage("rC", day3_01 + 5, 2, api_key_id="k1")):
        await publish(msg)
    async with running(nc, db, retention_days=90) as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 6 and s.stats.usage_ingested >= 3)
    expected = {"k1": pytest.approx(600 * 2 / 3 + 900), "k2": pytest.approx(600 * 1 / 3 + 300)}
    now_s = time.time()
    ledger = Ledger(db)  # the same file, now that the service is stopped: every step below is deterministic
    try:
        def dirty_hours() -> list[float]:
            rows = ledger.con.execute("SELECT epoch(hour) FROM rollup_dirty WHERE hour >= to_timestamp(?) "
                                      "AND hour < to_timestamp(?) ORDER BY hour", [pm, ms]).fetchall()
            return [r[0] for r in rows]

        ledger.refresh_rollups(now_s, 90)
        assert dirty_hours() == []  # all from key_energy_daily
        assert ledger.key_energy(pm, ms, now_s, 90) == (expected, pytest.approx(day3_01 + 5))
        # a rate dated day 2 03:00 marks the rolled-up hours from then on dirty: day 2 01:00 from the hourly
        # rollup, the other two hours from the raw shares
        assert ledger.add_dated_rate(day2_03, 0.2) and dirty_hours() == [day2_03, day3_01]
        assert ledger.key_energy(pm, ms, now_s, 90) == (expected, pytest.approx(day3_01 + 5))
        # with a one-day retention the raw rows are gone; the rollups still hold it all
        ledger.refresh_rollups(now_s, 90)
        ledger.enforce_retention(now_s, 1)
        assert ledger.con.execute("SELECT count(*) FROM energy_attribution").fetchall() == [(0,)]
        assert ledger.key_energy(pm, ms, now_s, 1) == (expected, pytest.approx(day3_01 + HOUR_S))
    finally:
        ledger.close()


async def test_a_request_that_ended_just_before_an_hour_gets_that_hours_share_when_its_record_comes_late(
        nc: Any, tmp_path: Path) -> None:
    ms = dt.datetime.now(dt.UTC).replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
    hour = dt.datetime.fromtimestamp(ms - 1, dt.UTC).replace(day=5, hour=10, minute=0, second=0).timestamp()
    publish = Publisher(nc)
    # 500 J from 3 s before the hour to 2 s after it; rZ's last tokens went out in the sample after the hour
    await publish(energy(1, hour - 3, 0))
    await publish(energy(2, hour + 2, 500_000, tokens=(("rZ", 5),)))
    async with running(nc, tmp_path / "l.duckdb", retention_days=90) as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 2)
        await service.refresh_rollups()  # both hours rolled up while the share has no API key
        await publish(usage("rZ", hour - 1, 5, api_key_id="k3"))  # it ended 1 s before the hour
        await ingested(service, lambda s: s.stats.usage_ingested >= 1)
        await service.refresh_rollups()
        reply = await key_energy(nc, encode(KeyEnergyQuery(month=previous_month(ms))))
        assert reply.joules_by_key == {"k3": pytest.approx(500 * 3 / 5 + 500 * 2 / 5)}
