"""Operator SQL on a small pool of reader cursors: a deadline from the start of execution, a bounded
queue, and a result capped in rows and JSON bytes while it is fetched (docs/accounting.md, "SQL limits").

Threads: ``num_readers`` worker threads, each running one query at a time on a reader cursor of the
ledger's database (a DuckDB cursor is its own connection: ``interrupt()`` on it stops that query only).
The ledger's writer thread (ingest, rollups) is never one of them, so a long query cannot stall ingest:
DuckDB's MVCC lets the readers' read-only transactions and the writer's commits run side by side.

Why the deadline starts at execution: the old limit counted from submission on an asyncio timer but
could only interrupt the running query, so with two long queries the second ran its full 40 s after
the first was stopped and ``SELECT 1`` behind them timed out without running. Here each query gets a
watchdog timer started just before it runs; a query that waited in the queue longer than
``2 * timeout_s`` is refused without running (the next in line behind a running query always gets its
turn within one limit), and the queue holds at most ``max_queued`` (a full queue is refused at once):
so no caller waits more than about ``3 * timeout_s`` for an answer.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import duckdb

from services.accounting import sql_values
from services.accounting.store import QueryFailed, QueryRejected

FETCH_ROWS = 256  # rows per fetchmany: at 40 kB a row, ~10 MB of Python objects before the cap is checked
ENVELOPE_BYTES = len(b'{"columns":,"rows":[]}')


@dataclass(frozen=True)
class QueryLimits:
    """One default per knob (``AccountingConfig`` and ``llmgw sql`` pass theirs in)."""

    timeout_s: float = 10.0
    max_rows: int = 10_000
    # 4 MiB of JSON: 10,000 rows of ~400 bytes, far more than an aggregate answer; under the embedded NATS
    # server's 8 MiB payload (services/common/nats_server.py). The bus answer is capped lower when the
    # server's max_payload is lower (service.py).
    max_result_bytes: int = 4 * 1024 * 1024
    max_sql_chars: int = 20_000
    num_readers: int = 4
    max_queued: int = 8


@dataclass(frozen=True)
class QueryResult:
    columns: list[str]
    rows: list[list[Any]]  # sql_values.json_row of each row
    num_bytes: int  # of the JSON answer {"columns": …, "rows": …}, as counted while fetching


class QueryTimedOut(RuntimeError):
    """The query ran ``timeout_s`` from the start of its execution and was interrupted."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"query interrupted after {timeout_s:g} s of execution (the limit for operator queries)")
        self.timeout_s = timeout_s


class QueryBusy(RuntimeError):
    """Refused without running: the queue is full, or the query waited its whole time limit in it."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ResultTooLarge(RuntimeError):
    """The result passed ``max_rows`` rows or ``max_bytes`` bytes of JSON while it was fetched."""

    def __init__(self, *, max_rows: int, max_bytes: int, num_rows: int, is_bytes: bool) -> None:
        what = (f"more than {max_bytes:,} bytes of JSON (the limit; reached after {num_rows:,} rows)" if is_bytes
                else f"more than {max_rows:,} rows (the limit)")
        super().__init__(f"the result is too large: {what}; narrow the query: select fewer or shorter columns, "
                         "aggregate (GROUP BY), filter (WHERE), or page with ORDER BY … LIMIT … OFFSET …")
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.num_rows = num_rows


class _Run:
    """One query's watchdog: interrupts its cursor only while that query is still running."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection, timeout_s: float) -> None:
        self.cursor = cursor
        self.deadline = time.monotonic() + timeout_s
        self.is_timed_out = False
        self.was_interrupted = False
        self.is_done = False
        self._lock = threading.Lock()

    def interrupt(self, timed_out: bool = True) -> None:
        with self._lock:
            if not self.is_done:
                self.is_timed_out = self.is_timed_out or timed_out
                self.was_interrupted = True
                self.cursor.interrupt()

    def finish(self) -> None:
        with self._lock:
            self.is_done = True


def fetch_capped(cursor: duckdb.DuckDBPyConnection, max_rows: int, max_bytes: int) -> QueryResult:
    """The executed query's columns and rows as JSON values, counting their encoded bytes as they come."""
    columns = [str(d[0]) for d in cursor.description or []]
    size = ENVELOPE_BYTES + sql_values.encoded_size(columns)
    rows: list[list[Any]] = []
    while chunk := cursor.fetchmany(FETCH_ROWS):
        for raw in chunk:
            row = sql_values.json_row(raw)
            size += sql_values.encoded_size(row) + (1 if rows else 0)  # the comma before it
            if len(rows) >= max_rows or size > max_bytes:
                raise ResultTooLarge(max_rows=max_rows, max_bytes=max_bytes, num_rows=len(rows),
                                     is_bytes=len(rows) < max_rows)
            rows.append(row)
    return QueryResult(columns=columns, rows=rows, num_bytes=size)


def _rollback(cursor: duckdb.DuckDBPyConnection) -> None:
    """End the read-only transaction, whatever state an interrupt or error left it in (DuckDB may have
    ended it already); the cursor must leave here outside any transaction for the next query's BEGIN."""
    for _ in range(2):  # an interrupt that landed just as the query ended fails the first attempt
        try:
            cursor.execute("ROLLBACK")
            return
        except duckdb.TransactionException:  # no transaction is active
            return
        except duckdb.Error:
            continue


def _error_text(exc: duckdb.Error) -> str:
    return str(exc).split("\n\nLINE", 1)[0]


