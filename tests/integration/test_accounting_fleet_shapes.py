"""Energy truth on fleet shapes beyond one worker on one device, replayed through the real accounting
service over a real JetStream (issue 22, parts 3 to 5; docs/accounting.md, "Intervals" and "Rollups").

Expected values are written as arithmetic from the counters published.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest

from proto import EnergyReading, EnergySample, RequestTokens, UsageRecord
from services.accounting.store import Ledger
from tests.integration.test_accounting_energy import Publisher, energy_seen, ingested, running, sql, usage, utc_midnight

RAPL_RANGE_UJ = 262_143_328_850  # max_energy_range_uj of an Intel package zone


def tp_sample(seq: int, ts_s: float, gpu0_mj: int | None, gpu1_mj: int | None,
              tokens: tuple[tuple[str, int], ...] = ()) -> EnergySample:
    """A tensor-parallel worker's sample: both of its GPUs in every sample, tokens once per sample."""
    readings = [EnergyReading(device_id=device, kind="nvml", method="counter" if mj is not None else "unavailable",
                              energy_mj=mj) for device, mj in (("GPU-0", gpu0_mj), ("GPU-1", gpu1_mj))]
    return EnergySample(worker_id="tp", session_id="s1", seq=seq, ts_s=ts_s, model_id="m1", readings=readings,
                        request_tokens=[RequestTokens(request_id=r, output_tokens=n) for r, n in tokens])


def tp_replay(t0: float) -> list[EnergySample]:
    # Window by window (5 s each), GPU-0 J + GPU-1 J and the tokens made in it:
    #   1→2: 1000 + 1200, r1 10 | 2→3: 600 + 600, r1 4 and r2 6 | 3→4: 400 + ? (GPU-1 unavailable), r2 5
    #   4→5: 300 + ? (from the unavailable reading), r2 5 | 5→6: 200 + 200, idle | 6→7: 500 + 600, r1 2
    return [tp_sample(1, t0, 0, 0),
            tp_sample(2, t0 + 5, 1_000_000, 1_200_000, (("r1", 10),)),
            tp_sample(3, t0 + 10, 1_600_000, 1_800_000, (("r1", 4), ("r2", 6))),
            tp_sample(4, t0 + 15, 2_000_000, None, (("r2", 5),)),
            tp_sample(5, t0 + 20, 2_300_000, 2_500_000, (("r2", 5),)),
            tp_sample(6, t0 + 25, 2_500_000, 2_700_000),
            tp_sample(7, t0 + 30, 3_000_000, 3_300_000, (("r1", 2),))]


