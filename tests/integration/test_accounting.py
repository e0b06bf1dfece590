"""Accounting against a real nats-server: durable consumer, duplicates, poison messages, SQL guard."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proto import UsageRecord, encode, subjects
from services.accounting.service import AccountingConfig, AccountingService
from services.accounting.store import Ledger, QueryRejected
from tests.integration.conftest import wait_for


def record(i: int) -> UsageRecord:
    return UsageRecord(gateway_id="gw", session_id="s", seq=i, ts_s=1.7e9 + i, request_id=f"r{i}", model="m",
                       pool="m", prompt_tokens=10, output_tokens=i)


async def test_redelivered_and_duplicate_records_count_once_and_poison_is_parked(nc, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    js = nc.jetstream()
    # r1 published twice with different message ids (so the stream keeps both): the ledger dedupes.
    for i, msg_id in [(1, "a"), (1, "b"), (2, "c")]:
        await js.publish(subjects.usage("gw"), encode(record(i)), headers={"Nats-Msg-Id": msg_id})
    await js.publish(subjects.usage("gw"), b"\x00not msgpack")
    service = AccountingService(nc, AccountingConfig(db_path=tmp_path / "l.duckdb", fetch_timeout_s=0.2))
    task = asyncio.create_task(service.run())
    try:
        await wait_for(lambda: service.stats.usage_ingested + service.stats.usage_duplicates >= 3
                       and service.stats.poison_messages == 1)
        assert (service.stats.usage_ingested, service.stats.usage_duplicates) == (2, 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # A restarted service resumes the durable consumer: nothing is ingested again.
    await js.publish(subjects.usage("gw"), encode(record(3)), headers={"Nats-Msg-Id": "d"})
    again = AccountingService(nc, AccountingConfig(db_path=tmp_path / "l.duckdb", fetch_timeout_s=0.2))
    task = asyncio.create_task(again.run())
    try:
        await wait_for(lambda: again.stats.usage_ingested >= 1)
        await asyncio.sleep(0.5)
        assert (again.stats.usage_ingested, again.stats.usage_duplicates, again.stats.poison_messages) == (1, 0, 0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    ledger = Ledger(tmp_path / "l.duckdb", read_only=True)
    assert ledger.query("select request_id, output_tokens from requests order by request_id")[1] == [
        ("r1", 1), ("r2", 2), ("r3", 3)]
    ledger.close()


@pytest.mark.parametrize("sql", [
    "insert into requests (request_id) values ('x')",
    "delete from requests",
    "select 1; select 2",
    "attach 'other.db' as o",
    "drop table requests",
    "not sql at all",
])
def test_the_sql_guard_refuses_anything_but_one_select(tmp_path: Path, sql: str) -> None:
    ledger = Ledger(tmp_path / "l.duckdb")
    with pytest.raises(QueryRejected):
        ledger.query(sql)
    assert ledger.query("select count(*) from requests")[1] == [(0,)]
    ledger.close()
