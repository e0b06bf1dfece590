"""``llmgw sql "SELECT …"``: ask the running accounting service, or read the file when none runs.

The accounting service is the only process that opens the DuckDB file while it runs, so the query
goes over the bus (``llm.v1.accounting.sql``). When no stack is running (no NATS URL, or nothing answers
at it after :data:`CONNECT_ATTEMPTS` tries: a stale ``stack.json`` after the supervisor was killed), the
file is opened read-only here instead, saying so on stderr, so the ledger stays queryable after the stack
stops. File mode runs the query the way the service does (sql_runner.py: the same guard, time limit,
result cap and values) on a reader thread, so Ctrl-C interrupts it: exit code 130, one line, no traceback.

Every failure is one line on stderr starting ``llmgw sql:`` and exit code 1 (130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

from proto import ProtoDecodeError, SqlQuery, SqlReply, decode_json, encode_json, subjects
from services.accounting.sql_runner import QueryLimits
from services.common.runtime import data_dir, read_stack_file

CONNECT_ATTEMPTS = 3
CONNECT_TIMEOUT_S = 2.0
BUS_TIMEOUT_S = 40.0  # the service answers within 3 query limits (a wait of up to 2, a run of 1): 30 s by default
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class SqlError(RuntimeError):
    pass


class BusUnavailable(RuntimeError):
    """No NATS server at the URL, or no accounting service on it: read the file instead."""


async def _quiet(_exc: Exception) -> None:
    """nats-py's default error callback logs a traceback per failed connect attempt."""


async def _over_bus(url: str, request: SqlQuery, timeout_s: float) -> SqlReply:
    import nats
    from nats.errors import Error as NatsError
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    try:
        # max_reconnect_attempts bounds the *initial* connect too (0 would mean: forever); the outer
        # timeout bounds a server that accepts the socket and never speaks NATS.
        nc = await asyncio.wait_for(nats.connect(
            url, connect_timeout=CONNECT_TIMEOUT_S, allow_reconnect=False, max_reconnect_attempts=CONNECT_ATTEMPTS - 1,
            reconnect_time_wait=0.5, error_cb=_quiet), CONNECT_ATTEMPTS * (CONNECT_TIMEOUT_S + 0.5) + 1.0)
    except (NatsError, OSError, TimeoutError, ValueError) as exc:
        raise BusUnavailable(f"no NATS server answers at {url} ({CONNECT_ATTEMPTS} attempts: "
                             f"{type(exc).__name__})") from None
    try:
        msg = await nc.request(subjects.ACCOUNTING_SQL, encode_json(request), timeout=timeout_s)
    except NoRespondersError:
        raise BusUnavailable(f"no accounting service answers on the bus at {url}") from None
    except (NatsTimeout, TimeoutError):
        raise SqlError(f"the accounting service did not answer within {timeout_s:g} s") from None
    finally:
        await nc.close()
    try:
        return decode_json(msg.data, SqlReply)
    except ProtoDecodeError as exc:
        raise SqlError(f"the accounting service sent a reply this client cannot read: {exc}") from None


def _from_file(db: Path, sql: str | None, export_dir: Path, timeout_s: float) -> SqlReply:
    """Open the ledger read-only and run the query as the service does (sql_runner.py): the same guard,
    read-only transaction, time limit from the start of execution, result cap and JSON values."""
    import duckdb

    from services.accounting.sql_runner import QueryBusy, QueryRunner, QueryTimedOut, ResultTooLarge
    from services.accounting.store import Ledger, QueryFailed, QueryRejected

    if not db.exists():
        raise SqlError(f"no ledger at {db}: start the stack with `make up` (or `llmgw up`) first")
    try:
        ledger = Ledger(db, read_only=True)
    except duckdb.Error as exc:
        raise SqlError(f"cannot open {db} ({exc}); is the accounting service running elsewhere?") from None
    runner: QueryRunner | None = None
    try:
        if sql is None:
            return SqlReply(files=[str(p) for p in ledger.export_parquet(export_dir)])
        limits = QueryLimits(timeout_s=timeout_s, num_readers=1, max_queued=0)
        runner = QueryRunner(ledger.query_cursors,
                             lambda cursor, text: ledger.check(cursor, text, limits.max_sql_chars), limits)
        # Ctrl-C (KeyboardInterrupt) lands in the wait; runner.close() below then interrupts the query until
        # it has ended (DuckDB stops at its next check)
        result = _wait(runner.submit(sql))
        return SqlReply(columns=result.columns, rows=result.rows)
    except (QueryRejected, QueryFailed, QueryTimedOut, QueryBusy, ResultTooLarge) as exc:
        return SqlReply(error=str(exc))
    finally:
        if runner is not None:
            runner.close()
        ledger.close()


def _wait(future: concurrent.futures.Future[Any]) -> Any:
    """The future's result, waking every 0.2 s so that Ctrl-C (KeyboardInterrupt) lands here at once."""
    while True:
        try:
            return future.result(timeout=0.2)
        except concurrent.futures.TimeoutError:
            continue


def format_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in columns]] + [["NULL" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:
        print("llmgw sql: interrupted", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None


def _main(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw sql", description=__doc__.splitlines()[0])
    parser.add_argument("query", nargs="?", help="one read-only SELECT statement")
    parser.add_argument("--format", choices=["table", "json", "csv"], default="table")
    parser.add_argument("--export-parquet", nargs="?", const="", metavar="DIR",
                        help="write the rollup tables as Parquet: the running service writes to its --export-dir; "
                             "with no service running, to DIR (default DATA_DIR/exports)")
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else the running stack's)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--db", help="DuckDB file when no accounting service runs")
    parser.add_argument("--timeout", type=float,
                        help=f"seconds: how long to wait for the service's answer (default {BUS_TIMEOUT_S:g}); "
                             "reading the file, the query's time limit from the start of its execution "
                             f"(default {QueryLimits.timeout_s:g}, as the service's)")
    args = parser.parse_args(argv)
    exporting = args.export_parquet is not None
    if exporting == (args.query is not None):
        parser.error("give either a query or --export-parquet")
    if args.timeout is not None and not 0 < args.timeout < 1e6:
        parser.error("--timeout must be a number of seconds > 0")

    data = data_dir(args.data_dir)
    url = args.nats or os.environ.get("NATS_URL") or (read_stack_file(data) or {}).get("nats_url")
    request = SqlQuery(export_parquet=True) if exporting else SqlQuery(sql=args.query)
    db = Path(args.db) if args.db else data / "accounting.duckdb"
    try:
        result = None
        if url:
            try:
                result = asyncio.run(_over_bus(url, request, args.timeout or BUS_TIMEOUT_S))
            except BusUnavailable as exc:
                print(f"llmgw sql: {exc}; reading {db} read-only instead", file=sys.stderr)
        if result is None:
            export_dir = Path(args.export_parquet) if args.export_parquet else data / "exports"
            result = _from_file(db, args.query, export_dir, args.timeout or QueryLimits.timeout_s)
    except SqlError as exc:
        print(f"llmgw sql: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    if result.error is not None:
        print(f"llmgw sql: {result.error}", file=sys.stderr)
        raise SystemExit(1)
    if exporting:
        print("\n".join(result.files or []))
        return
    columns, rows = result.columns or [], result.rows or []
    if args.format == "json":
        print(json.dumps([dict(zip(columns, r, strict=True)) for r in rows], default=str, indent=2))
    elif args.format == "csv":
        writer = csv.writer(sys.stdout)
        writer.writerow(columns)
        writer.writerows(rows)
    else:
        print(format_table(columns, rows))


if __name__ == "__main__":
    main()