async def test_a_tensor_parallel_worker_counts_tokens_once_and_j_per_token_over_fully_measured_windows(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = max(time.time() - 600, utc_midnight() + 1)
    samples = tp_replay(t0)
    rng = random.Random(22)
    delivery = samples + rng.sample(samples, 3)  # three delivered twice
    rng.shuffle(delivery)
    for msg in delivery:
        await publish(msg)
    await publish(usage("r1", t0 + 30, 10 + 4 + 2, api_key_id="k1"))
    await publish(usage("r2", t0 + 30, 6 + 5 + 5, api_key_id="k2"))
    # batches of 2: the shuffled samples arrive out of order across batches and are re-derived
    async with running(nc, tmp_path / "l.duckdb", batch_size=2) as service:
        await ingested(service, lambda s: energy_seen(len(delivery))(s) and s.stats.usage_ingested >= 2)
        assert (service.stats.energy_ingested, service.stats.energy_duplicates) == (7, 3)

        measured_j = (1000 + 1200) + (600 + 600) + 400 + 300 + (200 + 200) + (500 + 600)
        busy_j = measured_j - (200 + 200)
        # J per output token: only the windows in which both GPUs were measured (1→2, 2→3, 6→7)
        jpt_j, jpt_tokens = (1000 + 1200) + (600 + 600) + (500 + 600), 10 + (4 + 6) + 2
        output_tokens = 10 + (4 + 6) + 5 + 5 + 2
        # r1 ran alone in 1→2 and 6→7 and made 4 of 10 tokens in 2→3; r2 made 6 of 10 there, and all of
        # GPU-0's measured energy in 3→4 and 4→5 is its (GPU-1's is unknown)
        k1_j = (1000 + 1200) + (600 + 600) * 4 / 10 + (500 + 600)
        k2_j = (600 + 600) * 6 / 10 + 400 + 300
        assert k1_j + k2_j == pytest.approx(busy_j)

        # tokens once, in the raw tables as in the rollups
        assert await sql(service, "SELECT sum(output_tokens) FROM energy_intervals") == [[output_tokens]]
        assert await sql(service, "SELECT sum(output_tokens) FROM energy_attribution") == [[output_tokens]]
        # attributed + idle = measured, for every interval
        assert await sql(service, """
            SELECT i.device_id, i.end_seq, i.energy_j, sum(a.energy_j) FROM energy_intervals i
            LEFT JOIN energy_attribution a USING (worker_id, session_id, device_id, end_seq)
            WHERE i.energy_j IS NOT NULL GROUP BY ALL
            HAVING abs(i.energy_j - coalesce(sum(a.energy_j), -1)) > 1e-9""") == []
        assert await sql(service, "SELECT count(*), count(energy_j) FROM energy_intervals") == [[12, 10]]

        costs = await service.costs(30)
        tp = next(m for m in costs["by_member"] if m["member"] == "tp")
        assert tp["kwh"] == pytest.approx(measured_j / 3.6e6)
        assert tp["j_per_output_token"] == pytest.approx(jpt_j / jpt_tokens)
        # device-time: 6 windows x 2 GPUs x 5 s, of which GPU-1's 3→4 and 4→5 had no valid reading
        assert tp["coverage_pct"] == pytest.approx(100 * (60 - 10) / 60)
        assert await sql(service, "SELECT round(kwh * 3.6e6, 6), round(busy_kwh * 3.6e6, 6), "
                                  "round(idle_kwh * 3.6e6, 6), output_tokens, round(j_per_output_token, 9), "
                                  "round(token_coverage_pct, 9) FROM daily_energy WHERE worker_id = 'tp'") == [
            [measured_j, busy_j, 200 + 200, output_tokens, round(jpt_j / jpt_tokens, 9),
             round(100 * jpt_tokens / output_tokens, 9)]]

        keys = {k["api_key_id"]: k for k in costs["by_api_key"]}
        k1, k2 = keys["k1"], keys["k2"]
        assert k1["kwh"] == pytest.approx(k1_j / 3.6e6) and k2["kwh"] == pytest.approx(k2_j / 3.6e6)
        assert k1["j_per_output_token"] == pytest.approx(k1_j / (10 + 4 + 2)) and k1["coverage_pct"] == 100.0
        # r2's only fully measured window is 2→3 (6 tokens); its 10 tokens of 3→4 and 4→5 count in coverage
        assert k2["j_per_output_token"] == pytest.approx((600 + 600) * 6 / 10 / 6)
        assert k2["coverage_pct"] == pytest.approx(100 * 6 / (6 + 5 + 5))
        assert await sql(service, "SELECT api_key_id, sum(output_tokens), sum(measured_output_tokens) "
                                  "FROM key_energy_daily GROUP BY ALL ORDER BY 1") == [
            ["k1", 10 + 4 + 2, 10 + 4 + 2], ["k2", 6 + 5 + 5, 6]]


async def test_a_rapl_zone_silent_for_40_minutes_is_ambiguous_and_a_short_silence_is_exact_in_microjoules(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = max(time.time() - 3000, utc_midnight() + 1)

    def zone(seq: int, ts_s: float, uj: int, *, old_sender: bool = False) -> EnergySample:
        native: dict[str, Any] = {} if old_sender else {"energy_uj": uj, "max_range_uj": RAPL_RANGE_UJ}
        reading = EnergyReading(device_id="rapl:package-0", kind="rapl", method="counter", energy_mj=uj // 1000,
                                max_range_mj=RAPL_RANGE_UJ // 1000, **native)
        return EnergySample(worker_id="cpu", session_id="s1", seq=seq, ts_s=ts_s, model_id="m1", readings=[reading])

    # 1→2: 60 s, µJ on both ends; 2→3: 40 minutes of silence while the counter rose by 150 kJ (< the
    # range, but 600 W x 2,400 s = 1,440 kJ could have wrapped it unseen); 3→4: 5 s from an old sender.
    await publish(zone(1, t0, 10_000_000_123))
    await publish(zone(2, t0 + 60, 16_000_000_999))
    await publish(zone(3, t0 + 60 + 2400, 166_000_000_999))
    await publish(zone(4, t0 + 60 + 2405, 166_500_000_000, old_sender=True))
    async with running(nc, tmp_path / "l.duckdb") as service:
        await ingested(service, energy_seen(4))
        rows = await sql(service, "SELECT end_seq, energy_j, is_rapl_ambiguous, is_gap, is_implausible, device_s "
                                  "FROM energy_intervals ORDER BY end_seq")
        assert rows == [
            [2, (16_000_000_999 - 10_000_000_123) / 1e6, False, False, False, 60.0],  # exact µJ: 6000.000876 J
            [3, None, True, True, False, 2400.0],
            [4, (166_500_000_000 // 1000 - 166_000_000_999 // 1000) / 1000, False, False, False, 5.0],  # old: mJ
        ]
        assert await sql(service, "SELECT energy_uj, max_range_uj FROM energy_samples ORDER BY seq") == [
            [10_000_000_123, RAPL_RANGE_UJ], [16_000_000_999, RAPL_RANGE_UJ], [166_000_000_999, RAPL_RANGE_UJ],
            [None, None]]
        measured_j = (16_000_000_999 - 10_000_000_123) / 1e6 + (166_500_000 - 166_000_000) / 1000
        covered_pct = 100 * (60 + 5) / (60 + 2400 + 5)  # the ambiguous span is not covered
        daily = await sql(service, "SELECT kwh * 3.6e6, coverage_pct, methods, num_rapl_ambiguous, num_gap "
                                   "FROM daily_energy")
        # a flag counts once per hour its interval touches (the rollups' rule): the 40 minutes touch one or two
        start, end = t0 + 60, t0 + 60 + 2400
        hours = int((end - 1e-6) // 3600) - int(start // 3600) + 1
        assert daily == [[pytest.approx(measured_j), pytest.approx(covered_pct), ["counter"], hours, hours]]
        rolling = await sql(service, "SELECT kwh * 3.6e6, coverage_pct, methods FROM rolling_30d")
        assert rolling == [[pytest.approx(measured_j), pytest.approx(covered_pct), ["counter"]]]
        assert (await service.costs(30))["today"]["coverage_pct"] == pytest.approx(covered_pct)


NEW_COLUMNS = {
    "energy_samples": ("energy_uj", "max_range_uj"),
    "energy_intervals": ("is_rapl_ambiguous", "is_busy", "is_window_measured"),
    "energy_attribution": ("is_window_measured",),
    "energy_hourly": ("num_rapl_ambiguous", "jpt_busy_j", "output_tokens"),
    "energy_daily": ("num_rapl_ambiguous", "jpt_busy_j", "output_tokens"),
    "key_energy_hourly": ("jpt_busy_j",),
    "key_energy_daily": ("jpt_busy_j",),
}


# energy_intervals and energy_attribution as the version before device streams and token carriers wrote them
OLD_DERIVED = {
    "energy_intervals": ",\n".join((
        "worker_id VARCHAR NOT NULL", "session_id VARCHAR NOT NULL", "device_id VARCHAR NOT NULL",
        "start_seq BIGINT NOT NULL", "end_seq BIGINT NOT NULL", "start_ts TIMESTAMPTZ NOT NULL",
        "end_ts TIMESTAMPTZ NOT NULL", "model_id VARCHAR NOT NULL", "kind VARCHAR NOT NULL", "method VARCHAR NOT NULL",
        "energy_j DOUBLE", "device_s DOUBLE NOT NULL", "is_reset BOOLEAN NOT NULL", "is_wrap BOOLEAN NOT NULL",
        "is_gap BOOLEAN NOT NULL", "is_implausible BOOLEAN NOT NULL", "prompt_tokens BIGINT NOT NULL",
        "output_tokens BIGINT NOT NULL", "PRIMARY KEY (worker_id, session_id, device_id, end_seq)")),
    "energy_attribution": ",\n".join((
        "worker_id VARCHAR NOT NULL", "session_id VARCHAR NOT NULL", "device_id VARCHAR NOT NULL",
        "end_seq BIGINT NOT NULL", "start_ts TIMESTAMPTZ NOT NULL", "end_ts TIMESTAMPTZ NOT NULL",
        "model_id VARCHAR NOT NULL", "method VARCHAR NOT NULL", "request_id VARCHAR", "energy_j DOUBLE",
        "prompt_tokens BIGINT NOT NULL", "output_tokens BIGINT NOT NULL")),
}


def to_old_layout(con: duckdb.DuckDBPyConnection) -> None:
    """Rewrite the derived tables in OLD_DERIVED's layout, keeping the rows' old columns."""
    for table, ddl in OLD_DERIVED.items():
        columns = ", ".join(c.split()[0] for c in ddl.split(",\n") if not c.startswith("PRIMARY"))
        con.execute(f"CREATE TEMP TABLE old AS SELECT {columns} FROM {table}")
        con.execute(f"DROP TABLE {table}")
        con.execute(f"CREATE TABLE {table} ({ddl})")
        con.execute(f"INSERT INTO {table} SELECT * FROM old")
        con.execute("DROP TABLE old")


def test_a_ledger_with_intervals_per_session_is_derived_again_as_device_streams_on_open(tmp_path: Path) -> None:
    db = tmp_path / "l.duckdb"
    t0 = 1_767_240_000.0  # 2026-01-01T04:00:00Z
    ledger = Ledger(db)
    fresh = ledger.con.execute("DESCRIBE energy_intervals").fetchall()
    # a restart with the counter rising: sessions s1 (0 → 1000 J) and s2 (1300 → 2300 J) on one GPU
    ledger.insert_energy([reading_on("GPU-R", "w", "s1", 1, t0, 0), reading_on("GPU-R", "w", "s1", 2, t0 + 5, 1000),
                          reading_on("GPU-R", "w", "s2", 1, t0 + 20, 1300),
                          reading_on("GPU-R", "w", "s2", 2, t0 + 25, 2300)])
    ledger.close()
    with duckdb.connect(str(db)) as con:  # what the per-session version wrote: no interval from s1 to s2
        con.execute("DELETE FROM energy_intervals WHERE start_session_id <> end_session_id")
        con.execute("DELETE FROM energy_attribution WHERE end_session_id <> session_id OR end_seq = 1")
        to_old_layout(con)
        con.execute("DELETE FROM rollup_dirty")
        assert con.execute("SELECT sum(energy_j) FROM energy_intervals").fetchall() == [(1000 + 1000,)]
    ledger = Ledger(db)
    try:
        assert ledger.con.execute("DESCRIBE energy_intervals").fetchall() == fresh
        assert ledger.con.execute("SELECT start_session_id, end_session_id, energy_j, is_busy FROM energy_intervals "
                                  "ORDER BY end_ts").fetchall() == [
            ("s1", "s1", 1000.0, False), ("s1", "s2", 1300 - 1000.0, False), ("s2", "s2", 1000.0, False)]
        assert ledger.con.execute("SELECT count(*) FROM rollup_dirty").fetchall() == [(1,)]  # 04:00, to roll up
        ledger.refresh_rollups(t0 + 60, 30)
        assert ledger.con.execute("SELECT measured_j, idle_j, covered_s, device_s FROM energy_daily").fetchall() == [
            (2300.0, 2300.0, 25.0, 25.0)]
    finally:
        ledger.close()


def test_a_ledger_from_before_token_carriers_is_migrated_on_open_and_its_hours_rolled_up_again(
        tmp_path: Path) -> None:
    db = tmp_path / "l.duckdb"
    t0 = 1_767_240_000.0  # 2026-01-01T04:00:00Z
    ledger = Ledger(db)
    fresh = {t: ledger.con.execute(f"DESCRIBE {t}").fetchall() for t in NEW_COLUMNS}
    ledger.insert_energy(tp_replay(t0)[:3])
    ledger.insert_usage([UsageRecord(gateway_id="gw", session_id="g", seq=0, ts_s=t0 + 10, request_id=r, model="m1",
                                     pool="m1", worker_id="tp", api_key_id=k, output_tokens=n, latency_ms=1000.0)
                         for r, k, n in (("r1", "k1", 14), ("r2", "k2", 6))])
    ledger.refresh_rollups(t0 + 60, 30)
    ledger.close()
    # What the previous version wrote: each sample's tokens on every device's rows, rollups that counted
    # them twice, and none of the new columns.
    with duckdb.connect(str(db)) as con:
        for table, request in (("energy_intervals", ""), ("energy_attribution", "request_id")):
            group = ", ".join(["worker_id", "session_id", "end_seq", *([request] if request else [])])
            same = " AND ".join(f"t.{c} = w.{c}" for c in group.split(", "))
            con.execute(f"UPDATE {table} t SET output_tokens = w.n FROM (SELECT {group}, max(output_tokens) AS n "
                        f"FROM {table} WHERE {request or 'true'} IS NOT NULL GROUP BY ALL) w WHERE {same}")
        con.execute("UPDATE energy_hourly SET busy_output_tokens = 2 * busy_output_tokens")
        # ... and its intervals per worker session: the old layout (key, integer tokens, no device stream)
        to_old_layout(con)
        for table, columns in NEW_COLUMNS.items():
            for column in columns:
                if table not in OLD_DERIVED:
                    con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        con.execute("DELETE FROM rollup_dirty")
        assert con.execute("SELECT sum(output_tokens) FROM energy_intervals").fetchall() == [(2 * (10 + 10),)]

    ledger = Ledger(db)
    try:
        assert {t: ledger.con.execute(f"DESCRIBE {t}").fetchall() for t in NEW_COLUMNS} == fresh
        assert ledger.con.execute("SELECT sum(output_tokens), count(*) FILTER (is_busy), "
                                  "count(*) FILTER (is_window_measured), count(*) FILTER (is_rapl_ambiguous) "
                                  "FROM energy_intervals").fetchall() == [(10 + 10, 4, 4, 0)]
        assert ledger.con.execute("SELECT request_id, sum(output_tokens) FROM energy_attribution "
                                  "GROUP BY ALL ORDER BY 1").fetchall() == [("r1", 10 + 4), ("r2", 6)]
        assert ledger.con.execute("SELECT count(*) FROM rollup_dirty").fetchall() == [(1,)]  # 04:00
        ledger.refresh_rollups(t0 + 60, 30)
        jpt = ((1000 + 1200) + (600 + 600)) / (10 + 10)
        assert ledger.con.execute("SELECT busy_output_tokens, output_tokens FROM energy_daily").fetchall() == [
            (10 + 10, 10 + 10)]
        assert ledger.con.execute("SELECT j_per_output_token FROM daily_energy").fetchall() == [(pytest.approx(jpt),)]
        assert ledger.con.execute("SELECT api_key_id, output_tokens FROM key_energy_daily ORDER BY 1").fetchall() == [
            ("k1", 10 + 4), ("k2", 6)]
        assert ledger.con.execute("SELECT api_key_id, j_per_output_token, coverage_pct FROM daily_key_energy "
                                  "ORDER BY 1").fetchall() == [
            ("k1", pytest.approx(((1000 + 1200) + (600 + 600) * 4 / 10) / (10 + 4)), 100.0),
            ("k2", pytest.approx((600 + 600) * 6 / 10 / 6), 100.0)]
    finally:
        ledger.close()


# ---- one stream per device, across workers and sessions (issue 22, parts 1 and 2) ---------------------------

def reading_on(device: str, worker: str, session: str, seq: int, ts_s: float, j: int | None, model: str = "m1",
               tokens: tuple[tuple[str, int], ...] = ()) -> EnergySample:
    """A sample of one worker session reading ``device``'s cumulative counter (``j`` joules, NVML's mJ)."""
    reading = EnergyReading(device_id=device, kind="nvml", method="counter" if j is not None else "unavailable",
                            energy_mj=None if j is None else j * 1000)
    return EnergySample(worker_id=worker, session_id=session, seq=seq, ts_s=ts_s, model_id=model, readings=[reading],
                        request_tokens=[RequestTokens(request_id=r, output_tokens=n) for r, n in tokens])


def shuffled_with_duplicates(samples: list[EnergySample], seed: int) -> list[EnergySample]:
    rng = random.Random(seed)
    delivery = samples + rng.sample(samples, len(samples) // 2)
    rng.shuffle(delivery)
    return delivery


CONSERVATION = """
WITH parts AS (
    SELECT device_id, end_worker_id, end_session_id, end_seq, any_value(interval_energy_j) AS interval_j,
           sum(energy_j) AS parts_j, sum(weight) AS weight FROM energy_intervals GROUP BY ALL
), shares AS (
    SELECT device_id, end_worker_id, end_session_id, end_seq, sum(energy_j) AS shares_j
    FROM energy_attribution GROUP BY ALL
)
SELECT * FROM parts LEFT JOIN shares USING (device_id, end_worker_id, end_session_id, end_seq)
WHERE abs(weight - 1) > 1e-9
   OR interval_j IS NOT NULL AND (abs(interval_j - parts_j) > 1e-9 OR abs(interval_j - coalesce(shares_j, -1)) > 1e-9)
"""


async def test_two_processes_on_one_gpu_at_different_periods_count_its_energy_once_and_split_idle_by_overlap(
        nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = max(time.time() - 600, utc_midnight() + 1)
    # GPU-U, read by worker a (model m1) every 10 s and worker b (model m2) every 5 s, offset by 5 s.
    # The device's stream: 0 →(5 s) 500 J → 1000 → 1500 → 2000 → 2500 → 3200 → 3700: 3700 J, counted once.
    a = [reading_on("GPU-U", "a", "sa", 1, t0, 0),
         reading_on("GPU-U", "a", "sa", 2, t0 + 10, 1000, tokens=(("ra", 10),)),
         reading_on("GPU-U", "a", "sa", 3, t0 + 20, 2000), reading_on("GPU-U", "a", "sa", 4, t0 + 30, 3200)]
    b = [reading_on("GPU-U", "b", "sb", 1, t0 + 5, 500, "m2"),
         reading_on("GPU-U", "b", "sb", 2, t0 + 15, 1500, "m2", (("rb", 5),)),
         reading_on("GPU-U", "b", "sb", 3, t0 + 25, 2500, "m2"), reading_on("GPU-U", "b", "sb", 4, t0 + 35, 3700, "m2")]
    for msg in shuffled_with_duplicates(a + b, 1):
        await publish(msg)
    await publish(usage("ra", t0 + 10, 10, api_key_id="k1"))
    await publish(usage("rb", t0 + 15, 5, api_key_id="k2"))
    async with running(nc, tmp_path / "l.duckdb", batch_size=3) as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= 8 and s.stats.usage_ingested >= 2)
        costs = await service.costs(30)  # refreshes the rollups first
        # ra's window (0, 10] puts 5 tokens in each of 0→5 and 5→10; rb's (5, 15] 2.5 in 5→10 and 10→15.
        # 0→5: ra alone 500 | 5→10: ra 500 x 5/7.5, rb 500 x 2.5/7.5 | 10→15: rb 500 | then idle, split by
        # the overlap of each worker's windows: 15→20 a (10,20] 5 s, b (15,25] 5 s: 250 + 250 | 20→25 a
        # (20,30], b (15,25]: 250 + 250 | 25→30 a (20,30], b (25,35]: 350 + 350 | 30→35 b alone 500.
        ra_j, rb_j = 500 + 500 * 5 / 7.5, 500 * 2.5 / 7.5 + 500
        idle_a, idle_b = 250 + 250 + 350, 250 + 250 + 350 + 500
        assert ra_j + rb_j + idle_a + idle_b == pytest.approx(3700)
        assert await sql(service, CONSERVATION) == []
        assert await sql(service, "SELECT count(DISTINCT (end_worker_id, end_session_id, end_seq)), "
                                  "round(sum(energy_j), 9) FROM energy_intervals") == [[7, 3700]]
        daily = await sql(service, "SELECT worker_id, model_id, round(kwh * 3.6e6, 6), round(busy_kwh * 3.6e6, 6), "
                                   "round(idle_kwh * 3.6e6, 6), output_tokens, round(j_per_output_token, 6), "
                                   "coverage_pct FROM daily_energy ORDER BY worker_id")
        assert daily == [["a", "m1", round(ra_j + idle_a, 6), round(ra_j, 6), idle_a, 10, round(ra_j / 10, 6), 100.0],
                         ["b", "m2", round(rb_j + idle_b, 6), round(rb_j, 6), idle_b, 5, round(rb_j / 5, 6), 100.0]]
        # device-time splits like the energy: 35 s in all
        assert await sql(service, "SELECT round(sum(device_s), 9) FROM energy_daily") == [[35.0]]
        assert costs["today"]["kwh"] == pytest.approx(3700 / 3.6e6)
        keys = {k["api_key_id"]: k for k in costs["by_api_key"]}
        assert keys["k1"]["kwh"] == pytest.approx(ra_j / 3.6e6) and keys["k2"]["kwh"] == pytest.approx(rb_j / 3.6e6)
        assert keys["k1"]["j_per_output_token"] == pytest.approx(ra_j / 10)
        assert keys["k2"]["j_per_output_token"] == pytest.approx(rb_j / 5)


async def test_intervals_bridge_sessions_restarts_resets_a_day_off_and_colliding_seqs(nc: Any, tmp_path: Path) -> None:
    publish = Publisher(nc)
    t0 = max(time.time() - 600, utc_midnight() + 1)
    day_s = 86400
    samples = [
        # GPU-R: worker w restarts (session s1 → s2) with the counter still rising; s2's seqs collide with s1's
        reading_on("GPU-R", "w", "s1", 1, t0, 0), reading_on("GPU-R", "w", "s1", 2, t0 + 5, 1000, tokens=(("r1", 10),)),
        reading_on("GPU-R", "w", "s2", 1, t0 + 20, 1300), reading_on("GPU-R", "w", "s2", 2, t0 + 25, 2300,
                                                                      tokens=(("r2", 5),)),
        # GPU-X: a driver reset between worker x's sessions a and b (the counter starts again near 0)
        reading_on("GPU-X", "x", "a", 1, t0, 5000), reading_on("GPU-X", "x", "a", 2, t0 + 5, 6000),
        reading_on("GPU-X", "x", "b", 1, t0 + 10, 200), reading_on("GPU-X", "x", "b", 2, t0 + 15, 700,
                                                                   tokens=(("rx", 5),)),
        # GPU-D: host h off for a day, and its counter reset meanwhile
        reading_on("GPU-D", "h", "a", 1, t0 - day_s - 10, 9000), reading_on("GPU-D", "h", "a", 2, t0 - day_s - 5, 9500),
        reading_on("GPU-D", "h", "b", 1, t0, 100), reading_on("GPU-D", "h", "b", 2, t0 + 5, 600),
    ]
    for msg in shuffled_with_duplicates(samples, 2):
        await publish(msg)
    async with running(nc, tmp_path / "l.duckdb", batch_size=3) as service:
        await ingested(service, lambda s: s.stats.energy_ingested >= len(samples))
        costs = await service.costs(30)  # refreshes the rollups first
        assert await sql(service, "SELECT count(*) FROM sample_log") == [[len(samples)]]  # colliding seqs both kept
        rows = await sql(service, "SELECT device_id, start_session_id, end_session_id, end_seq, energy_j, is_reset, "
                                  "is_gap, is_busy, device_s FROM energy_intervals ORDER BY device_id, end_ts")
        assert rows == [
            ["GPU-D", "a", "a", 2, 500.0, False, False, False, 5.0],
            ["GPU-D", "a", "b", 1, None, True, True, False, day_s + 5.0],  # counter down and nobody watching
            ["GPU-D", "b", "b", 2, 500.0, False, False, False, 5.0],
            ["GPU-R", "s1", "s1", 2, 1000.0, False, False, True, 5.0],
            ["GPU-R", "s1", "s2", 1, 300.0, False, False, False, 15.0],  # the restart: exact, idle
            ["GPU-R", "s2", "s2", 2, 1000.0, False, False, True, 5.0],
            ["GPU-X", "a", "a", 2, 1000.0, False, False, False, 5.0],
            ["GPU-X", "a", "b", 1, None, True, False, False, 5.0],  # the driver reset
            ["GPU-X", "b", "b", 2, 500.0, False, False, True, 5.0],
        ]
        assert await sql(service, CONSERVATION) == []
        daily = {w: r for w, *r in await sql(service, "SELECT worker_id, sum(measured_j), sum(idle_j), sum(covered_s), "
                                                       "sum(device_s), sum(num_reset), sum(num_gap) FROM energy_daily "
                                                       "GROUP BY ALL")}
        assert daily["w"] == [pytest.approx(2300), pytest.approx(300), pytest.approx(25), pytest.approx(25), 0, 0]
        assert daily["x"] == [pytest.approx(1500), pytest.approx(1000), pytest.approx(10), pytest.approx(15), 1, 0]
        # a flag counts once per hour its interval touches (the rollups' rule): the day off touches 25 or 26
        assert daily["h"][:4] == [pytest.approx(1000), pytest.approx(1000), pytest.approx(10),
                                  pytest.approx(day_s + 15)]
        assert daily["h"][4] == daily["h"][5] and daily["h"][4] in (25, 26)
        # every day the host's silence touches shows it uncovered
        per_day = await sql(service, "SELECT day, coverage_pct FROM daily_energy WHERE worker_id = 'h' ORDER BY day")
        assert len(per_day) >= 2 and all(pct < 100 for _, pct in per_day)
        w = next(m for m in costs["by_member"] if m["member"] == "w")
        assert w["kwh"] == pytest.approx(2300 / 3.6e6) and w["coverage_pct"] == 100.0
        assert w["j_per_output_token"] == pytest.approx((1000 + 1000) / (10 + 5))