class QueryRunner:
    """Runs operator queries on ``limits.num_readers`` cursors; :meth:`submit` from any thread."""

    def __init__(self, cursors: list[duckdb.DuckDBPyConnection],
                 check: Callable[[duckdb.DuckDBPyConnection, str], None], limits: QueryLimits) -> None:
        if not 1 <= limits.num_readers <= len(cursors):
            raise ValueError(f"{limits.num_readers} readers need as many cursors, got {len(cursors)}")
        self.limits = limits
        self._check = check
        self._cursors = list(cursors[:limits.num_readers])
        self._free = list(self._cursors)
        self._lock = threading.Lock()
        self._num_pending = 0  # queued + running
        self._running: set[_Run] = set()
        self._is_closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(self._cursors),
                                                           thread_name_prefix="duckdb-sql")

    @property
    def num_readers(self) -> int:
        return len(self._cursors)

    @property
    def max_wait_s(self) -> float:
        """How long a query may wait for a reader before it is refused unrun."""
        return 2 * self.limits.timeout_s

    def submit(self, sql: str, max_bytes: int | None = None) -> concurrent.futures.Future[QueryResult]:
        """Queue one query; raises :class:`QueryBusy` at once when ``num_readers + max_queued`` are pending.

        The future raises QueryRejected/QueryFailed/QueryTimedOut/QueryBusy/ResultTooLarge."""
        max_bytes = self.limits.max_result_bytes if max_bytes is None else min(max_bytes, self.limits.max_result_bytes)
        with self._lock:
            if self._is_closed:
                raise QueryBusy("the accounting service is stopping", retry_after_s=5.0)
            capacity = self.num_readers + self.limits.max_queued
            if self._num_pending >= capacity:
                raise QueryBusy(f"too many operator queries: {self.num_readers} running and {self.limits.max_queued} "
                                "waiting (the limit); retry later", retry_after_s=self._retry_after_s())
            self._num_pending += 1
        try:
            future = self._pool.submit(self._run, sql, max_bytes, time.monotonic())
        except RuntimeError:  # the pool shut down in between
            self._release()
            raise QueryBusy("the accounting service is stopping", retry_after_s=5.0) from None
        future.add_done_callback(lambda _: self._release())
        return future

    def run(self, sql: str, max_bytes: int | None = None) -> QueryResult:
        return self.submit(sql, max_bytes).result()

    def _release(self) -> None:
        with self._lock:
            self._num_pending -= 1

    def _retry_after_s(self) -> float:
        """When the first running query must have ended (its deadline), at least 1 s. Call under the lock."""
        now = time.monotonic()
        ends = [r.deadline - now for r in self._running]
        return max(1.0, math.ceil(min(ends, default=self.limits.timeout_s)))

    def _run(self, sql: str, max_bytes: int, submitted: float) -> QueryResult:
        waited_s = time.monotonic() - submitted
        if waited_s > self.max_wait_s:
            raise QueryBusy(f"the query waited {waited_s:.1f} s for a free reader (more than twice its "
                            f"{self.limits.timeout_s:g} s limit) and was not run; retry later",
                            retry_after_s=self.limits.timeout_s)
        with self._lock:
            if self._is_closed:  # closed while this query waited for its thread: close() must not wait for it
                raise QueryFailed("query interrupted (the service is stopping)")
            cursor = self._free.pop()
            run = _Run(cursor, self.limits.timeout_s)
            self._running.add(run)
        timer = threading.Timer(self.limits.timeout_s, run.interrupt)
        timer.daemon = True
        timer.start()
        try:
            return self._execute(run, sql, max_bytes)
        finally:
            timer.cancel()
            with self._lock:
                self._running.discard(run)
                self._free.append(cursor)

    def _execute(self, run: _Run, sql: str, max_bytes: int) -> QueryResult:
        cursor = run.cursor
        try:
            try:
                try:
                    self._check(cursor, sql)
                except QueryRejected:
                    if run.was_interrupted:  # the check's own statement was cut short: not the query's fault
                        raise duckdb.InterruptException("interrupted while checking") from None
                    raise
                cursor.execute("BEGIN TRANSACTION READ ONLY")
                try:
                    cursor.execute(sql)
                    return fetch_capped(cursor, self.limits.max_rows, max_bytes)
                finally:
                    run.finish()
                    _rollback(cursor)
            finally:
                run.finish()
        except duckdb.InterruptException:
            if run.is_timed_out:
                raise QueryTimedOut(self.limits.timeout_s) from None
            raise QueryFailed("query interrupted (the service is stopping)") from None
        except duckdb.Error as exc:
            if run.is_timed_out:  # the interrupt can surface as another error (e.g. in a ROLLBACK after it)
                raise QueryTimedOut(self.limits.timeout_s) from None
            raise QueryFailed(_error_text(exc)) from None

    def interrupt_all(self) -> None:
        """Stop every running query now (Ctrl-C in ``llmgw sql``, shutdown); they fail with QueryFailed."""
        with self._lock:
            runs = list(self._running)
        for run in runs:
            run.interrupt(timed_out=False)

    def close(self) -> None:
        """Stop: no new query starts, and running ones are interrupted until they have ended. An interrupt
        that reaches a cursor before its query started executing is lost (DuckDB interrupts only a running
        query), so it is repeated: Ctrl-C in ``llmgw sql`` just as its query started hung for the query's
        whole time limit."""
        with self._lock:
            self._is_closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        while True:
            self.interrupt_all()
            with self._lock:
                if not self._running:
                    break
            time.sleep(0.05)
        self._pool.shutdown(wait=True)


__all__ = ["QueryBusy", "QueryFailed", "QueryLimits", "QueryRejected", "QueryResult", "QueryRunner",
           "QueryTimedOut", "ResultTooLarge", "fetch_capped"]
