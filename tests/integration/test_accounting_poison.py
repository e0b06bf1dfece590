"""Poison messages through a real nats-server: a message that decodes but cannot be stored is parked alone.

Before: ``ts_s = inf`` (or a ``seq`` past BIGINT) escaped the consumer, stopped the service, and on every
restart the same batch came back and stopped it again; the good records beside it were never stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import duckdb

from proto import EnergyReading, EnergySample, UsageRecord, encode, subjects
from services.accounting import schema
from services.accounting.service import AccountingConfig, AccountingService
from tests.integration.conftest import wait_for
from tests.integration.test_accounting_energy import energy, sql


def usage(request_id: str, *, ts_s: float = 1.7e9, output_tokens: int = 5) -> UsageRecord:
    return UsageRecord(gateway_id="gw", session_id="s", seq=0, ts_s=ts_s, request_id=request_id, model="m",
                       pool="m", output_tokens=output_tokens)


async def publish(nc: Any, *msgs: UsageRecord | EnergySample) -> None:
    js = nc.jetstream()
    for msg in msgs:
        subject = subjects.energy(msg.worker_id) if isinstance(msg, EnergySample) else subjects.usage("gw")
        await js.publish(subject, encode(msg))


@contextlib.asynccontextmanager
async def running(nc: Any, db: Path) -> AsyncIterator[tuple[AccountingService, asyncio.Task[None]]]:
    service = AccountingService(nc, AccountingConfig(db_path=db, fetch_timeout_s=0.1, ack_wait_s=1.0))
    task = asyncio.create_task(service.run())
    try:
        yield service, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def seen(service: AccountingService, num_usage: int, num_energy: int, num_parked: int) -> bool:
    s = service.stats
    return (s.usage_ingested >= num_usage and s.energy_ingested >= num_energy and s.poison_messages >= num_parked)


async def test_a_message_that_cannot_be_stored_is_parked_and_the_rest_of_its_batch_is_stored(
        nc: Any, tmp_path: Path) -> None:
    t0 = time.time() - 60
    bad_energy = EnergySample(worker_id="w1", session_id="s1", seq=2, ts_s=t0 + 5, model_id="m1",
                              readings=[EnergyReading(device_id="GPU-0", kind="nvml", method="counter",
                                                      energy_mj=2**63)])
    # one batch per stream: good, poison, good
    await publish(nc, usage("good-1"), usage("bad", ts_s=math.inf), usage("good-2"),
                  energy(1, t0, 1_000_000), bad_energy, energy(3, t0 + 10, 1_400_000))
    async with running(nc, tmp_path / "l.duckdb") as (service, task):
        await wait_for(lambda: seen(service, 2, 2, 2) or task.done())
        assert not task.done()  # still consuming
        assert (service.stats.usage_ingested, service.stats.energy_ingested, service.stats.poison_messages) == (2, 2, 2)
        assert await sql(service, "SELECT request_id FROM requests ORDER BY request_id") == [["good-1"], ["good-2"]]
        assert await sql(service, "SELECT seq FROM sample_log ORDER BY seq") == [[1], [3]]
        # the interval spans the parked sample: flagged as a gap, its energy kept (the counter is cumulative)
        assert await sql(service, "SELECT start_seq, end_seq, energy_j, is_gap FROM energy_intervals") == [
            [1, 3, (1_400_000 - 1_000_000) / 1000, True]]
        assert await sql(service, "SELECT stream, subject, stream_seq, reason FROM parked ORDER BY stream") == [
            ["ENERGY", subjects.energy("w1"), 2, f"invalid: readings['GPU-0'].energy_mj {2**63} is outside "
                                                 f"[0, {2**63 - 1}]"],
            ["USAGE", subjects.usage("gw"), 2, "invalid: ts_s is inf, not a finite number"]]
        # and later messages still arrive
        await publish(nc, usage("good-3"))
        await wait_for(lambda: service.stats.usage_ingested >= 3)
    # Terminated, not redelivered: a restart finds nothing left to park.
    async with running(nc, tmp_path / "l.duckdb") as (again, task):
        await publish(nc, usage("good-4"))
        await wait_for(lambda: again.stats.usage_ingested >= 1 or task.done())
        await asyncio.sleep(0.3)
        assert (again.stats.usage_ingested, again.stats.poison_messages, task.done()) == (1, 0, False)


def refusing(checks: dict[str, str]) -> str:
    """The ledger's tables with a CHECK added to some (table → condition): a ledger that refuses rows
    that validation accepts, as a DuckDB error no check foresaw would."""
    tables = schema.TABLES
    for table, check in checks.items():
        start = tables.index(f"CREATE TABLE IF NOT EXISTS {table} (")
        end = tables.index("\n);", start)
        tables = tables[:end] + f",\n    CHECK ({check})" + tables[end:]
    return tables


async def test_a_message_the_ledger_refuses_is_parked_alone(nc: Any, tmp_path: Path) -> None:
    db = tmp_path / "l.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute(refusing({"requests": "output_tokens <> 13", "sample_log": "seq <> 2"}))
    t0 = time.time() - 60
    await publish(nc, usage("r1", output_tokens=1), usage("r13", output_tokens=13), usage("r3", output_tokens=3),
                  energy(1, t0, 1_000_000), energy(2, t0 + 5, 1_200_000), energy(3, t0 + 10, 1_400_000))
    async with running(nc, db) as (service, task):
        await wait_for(lambda: seen(service, 2, 2, 2) or task.done())
        assert not task.done()
        assert (service.stats.usage_ingested, service.stats.energy_ingested, service.stats.poison_messages) == (2, 2, 2)
        assert await sql(service, "SELECT request_id FROM requests ORDER BY request_id") == [["r1"], ["r3"]]
        assert await sql(service, "SELECT start_seq, end_seq, energy_j, is_gap FROM energy_intervals") == [
            [1, 3, (1_400_000 - 1_000_000) / 1000, True]]
        parked = await sql(service, "SELECT stream, stream_seq, reason FROM parked ORDER BY stream")
        assert [(p[0], p[1]) for p in parked] == [("ENERGY", 2), ("USAGE", 2)]
        assert all(p[2].startswith("refused by the ledger: ConstraintException") and "CHECK" in p[2] for p in parked)
