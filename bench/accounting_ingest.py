"""Accounting ingest and rollup latency (issue #7).

1. **Usage ingest, end to end**: N ``UsageRecord``s are published to the ``USAGE`` stream of a real
   ``nats-server`` (JetStream, file storage) before the consumer starts; then an ``AccountingService``
   starts and the clock runs from its start until all N are committed to DuckDB and acked.
2. **Energy ingest, end to end**: the same with ``EnergySample``s of one worker with ``--gpus`` devices and
   ``--requests-per-sample`` request token counts per sample (1 s apart, in order): stored raw, intervals
   derived, energy attributed, rollups refreshed.
3. **Rollup queries** over ``--days`` days x ``--gpus`` GPUs of 1 Hz intervals, generated directly in
   DuckDB (``energy_intervals`` rows, plus one request per second in ``energy_attribution``): the rollup
   refresh of every hour is timed once, then today's and the 30-day queries are timed ``--repeat`` times.

    .venv/bin/python bench/accounting_ingest.py [--usage 100000] [--energy 20000] [--days 30] [--gpus 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from proto import EnergyReading, EnergySample, RequestTokens, UsageRecord, encode, subjects
from services.accounting.service import AccountingConfig, AccountingService
from services.accounting.store import Ledger
from services.common.bus import connect, ensure_bus
from services.common.nats_server import EmbeddedNatsServer


async def _publish(nc: Any, messages: list[tuple[str, bytes]], label: str) -> None:
    """Core publishes into the stream's subjects (JetStream stores them), flushed in chunks."""
    for i, (subject, data) in enumerate(tqdm(messages, desc=f"publish {label}", unit="msg", mininterval=1.0)):
        await nc.publish(subject, data)
        if i % 5000 == 4999:
            await nc.flush()
    await nc.flush()
    js = nc.jetstream()
    stream = subjects.STREAM_USAGE if label == "usage" else subjects.STREAM_ENERGY
    while (await js.stream_info(stream)).state.messages < len(messages):
        await asyncio.sleep(0.05)


async def _time_ingest(nc: Any, db: Path, label: str, total: int) -> float:
    service = AccountingService(nc, AccountingConfig(db_path=db, batch_size=1024, fetch_timeout_s=0.2))

    def done() -> int:
        s = service.stats
        return s.usage_ingested if label == "usage" else s.energy_ingested

    started = time.perf_counter()
    task = asyncio.create_task(service.run())
    try:
        with tqdm(total=total, desc=f"ingest {label}", unit="rec", mininterval=1.0) as bar:
            while done() < total:
                service.ingested.clear()
                await asyncio.wait_for(service.ingested.wait(), 60)
                bar.update(done() - bar.n)
        return time.perf_counter() - started
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def ingest_rates(work: Path, num_usage: int, num_energy: int, gpus: int, requests_per_sample: int
                       ) -> dict[str, float]:
    async with EmbeddedNatsServer(work / "nats") as server:
        nc = await connect(server.url, "bench")
        await ensure_bus(nc)
        t0 = time.time() - num_energy - 60
        usage = [(subjects.usage("gw"), encode(UsageRecord(
            gateway_id="gw", session_id="s", seq=i, ts_s=t0 + i * 0.01, request_id=f"req-{i}", model="m", pool="m",
            worker_id="w1", api_key_id=f"k{i % 50}", prompt_tokens=500, cached_tokens=100, output_tokens=200,
            latency_ms=800.0))) for i in range(num_usage)]
        await _publish(nc, usage, "usage")
        usage_s = await _time_ingest(nc, work / "usage.duckdb", "usage", num_usage)
        energy = [(subjects.energy("w1"), encode(EnergySample(
            worker_id="w1", session_id="s", seq=i, ts_s=t0 + i, model_id="m",
            readings=[EnergyReading(device_id=f"GPU-{g}", kind="nvml", method="counter", energy_mj=i * 300_000 + g)
                      for g in range(gpus)],
            request_tokens=[RequestTokens(request_id=f"req-{i}-{r}", output_tokens=20)
                            for r in range(requests_per_sample)]))) for i in range(num_energy)]
        await _publish(nc, energy, "energy")
        energy_s = await _time_ingest(nc, work / "energy.duckdb", "energy", num_energy)
        await nc.drain()
    return {"usage_per_s": num_usage / usage_s, "usage_s": usage_s,
            "energy_per_s": num_energy / energy_s, "energy_s": energy_s}


