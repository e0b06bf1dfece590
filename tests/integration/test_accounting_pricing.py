"""What energy and tokens cost: dated electricity rates (``--tariff``) and the list-price book.

Expected values are written as arithmetic (docs/accounting.md, "Tables": ``tariff`` and ``price_book``).
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from proto import CostsQuery, UsageRecord, encode_json, subjects
from services.accounting.service import DatedRate
from services.accounting.store import Ledger, PriceBookEntry
from tests.integration.test_accounting_energy import (
    DAY_S,
    Publisher,
    energy,
    energy_seen,
    ingested,
    running,
    sql,
    usage,
    utc_midnight,
)

J_PER_KWH = 3.6e6


def day_of(epoch_s: float) -> str:
    return dt.datetime.fromtimestamp(epoch_s, dt.UTC).date().isoformat()


async def test_each_period_of_a_dated_tariff_is_priced_at_its_own_rate(nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    midnight = utc_midnight()
    before, now = midnight - 2 * DAY_S + 3600, max(time.time() - 600, midnight + 1)
    # 100 J two days ago (session a), 300 J today (session b)
    for session, t, joules in (("a", before, 100), ("b", now, 300)):
        await publish(energy(1, t, 0, session=session))
        await publish(energy(2, t + 5, joules * 1000, session=session))
    rates = (DatedRate(effective_s=midnight - 3 * DAY_S, usd_per_kwh=0.20),
             DatedRate(effective_s=midnight - DAY_S, usd_per_kwh=0.30))
    async with running(nc, tmp_path / "l.duckdb", electricity_rate_usd_per_kwh=0.10, tariff=rates,
                       retention_days=40) as service:
        await ingested(service, energy_seen(4))
        costs = await service.costs(30)
        daily = {d["day"]: d for d in costs["daily"]}
        assert daily[day_of(before)]["energy_usd"] == pytest.approx(100 / J_PER_KWH * 0.20)
        assert daily[day_of(now)]["energy_usd"] == pytest.approx(300 / J_PER_KWH * 0.30)
        assert costs["window"]["energy_usd"] == pytest.approx((100 * 0.20 + 300 * 0.30) / J_PER_KWH)
        assert costs["rate_usd_per_kwh"] == 0.30
        schedule = [[0.0, 0.10, "--electricity-rate"], [midnight - 3 * DAY_S, 0.20, "--tariff"],
                    [midnight - DAY_S, 0.30, "--tariff"]]
        assert await sql(service, "SELECT epoch(effective_from), usd_per_kwh, source FROM tariff "
                                  "ORDER BY effective_from") == schedule
    # The same flags at the next start change nothing; the configured rate does not override them.
    async with running(nc, tmp_path / "l.duckdb", electricity_rate_usd_per_kwh=0.10, tariff=rates) as service:
        assert await sql(service, "SELECT epoch(effective_from), usd_per_kwh, source FROM tariff "
                                  "ORDER BY effective_from") == schedule
        assert (await service.costs(30))["rate_usd_per_kwh"] == 0.30


def test_a_rate_entered_after_the_fact_prices_again_what_was_rolled_up_even_past_the_retention(
        tmp_path: Path) -> None:
    now = time.time()
    old, recent = now - 10 * DAY_S, now - 3600
    ledger = Ledger(tmp_path / "l.duckdb")
    ledger.set_tariff(0.125, old - DAY_S, "--electricity-rate")
    # 100 J ten days ago, 300 J an hour ago, each made by one request of key k1 (busy energy)
    ledger.insert_usage([usage("old", old + 5, 1), usage("new", recent + 5, 1)])
    ledger.insert_energy([energy(1, old, 0, session="a"),
                          energy(2, old + 5, 100_000, session="a", tokens=(("old", 1),)),
                          energy(1, recent, 0, session="b"),
                          energy(2, recent + 5, 300_000, session="b", tokens=(("new", 1),))])
    ledger.refresh_rollups(now, retention_days=40)

    def priced() -> dict[str, tuple[float, float]]:
        """day → ($ of all energy, $ of key k1's energy), from the daily rollups."""
        rows = ledger.con.execute(
            "SELECT e.day::VARCHAR, e.usd, k.usd "
            "FROM (SELECT day, sum(energy_usd) AS usd FROM energy_daily GROUP BY day) e "
            "JOIN (SELECT day, sum(energy_usd) AS usd FROM key_energy_daily WHERE api_key_id = 'k1' GROUP BY day) k "
            "USING (day)").fetchall()
        return {day: (pytest.approx(total), pytest.approx(key)) for day, total, key in rows}

    assert priced() == {day_of(old): (100 / J_PER_KWH * 0.125,) * 2, day_of(recent): (300 / J_PER_KWH * 0.125,) * 2}
    assert ledger.add_dated_rate(now - 3 * DAY_S, 0.5)
    assert not ledger.add_dated_rate(now - 3 * DAY_S, 0.5)  # the same rate again: nothing to do
    ledger.refresh_rollups(now, retention_days=40)
    assert priced() == {day_of(old): (100 / J_PER_KWH * 0.125,) * 2, day_of(recent): (300 / J_PER_KWH * 0.5,) * 2}
    # The raw rows of ten days ago go; a rate from before then still reaches their rollups.
    ledger.enforce_retention(now, retention_days=5)
    assert ledger.con.execute("SELECT count(*) FROM energy_intervals WHERE end_ts < now() - INTERVAL 5 DAY"
                              ).fetchall() == [(0,)]
    assert ledger.add_dated_rate(now - 20 * DAY_S, 0.2)
    ledger.refresh_rollups(now, retention_days=5)
    assert priced() == {day_of(old): (100 / J_PER_KWH * 0.2,) * 2, day_of(recent): (300 / J_PER_KWH * 0.5,) * 2}
    assert ledger.rate_at(now) == 0.5 and ledger.rate_at(now - 15 * DAY_S) == 0.2
    ledger.close()


async def test_list_value_uses_the_model_price_else_the_star_price(nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    now = max(time.time() - 60, utc_midnight() + 1)
    for request_id, model, prompt, cached, output in (("a", "m1", 10, 4, 20), ("b", "m2", 100, 40, 50),
                                                      ("c", "m1", 7, 0, 3)):
        await publish(UsageRecord(gateway_id="gw", session_id="g", seq=0, ts_s=now, request_id=request_id,
                                  model=model, pool=model, api_key_id="k1", prompt_tokens=prompt,
                                  cached_tokens=cached, output_tokens=output))
    book = {"m1": PriceBookEntry(prompt_usd_per_m=1.0, cached_usd_per_m=0.5, output_usd_per_m=2.0),
            "*": PriceBookEntry(prompt_usd_per_m=0.3, cached_usd_per_m=0.1, output_usd_per_m=0.6)}
    # ((prompt - cached) * P + cached * C + output * O) / 1e6, per model
    m1 = ((10 - 4) * 1.0 + 4 * 0.5 + 20 * 2.0) / 1e6 + ((7 - 0) * 1.0 + 0 * 0.5 + 3 * 2.0) / 1e6
    m2 = ((100 - 40) * 0.3 + 40 * 0.1 + 50 * 0.6) / 1e6  # no row of its own: the '*' row
    async with running(nc, tmp_path / "l.duckdb", price_book=book) as service:
        await ingested(service, lambda s: s.stats.usage_ingested >= 3)
        costs = msgspec.json.decode((await nc.request(subjects.ACCOUNTING_COSTS, encode_json(CostsQuery()),
                                                      timeout=10)).data)
        assert {m["model"]: m["list_value_usd"] for m in costs["by_model"]} == {
            "m1": pytest.approx(m1), "m2": pytest.approx(m2)}
        assert costs["today"]["list_value_usd"] == pytest.approx(m1 + m2)
        assert costs["by_api_key"][0]["list_value_usd"] == pytest.approx(m1 + m2)
        rows = await sql(service, "SELECT model, sum(list_value_usd) FROM daily_usage GROUP BY model ORDER BY model")
        assert rows == [["m1", pytest.approx(m1)], ["m2", pytest.approx(m2)]]
