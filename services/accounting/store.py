"""The DuckDB ledger. Owned by exactly one thread (see :class:`LedgerThread`)."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from proto import UsageRecord

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id      VARCHAR PRIMARY KEY,
    ts              TIMESTAMPTZ NOT NULL,
    gateway_id      VARCHAR NOT NULL,
    gateway_session VARCHAR NOT NULL,
    gateway_seq     BIGINT NOT NULL,
    model           VARCHAR NOT NULL,
    pool            VARCHAR NOT NULL,
    member          VARCHAR,
    worker_id       VARCHAR,
    api_key_id      VARCHAR,
    endpoint        VARCHAR,
    stream          BOOLEAN,
    status          VARCHAR NOT NULL,
    http_status     INTEGER,
    finish_reason   VARCHAR,
    error_code      VARCHAR,
    prompt_tokens   BIGINT NOT NULL,
    cached_tokens   BIGINT NOT NULL,
    output_tokens   BIGINT NOT NULL,
    ttft_ms         DOUBLE,
    latency_ms      DOUBLE,
    routing_reason  VARCHAR,
    ingested_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""

_USAGE_COLUMNS = (
    "request_id, ts, gateway_id, gateway_session, gateway_seq, model, pool, member, worker_id, "
    "api_key_id, endpoint, stream, status, http_status, finish_reason, error_code, prompt_tokens, "
    "cached_tokens, output_tokens, ttft_ms, latency_ms, routing_reason"
)


class QueryRejected(ValueError):
    """The SQL is not exactly one read-only SELECT statement."""


class QueryFailed(RuntimeError):
    """DuckDB refused or failed the query."""


def _usage_row(r: UsageRecord) -> tuple[Any, ...]:
    return (
        r.request_id, dt.datetime.fromtimestamp(r.ts_s, dt.UTC), r.gateway_id, r.session_id, r.seq,
        r.model, r.pool, r.member, r.worker_id, r.api_key_id, r.endpoint, r.stream, r.status,
        r.http_status, r.finish_reason, r.error_code, r.prompt_tokens, r.cached_tokens,
        r.output_tokens, r.ttft_ms, r.latency_ms, r.routing_reason,
    )


class Ledger:
    """Synchronous DuckDB access. Not thread-safe: call it from one thread only."""

    def __init__(self, path: Path, read_only: bool = False) -> None:
        self.path = path
        if read_only:
            self.con = duckdb.connect(str(path), read_only=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.con = duckdb.connect(str(path))
        self.con.execute("SET TimeZone = 'UTC'")
        if not read_only:
            self.con.execute(SCHEMA)

    def close(self) -> None:
        self.con.close()

    def insert_usage(self, records: Sequence[UsageRecord]) -> int:
        """Insert in one transaction; a request id already present is skipped. Returns rows added."""
        if not records:
            return 0
        before = self._count()
        self.con.execute("BEGIN")
        try:
            self.con.executemany(
                f"INSERT OR IGNORE INTO requests ({_USAGE_COLUMNS}) VALUES "
                f"({', '.join('?' * 22)})",
                [_usage_row(r) for r in records],
            )
            self.con.execute("COMMIT")
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        return self._count() - before

    def _count(self) -> int:
        row = self.con.execute("SELECT count(*) FROM requests").fetchone()
        return int(row[0]) if row else 0

    def query(self, sql: str, max_rows: int = 10_000) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run exactly one SELECT (or WITH … SELECT); anything else is rejected before it runs."""
        try:
            statements = self.con.extract_statements(sql)
        except duckdb.Error as exc:
            raise QueryRejected(f"cannot parse SQL: {exc}") from None
        if len(statements) != 1:
            raise QueryRejected(f"send exactly one statement (got {len(statements)})")
        if statements[0].type != duckdb.StatementType.SELECT:
            raise QueryRejected(f"only read-only SELECT queries are allowed (got {statements[0].type.name})")
        cur = self.con.cursor()
        try:
            cur.execute("SET TimeZone = 'UTC'")
            cur.execute(sql)
            columns = [d[0] for d in cur.description or []]
            rows = cur.fetchmany(max_rows)
        except duckdb.Error as exc:
            raise QueryFailed(str(exc)) from None
        finally:
            cur.close()
        return columns, rows


class LedgerThread:
    """Owns a :class:`Ledger` on one dedicated thread; async code submits work to it."""

    def __init__(self, path: Path) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="duckdb")
        self.ledger: Ledger = self._pool.submit(Ledger, path).result()

    def submit(self, fn: Callable[[Ledger], T]) -> concurrent.futures.Future[T]:
        return self._pool.submit(fn, self.ledger)

    def close(self) -> None:
        self._pool.submit(self.ledger.close).result()
        self._pool.shutdown(wait=True)
