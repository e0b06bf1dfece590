"""``llmgw sql "SELECT …"``: ask the running accounting service, or read the file when none runs.

The accounting service is the only process that opens the DuckDB file while it runs, so the query
goes over the bus (``llm.v1.accounting.sql``). When no stack is running, the file is opened read-only
here instead, so the ledger stays queryable after the stack stops.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

from proto import SqlQuery, SqlReply, decode_json, encode_json, subjects
from services.common.runtime import data_dir, read_stack_file


class SqlError(RuntimeError):
    pass


async def _over_bus(url: str, request: SqlQuery, timeout_s: float) -> SqlReply | None:
    import nats
    from nats.errors import NoRespondersError, NoServersError
    from nats.errors import TimeoutError as NatsTimeout

    try:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False)
    except (NoServersError, OSError, TimeoutError, NatsTimeout):
        return None
    try:
        msg = await nc.request(subjects.ACCOUNTING_SQL, encode_json(request), timeout=timeout_s)
        return decode_json(msg.data, SqlReply)
    except NoRespondersError:
        return None
    finally:
        await nc.close()


def _from_file(db: Path, sql: str | None, export_dir: Path) -> SqlReply:
    """Open the ledger read-only (same guards as the service: no file access, read-only transaction)."""
    import duckdb

    from services.accounting.store import Ledger, QueryFailed, QueryRejected, jsonable

    if not db.exists():
        raise SqlError(f"no ledger at {db}: start the stack with `make up` (or `llmgw up`) first")
    try:
        ledger = Ledger(db, read_only=True)
    except duckdb.Error as exc:
        raise SqlError(f"cannot open {db} ({exc}); is the accounting service running elsewhere?") from None
    try:
        if sql is None:
            return SqlReply(files=[str(p) for p in ledger.export_parquet(export_dir)])
        columns, rows = ledger.query(sql)
        # the same values as the service sends over the bus (so --format json does not depend on the path)
        return SqlReply(columns=columns, rows=[[jsonable(v) for v in r] for r in rows])
    except (QueryRejected, QueryFailed) as exc:
        return SqlReply(error=str(exc))
    finally:
        ledger.close()


def format_table(columns: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in columns]] + [["NULL" if v is None else str(v) for v in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmgw sql", description=__doc__.splitlines()[0])
    parser.add_argument("query", nargs="?", help="one read-only SELECT statement")
    parser.add_argument("--format", choices=["table", "json", "csv"], default="table")
    parser.add_argument("--export-parquet", nargs="?", const="", metavar="DIR",
                        help="write the rollup tables as Parquet: the running service writes to its --export-dir; "
                             "with no service running, to DIR (default DATA_DIR/exports)")
    parser.add_argument("--nats", help="NATS URL (default: $NATS_URL, else the running stack's)")
    parser.add_argument("--data-dir", help="data directory (default: $LLMGW_DATA_DIR or ./data)")
    parser.add_argument("--db", help="DuckDB file when no accounting service runs")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    exporting = args.export_parquet is not None
    if exporting == (args.query is not None):
        parser.error("give either a query or --export-parquet")

    data = data_dir(args.data_dir)
    url = args.nats or os.environ.get("NATS_URL") or (read_stack_file(data) or {}).get("nats_url")
    request = SqlQuery(export_parquet=True) if exporting else SqlQuery(sql=args.query)
    result = asyncio.run(_over_bus(url, request, args.timeout)) if url else None
    try:
        if result is None:
            export_dir = Path(args.export_parquet) if args.export_parquet else data / "exports"
            result = _from_file(Path(args.db) if args.db else data / "accounting.duckdb", args.query, export_dir)
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