def rollup_latency(work: Path, days: int, gpus: int, repeat: int) -> dict[str, Any]:
    ledger = Ledger(work / "rollups.duckdb")
    ledger.set_tariff(0.125, 0.0, "bench")
    now = time.time()
    start = int(now) - days * 86400
    num = days * 86400
    t = time.perf_counter()
    for g in tqdm(range(gpus), desc="generate intervals", unit="gpu"):
        ledger.con.execute("""
            INSERT INTO energy_intervals
            SELECT 'w1', 's', $2, i, i + 1, to_timestamp($1 + i), to_timestamp($1 + i + 1), 'm', 'nvml', 'counter',
                   300.0, 1.0, false, false, false, false, 0, CASE WHEN i % 4 = 0 THEN 0 ELSE 20 END
            FROM range($3) r(i)""", [start, f"GPU-{g}", num])
    ledger.con.execute("""
        INSERT INTO energy_attribution
        SELECT 'w1', 's', 'GPU-0', i + 1, to_timestamp($1 + i), to_timestamp($1 + i + 1), 'm', 'counter',
               'req-' || (i // 10), 300.0 * $2, 0, 20
        FROM range($3) r(i) WHERE i % 4 <> 0""", [start, gpus, num])
    generate_s = time.perf_counter() - t
    ledger.con.execute("INSERT INTO rollup_dirty SELECT DISTINCT date_trunc('hour', end_ts) FROM energy_intervals")
    t = time.perf_counter()
    hours = ledger.refresh_rollups(now, days + 2)
    refresh_s = time.perf_counter() - t
    queries = {
        "costs document (today + 30 d + breakdowns)": lambda: ledger.costs(now, 30),
        "today's kWh by model (daily_energy)": lambda: ledger.query(
            "SELECT model_id, kwh, energy_usd FROM daily_energy WHERE day = current_date"),
        "30-day kWh and $ (rolling_30d)": lambda: ledger.query("SELECT * FROM rolling_30d"),
    }
    latencies = {}
    for name, fn in queries.items():
        samples = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t) * 1000)
        latencies[name] = (statistics.median(samples), max(samples))
    rows = ledger.con.execute("SELECT count(*) FROM energy_intervals").fetchone()
    ledger.close()
    return {"intervals": rows[0] if rows else 0, "generate_s": generate_s, "refresh_s": refresh_s, "hours": hours,
            "latencies_ms": latencies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--usage", type=int, default=100_000)
    parser.add_argument("--energy", type=int, default=20_000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--requests-per-sample", type=int, default=8)
    parser.add_argument("--days", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="acct-bench-") as tmp:
        work = Path(tmp)
        rates = asyncio.run(ingest_rates(work, args.usage, args.energy, args.gpus, args.requests_per_sample))
        rollups = rollup_latency(work, args.days, args.gpus, args.repeat)
    print()
    print("| measurement | value |")
    print("|---|---|")
    print(f"| usage ingest, end to end ({args.usage:,} records) | {rates['usage_per_s']:,.0f} records/s "
          f"({rates['usage_s']:.2f} s) |")
    print(f"| energy ingest, end to end ({args.energy:,} samples x {args.gpus} GPUs x "
          f"{args.requests_per_sample} requests) | {rates['energy_per_s']:,.0f} samples/s ({rates['energy_s']:.2f} s; "
          f"{rates['energy_per_s'] * args.gpus:,.0f} device readings/s) |")
    print(f"| generate {rollups['intervals']:,} intervals ({args.days} d x {args.gpus} GPUs x 1 Hz) in DuckDB | "
          f"{rollups['generate_s']:.1f} s |")
    print(f"| rollup refresh of all {rollups['hours']} hours | {rollups['refresh_s']:.1f} s |")
    for name, (p50, worst) in rollups["latencies_ms"].items():
        print(f"| {name}: p50 / max of {args.repeat} | {p50:.1f} ms / {worst:.1f} ms |")


if __name__ == "__main__":
    main()
