"""The accounting I/O shell: durable USAGE consumer and the SQL responder."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import decimal
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.client import JetStreamContext

from proto import ProtoDecodeError, UsageRecord, decode, subjects
from services.accounting.store import LedgerThread, QueryFailed, QueryRejected
from services.common.runtime import raise_if_cancelling

log = logging.getLogger(__name__)

USAGE_DURABLE = "accounting-usage"


@dataclass(frozen=True)
class AccountingConfig:
    db_path: Path
    batch_size: int = 512
    fetch_timeout_s: float = 1.0


@dataclass
class AccountingStats:
    usage_ingested: int = 0
    usage_duplicates: int = 0
    poison_messages: int = 0


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


class AccountingService:
    def __init__(self, nc: Client, config: AccountingConfig) -> None:
        self.nc = nc
        self.config = config
        self.stats = AccountingStats()
        self.ledger = LedgerThread(config.db_path)
        self.ingested = asyncio.Event()  # set after every committed batch (tests await it)
        self._psub: JetStreamContext.PullSubscription | None = None

    async def run(self) -> None:
        sql_sub = await self.nc.subscribe(subjects.ACCOUNTING_SQL, cb=self._on_sql)
        try:
            await self._consume_usage()
        finally:
            # Unsubscribe before the connection drains, so the drain does not wait on a pending fetch.
            for sub in (sql_sub, self._psub):
                with contextlib.suppress(Exception):
                    if sub is not None:
                        await sub.unsubscribe()
            self.ledger.close()

    async def _consume_usage(self) -> None:
        js = self.nc.jetstream()
        self._psub = psub = await js.pull_subscribe(
            subjects.USAGE_SUBJECTS,
            durable=USAGE_DURABLE,
            stream=subjects.STREAM_USAGE,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, max_ack_pending=20_000, ack_wait=60.0),
        )
        while True:
            try:
                msgs = await psub.fetch(self.config.batch_size, timeout=self.config.fetch_timeout_s)
            except (NatsTimeout, TimeoutError):  # nats-py raises either on an empty fetch
                raise_if_cancelling()
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # bus trouble (reconnecting, …): nothing is acked, so nothing is lost
                raise_if_cancelling()
                log.warning("usage fetch failed: %s; retrying", exc)
                await asyncio.sleep(1.0)
                continue
            await self._ingest(msgs)

    async def _ingest(self, msgs: list[Msg]) -> None:
        records: list[UsageRecord] = []
        good: list[Msg] = []
        for msg in msgs:
            try:
                records.append(decode(msg.data, UsageRecord))
                good.append(msg)
            except ProtoDecodeError as exc:
                # Poison: count it and stop redelivery (term), never retry it forever.
                self.stats.poison_messages += 1
                log.warning("parked undecodable usage message on %s: %s", msg.subject, exc.reason)
                await msg.term()
        if records:
            added = await asyncio.wrap_future(self.ledger.submit(lambda ledger: ledger.insert_usage(records)))
            self.stats.usage_ingested += added
            self.stats.usage_duplicates += len(records) - added
            # Ack only after the commit: a crash before this line means redelivery, which the
            # primary key turns into a no-op.
            for msg in good:
                await msg.ack()
            log.debug("ingested %d usage records (%d duplicates)", added, len(records) - added)
        self.ingested.set()

    async def _on_sql(self, msg: Msg) -> None:
        try:
            request = msgspec.json.decode(msg.data)
            sql = request["sql"] if isinstance(request, dict) else None
            if not isinstance(sql, str):
                raise QueryRejected('send {"sql": "SELECT …"}')
            columns, rows = await asyncio.wrap_future(self.ledger.submit(lambda ledger: ledger.query(sql)))
            reply: dict[str, Any] = {"columns": columns, "rows": [[_jsonable(v) for v in r] for r in rows]}
        except (QueryRejected, QueryFailed) as exc:
            reply = {"error": str(exc)}
        except msgspec.DecodeError:
            reply = {"error": "request is not JSON"}
        await msg.respond(msgspec.json.encode(reply))
