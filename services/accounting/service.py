"""The accounting I/O shell: durable USAGE and ENERGY consumers, rollup and retention jobs, the SQL, costs
and key-energy responders on the bus, and the admin HTTP server (``POST /sql``, ``GET /costs``).

Exactly once: messages are fetched in batches from durable pull consumers, written in one DuckDB
transaction, and acknowledged only after the commit. A crash before the ack means redelivery, which
the ledger's message identities (request id; worker/session/seq) turn into a no-op.

Poison: a message that does not decode, fails :mod:`validation`, or that the ledger still refuses is
stored in ``parked`` with the reason and terminated, never retried forever. A refused batch is written
again one message at a time, so one bad message never holds back the good ones beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig

from proto import (
    AuthCheck,
    AuthReply,
    CostsQuery,
    CostsReport,
    EnergySample,
    ErrorDetail,
    ErrorReply,
    KeyEnergyQuery,
    KeyEnergyReply,
    ProtoDecodeError,
    SqlQuery,
    SqlReply,
    UsageRecord,
    decode,
    decode_json,
    encode,
    encode_json,
    subjects,
)
from proto import pools as pool_config
from services.accounting import openapi, sql_values
from services.accounting.intervals import Limits
from services.accounting.puller import BatchPuller
from services.accounting.sql_runner import QueryBusy, QueryLimits, QueryRunner, QueryTimedOut, ResultTooLarge
from services.accounting.store import (
    LEDGER_ERRORS,
    REFUSED_VALUE_ERRORS,
    LedgerThread,
    PriceBookEntry,
    QueryFailed,
    QueryRejected,
)
from services.accounting.validation import energy_problem, month_bounds, usage_problem
from services.common.http import HTTPError, error_middleware, read_json_object, serving
from services.common.runtime import ConfigError, raise_if_cancelling

log = logging.getLogger(__name__)

USAGE_DURABLE = "accounting-usage"
ENERGY_DURABLE = "accounting-energy"


def price_book_of(pools: pool_config.GatewayFileConfig) -> dict[str, PriceBookEntry]:
    return {model: PriceBookEntry(p.prompt_usd_per_m, p.cached_usd_per_m, p.output_usd_per_m)
            for model, p in pools.price_book.items()}


@dataclass(frozen=True)
class DatedRate:
    """``--tariff``: ``usd_per_kwh`` in force from ``effective_s`` (epoch s, UTC) until the next rate."""

    effective_s: float
    usd_per_kwh: float


@dataclass(frozen=True)
class AccountingConfig:
    """``port`` None: no HTTP server (the bus responders still run); 0 picks a free port."""

    db_path: Path
    batch_size: int = 512
    fetch_timeout_s: float = 1.0
    # A batch fetched but not acked (the process stopped mid-batch) is redelivered after this long.
    ack_wait_s: float = 15.0  # ingest is idempotent: a crash mid-batch delays the ledger this long, no more
    host: str = "127.0.0.1"
    port: int | None = None
    electricity_rate_usd_per_kwh: float = 0.125
    tariff: tuple[DatedRate, ...] = ()
    price_book: dict[str, PriceBookEntry] = field(default_factory=dict)
    retention_days: float = 30.0
    maintenance_interval_s: float = 3600.0
    rollup_interval_s: float = 2.0
    # Operator SQL (docs/accounting.md, "SQL limits"); the defaults are QueryLimits'.
    query_timeout_s: float = QueryLimits.timeout_s
    max_query_rows: int = QueryLimits.max_rows
    max_sql_chars: int = QueryLimits.max_sql_chars
    max_result_bytes: int = QueryLimits.max_result_bytes
    num_query_readers: int = QueryLimits.num_readers
    max_queued_queries: int = QueryLimits.max_queued
    auth_timeout_s: float = 2.0
    export_dir: Path | None = None
    limits: Limits = field(default_factory=Limits)


@dataclass
class AccountingStats:
    usage_ingested: int = 0
    usage_duplicates: int = 0
    energy_ingested: int = 0
    energy_duplicates: int = 0
    poison_messages: int = 0
    rollup_refreshes: int = 0


class AccountingService:
    def __init__(self, nc: Client, config: AccountingConfig) -> None:
        self.nc = nc
        self.config = config
        self.stats = AccountingStats()
        self.ledger = LedgerThread(config.db_path, config.limits, config.num_query_readers)
        ledger = self.ledger.ledger
        self.queries = QueryRunner(ledger.query_cursors, lambda cursor, sql: ledger.check(
            cursor, sql, config.max_sql_chars), self.query_limits)
        now_s = time.time()
        self.ledger.submit(lambda ledger: ledger.set_tariff(config.electricity_rate_usd_per_kwh, now_s,
                                                            "--electricity-rate")).result()
        for rate in config.tariff:  # after the configured rate: on a new ledger that one covers the time before
            self.ledger.submit(lambda ledger: ledger.add_dated_rate(rate.effective_s, rate.usd_per_kwh)).result()
        if config.price_book:
            self.ledger.submit(lambda ledger: ledger.set_price_book(config.price_book)).result()
        self.ingested = asyncio.Event()  # set after every committed batch (tests await it)
        self.ready = asyncio.Event()  # set once the responders (and the HTTP server, if any) are up
        self.config_applied = asyncio.Event()  # set after a gateway's config change was applied (tests)
        self.url: str | None = None
        self._subs: list[Any] = []
        self._pullers: list[BatchPuller] = []
        self._last_refresh_s = 0.0

    @property
    def query_limits(self) -> QueryLimits:
        c = self.config
        return QueryLimits(timeout_s=c.query_timeout_s, max_rows=c.max_query_rows, max_result_bytes=c.max_result_bytes,
                           max_sql_chars=c.max_sql_chars, num_readers=c.num_query_readers,
                           max_queued=c.max_queued_queries)

    async def run(self) -> None:
        try:
            self._subs.append(await self.nc.subscribe(subjects.ACCOUNTING_SQL, cb=self._on_sql))
            self._subs.append(await self.nc.subscribe(subjects.ACCOUNTING_COSTS, cb=self._on_costs))
            self._subs.append(await self.nc.subscribe(subjects.ACCOUNTING_KEY_ENERGY, cb=self._on_key_energy))
            self._subs.append(await self.nc.subscribe(subjects.CONFIG_CHANGED, cb=self._on_config_changed))
            await self.nc.flush()  # the server has the subscriptions before anyone is told we are ready
            async with contextlib.AsyncExitStack() as stack:
                if self.config.port is not None:
                    self.url = await stack.enter_async_context(
                        serving(self.app(), self.config.host, self.config.port))
                self.ready.set()
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(self._consume(subjects.STREAM_USAGE, subjects.USAGE_SUBJECTS, USAGE_DURABLE,
                                                 self._ingest_usage))
                    tg.create_task(self._consume(subjects.STREAM_ENERGY, subjects.ENERGY_SUBJECTS, ENERGY_DURABLE,
                                                 self._ingest_energy))
                    tg.create_task(self._maintenance_loop())
        finally:
            # Unsubscribe before the connection drains, so the drain does not wait on a pending fetch.
            for sub in self._subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            for puller in self._pullers:
                await puller.stop()
            self.queries.close()
            self.ledger.close()

    async def _on_config_changed(self, msg: Msg) -> None:
        """A gateway saved its pools file (Config page): take its electricity rate and price book."""
        try:
            pools = pool_config.read_change_message(msg.data).config
        except ConfigError as exc:
            log.warning("ignored a config-changed message: %s", exc)
            return
        now_s, book = time.time(), price_book_of(pools)
        await asyncio.wrap_future(self.ledger.submit(lambda ledger: ledger.set_tariff(
            pools.electricity_rate_usd_per_kwh, now_s, "gateway config")))
        await asyncio.wrap_future(self.ledger.submit(lambda ledger: ledger.set_price_book(book, replace=True)))
        self.config_applied.set()
        log.info("electricity rate %.4g $/kWh and %d price-book entries from the gateway's config",
                 pools.electricity_rate_usd_per_kwh, len(book))

    # ---- ingest ---------------------------------------------------------------------------------------

    async def _consume(self, stream: str, subject: str, durable: str,
                       ingest: Callable[[list[Msg]], Awaitable[None]]) -> None:
        puller = BatchPuller(self.nc, stream, durable, subject, ConsumerConfig(
            durable_name=durable, ack_policy=AckPolicy.EXPLICIT, max_ack_pending=20_000,
            ack_wait=self.config.ack_wait_s, filter_subject=subject))
        await puller.start()
        self._pullers.append(puller)
        while True:
            raise_if_cancelling()
            try:
                msgs = await puller.fetch(self.config.batch_size, self.config.fetch_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # bus trouble (reconnecting, …): nothing is acked, so nothing is lost
                raise_if_cancelling()
                log.warning("%s fetch failed: %s; retrying", stream, exc)
                await asyncio.sleep(1.0)
                continue
            if not msgs:
                await self._maybe_refresh(caught_up=True)
                continue
            await ingest(msgs)
            await self._maybe_refresh(caught_up=len(msgs) < self.config.batch_size)
            self.ingested.set()

    async def _decode_all(self, stream: str, msgs: list[Msg], cls: type[Any], problem: Callable[[Any], str | None]
                          ) -> tuple[list[Any], list[Msg]]:
        """The messages that decode and pass ``problem`` (validation.py), with their items; the rest are parked."""
        items: list[Any] = []
        good: list[Msg] = []
        for msg in msgs:
            try:
                item = decode(msg.data, cls)
            except ProtoDecodeError as exc:
                await self._park(stream, msg, exc.reason)
                continue
            reason = problem(item)
            if reason is not None:
                await self._park(stream, msg, f"invalid: {reason}")
                continue
            items.append(item)
            good.append(msg)
        return items, good

    async def _park(self, stream: str, msg: Msg, reason: str) -> None:
        """Poison: keep it with the reason, count it, and stop redelivery (term)."""
        self.stats.poison_messages += 1
        try:
            seq: int | None = msg.metadata.sequence.stream
        except Exception:  # not a JetStream delivery (no metadata in the reply subject)
            seq = None
        await self._write(lambda ledger: ledger.park(stream, msg.subject, seq, reason, msg.data))
        log.warning("parked a %s message on %s: %s", stream, msg.subject, reason)
        await msg.term()

    async def _write(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.ledger.submit(fn))

    async def _ingest_usage(self, msgs: list[Msg]) -> None:
        records, good = await self._decode_all(subjects.STREAM_USAGE, msgs, UsageRecord, usage_problem)

        async def store(batch: Sequence[UsageRecord]) -> None:
            added = await self._write(lambda ledger: ledger.insert_usage(batch))
            self.stats.usage_ingested += added
            self.stats.usage_duplicates += len(batch) - added

        await self._commit(subjects.STREAM_USAGE, records, good, store)

    async def _ingest_energy(self, msgs: list[Msg]) -> None:
        samples, good = await self._decode_all(subjects.STREAM_ENERGY, msgs, EnergySample, energy_problem)

        async def store(batch: Sequence[EnergySample]) -> None:
            result = await self._write(lambda ledger: ledger.insert_energy(batch))
            self.stats.energy_ingested += result.num_new
            self.stats.energy_duplicates += result.num_duplicates

        await self._commit(subjects.STREAM_ENERGY, samples, good, store)

    async def _commit(self, stream: str, items: list[Any], msgs: list[Msg],
                      store: Callable[[Sequence[Any]], Awaitable[None]]) -> None:
        """Store ``items`` in one transaction, then ack ``msgs`` (item i came in message i).

        Ack only after the commit: a crash before the ack means redelivery, which the ledger's message
        identities turn into a no-op. When the ledger refuses the batch (the transaction rolled back),
        each item is stored alone: one still refused is parked and terminated, the others are acked."""
        if not items:
            return
        try:
            await store(items)
        except REFUSED_VALUE_ERRORS as exc:
            log.warning("the ledger refused a batch of %d %s messages (%s); storing them one by one",
                        len(items), stream, exc)
            for item, msg in zip(items, msgs, strict=True):
                try:
                    await store([item])
                except REFUSED_VALUE_ERRORS as item_exc:
                    await self._park(stream, msg, f"refused by the ledger: {type(item_exc).__name__}: {item_exc}")
                else:
                    await msg.ack()
            return
        for msg in msgs:
            await msg.ack()

    # ---- rollups and maintenance ------------------------------------------------------------------------

    async def _maybe_refresh(self, caught_up: bool) -> None:
        """Refresh rollups when a consumer has caught up, and at least every ``rollup_interval_s`` while
        it catches up (so a long backlog is not refreshed hour by hour, batch by batch)."""
        now = time.monotonic()
        if caught_up or now - self._last_refresh_s >= self.config.rollup_interval_s:
            self._last_refresh_s = now
            try:
                await self.refresh_rollups()
            except LEDGER_ERRORS:
                # The refresh is one transaction: its hours stay dirty and are retried next time. Ingest
                # goes on; a failing refresh must not stop the consumer (and restart into it again).
                log.exception("rollup refresh failed; its hours stay dirty and are retried")

    async def refresh_rollups(self) -> int:
        now_s = time.time()
        num = await self._write(lambda ledger: ledger.refresh_rollups(now_s, self.config.retention_days))
        if num:
            self.stats.rollup_refreshes += 1
        return int(num)

    async def _maintenance_loop(self) -> None:
        """Retention (raw energy rows older than ``retention_days``), checkpoint, and the Parquet export."""
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                await self.maintain()
            except Exception:
                log.exception("accounting maintenance failed; retrying next cycle")

    async def maintain(self) -> None:
        await self.refresh_rollups()
        now_s = time.time()
        deleted = await self._write(lambda ledger: ledger.enforce_retention(now_s, self.config.retention_days))
        log.info("retention: deleted %d raw energy samples older than %.0f days", deleted, self.config.retention_days)
        if self.config.export_dir is not None:
            await self.export_parquet()

    async def export_parquet(self) -> list[str]:
        if self.config.export_dir is None:
            raise QueryRejected("this accounting service has no --export-dir")
        export_dir = self.config.export_dir
        await self.refresh_rollups()
        paths = await self._write(lambda ledger: ledger.export_parquet(export_dir))
        return [str(p) for p in paths]

    # ---- queries ----------------------------------------------------------------------------------------

    async def run_sql(self, sql: str, max_bytes: int | None = None) -> tuple[list[str], list[list[Any]]]:
        """One operator query on a reader cursor (sql_runner.py): interrupted ``query_timeout_s`` after it
        starts, refused at once (QueryBusy) when the queue is full, its rows JSON values (sql_values.py)
        capped at ``max_bytes`` (default and most: ``max_result_bytes``) of JSON while fetched.

        Raises QueryRejected, QueryFailed, QueryTimedOut, QueryBusy, ResultTooLarge."""
        result = await self._query(sql, max_bytes)
        return result.columns, result.rows

    async def _query(self, sql: str, max_bytes: int | None) -> Any:
        future = self.queries.submit(sql, max_bytes)
        # The reader's own watchdog ends the query; this bound only guards against an interrupt DuckDB
        # does not honour (the caller then gets an answer even if the reader is still stuck).
        bound_s = self.queries.max_wait_s + self.config.query_timeout_s + 5.0
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), bound_s)
        except TimeoutError:
            raise_if_cancelling()
            raise QueryTimedOut(self.config.query_timeout_s) from None

    def bus_reply_limit(self) -> int:
        """The most bytes an SQL reply may take on the bus: the server's max_payload less headroom for the
        reply's headers, and at most ``max_result_bytes``."""
        max_payload = int(getattr(self.nc, "max_payload", 0) or 1024 * 1024)
        return min(self.config.max_result_bytes, max_payload - 4096)

    async def costs_report(self, num_days: int = 30) -> CostsReport:
        """The costs document (services/accounting/costs.py) over the ``num_days`` UTC days ending today."""
        now_s = time.time()
        retention = self.config.retention_days

        def work(ledger: Any) -> CostsReport:
            ledger.refresh_rollups(now_s, retention)
            return ledger.costs(now_s, num_days)

        return await self._write(work)

    async def costs(self, num_days: int = 30) -> dict[str, Any]:
        """:meth:`costs_report` as its JSON form (plain dicts and lists)."""
        return msgspec.to_builtins(await self.costs_report(num_days))

    async def key_energy(self, month: str) -> KeyEnergyReply:
        """Month-to-date measured joules per API key (``Ledger.key_energy``), fresh as the last committed
        batch. A month that is not ``"YYYY-MM"`` gets the empty reply for month ``""``."""
        bounds = month_bounds(month)
        if bounds is None:
            return KeyEnergyReply(month="")
        now_s, retention = time.time(), self.config.retention_days
        joules, as_of_s = await self._write(lambda ledger: ledger.key_energy(*bounds, now_s, retention))
        return KeyEnergyReply(month=month, joules_by_key=joules, as_of_s=as_of_s)

    async def _on_key_energy(self, msg: Msg) -> None:
        """``KeyEnergyQuery`` → ``KeyEnergyReply`` (msgpack). A reply for month ``""`` carries no figure (the
        query was malformed, or the ledger failed): the gateway must not read it as zero joules."""
        try:
            reply = await self.key_energy(decode(msg.data, KeyEnergyQuery).month)
        except ProtoDecodeError as exc:
            log.warning("bad key-energy query: %s", exc)
            reply = KeyEnergyReply(month="")
        except LEDGER_ERRORS:
            log.exception("key-energy query failed")
            reply = KeyEnergyReply(month="")
        await msg.respond(encode(reply))

    async def _on_sql(self, msg: Msg) -> None:
        """``SqlQuery`` → ``SqlReply`` (JSON); a refused, failed or malformed query gets ``error`` only."""
        try:
            request = decode_json(msg.data, SqlQuery)
            if request.export_parquet:
                reply = SqlReply(files=await self.export_parquet())
            else:
                if request.sql is None:
                    raise QueryRejected('send {"sql": "SELECT …"}')
                columns, rows = await self.run_sql(request.sql, self.bus_reply_limit())
                reply = SqlReply(columns=columns, rows=rows)
        except (QueryRejected, QueryFailed, QueryTimedOut, QueryBusy, ResultTooLarge) as exc:
            reply = SqlReply(error=str(exc))
        except ProtoDecodeError as exc:
            reply = SqlReply(error="request is not JSON" if exc.is_malformed else 'send {"sql": "SELECT …"}')
        try:
            await msg.respond(encode_json(reply))
        except MaxPayloadError:  # counted under the limit, so only a reply header could tip it over
            await msg.respond(encode_json(SqlReply(error=f"the result is too large for the bus (more than "
                                                          f"{self.nc.max_payload:,} bytes); narrow the query")))

    async def _on_costs(self, msg: Msg) -> None:
        """``CostsQuery`` (an empty payload is the default query) → ``CostsReport``, or an ``ErrorReply``."""
        reply: CostsReport | ErrorReply
        try:
            request = decode_json(msg.data, CostsQuery) if msg.data else CostsQuery()
            reply = await self.costs_report(_days(request.days))
        except (ProtoDecodeError, ValueError) as exc:
            reply = ErrorReply(error=ErrorDetail(message=f"bad costs request: {exc}", type="invalid_request_error",
                                                 code="invalid_request"))
        await msg.respond(encode_json(reply))

    # ---- HTTP -------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=1 << 20)
        app.router.add_post("/sql", self._http_sql)
        app.router.add_get("/costs", self._http_costs)
        app.router.add_get("/health", self._http_health)
        app.router.add_get("/openapi.json", self._http_openapi)
        return app

    async def _http_openapi(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(openapi.document())

    async def _require_admin(self, request: web.Request) -> None:
        """``Authorization: Bearer sk-…`` checked by the gateways over ``llm.v1.auth.check`` (only the
        key's SHA-256 crosses the bus). No or unknown key → 401, a non-admin key → 403."""
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise HTTPError(401, "send an admin API key: Authorization: Bearer sk-…", code="missing_api_key")
        digest = hashlib.sha256(key.strip().encode()).hexdigest()
        try:
            msg = await self.nc.request(subjects.AUTH_CHECK, encode_json(AuthCheck(key_sha256=digest)),
                                        timeout=self.config.auth_timeout_s)
            answer = decode_json(msg.data, AuthReply)
        except (NoRespondersError, NatsTimeout, TimeoutError):
            raise_if_cancelling()
            raise HTTPError(503, "cannot check the API key: no gateway answered on the bus",
                            code="auth_unavailable", retry_after_s=5) from None
        except ProtoDecodeError:
            raise HTTPError(503, "the key check returned garbage", code="auth_unavailable") from None
        if not answer.ok:
            raise HTTPError(401, "invalid API key", code="invalid_api_key")
        if answer.role != "admin":
            raise HTTPError(403, "this endpoint needs an admin API key", code="admin_required")

    async def _http_sql(self, request: web.Request) -> web.StreamResponse:
        await self._require_admin(request)
        body = await read_json_object(request)
        sql = body.get("sql")
        if not isinstance(sql, str):
            raise HTTPError(400, 'send {"sql": "SELECT …"}', code="invalid_request", param="sql")
        try:
            columns, rows = await self.run_sql(sql)
        except QueryRejected as exc:
            raise HTTPError(400, str(exc), code="query_rejected") from None
        except QueryFailed as exc:
            raise HTTPError(400, str(exc), code="query_failed") from None
        except ResultTooLarge as exc:
            raise HTTPError(400, str(exc), code="result_too_large") from None
        except QueryTimedOut as exc:
            raise HTTPError(408, str(exc), code="query_timeout") from None
        except QueryBusy as exc:
            raise HTTPError(503, str(exc), code="sql_busy", retry_after_s=exc.retry_after_s) from None
        # sql_values made every value plain JSON: the same bytes the bus path sends (no NaN, no 500 on a type)
        return web.Response(body=sql_values.encode({"columns": columns, "rows": rows}), content_type="application/json")

    async def _http_costs(self, request: web.Request) -> web.StreamResponse:
        await self._require_admin(request)
        try:
            days = _days(request.query.get("days", "30"))
        except ValueError as exc:
            raise HTTPError(400, str(exc), code="invalid_request", param="days") from None
        return web.json_response(body=encode_json(await self.costs_report(days)))

    async def _http_health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})


def _days(value: Any) -> int:
    """A window length in days: 1..366."""
    try:
        days = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"days must be an integer, got {value!r}") from None
    if not 1 <= days <= 366:
        raise ValueError(f"days must be between 1 and 366, got {days}")
    return days
